"""DSpark draft sampling (Markov chain over the draft block) and lossless verification.

Round structure (notes/dspark.md section 5), with R requests and block size G (gamma):

1. `markov_draft(U, anchor, bias_fn, params)`: x_0 = anchor; for k = 1..G,
   z_k = U[:, k-1] + bias(x_{k-1}), q_k = process_logits(z_k, params), x_k ~ q_k. The DraftBlock
   keeps x, the predecessor of each x (input of the confidence head), q_k(x_k) and z.
2. The engine computes confidences c [R, G] from `block.prev` and calls dspark_sched.admit.
3. `verify_layout(anchor, block.tokens, ell)` gives the verify forward's flat input
   [x_0, x_1..x_ell_r] per request: sum(1 + ell_r) rows, request r at offsets[r].
4. `verify(target_logits [sum(1+ell_r), V], block, ell, params)`: row offsets[r] + i of the
   logits is the target's distribution for the token after x_i. Drafts are accepted left to
   right with probability min(1, p_i(x_{i+1}) / q_{i+1}(x_{i+1})); on the first rejection the
   emitted token is drawn from normalise(max(p_i - q_{i+1}, 0)); if all ell_r admitted drafts are
   accepted the bonus is drawn from p_{ell_r} (never from the unadmitted x_{ell_r + 1}). p uses the
   same temperature / top-k / top-p as q. Greedy rows (T = 0) reduce to "accept iff the draft is
   the target argmax; emit the target argmax" and an all-greedy batch never computes q or p.
   Committed tokens are then cut after the first stop token and at the remaining token budget.

Everything is batched with ragged ell; randomness only enters through the Sampler, so tests can
enumerate every branch exactly through these same functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch

from .sampling import (
    Sampler,
    SamplingParams,
    TorchSampler,
    bernoulli_from_uniform,
    categorical_from_uniform,
    process_logits_static,
)

# Residual mass at or below this falls back to p (DeepSpec's rule). Exactly, the residual has
# mass >= q(x) - p(x) > 0 whenever a rejection can happen; the fallback only guards rounding.
RESIDUAL_EPS = 1e-8


@dataclass
class DraftBlock:
    tokens: torch.Tensor  # [R, G] int64: x_1..x_G
    prev: torch.Tensor  # [R, G] int64: x_0..x_{G-1}, the Markov predecessor of each draft
    q_token: torch.Tensor  # [R, G]: q_k(x_k), probability of the drafted token under its exact q
    z: torch.Tensor  # [R, G, V]: Markov-corrected logits; q_k = process_logits(z[:, k-1], params)

    @property
    def gamma(self) -> int:
        return int(self.tokens.shape[1])


def markov_draft(U: torch.Tensor, anchor: torch.Tensor,
                 bias_fn: Callable[[torch.Tensor], torch.Tensor],
                 params: SamplingParams, sampler: Optional[Sampler] = None,
                 inplace: bool = False,
                 logit_fn: Optional[Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]] = None
                 ) -> DraftBlock:
    """Sample x_1..x_G left to right. U [R, G, V] base draft logits; anchor [R] int64 (x_0);
    bias_fn(prev_ids [R]) -> [R, V] Markov bias B(prev). Each x_k is drawn from
    q_k = process_logits(U_k + B(x_{k-1}), params): conditioned on the SAMPLED predecessor.

    inplace=True (fp32/fp64 U only) adds the bias into U and returns it as block.z, saving an
    [R, G, V] buffer (U[:, k] is not needed after step k).

    logit_fn(k, z_k, drafted [R, k]) -> z_k': a logit processor of the target (min_tokens masking,
    penalties; drafted = x_1..x_k, the drafts before slot k) for the token at block slot k; applied
    before sampling, and block.z keeps the processed logits, so
    the q verification divides by (and the residual subtracts) is the one x_k was drawn from.

    The host's adapter of `_draft` (the one implementation, which `markov_draft_static` runs with
    the uniforms in the graph): the draws come from `sampler`; an all-greedy batch draws from no
    sampler (each q is one-hot: its draw is its argmax)."""
    if U.dim() != 3 or U.shape[0] != anchor.shape[0] or len(params) != U.shape[0]:
        raise ValueError("U must be [R, G, V] with R = len(anchor) = len(params)")
    dtype = U.dtype if U.dtype in (torch.float32, torch.float64) else torch.float32
    if inplace and U.dtype != dtype:
        raise ValueError("inplace drafting needs fp32 or fp64 U")
    sampler = _POINT if params.all_greedy() else (sampler or TorchSampler())
    params = params.to(U.device)
    return _draft(U, anchor.to(U.device, torch.int64), bias_fn, params.temperature, params.top_k, params.top_p,
                  lambda k, q: sampler.categorical(q).to(U.device), logit_fn, out=U if inplace else None,
                  stages=params.stages(U.shape[2]))


class _PointSampler:
    """The draws of point masses (every row greedy): the one token with mass, acceptance iff certain.
    Equal to any Sampler's draws on such rows (u < 1 always, u < 0 never), with no randomness spent."""

    @staticmethod
    def categorical(probs: torch.Tensor) -> torch.Tensor:
        return probs.argmax(-1)

    @staticmethod
    def bernoulli(prob: torch.Tensor) -> torch.Tensor:
        return prob >= 1


