"""Counter-based sampling noise: uniforms as a pure function of (request seed, round, stream, index).

The static decode graphs sample inside the graph, so their randomness must be an input or a
function of inputs; a torch.Generator (a stateful host object) is neither. Every draw of the
engine therefore comes from `uniforms(seed, round, stream, index)`: a multiply-xorshift hash over
31-bit lanes, computed in int32 arithmetic only. A NeuronCore has no int64 arithmetic that
neuronx-cc keeps exact (it narrows 64-bit integers unless told otherwise), so the hash never
forms a 64-bit value: the 31 x 31-bit multiplies mod 2^31 are assembled from 15 x 16-bit partial
products (`_mulmod31`), every intermediate below 2^31, and no signed overflow is relied on.
The request's int64 seed enters as two int32 words (`seed_words`, split on the host, exactly);
the lanes the hash reads from those words are the bits it read from the int64 seed before, so
the draws are the same bits as the int64 hash's (tests/test_noise.py checks the multiply against
the int64 product).

`uniforms` returns `precision.loop_dtype()` values: fp32 with 24 random bits (the top bits of one
hash) under the kernels' numerics, fp64 with 53 bits (two hashes, combined in exact fp64 ops) for
the CPU reference (torch ops, exact numerics). Eager and static serving use the same draws, so
the same request and seed give the same tokens in both modes and at every W.

Keys: `round` is the request's sampling round (0: the first token after prefill, then one per
verify), so a rejected draft's position is never re-drawn with reused noise; `stream` separates the
verify draws (acceptance bernoullis, final/residual categorical) from the Markov drafting draws;
`index` = call * 64 + column within one call of a Sampler. `CounterSampler` hands these out through
the `Sampler` protocol of `sampling`, so `dspark_accept.verify` / `markov_draft` consume exactly the
uniforms the static graphs compute.
"""

from __future__ import annotations

import torch

from .precision import loop_dtype

M31 = (1 << 31) - 1
M16 = (1 << 16) - 1
M15 = (1 << 15) - 1
STREAM_VERIFY = 1
STREAM_DRAFT = 2
CALL_STRIDE = 64  # columns per Sampler call (gamma + 1 <= 64)
_K1, _K2, _K3 = 0x2C1B3C6D, 0x297A2D39, 0x5BD1E995 & M31


