"""The DSpark decode round as two fixed-shape graphs per bucket, sampling included.

Graph 1 (`verify_round`): compose each sequence's rows from the runner's per-slot draft block
([pending token, drafts...], 1 + ell valid rows), run the static verify forward, then the lossless
acceptance (min(1, p/q), residual, bonus) with the request's seeded noise
(`noise.uniforms(seed, round, VERIFY, ..)`), stop tokens and token budgets.

Graph 2 (`draft_round`): the DSpark ring writes of the committed rows, the draft block at the
bonus token, Markov drafting with the drafting noise, the confidence head, admission (`admit_static`
with the SPS table as an input, or the fixed length) clipped to each request's room; the new block
goes into the per-slot state, and the round's one output is a small int64 tensor
[S, G+1 tokens | committed | accepted | stopped | next ell] -- the only thing the host reads.

The functions are the host functions' static forms (`dspark_accept.verify_static`,
`markov_draft_static`, `sampling.process_logits_static`, `dspark_sched.admit_static`), so eager
serving (which runs the host forms with `noise.CounterSampler`) and these graphs commit the same
tokens for the same request and seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from v4flash_backend.engine import noise
from v4flash_backend.engine.dspark_accept import markov_draft_static, verify_static
from v4flash_backend.engine.dspark_sched import admit_static

from .static_step import StaticDecoder


@dataclass
class BlockState:
    """Per-slot draft block, resident where the model is (the draft graph writes it, the verify
    graph reads it): tokens [slots, G] int64, q(x) [slots, G] f32, Markov-corrected logits z
    [slots, G, V] f32."""

    tokens: torch.Tensor
    q: torch.Tensor
    z: torch.Tensor

    @classmethod
    def empty(cls, slots: int, G: int, V: int) -> "BlockState":
        return cls(torch.zeros(slots, G, dtype=torch.long), torch.ones(slots, G, dtype=torch.float32),
                   torch.zeros(slots, G, V, dtype=torch.float32))


# the int64 inputs of a round, [S] each unless noted (one row per sequence of the bucket)
ROUND_INPUTS = ("slot", "start", "n", "pending", "top_k", "seed", "rnd", "budget", "len_left")


def verify_round(dec: StaticDecoder, blk: BlockState, ctx: int, slot, start, n, pending, temperature, top_k,
                 top_p, seed, rnd, budget, stop_ids):
    """Graph 1. n [S]: 1 + ell for a sequence, 0 for a padding one. Returns (committed tokens
    [S, G+1] (-1 padded), committed count [S], accepted [S], stopped [S], taps)."""
    G = dec.max_rows - 1
    S = slot.shape[0]
    drafts = blk.tokens[slot]
    tokens = torch.cat([pending[:, None], drafts], dim=1)
    logits, taps = dec.verify(tokens, slot, start, n, ctx)
    V = logits.shape[-1]
    ell = (n - 1).clamp_min(0)
    u_acc = noise.call_uniforms(seed, rnd, noise.STREAM_VERIFY, 0, G) if G else torch.zeros(S, 0, dtype=torch.float64)
    u_fin = noise.call_uniforms(seed, rnd, noise.STREAM_VERIFY, 1, None)
    res = verify_static(logits.view(S, G + 1, V), drafts, blk.q[slot], blk.z[slot], ell, temperature, top_k, top_p,
                        u_acc, u_fin, stop_ids, budget)
    return res.tokens, res.num_tokens, res.accepted, res.stopped, taps


def draft_round(dec: StaticDecoder, blk: BlockState, mode: str, fixed_len: int, taps, committed, tokens_out,
                accepted, stopped, slot, start, n, temperature, top_k, top_p, seed, rnd, budget, len_left, sps_t):
    """Graph 2 (mode: dspark | fixed). Returns the round's read-back [S, G+5] int64."""
    G = dec.max_rows - 1
    S = slot.shape[0]
    d = dec.drafter
    k = torch.where(n > 0, committed, torch.zeros_like(committed))
    anchor = tokens_out.gather(1, (k - 1).clamp_min(0)[:, None]).squeeze(1).clamp_min(0)
    U, hidden, *_ = dec.draft(taps, k, slot, start, anchor, greedy=False)
    u_draft = torch.stack([noise.call_uniforms(seed, rnd, noise.STREAM_DRAFT, j, None) for j in range(G)], 1)
    block = markov_draft_static(U, anchor, lambda prev: d.markov(prev)[0], temperature, top_k, top_p, u_draft)
    live = (n > 0) & ~stopped & (k < budget) & (k < len_left)
    if mode == "dspark":
        c = torch.sigmoid(d.confidence(hidden, d.markov(block.prev)[1]))
        ell = admit_static(c, live, sps_t)
    else:
        ell = torch.full((S,), min(fixed_len, G), dtype=torch.long)
    room = torch.minimum(budget - k - 1, len_left - k - 1).clamp(0, G)
    ell = torch.where(live, torch.minimum(ell, room), torch.zeros_like(ell))
    blk.tokens[slot] = block.tokens
    blk.q[slot] = block.q_token.float()
    blk.z[slot] = block.z.float()
    return pack(tokens_out, committed, accepted, stopped, ell)


def pack(tokens_out, committed, accepted, stopped, ell):
    """The round's read-back: [S, G+1 committed tokens | committed | accepted | stopped | next ell]."""
    return torch.cat([tokens_out, committed[:, None], accepted[:, None], stopped.long()[:, None],
                      ell.long()[:, None]], 1)
