"""One sequence without the engine: prefill, then decode with caches, greedy or sampled (the
reference decode loop; `python -m v4flash_backend generate` uses it when no rank group is asked for)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from v4flash_backend.model.state import ModelState, make_segments
from v4flash_backend.model.transformer import V41Model

from .sampling import SamplingParams, TorchSampler, sample


@dataclass
class Generation:
    tokens: list[int]
    finish_reason: str  # "stop" (EOS / stop token) or "length"
    prefill_s: float
    decode_s: float


def generate_single(model: V41Model, prompt: list[int], max_tokens: int, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int | None = None, stop_ids: tuple[int, ...] | None = None,
             ignore_eos: bool = False, max_len: int | None = None) -> Generation:
    cfg = model.cfg
    if not prompt:
        raise ValueError("empty prompt")
    if max_tokens <= 0:
        raise ValueError("max_tokens must be positive")
    bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
    if bad:
        raise ValueError(f"token ids outside the vocabulary [0, {cfg.vocab_size}): {bad[:5]}")
    stops = set(stop_ids or ())
    if not ignore_eos:
        stops.add(cfg.eos_token_id)
    state = ModelState(cfg, 1, max_len or len(prompt) + max_tokens + 1)
    params = SamplingParams.make(1, temperature=temperature, top_k=top_k, top_p=top_p)
    sampler = TorchSampler.seeded([seed])
    t0 = time.perf_counter()
    out = model.forward(state, torch.tensor(prompt), make_segments([(0, 0, len(prompt))]))
    t1 = time.perf_counter()
    tokens, pos, reason = [], len(prompt), "length"
    while True:
        tok = int(sample(out.logits, params, sampler)[0])
        tokens.append(tok)
        if tok in stops:
            reason = "stop"
            break
        if len(tokens) >= max_tokens:
            break
        out = model.forward(state, torch.tensor([tok]), make_segments([(0, pos, 1)]))
        pos += 1
    return Generation(tokens, reason, t1 - t0, time.perf_counter() - t1)
