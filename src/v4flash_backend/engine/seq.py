"""A request as the engine holds it (`Seq`), the events it sends (`Event`), and the constants
both sides of a step share."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from v4flash_backend.request import GenerateRequest

# the draft block of a sequence lives in the runner's per-slot state (a static decode round wrote it)
ON_DEVICE = "device"
STEP_KINDS = ("draft", "probe", "aside")  # decode steps by DSpark decision (stats)
KIND_OF = {"draft": "draft", "probe": "probe", "skip": "aside"}

CONTEXT_IDS = 8  # committed ids sent before each chunk, for exact stateless detokenization


@dataclass
class Event:
    request_id: str
    token_ids: list[int]
    context_ids: list[int]
    finish_reason: str | None = None  # stop | length | cancelled (None while streaming)
    error: str | None = None
    error_code: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens restored from the prefix cache, not prefilled
    num_output_tokens: int = 0
    drafted: int = 0  # drafts produced for this request so far
    admitted: int = 0  # drafts verified
    accepted: int = 0  # drafts accepted
    verify_steps: int = 0  # decode steps (each commits accepted drafts + one target token)
    # per token of token_ids when the request asked for log-probs (GenerateRequest.logprobs >= 0):
    # [logprob, rank, [[id, logprob], ...top alternatives]]
    logprobs: list | None = None

    def to_wire(self) -> dict:
        """The protocol event dict (what rank 0 sends over its socket; serving/response.py reads it)."""
        if self.error is not None:
            return {"event": "error", "code": self.error_code or "INTERNAL", "message": self.error}
        d = {"event": "chunk", "token_ids": list(self.token_ids), "context_ids": list(self.context_ids),
             "finish_reason": self.finish_reason, "num_prompt_tokens": self.num_prompt_tokens,
             "num_cached_tokens": self.num_cached_tokens,
             "num_output_tokens": self.num_output_tokens, "drafted": self.drafted, "accepted": self.accepted}
        if self.logprobs is not None:
            d["logprobs"] = self.logprobs
        return d

    @property
    def tau(self) -> float:
        """Tokens committed per verify step, the bonus included."""
        return (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass
class Seq:
    req: GenerateRequest
    slot: int
    tokens: list[int]  # prompt + committed output
    n_cached: int = 0  # leading tokens whose rows are in the cache
    n_out: int = 0
    drafted: int = 0
    admitted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    seed: int = 0  # the request's seed (drawn at admission when it gives none): keys its noise
    rounds: int = 0  # sampling rounds so far (first token, then one per verify): keys its noise
    counted: int = 0  # generated tokens the static runner's device-resident counts hold (penalties)
    draft: tuple | str | None = None  # (tokens [G], prev [G], q [G], z [G, V]) or ON_DEVICE
    conf_logits: torch.Tensor | None = None  # [G] the confidence head's logits for a host-drafted block
    last_c: list[float] | None = None  # calibrated conditional confidences of the block it verifies next
    # per position k: decayed counts of "draft k reached" (trials) and "draft k accepted" (hits) over
    # its verified blocks, unverified positions counted in expectation (see Engine._observe_block)
    ev_trials: list[float] | None = None
    ev_hits: list[float] | None = None
    ev_blocks: int = 0  # verified blocks in that evidence (the stepping-aside verdict's inputs: adaptive)
    aside: int = 0  # steps stepped aside since its last verified block (they age that evidence: adaptive)
    ell: int = 0  # drafts admitted for the next verify
    adm: str = ""  # how ell was chosen: admit | probe | explore | fixed (the fixed-length guard reads it)
    first_token_time: float | None = None
    finish: str | None = None  # why it ended (stop / length / cancelled / error); None while running
    num_cached_tokens: int = 0  # prompt tokens restored from the prefix cache (engine.prefix_cache)
    prefix_entry: object = None  # the prefix-cache entry its prefill extends (pinned while it does)

    @property
    def prefilling(self) -> bool:
        return self.n_cached < len(self.req.prompt)