_POINT = _PointSampler()


def _draft(U: torch.Tensor, anchor: torch.Tensor, bias_fn: Callable[[torch.Tensor], torch.Tensor],
           temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           draw: Callable[[int, torch.Tensor], torch.Tensor], logit_fn=None,
           out: Optional[torch.Tensor] = None, stages: Optional[dict] = None) -> DraftBlock:
    """THE Markov drafting loop, fixed shapes and no host read: x_k = draw(k, q_k) [R] from
    q_k = process_logits_static(z_k) (greedy rows are one-hot, so any draw gives their argmax).
    out: a buffer [R, G, V] that receives z (inplace drafting), else z is stacked. stages: process_logits_static's
    stage switches (`SamplingParams.stages`: the host adapter's; None: every stage, as in the graphs)."""
    R, G, V = U.shape
    dtype = U.dtype if U.dtype in (torch.float32, torch.float64) else torch.float32
    prev = anchor
    toks, prevs, qs, zs = [], [], [], []
    for k in range(G):
        z = U[:, k].to(dtype) + bias_fn(prev).to(dtype)
        if logit_fn is not None:
            z = logit_fn(k, z, torch.stack(toks, 1) if toks else prev[:, None][:, :0])
        q = process_logits_static(z, temperature, top_k, top_p, **(stages or {}))
        x = draw(k, q)
        toks.append(x)
        prevs.append(prev)
        qs.append(q.gather(1, x.unsqueeze(1)).squeeze(1))
        if out is not None:
            out[:, k] = z
        zs.append(z)
        prev = x
    if not G:
        e = torch.empty(R, 0, dtype=torch.int64, device=U.device)
        return DraftBlock(tokens=e, prev=e.clone(), q_token=torch.empty(R, 0, dtype=dtype, device=U.device),
                          z=out if out is not None else torch.empty(R, 0, V, dtype=dtype, device=U.device))
    return DraftBlock(tokens=torch.stack(toks, 1), prev=torch.stack(prevs, 1), q_token=torch.stack(qs, 1),
                      z=out if out is not None else torch.stack(zs, 1))


def verify_offsets(ell: torch.Tensor) -> torch.Tensor:
    """offsets [R]: first verify row of each request (exclusive cumsum of 1 + ell)."""
    n = 1 + ell.to(torch.int64)
    return torch.cumsum(n, 0) - n


def verify_layout(anchor: torch.Tensor, drafts: torch.Tensor, ell: torch.Tensor):
    """Flat verify input. Returns (ids [N], request [N], step [N], offsets [R]) with
    N = sum(1 + ell): request r contributes ids [x_0, x_1..x_ell_r] at steps 0..ell_r (the
    position of row step i is the anchor's position + i)."""
    ell = ell.to(torch.int64)
    R, G = drafts.shape
    if bool((ell < 0).any()) or bool((ell > G).any()):
        raise ValueError("ell must be in [0, gamma]")
    counts = 1 + ell
    request = torch.repeat_interleave(torch.arange(R, device=drafts.device), counts)
    offsets = verify_offsets(ell)
    step = torch.arange(int(counts.sum()), device=drafts.device) - offsets[request]
    full = torch.cat([anchor.to(drafts.device, torch.int64).unsqueeze(1), drafts], dim=1)
    ids = full[request, step]
    return ids, request, step, offsets