def _mulmod31(x: torch.Tensor, k: int) -> torch.Tensor:
    """(x * k) mod 2^31 for int32 x in [0, 2^31) and a constant k in [0, 2^31), in int32 with every
    intermediate in [0, 2^31). With x = xh 2^15 + xl, k = kh 2^15 + kl (xl, kl < 2^15; xh, kh < 2^16):
    x k = xh kh 2^30 + (xh kl + xl kh) 2^15 + xl kl, and mod 2^31 the first term keeps only the
    parity of xh kh and the middle one only its low 16 bits."""
    kl, kh = k & M15, k >> 15
    xl, xh = x & M15, x >> 15
    p = xl * kl  # < 2^30
    mid = (p >> 15) + ((xh * kl) & M16) + ((xl * kh) & M16)  # each product < 2^31; the sum < 2^17 + 2^15
    if kh & 1:
        mid = mid + ((xh & 1) << 15)
    return (p & M15) | ((mid & M16) << 15)  # (mid & M16) << 15 < 2^31


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 31-bit to 31-bit avalanche (int32 x in [0, 2^31)): xorshift, multiply mod 2^31, thrice."""
    x = _mulmod31(x ^ (x >> 15), _K1)
    x = _mulmod31(x ^ (x >> 13), _K2)
    x = _mulmod31(x ^ (x >> 16), _K3)
    return x ^ (x >> 15)


def _hash(lo: torch.Tensor, hi: torch.Tensor, rnd: torch.Tensor, stream: int, index: torch.Tensor) -> torch.Tensor:
    """31 hash bits (int32 in [0, 2^31)) of (seed = hi 2^32 + (lo mod 2^32), rnd, stream, index); all
    int32. The seed lanes: bits 0-30, bits 31-61 and bits 62-63 of the 64-bit seed."""
    s0 = lo & M31
    s1 = ((lo >> 31) & 1) | ((hi & (M31 >> 1)) << 1)  # (hi & (2^30 - 1)) << 1 < 2^31
    s2 = (hi >> 30) & 3
    h = _mix(s0)
    h = _mix(h ^ s1)
    h = _mix(h ^ s2 ^ (rnd & M31))
    h = _mix(h ^ stream)
    return _mix(h ^ (index & M31))


def seed_words(seed) -> torch.Tensor:
    """A request seed (int64 tensor [R] or a list of ints) as int32 words [R, 2] (low, high), split
    with exact int64 ops: the host side of the round inputs (an int32 [R, 2] tensor passes through)."""
    s = torch.as_tensor(seed)
    if s.dtype == torch.int32 and s.dim() >= 1 and s.shape[-1] == 2:
        return s
    s = s.to(torch.int64)
    lo = s & 0xFFFFFFFF  # [0, 2^32): as a signed int32, the same bits
    lo = torch.where(lo > M31, lo - (1 << 32), lo)
    return torch.stack([lo, s >> 32], -1).to(torch.int32)  # s >> 32 is in [-2^31, 2^31)


def _int32(t: torch.Tensor) -> torch.Tensor:
    """A round / index counter as int32 (its low 31 bits, the lane the hash reads)."""
    return t if t.dtype == torch.int32 else (t.to(torch.int64) & M31).to(torch.int32)


def uniforms(seed: torch.Tensor, rnd: torch.Tensor, stream: int, index: torch.Tensor,
             dtype: torch.dtype | None = None) -> torch.Tensor:
    """Uniforms in [0, 1) of `dtype` (default `loop_dtype()`): fp32 with 24 random bits, fp64 with 53.
    seed: int32 words [R, 2] (`seed_words`; an int64 [R] is split here, on the host); rnd [R] int32
    (int64 accepted); index broadcastable against [R, 1] (e.g. [n] columns) -> [R, n] (or [R] for a
    scalar-shaped index)."""
    dtype = dtype or loop_dtype()
    w = seed_words(seed)
    lo, hi, r, i = w[..., 0], w[..., 1], _int32(rnd), _int32(index)
    if index.dim() != 0:
        lo, hi, r = lo[:, None], hi[:, None], r[:, None]
    a = _hash(lo, hi, r, stream, 2 * i)
    if dtype == torch.float32:
        return (a >> 7).to(torch.float32) * (2.0 ** -24)  # 24 bits: exact in fp32, below 1
    if dtype != torch.float64:
        raise ValueError(f"uniforms in {dtype}: float32 or float64 only")
    b = _hash(lo, hi, r, stream, 2 * i + 1)
    # a 2^22 + (b >> 9) < 2^53: every fp64 op below is exact
    return (a.to(torch.float64) * (1 << 22) + (b >> 9).to(torch.float64)) * (2.0 ** -53)


def call_uniforms(seed, rnd, stream: int, call: int, n: int | None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The uniforms of Sampler call number `call`: [R] (n None, a categorical) or [R, n]."""
    dev = seed.device
    if n is None:
        # a fill, not torch.tensor(..., device=dev): that is a host-to-device copy inside the step
        return uniforms(seed, rnd, stream, torch.full((), call * CALL_STRIDE, dtype=torch.int32, device=dev), dtype)
    if n > CALL_STRIDE:
        raise ValueError(f"at most {CALL_STRIDE} draws per call")
    return uniforms(seed, rnd, stream, call * CALL_STRIDE + torch.arange(n, dtype=torch.int32, device=dev), dtype)


class CounterSampler:
    """`sampling.Sampler` over `uniforms`: call k of this sampler (categorical or bernoulli) uses
    index k * 64 + column. One sampler serves one verify or one drafting of a batch of requests."""

    def __init__(self, seeds, rounds, stream: int):
        self.seeds = seed_words(seeds if isinstance(seeds, torch.Tensor) else torch.tensor(seeds, dtype=torch.long))
        self.rounds = _int32(torch.as_tensor(rounds, dtype=torch.long))
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
        from .sampling import bernoulli_from_uniform

        return bernoulli_from_uniform(prob, self._next(prob.shape[1]).to(prob.device))
