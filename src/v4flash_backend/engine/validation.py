"""What the engine accepts: the one check of a `GenerateRequest`'s prompt and sampling values, with
the messages every client sees (the Triton models, the rank group's socket, the CLI).

`Engine.validate` runs it on every submitted request; the Triton side (`serving/parse.py`) parses
and converts the inputs, then runs the same checks before a request leaves the stub, so a bad request
is answered INVALID_ARG without a round trip to rank 0. Torch-free: the Triton stub imports it.
"""

from __future__ import annotations

import math

from v4flash_backend.request import GenerateRequest, invalid

UINT64_MAX = 2**64 - 1
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI: 5 for completions, 20 for chat)
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256
PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's range of frequency_penalty / presence_penalty


def check_prompt(prompt: list[int], vocab_size: int, max_model_len: int) -> None:
    if not prompt:
        raise invalid("empty prompt: give at least one token")
    bad = [t for t in prompt if not 0 <= int(t) < vocab_size]
    if bad:
        raise invalid(f"token id {bad[0]} in the prompt is outside the vocabulary [0, {vocab_size})")
    if len(prompt) >= max_model_len:
        raise invalid(f"prompt has {len(prompt)} tokens; max_model_len is {max_model_len} "
                      "(prompt + at least one generated token must fit)")


def check_penalty(name: str, value) -> None:
    low, high = PENALTY_RANGE
    if not low <= value <= high:
        raise invalid(f"{name} must be in [-2, 2], got {value!r}")


def check_sampling(r: GenerateRequest, vocab_size: int) -> None:
    """The sampling values of `r`, in the order a client most likely gets one wrong."""
    if r.max_tokens <= 0:
        raise invalid(f"max_tokens must be > 0, got {r.max_tokens}")
    if not (r.temperature >= 0 and math.isfinite(r.temperature)):
        raise invalid(f"temperature must be >= 0, got {r.temperature}")
    if not 0 < r.top_p <= 1:
        raise invalid(f"top_p must be in (0, 1], got {r.top_p}")
    if r.top_k < 0:
        raise invalid(f"top_k must be >= 0 (0: disabled), got {r.top_k}")
    if r.seed is not None and not 0 <= r.seed <= UINT64_MAX:
        raise invalid(f"seed must be in [0, 2**64), got {r.seed}")
    bad = [t for t in r.stop_token_ids if not 0 <= int(t) < vocab_size]
    if bad:
        raise invalid(f"stop token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if not 0 <= r.min_tokens <= r.max_tokens:
        raise invalid(f"min_tokens must be in [0, max_tokens={r.max_tokens}], got {r.min_tokens}")
    if len(r.stop) > MAX_STOP_STRINGS or any(len(t) > MAX_STOP_CHARS for t in r.stop):
        raise invalid(f"stop: at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters")
    check_penalty("frequency_penalty", r.frequency_penalty)
    check_penalty("presence_penalty", r.presence_penalty)
    if not -1 <= r.logprobs <= MAX_LOGPROBS:
        raise invalid(f"logprobs must be in [0, {MAX_LOGPROBS}] (-1: none), got {r.logprobs}")


def check_request(r: GenerateRequest, vocab_size: int, max_model_len: int) -> None:
    """Raise RequestError (INVALID_ARG) naming the first value of `r` the engine cannot serve."""
    check_prompt(r.prompt, vocab_size, max_model_len)
    check_sampling(r, vocab_size)