@dataclass
class VerifyResult:
    tokens: torch.Tensor  # [R, G+1] int64 committed tokens, left-aligned, padded with -1
    num_tokens: torch.Tensor  # [R] committed count (1 + accepted unless cut by stop / budget)
    accepted: torch.Tensor  # [R] admitted drafts accepted by verification (before any cut)
    admitted: torch.Tensor  # [R] ell: drafts verified
    drafted: torch.Tensor  # [R] drafts produced (G)
    stopped: torch.Tensor  # [R] bool: a stop token was committed; nothing follows it

    def token_lists(self) -> List[List[int]]:
        return [row[:n].tolist() for row, n in zip(self.tokens, self.num_tokens.tolist())]

    def last_tokens(self) -> torch.Tensor:
        """[R] the last committed token of each row: the next round's anchor x_0 (-1 if none)."""
        idx = (self.num_tokens - 1).clamp(min=0).unsqueeze(1)
        last = self.tokens.gather(1, idx).squeeze(1)
        return torch.where(self.num_tokens > 0, last, torch.full_like(last, -1))

    def committed_rows(self) -> torch.Tensor:
        """Flat indices of the verify rows whose inputs are now committed context: x_0..x_{n-1} of
        each request (n = num_tokens), i.e. the rows whose KV / taps the engine keeps."""
        off = verify_offsets(self.admitted)
        start = torch.repeat_interleave(off, self.num_tokens)
        first = torch.repeat_interleave(torch.cumsum(self.num_tokens, 0) - self.num_tokens, self.num_tokens)
        return start + torch.arange(int(self.num_tokens.sum()), device=off.device) - first


def _gather_rows(ell: torch.Tensor, G: int) -> torch.Tensor:
    """[R, G+1] verify row index of steps 0..G, clamped to the request's last row (ell_r)."""
    steps = torch.arange(G + 1, device=ell.device)
    return verify_offsets(ell).unsqueeze(1) + torch.minimum(steps.unsqueeze(0), ell.unsqueeze(1))


def _finish(tokens_G: torch.Tensor, n_acc: torch.Tensor, final: torch.Tensor, ell: torch.Tensor,
            stop_ids: Optional[torch.Tensor], max_tokens: Optional[torch.Tensor]) -> VerifyResult:
    R, G = tokens_G.shape
    steps = torch.arange(G + 1, device=tokens_G.device).unsqueeze(0)
    out = torch.cat([tokens_G, torch.full((R, 1), -1, dtype=torch.int64, device=tokens_G.device)], 1)
    out = torch.where(steps < n_acc.unsqueeze(1), out, torch.full_like(out, -1))
    out.scatter_(1, n_acc.unsqueeze(1), final.to(torch.int64).unsqueeze(1))
    num = n_acc + 1
    stopped = torch.zeros(R, dtype=torch.bool, device=out.device)
    if stop_ids is not None and stop_ids.numel():
        stop_ids = stop_ids.to(out.device)
        if stop_ids.dim() == 1:
            stop_ids = stop_ids.unsqueeze(0).expand(R, -1)
        hit = (out.unsqueeze(2) == stop_ids.unsqueeze(1)).any(2) & (out >= 0) & (steps < num.unsqueeze(1))
        stopped = hit.any(1)
        first = hit.to(torch.int8).argmax(1)
        num = torch.where(stopped, first + 1, num)
    if max_tokens is not None:
        cap = torch.as_tensor(max_tokens, dtype=torch.int64, device=out.device).clamp(min=0)
        stopped = stopped & (num <= cap)  # a stop token cut off by the budget was not committed
        num = torch.minimum(num, cap.expand(R))
    out = torch.where(steps < num.unsqueeze(1), out, torch.full_like(out, -1))
    return VerifyResult(tokens=out, num_tokens=num, accepted=n_acc, admitted=ell.clone(),
                        drafted=torch.full_like(ell, G), stopped=stopped)


