"""The DSpark decode round as two fixed-shape graphs per bucket, sampling included.

Graph 1 (`verify_round`): compose each sequence's rows from the runner's per-slot draft block
([pending token, drafts...], 1 + ell valid rows), run the static verify forward, then the lossless
acceptance (min(1, p/q), residual, bonus) with the request's seeded noise
(`noise.uniforms(seed, round, VERIFY, ..)`), stop tokens and token budgets.

Graph 2 (`draft_round`): the DSpark ring writes of the committed rows, the draft block at the
bonus token, Markov drafting with the drafting noise, the confidence head, admission (`admit_static`
with the SPS table as an input, or the fixed length) clipped to each request's room; the new block
goes into the per-slot state, and the round's one output is a small int64 tensor
[S, G+1 tokens | committed | accepted | stopped | next ell | G confidence logits] -- the only thing
the host reads.

dspark_adaptive (`Engine._step_static`): the draft graph applies the calibration (per row and
position, (T_k, b_k) as an input: `calibrated_confidence`, `Calibration.confidence`'s operations) and
admits with the whole step's cost (`admit_static`'s t_draft input: `StepCost.sps_for(R)`); a probe
admits a fixed length per row (`fixed_ell` input, -1: admission). The confidence logits of the new
block come back in the read-back (float64 bits: exact), for the host's online calibration and the
next stepping-aside decision. A round that steps aside runs graph 1 alone (`verify_round` also
returns that round's read-back, ell 0): no ring writes, no draft stages, no taps read.

Sampling, acceptance, the logit processors and log-probs are the engine's one implementation
(`dspark_accept.verify_static` / `markov_draft_static`, `sampling.process_logits_static` /
`token_logprobs_static`, `logit_proc`, `calibration.calibrated_confidence`): eager serving runs the
same functions through thin adapters, with `noise.CounterSampler` handing out these uniforms, so the
two commit the same tokens for the same request and seed. Admission is still a pair
(`dspark_sched.admit` on the host, `admit_static` here), checked equal row by row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from v4flash_backend.engine import noise
from v4flash_backend.engine.calibration import calibrated_confidence
from v4flash_backend.engine.dspark_accept import markov_draft_static, verify_static
from v4flash_backend.engine.dspark_sched import admit_static
from v4flash_backend.engine.logit_proc import draft_logit_fn, process_verify_rows
from v4flash_backend.engine.precision import loop_dtype
from v4flash_backend.engine.round_plan import pack_logprobs
from v4flash_backend.engine.round_plan import pack_result as pack  # the read-back's layout is the plan types'
from v4flash_backend.engine.sampling import LOGPROB_WIDTH, token_logprobs_static

from .static_step import StaticDecoder


@dataclass
class BlockState:
    """Per-slot draft block, resident where the model is (the draft graph writes it, the verify
    graph reads it): tokens [slots, G] int64, q(x) [slots, G] f32, Markov-corrected logits z
    [slots, G, V] f32."""

    tokens: torch.Tensor
    q: torch.Tensor
    z: torch.Tensor
    # [slots, V] `loop_dtype()`: how often each id occurs in the slot's generated tokens (the penalties'
    # counts; the processed round graphs add each round's committed tokens, `set_counts` loads them)
    counts: torch.Tensor | None = None

    @classmethod
    def empty(cls, slots: int, G: int, V: int, device=None) -> "BlockState":
        return cls(torch.zeros(slots, G, dtype=torch.long, device=device),
                   torch.ones(slots, G, dtype=torch.float32, device=device),
                   torch.zeros(slots, G, V, dtype=torch.float32, device=device),
                   torch.zeros(slots, V, dtype=loop_dtype(), device=device))


# the int64 inputs of a round, [S] each unless noted (one row per sequence of the bucket)
ROUND_INPUTS = ("slot", "start", "n", "pending", "top_k", "seed", "rnd", "budget", "len_left")


def stages_of(proc: dict | None) -> dict | None:
    """The sampling stages a round variant runs (`process_logits_static`): the processed variant
    every stage; the plain one no top-k / top-p filter -- the engine sends a round in which any row
    filters to the processed variant (`round_plan.filters_sampling`; StaticRunner refuses a plain
    plan that filters), so on the plain one's rows the filters are the identity, and leaving them
    out saves their sort over the vocabulary per verify and draft position (~0.25 ms a 4096-wide
    row here)."""
    return None if proc is not None else {"filters": False}


def verify_round(dec: StaticDecoder, blk: BlockState, ctx: int, slot, start, n, pending, temperature, top_k,
                 top_p, seed, rnd, budget, stop_ids, proc: dict | None = None):
    """Graph 1. n [S]: 1 + ell for a sequence, 0 for a padding one. Returns (committed tokens
    [S, G+1] (-1 padded), committed count [S], accepted [S], stopped [S], taps), and with `proc`
    (the processed variant: `process_verify_rows`) also the log-probs pack of the committed tokens;
    last, the read-back of a round that stops here (no draft graph: next ell 0, no confidences)."""
    G = dec.max_rows - 1  # 0 for the plain-decode graph (1 row per sequence; the blocks hold more)
    S = slot.shape[0]
    drafts = blk.tokens[slot][:, :G]
    tokens = torch.cat([pending[:, None], drafts], dim=1)
    logits, taps = dec.verify(tokens, slot, start, n, ctx)
    V = logits.shape[-1]
    if proc is not None:
        logits = process_verify_rows(logits.view(S, G + 1, V), blk.counts[slot], drafts, stop_ids, proc)
    ell = (n - 1).clamp_min(0)
    u_acc = (noise.call_uniforms(seed, rnd, noise.STREAM_VERIFY, 0, G) if G
             else torch.zeros(S, 0, dtype=loop_dtype(), device=seed.device))
    u_fin = noise.call_uniforms(seed, rnd, noise.STREAM_VERIFY, 1, None)
    res = verify_static(logits.view(S, G + 1, V), drafts, blk.q[slot][:, :G], blk.z[slot][:, :G], ell, temperature,
                        top_k, top_p, u_acc, u_fin, stop_ids, budget, stages=stages_of(proc))
    zero_c = torch.zeros(S, G, dtype=torch.float32, device=slot.device)
    alone = pack(res.tokens, res.num_tokens, res.accepted, res.stopped, torch.zeros_like(res.num_tokens), zero_c)
    if proc is None:
        return res.tokens, res.num_tokens, res.accepted, res.stopped, taps, alone
    lp = logprobs_pack(logits.view(S * (G + 1), V), res.tokens, temperature, top_k, top_p)
    add_counts(blk, slot, res.tokens, n > 0)
    return res.tokens, res.num_tokens, res.accepted, res.stopped, taps, lp, torch.cat([alone, lp], 1)


def draft_round(dec: StaticDecoder, blk: BlockState, mode: str, fixed_len: int, taps, committed, tokens_out,
                accepted, stopped, slot, start, n, temperature, top_k, top_p, seed, rnd, budget, len_left, sps_t,
                t_draft, cal, fixed_ell, proc: dict | None = None, extra=None):
    """Graph 2 (mode: dspark | fixed). Returns the round's read-back [S, 2G+5] int64 (with `extra`,
    graph 1's log-probs pack, appended: still one read-back). `proc`: the processed variant's
    drafting processors (`draft_logit_fn`). t_draft [S+1] `loop_dtype()`: the draft seconds by live rows R
    (0: the forward's table alone); cal [S, G, 2] `loop_dtype()`: (T_k, b_k) per row and position (T = 0: the
    raw head, sigmoid in f32); fixed_ell [S]: >= 0 admits that many (a probe), -1 - f runs admission with at
    least f drafts (the fixed-length guard's floor; -1: admission alone)."""
    G = dec.max_rows - 1
    S = slot.shape[0]
    d = dec.drafter
    k = torch.where(n > 0, committed, torch.zeros_like(committed))
    anchor = tokens_out.gather(1, (k - 1).clamp_min(0)[:, None]).squeeze(1).clamp_min(0)
    U, hidden, *_ = dec.draft(taps, k, slot, start, anchor, greedy=False)
    u_draft = torch.stack([noise.call_uniforms(seed, rnd, noise.STREAM_DRAFT, j, None) for j in range(G)], 1)
    fn = None if proc is None else draft_logit_fn(blk.counts[slot], proc["n_out"] + k, proc)
    block = markov_draft_static(U, anchor, lambda prev: d.markov(prev)[0], temperature, top_k, top_p, u_draft,
                                logit_fn=fn, stages=stages_of(proc))
    live = (n > 0) & ~stopped & (k < budget) & (k < len_left)
    # the head on each draft's predecessor (block.prev), as Engine._confidence_logits
    conf = d.confidence(hidden, d.markov_embed(block.prev))
    if mode == "dspark":
        ell = admit_static(calibrated_confidence(conf, cal), live, sps_t, t_draft)
        ell = torch.where(fixed_ell >= 0, fixed_ell.clamp(max=G), torch.maximum(ell, (-1 - fixed_ell).clamp(0, G)))
    else:
        ell = torch.full((S,), min(fixed_len, G), dtype=torch.long, device=slot.device)
    room = torch.minimum(budget - k - 1, len_left - k - 1).clamp(0, G)
    ell = torch.where(live, torch.minimum(ell, room), torch.zeros_like(ell))
    blk.tokens[slot] = block.tokens
    blk.q[slot] = block.q_token.float()
    blk.z[slot] = block.z.float()
    out = pack(tokens_out, committed, accepted, stopped, ell, conf)
    return out if extra is None else torch.cat([out, extra], 1)


# ---- the processed round variant: min_tokens, penalties, log-probs (and top-k / top-p) in the graphs ---
# engine/logit_proc.py (`process_verify_rows`, `draft_logit_fn`) and sampling.token_logprobs_static are
# the one implementation; the eager engine runs the same functions (logits.LogitProcessing), so eager
# and static commit the same tokens and report the same log-probs. proc: n_out [S] (generated tokens
# before the round), min_tokens [S], frequency / presence [S] `loop_dtype()`, stop_ids [S, W].
# The graph computes the top LOGPROB_WIDTH alternatives (as the host does: sampling.LOGPROB_WIDTH) and
# the host keeps the request's first `logprobs`.


def logprobs_pack(logits: torch.Tensor, tokens: torch.Tensor, temperature, top_k, top_p) -> torch.Tensor:
    """`sampling.token_logprobs_static` of the committed tokens [S, G+1] (-1 padded) under their processed
    verify rows [S*(G+1), V], top LOGPROB_WIDTH alternatives, packed by `round_plan.pack_logprobs`
    (`loop_dtype` values bit-cast: no float64 op under the kernels' numerics) for the round's one
    read-back (`round_plan.RoundResult.logprobs` reads it)."""
    S, G1 = tokens.shape
    rep = lambda t: t[:, None].expand(S, G1).reshape(-1)  # noqa: E731
    tok, rank, top_ids, top_lp = token_logprobs_static(logits, rep(temperature), rep(top_k), rep(top_p),
                                                       tokens.reshape(-1), LOGPROB_WIDTH)
    return pack_logprobs(tok, rank, top_ids, top_lp, S)


def add_counts(blk: BlockState, slot: torch.Tensor, tokens: torch.Tensor, live: torch.Tensor) -> None:
    """The round's committed tokens [S, G+1] (-1 padded) into the slots' generated-token counts."""
    base = blk.counts[slot]
    w = ((tokens >= 0) & live[:, None]).to(base.dtype)
    blk.counts[slot] = base.scatter_add(1, tokens.clamp_min(0), w)
