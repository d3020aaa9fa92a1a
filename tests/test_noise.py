"""The counter-based noise (engine/noise.py) in 32-bit integer arithmetic.

- The int32 multiply mod 2^31 equals the int64 product masked to 31 bits (the definition), on edge
  values and 1e5 random ones: exact equality, no tolerance.
- Every tensor the hash makes is int32 (a dispatch-mode recorder); a hash with one deliberate int64
  cast is caught by the same check.
- The draws are the previous int64 hash's bits (its code is kept here as the reference): the fp64
  draws of the CPU reference did not change; the fp32 draw is the fp64 draw cut to 24 bits.
- Uniform (chi-square and Kolmogorov-Smirnov over 1e5 draws, fixed keys so the statistics are
  deterministic; bounds stated per test) and decorrelated across streams, rounds, indices and seeds
  (the seed's high word included).
"""

import math

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from v4flash_backend import ops
from v4flash_backend.engine import noise

N = 100_000


class DtypeRecorder(TorchDispatchMode):
    """The dtypes of every tensor an op returns while active."""

    def __init__(self):
        super().__init__()
        self.dtypes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.dtypes |= {t.dtype for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)}
        return out


def _old_uniforms(seed, rnd, stream, index):
    """The previous int64 hash (products < 2^62), the reference the int32 hash must reproduce."""
    m31 = (1 << 31) - 1

    def mix(x):
        x = ((x ^ (x >> 15)) * noise._K1) & m31
        x = ((x ^ (x >> 13)) * noise._K2) & m31
        x = ((x ^ (x >> 16)) * noise._K3) & m31
        return x ^ (x >> 15)

    def h(s, r, i):
        v = mix(s & m31)
        v = mix(v ^ ((s >> 31) & m31))
        v = mix(v ^ ((s >> 62) & 3) ^ (r & m31))
        v = mix(v ^ stream)
        return mix(v ^ (i & m31))

    s, r, i = seed[:, None], rnd[:, None], index.long()
    a, b = h(s, r, 2 * i), h(s, r, 2 * i + 1)
    return (a * (1 << 22) + (b >> 9)).double() * (2.0 ** -53)


EDGE_SEEDS = [0, 1, -1, 7, 2**31 - 1, 2**31, 2**32 - 1, 2**32 + 3, 2**62 + 12345, 2**63 - 1, -2**63, -5]


def test_mulmod31_equals_the_int64_product():
    g = torch.Generator().manual_seed(0)
    edges = torch.tensor([0, 1, 2, 2**15 - 1, 2**15, 2**15 + 1, 2**16 - 1, 2**16, 2**30, 2**31 - 2, 2**31 - 1])
    x = torch.cat([edges, torch.randint(0, 2**31, (N,), generator=g)])
    ks = [noise._K1, noise._K2, noise._K3, 1, 2**31 - 1, 2**15, 2**16 + 1] + \
        torch.randint(0, 2**31, (8,), generator=g).tolist()
    for k in ks:
        got = noise._mulmod31(x.to(torch.int32), k)
        assert got.dtype == torch.int32 and int(got.min()) >= 0
        assert torch.equal(got.long(), (x * k) & noise.M31), k


def _hash_dtypes(mix=None):
    w = noise.seed_words(torch.tensor(EDGE_SEEDS))
    r = torch.arange(len(EDGE_SEEDS), dtype=torch.int32)
    i = torch.arange(8, dtype=torch.int32)
    rec = DtypeRecorder()
    with rec:
        noise._hash(w[:, 0, None], w[:, 1, None], r[:, None], noise.STREAM_DRAFT, i)
    return rec.dtypes


def test_the_hash_is_int32_only(monkeypatch):
    assert _hash_dtypes() == {torch.int32}
    # negative control: one int64 step inside the mix is seen by the same check
    real = noise._mix
    monkeypatch.setattr(noise, "_mix", lambda x: real(x.long() if x.dtype == torch.int32 else x))
    assert torch.int64 in _hash_dtypes()