def verify_greedy(target_logits: torch.Tensor, drafts: torch.Tensor, ell: torch.Tensor,
                  stop_ids: Optional[torch.Tensor] = None,
                  max_tokens: Optional[torch.Tensor] = None) -> VerifyResult:
    """Greedy verification: accept x_{i+1} iff it equals argmax of verify row i; the emitted
    token after the accepted run is the target argmax. Output = the target's greedy tokens.
    `verify` with T = 0 (greedy drafts have q(x) = 1; the residual never needs their z, since a
    rejection's residual of a one-hot p is p itself, so a zero z stands in)."""
    R, G = drafts.shape
    V = target_logits.shape[-1]
    block = DraftBlock(tokens=drafts, prev=drafts, q_token=torch.ones(R, G, dtype=torch.float64, device=drafts.device),
                       z=torch.zeros(R, G, V, device=drafts.device))
    return verify(target_logits, block, ell, SamplingParams.make(R, 0.0), stop_ids=stop_ids, max_tokens=max_tokens)


def verify(target_logits: torch.Tensor, block: DraftBlock, ell: torch.Tensor, params: SamplingParams,
           sampler: Optional[Sampler] = None, stop_ids: Optional[torch.Tensor] = None,
           max_tokens: Optional[torch.Tensor] = None,
           residual_eps: float = RESIDUAL_EPS) -> VerifyResult:
    """Lossless verification of a batch with ragged admitted lengths.

    target_logits [sum(1 + ell_r), V]: the verify forward's logits in verify_layout order.
    block: the DraftBlock these drafts came from (its q_token and z define q exactly).
    ell [R]: admitted drafts per request. params: the requests' sampling params (the SAME
    as used for drafting). stop_ids: [S] shared or [R, S] per request (pad with -1).
    max_tokens [R] (optional): tokens each request may still emit.

    Randomness per request per call: one bernoulli over [G] and one categorical draw whatever
    ell is, so a seeded request's generator advances identically in every batch (its tokens
    still depend on ell, which the batch-wide admission sets); an all-greedy batch draws none.

    The host's adapter of `_verify` (the one implementation, which `verify_static` runs with the
    uniforms in the graph): the ragged rows are laid out as [R, G+1, V] (a request's rows past
    ell_r repeat its last one and are never read)."""
    ell = ell.to(block.tokens.device, torch.int64)
    R, G = block.tokens.shape
    n_rows = int((1 + ell).sum())
    if target_logits.shape[0] != n_rows:
        raise ValueError(f"target_logits has {target_logits.shape[0]} rows, layout needs {n_rows}")
    sampler = _POINT if params.all_greedy() else (sampler or TorchSampler())
    params = params.to(ell.device)
    return _verify(target_logits[_gather_rows(ell, G)], block.tokens, block.q_token, block.z, ell,
                   params.temperature, params.top_k, params.top_p,
                   lambda p: sampler.bernoulli(p).to(ell.device), lambda d: sampler.categorical(d).to(ell.device),
                   stop_ids, max_tokens, residual_eps, params.stages(target_logits.shape[1]))


def _verify(target_logits: torch.Tensor, drafts: torch.Tensor, q_token: torch.Tensor, z: torch.Tensor,
            ell: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
            bernoulli: Callable[[torch.Tensor], torch.Tensor], categorical: Callable[[torch.Tensor], torch.Tensor],
            stop_ids: Optional[torch.Tensor], max_tokens: Optional[torch.Tensor],
            residual_eps: float, stages: Optional[dict] = None) -> VerifyResult:
    """THE lossless acceptance, fixed shapes and no host read: target_logits [S, G+1, V] (row i of
    request s: the target after x_i; rows > ell[s] are ignored), drafts / q_token [S, G], z [S, G, V],
    ell [S], params [S]; bernoulli(accept_prob [S, G]) and categorical(dist [S, V]) are the draws.
    The residual is computed for every row and selected where a draft was rejected. stages: as in
    `_draft`."""
    S, G1, V = target_logits.shape
    G = G1 - 1
    rep = lambda t: t[:, None].expand(S, G1).reshape(-1)  # noqa: E731 - params per verify row
    probs = process_logits_static(target_logits.reshape(S * G1, V), rep(temperature), rep(top_k),
                                  rep(top_p), **(stages or {})).view(S, G1, V)
    steps = torch.arange(G1, device=ell.device)
    rows = torch.minimum(steps[None, :], ell[:, None])  # [S, G+1] the clamped verify row of step i
    in_play = steps[None, :G] < ell[:, None]
    p_rows = probs.gather(1, rows[:, :G, None].expand(S, G, V))  # p_i for i < G (clamped)
    p_tok = p_rows.gather(2, drafts.long()[:, :, None]).squeeze(2)
    q_tok = q_token.to(probs.dtype)
    accept_prob = torch.clamp(p_tok / q_tok.clamp_min(torch.finfo(probs.dtype).tiny), max=1.0)
    accept_prob = torch.where(in_play, accept_prob, torch.zeros_like(accept_prob))
    acc = bernoulli(accept_prob) & in_play
    n_acc = torch.cumprod(acc.to(torch.int64), 1).sum(1)
    final_row = rows.gather(1, n_acc[:, None]).squeeze(1)
    dist = probs.gather(1, final_row[:, None, None].expand(S, 1, V)).squeeze(1)  # p at the final row
    if G:
        k = n_acc.clamp_max(G - 1)  # 0-based index of the rejected draft x_{k+1} (where one was)
        zk = z.gather(1, k[:, None, None].expand(S, 1, V)).squeeze(1)
        q_rej = process_logits_static(zk, temperature, top_k, top_p, **(stages or {}))
        res = torch.clamp(dist - q_rej, min=0.0)
        mass = res.sum(1, keepdim=True)
        fixed = torch.where(mass > residual_eps, res / mass.clamp_min(residual_eps), dist)
        dist = torch.where((n_acc < ell)[:, None], fixed, dist)
    final = categorical(dist)
    return _finish(drafts.long(), n_acc, final, ell, stop_ids, max_tokens)


