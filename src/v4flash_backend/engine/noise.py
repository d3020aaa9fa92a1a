"""Counter-based sampling noise: uniforms as a pure function of (request seed, round, stream, index).

The static decode graphs sample inside the graph, so their randomness must be an input or a
function of inputs; a torch.Generator (a stateful host object) is neither. Every draw of the
engine therefore comes from `uniforms(seed, round, stream, index)`: a multiply-xorshift hash in
int64 arithmetic whose intermediate values stay below 2^62 (31-bit lanes times 31-bit odd
multipliers), so it never overflows and gives the same bits in eager torch, in a traced graph and on
any backend that implements int64 multiply / xor / shift exactly. Eager and static serving use the
same draws, so the same request and seed give the same tokens in both modes and at every W.

Keys: `round` is the request's sampling round (0: the first token after prefill, then one per
verify), so a rejected draft's position is never re-drawn with reused noise; `stream` separates the
verify draws (acceptance bernoullis, final/residual categorical) from the Markov drafting draws;
`index` = call * 64 + column within one call of a Sampler. `CounterSampler` hands these out through
the `Sampler` protocol of `sampling`, so `dspark_accept.verify` / `markov_draft` consume exactly the
uniforms the static graphs compute.
"""

from __future__ import annotations

import torch

M31 = (1 << 31) - 1
STREAM_VERIFY = 1
STREAM_DRAFT = 2
CALL_STRIDE = 64  # columns per Sampler call (gamma + 1 <= 64)
_K1, _K2, _K3 = 0x2C1B3C6D, 0x297A2D39, 0x5BD1E995 & M31


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 31-bit to 31-bit bijective-ish avalanche (x in [0, 2^31), products < 2^62)."""
    x = ((x ^ (x >> 15)) * _K1) & M31
    x = ((x ^ (x >> 13)) * _K2) & M31
    x = ((x ^ (x >> 16)) * _K3) & M31
    return x ^ (x >> 15)


def _hash(seed: torch.Tensor, rnd: torch.Tensor, stream: int, index: torch.Tensor) -> torch.Tensor:
    h = _mix(seed & M31)
    h = _mix(h ^ ((seed >> 31) & M31))
    h = _mix(h ^ ((seed >> 62) & 3) ^ (rnd & M31))
    h = _mix(h ^ stream)
    return _mix(h ^ (index & M31))


def uniforms(seed: torch.Tensor, rnd: torch.Tensor, stream: int, index: torch.Tensor) -> torch.Tensor:
    """Float64 uniforms in [0, 1) with 53 random bits. seed, rnd [R] int64; index broadcastable
    against [R, 1] (e.g. [n] columns) -> [R, n] (or [R] for a scalar-shaped index)."""
    seed = seed.long()
    rnd = rnd.long()
    if index.dim() == 0:
        s, r, i = seed, rnd, index.long()
    else:
        s, r, i = seed[:, None], rnd[:, None], index.long()
    a = _hash(s, r, stream, 2 * i)
    b = _hash(s, r, stream, 2 * i + 1)
    return (a * (1 << 22) + (b >> 9)).double() * (2.0 ** -53)


def call_uniforms(seed, rnd, stream: int, call: int, n: int | None) -> torch.Tensor:
    """The uniforms of Sampler call number `call`: [R] (n None, a categorical) or [R, n]."""
    if n is None:
        return uniforms(seed, rnd, stream, torch.tensor(call * CALL_STRIDE))
    if n > CALL_STRIDE:
        raise ValueError(f"at most {CALL_STRIDE} draws per call")
    return uniforms(seed, rnd, stream, call * CALL_STRIDE + torch.arange(n))


class CounterSampler:
    """`sampling.Sampler` over `uniforms`: call k of this sampler (categorical or bernoulli) uses
    index k * 64 + column. One sampler serves one verify or one drafting of a batch of requests."""

    def __init__(self, seeds: torch.Tensor, rounds: torch.Tensor, stream: int):
        self.seeds = torch.as_tensor(seeds, dtype=torch.long)
        self.rounds = torch.as_tensor(rounds, dtype=torch.long)
        self.stream = stream
        self.calls = 0

    def _next(self, n: int | None) -> torch.Tensor:
        u = call_uniforms(self.seeds, self.rounds, self.stream, self.calls, n)
        self.calls += 1
        return u

    def categorical(self, probs: torch.Tensor) -> torch.Tensor:
        from .sampling import categorical_from_uniform

        return categorical_from_uniform(probs, self._next(None).to(probs.device))

    def bernoulli(self, prob: torch.Tensor) -> torch.Tensor:
        return self._next(prob.shape[1]).to(prob.device) < prob.to(torch.float64)