def test_seed_words_split_the_int64_seed_exactly():
    w = noise.seed_words(torch.tensor(EDGE_SEEDS))
    assert w.dtype == torch.int32 and w.shape == (len(EDGE_SEEDS), 2)
    for s, (lo, hi) in zip(EDGE_SEEDS, w.tolist()):
        assert hi * 2**32 + (lo % 2**32) == s
    assert noise.seed_words(w) is w  # words pass through (the graphs' input form)


def test_draws_are_the_int64_hashs_bits():
    seeds = torch.tensor(EDGE_SEEDS)
    rnd = torch.arange(len(EDGE_SEEDS)) * 1000
    for stream in (noise.STREAM_VERIFY, noise.STREAM_DRAFT):
        for idx in (torch.arange(70), torch.tensor([0, 64, 2**20])):
            want = _old_uniforms(seeds, rnd, stream, idx)
            u64 = noise.uniforms(seeds, rnd, stream, idx, torch.float64)
            assert torch.equal(u64, want)  # the CPU reference's draws are unchanged
            words = noise.uniforms(noise.seed_words(seeds), rnd.to(torch.int32), stream, idx.to(torch.int32),
                                   torch.float64)
            assert torch.equal(words, want)  # int32 words in: the same draws
            u32 = noise.uniforms(seeds, rnd, stream, idx, torch.float32)
            assert u32.dtype == torch.float32
            # 24 bits: the fp64 draw's leading 24 bits, exactly
            assert torch.equal(u32.double() * 2**24, torch.floor(want * 2**24))


def test_uniforms_follow_the_loop_dtype():
    s, r = torch.tensor([3]), torch.tensor([0])
    assert noise.uniforms(s, r, 1, torch.arange(2)).dtype == torch.float64  # torch + exact: the reference
    ops.set_numerics("reference")
    assert noise.uniforms(s, r, 1, torch.arange(2)).dtype == torch.float32
    assert noise.CounterSampler([3], [0], 1).bernoulli(torch.full((1, 4), 0.5)).dtype == torch.bool


def _draws(dtype, stream=1, rnd=0, seed0=0, index0=0, seed_hi=0):
    """N draws: 1000 seeds x 100 indices."""
    seeds = torch.arange(1000) + seed0 + (seed_hi << 32)
    return noise.uniforms(seeds, torch.full((1000,), rnd), stream, torch.arange(100) + index0, dtype).reshape(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_uniforms_are_uniform(dtype):
    u = _draws(dtype).double()
    assert u.numel() == N and float(u.min()) >= 0 and float(u.max()) < 1
    # chi-square over 100 equal bins, 99 degrees of freedom: mean 99, sd 14.1. Bounds at ~ +-4.5 sd
    # (p ~ 1e-5 each side for a uniform source): too large = lumpy, too small = too regular (a counter)
    counts = torch.bincount((u * 100).long(), minlength=100).double()
    chi2 = float(((counts - N / 100) ** 2 / (N / 100)).sum())
    assert 35 < chi2 < 165, chi2
    # Kolmogorov-Smirnov: sqrt(n) D < 1.95 is the 0.001 critical value
    srt = torch.sort(u).values
    grid = torch.arange(1, N + 1, dtype=torch.float64) / N
    d = float(torch.maximum(grid - srt, srt - (grid - 1.0 / N)).max())
    assert math.sqrt(N) * d < 1.95, d


def _corr(a, b):
    a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_keys_give_decorrelated_draws(dtype):
    # 1e5 pairs: an independent pair's correlation has sd 1 / sqrt(N) = 0.0032; bound 0.02 (6 sd)
    base = _draws(dtype)
    others = {"stream": _draws(dtype, stream=2), "round": _draws(dtype, rnd=1), "index": _draws(dtype, index0=100),
              "seed": _draws(dtype, seed0=1000), "seed high word": _draws(dtype, seed_hi=1)}
    for name, v in others.items():
        assert abs(_corr(base, v)) < 0.02, name
        assert float((base == v).double().mean()) < 0.001, name  # fp32: equal by chance ~6e-8 a pair
    # neighbours within one key: the next index and the next seed
    u = base.view(1000, 100)
    assert abs(_corr(u[:, :-1], u[:, 1:])) < 0.02 and abs(_corr(u[:-1], u[1:])) < 0.02