def commit_stats(results: Sequence[VerifyResult]) -> dict:
    """Totals over rounds: drafted / admitted / accepted drafts and committed tokens."""
    tot = {"drafted": 0, "admitted": 0, "accepted": 0, "committed": 0, "rounds": 0}
    for r in results:
        tot["drafted"] += int(r.drafted.sum())
        tot["admitted"] += int(r.admitted.sum())
        tot["accepted"] += int(r.accepted.sum())
        tot["committed"] += int(r.num_tokens.sum())
        tot["rounds"] += int(r.num_tokens.numel())
    return tot


# ---- the static graphs' forms (no host reads, fixed shapes) -----------------------------------------
# `_draft` / `_verify` with the draws taken from uniforms u (what noise.CounterSampler hands the host
# adapters above), over a fixed bucket of S requests: the decode graphs of trn2/static_round.py run
# them inside the graph; tests/test_dspark_lossless.py and tests/test_static_round.py check them
# against the host adapters.

def markov_draft_static(U: torch.Tensor, anchor: torch.Tensor, bias_fn: Callable[[torch.Tensor], torch.Tensor],
                        temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                        u: torch.Tensor, logit_fn=None, stages: Optional[dict] = None) -> DraftBlock:
    """`_draft` with uniforms u [S, G] (column k: the draw of x_{k+1}). Every row takes the
    sampling path (greedy rows are one-hot under process_logits, so they draw their argmax).
    logit_fn(k, z_k, drafted [S, k]): as in markov_draft (a static form: no host reads). stages: as in
    `_draft` (a graph variant whose rows never filter leaves the filters out)."""
    return _draft(U, anchor.long(), bias_fn, temperature, top_k, top_p,
                  lambda k, q: categorical_from_uniform(q, u[:, k]), logit_fn, stages=stages)


def verify_static(target_logits: torch.Tensor, drafts: torch.Tensor, q_token: torch.Tensor, z: torch.Tensor,
                  ell: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  u_accept: torch.Tensor, u_final: torch.Tensor, stop_ids: torch.Tensor,
                  max_tokens: torch.Tensor, residual_eps: float = RESIDUAL_EPS,
                  stages: Optional[dict] = None) -> VerifyResult:
    """`_verify` over a bucket: target_logits [S, G+1, V], u_accept [S, G] (the bernoulli draws,
    compared in the noise's dtype as CounterSampler.bernoulli does), u_final [S] (the final /
    residual / bonus draw), stop_ids [S, W] (-1 padded), max_tokens [S]. stages: as in `_draft`."""
    return _verify(target_logits, drafts, q_token, z, ell.long(), temperature, top_k, top_p,
                   lambda p: bernoulli_from_uniform(p, u_accept), lambda d: categorical_from_uniform(d, u_final),
                   stop_ids, max_tokens, residual_eps, stages)
