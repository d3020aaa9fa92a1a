"""Parity of every NKI kernel, executed by the CPU simulator through `ops.nki_ops`, with the torch reference
op (`ops.torch_ops` in 'reference' numerics: the official reference's fp32 accumulation and rounding
points), on several shapes including partial 128-row tiles, both launch grids (1 program, and 2 programs
splitting the work as on a LNC=2 NeuronCore pair), and empty / out-of-range attention slots.

Tolerances, and why:
- EXACT: ops without a GEMM whose instruction sequence mirrors the reference (quantization, norms, hc
  collapse / post / expand, SwiGLU, Engram gate) must be bit-identical.
- GEMM: ops with a Tensor Engine contraction (linears, attention, indexer) sum fp32 products in a
  different order than the reference (PSUM accumulation over 128-row K chunks vs. the reference's GEMM),
  which moves an fp32 sum by a few ulps and can flip a bf16 rounding: every bf16 element within one bf16
  ulp of the reference, and at most 0.5 % of elements differing at all.
- F32: fp32 outputs behind a GEMM or torch's fused softmax (hc_mixes, softmax_pool):
  |got - want| <= 1e-6 + 2e-6 * |want| (a few fp32 ulps); linear_f32 uses the worst-case bound of
  reordering an fp32 sum (see its test).
"""

import pytest
import torch
import torch.nn.functional as F

from v4flash_backend import ops
from v4flash_backend.formats import quant
from v4flash_backend.ops import nki_ops, torch_ops

BF16 = torch.bfloat16


@pytest.fixture(params=[1, 2], ids=["grid1", "grid2"])
def grid(request, monkeypatch):
    monkeypatch.setenv("V4FLASH_NKI_GRID", str(request.param))
    return request.param


@pytest.fixture(autouse=True)
def _reference_numerics():
    ops.set_numerics("reference")  # conftest restores the previous mode


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=_gen(seed)) * scale).to(dtype)


def _bf16_ulp(x):
    _, e = torch.frexp(x.float().abs())
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), e - 8)


def assert_exact(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got, want), f"{(got != want).sum().item()} of {got.numel()} elements differ"


def assert_gemm(got, want, max_frac=5e-3):
    assert got.shape == want.shape and got.dtype == want.dtype == BF16
    g, w = got.float(), want.float()
    diff = (g - w).abs()
    ulp = torch.maximum(_bf16_ulp(w), _bf16_ulp(g))
    assert bool((diff <= ulp).all()), f"max diff {diff.max().item()} exceeds one bf16 ulp"
    frac = (diff > 0).float().mean().item()
    assert frac <= max_frac, f"{frac:.4f} of elements differ"


def assert_f32(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)


def both(name, *args):
    return getattr(nki_ops, name)(*args), getattr(torch_ops, name)(*args)


# ---- linear layers -------------------------------------------------------------------------------------
@pytest.mark.parametrize("lead,k,n", [((1,), 128, 64), ((5,), 256, 96), ((1, 133), 384, 200), ((130,), 64, 640)])
def test_linear_fp8(grid, lead, k, n):
    x = _randn(*lead, k, seed=1, dtype=BF16)
    x[..., :32] = 0  # an all-zero group takes the 1e-4 amax floor
    w, s = quant.quantize_fp8_weight(_randn(n, k, seed=2))
    assert_gemm(*both("linear_fp8", x, w, s))


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_linear_on_routed_experts_of_a_stack(grid, fmt):
    """`experts` (the MoE's routed form): entry i of x meets stack entry experts[i]; both backends
    against the same call on the explicitly gathered stack (nki: bit for bit, it gathers the same
    bytes; torch: its gather from the dequantized copy, exact) and against each other (GEMM tolerance)."""
    quantize = quant.quantize_fp8_weight if fmt == "fp8" else quant.quantize_fp4_weight
    ws, ss = zip(*(quantize(_randn(96, 128, seed=20 + e)) for e in range(5)))
    w, s = torch.stack(ws), torch.stack(ss)
    experts = torch.tensor([3, 0, 3, 4])
    x = _randn(4, 2, 128, seed=30, scale=2.0, dtype=BF16)
    name = f"linear_{fmt}"
    for backend in (nki_ops, torch_ops):
        got = getattr(backend, name)(x, w, s, experts)
        assert_exact(got, getattr(backend, name)(x, w[experts], s[experts]))
    assert_gemm(*(getattr(b, name)(x, w, s, experts) for b in (nki_ops, torch_ops)))


@pytest.mark.parametrize("lead,k,n", [((1,), 64, 64), ((133,), 256, 100), ((1, 7), 512, 520)])
def test_linear_fp4(grid, lead, k, n):
    x = _randn(*lead, k, seed=3, scale=3.0, dtype=BF16)
    w, s = quant.quantize_fp4_weight(_randn(n, k, seed=4))
    assert_gemm(*both("linear_fp4", x, w, s))


@pytest.mark.parametrize("lead,k,n", [((3,), 96, 80), ((1, 133), 192, 130)])
def test_linear_bf16(grid, lead, k, n):
    x = _randn(*lead, k, seed=5, dtype=BF16)
    assert_gemm(*both("linear_bf16", x, _randn(n, k, seed=6, dtype=BF16)))


def test_linear_bf16_grouped(grid):
    """A 3-D weight is the block-diagonal wo_a projection: group g of x meets only weight[g]."""
    x = _randn(1, 133, 4, 64, seed=7, dtype=BF16)
    w = _randn(4, 32, 64, seed=8, scale=0.2, dtype=BF16)
    assert_gemm(*both("linear_bf16", x, w))


@pytest.mark.parametrize("lead,k,n", [((2, 67), 128, 24), ((1,), 200, 130)])
def test_linear_f32(grid, lead, k, n):
    """fp32 GEMM: two summation orders of K products differ by at most ~2*K*2^-24 * sum_k |x_k w_k|
    (the standard worst-case bound), which is the tolerance here."""
    x, w = _randn(*lead, k, seed=9), _randn(n, k, seed=10)
    got, want = both("linear_f32", x, w)
    assert got.shape == want.shape and got.dtype == torch.float32
    bound = 2 * k * 2.0 ** -24 * (x.abs() @ w.abs().T)
    assert bool(((got - want).abs() <= bound).all())


# ---- norms and elementwise ---------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,xdt,wdt,eps", [((1, 128), BF16, BF16, 1e-20), ((2, 70, 320), BF16, torch.float32, 1e-6),
                                              ((133, 64), torch.float32, torch.float32, 1e-20)])
def test_rms_norm(grid, shape, xdt, wdt, eps):
    x = _randn(*shape, seed=11, scale=0.3, dtype=xdt)
    w = (torch.rand(shape[-1], generator=_gen(12)) + 0.5).to(wdt)
    assert_exact(*both("rms_norm", x, w, eps))


@pytest.mark.parametrize("n,weighted,limit", [(1, False, 10.0), (133, True, 10.0), (70, True, 0.0)])
def test_swiglu(grid, n, weighted, limit):
    gate = _randn(n, 96, seed=13, scale=6.0, dtype=BF16)  # wide enough to hit both clamps
    up = _randn(n, 96, seed=14, scale=6.0, dtype=BF16)
    w = torch.rand(n, 1, generator=_gen(15)) if weighted else None
    assert_exact(*both("swiglu", gate, up, w, limit))


@pytest.mark.parametrize("b,s,d", [(1, 41, 128), (2, 70, 64)])
def test_engram_gate(grid, b, s, d):
    h = _randn(b, s, 4, d, seed=16, dtype=BF16)
    key = _randn(b, s, 4, d, seed=17, dtype=BF16)
    value = _randn(b, s, d, seed=18, dtype=BF16)
    qk = 1 + 0.1 * _randn(4, d, seed=19)
    assert_exact(*both("engram_gate", h, key, value, qk, 1e-20))


# ---- attention ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("b,m,h,d,n,k", [(1, 41, 4, 64, 50, 24), (2, 3, 8, 192, 70, 150), (1, 2, 16, 576, 9, 8)])
def test_sparse_attn(grid, b, m, h, d, n, k):
    q = _randn(b, m, h, d, seed=20, dtype=BF16)
    kv = _randn(b, n, d, seed=21, dtype=BF16)
    sink = _randn(h, seed=22)
    idx = torch.randint(-1, n, (b, m, k), generator=_gen(23), dtype=torch.int32)
    idx[0, 0] = -1  # a row with no valid slot gives 0
    got, want = both("sparse_attn", q, kv, sink, idx, d ** -0.5)
    assert_gemm(got, want)
    assert bool((got[0, 0] == 0).all())


def test_sparse_attn_out_of_range_slots_are_empty(grid):
    """Slots >= n (or < -1) select nothing, exactly like -1."""
    b, m, h, d, n, k = 2, 5, 4, 64, 30, 40
    q = _randn(b, m, h, d, seed=24, dtype=BF16)
    kv = _randn(b, n, d, seed=25, dtype=BF16)
    sink = _randn(h, seed=26)
    idx = torch.randint(0, n, (b, m, k), generator=_gen(27), dtype=torch.int32)
    bad = torch.rand(b, m, k, generator=_gen(28)) < 0.3
    wild = torch.where(torch.rand(b, m, k, generator=_gen(29)) < 0.5, torch.tensor(n + 3), torch.tensor(-7))
    got = nki_ops.sparse_attn(q, kv, sink, torch.where(bad, wild, idx).to(torch.int32), d ** -0.5)
    want = torch_ops.sparse_attn(q, kv, sink, torch.where(bad, -1, idx).to(torch.int32), d ** -0.5)
    assert_gemm(got, want)


def test_sparse_attn_kernel_requires_padded_index_width():
    from nki_sim import SimError
    from v4flash_backend.kernels.sparse_attn import sparse_attn_kernel

    q, kv = torch.zeros(1, 1, 4, 64, dtype=BF16), torch.zeros(1, 8, 64, dtype=BF16)
    with pytest.raises((AssertionError, SimError)):
        sparse_attn_kernel(q, kv, torch.zeros(4), torch.zeros(1, 1, 24, dtype=torch.int32), 0.125)


@pytest.mark.parametrize("b,s,h,d,t", [(1, 41, 8, 32, 20), (2, 37, 4, 64, 600), (1, 1, 32, 128, 5)])
def test_indexer_scores(grid, b, s, h, d, t):
    q = _randn(b, s, h, d, seed=30, dtype=BF16)
    k = _randn(b, t, d, seed=31, dtype=BF16)
    w = _randn(b, s, h, seed=32, scale=0.1, dtype=BF16)
    assert_gemm(*both("indexer_scores", q, k, w))


@pytest.mark.parametrize("shape", [(1, 20, 2, 64), (3, 50, 2, 128), (7, 4, 16)])
def test_softmax_pool(grid, shape):
    kv = _randn(*shape, seed=33)
    score = _randn(*shape, seed=34, scale=3.0)
    assert_f32(*both("softmax_pool", kv, score))


# ---- hyper-connections ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("s,d,iters", [(41, 128, 20), (133, 32, 1)])
def test_hc_mixes(grid, s, d, iters):
    hc = 4
    x = _randn(1, s, hc, d, seed=35, dtype=BF16)
    fn = _randn((2 + hc) * hc, hc * d, seed=36, scale=(hc * d) ** -0.5)
    scale = torch.rand(3, generator=_gen(37)) * 0.4 + 0.1
    base = _randn((2 + hc) * hc, seed=38, scale=0.5)
    got = nki_ops.hc_mixes(x, fn, scale, base, hc, iters, 1e-6, 1e-20)
    want = torch_ops.hc_mixes(x, fn, scale, base, hc, iters, 1e-6, 1e-20)
    for g, w in zip(got, want):
        assert_f32(g, w)


def test_hc_expand_collapse_post(grid):
    x = _randn(1, 133, 96, seed=39, dtype=BF16)
    assert_exact(*both("hc_expand", x, 4))
    streams = _randn(1, 133, 4, 96, seed=40, dtype=BF16)
    mix = torch.rand(1, 133, 4, generator=_gen(41))
    assert_exact(*both("hc_collapse", streams, mix))
    post = torch.rand(1, 133, 4, generator=_gen(42)) * 2
    comb = torch.rand(1, 133, 4, 4, generator=_gen(43))
    assert_exact(*both("hc_post", x, streams, post, comb))
    # fp32 streams keep fp32 outputs
    assert_exact(*both("hc_collapse", streams.float(), mix))


def test_padding_sparse_index_width_is_neutral():
    """nki_ops pads the index width to 128 with -1; the same slots with extra -1 give the same output."""
    q = _randn(1, 3, 4, 64, seed=44, dtype=BF16)
    kv = _randn(1, 20, 64, seed=45, dtype=BF16)
    sink = _randn(4, seed=46)
    idx = torch.randint(0, 20, (1, 3, 10), generator=_gen(47), dtype=torch.int32)
    a = nki_ops.sparse_attn(q, kv, sink, idx, 0.125)
    b = nki_ops.sparse_attn(q, kv, sink, F.pad(idx, (0, 118), value=-1), 0.125)
    assert_exact(a, b)


def test_results_do_not_depend_on_the_work_split(monkeypatch):
    """On the device every output element is computed the same way whatever the launch grid or the number
    of rows sharing a launch (each PE column accumulates on its own); the simulator must keep that
    property (bit-identical results), which serving relies on for decode == prefill recompute."""
    x = _randn(133, 128, seed=48)  # fp32 operands: the sums really round, so their order would show
    w = _randn(1024, 128, seed=49)
    q = _randn(1, 40, 4, 64, seed=50, dtype=BF16)
    kv = _randn(1, 60, 64, seed=51, dtype=BF16)
    sink = _randn(4, seed=52)
    idx = torch.randint(-1, 60, (1, 40, 150), generator=_gen(53), dtype=torch.int32)
    outs = []
    for g in (1, 2):
        monkeypatch.setenv("V4FLASH_NKI_GRID", str(g))
        outs.append((nki_ops.linear_f32(x, w), nki_ops.sparse_attn(q, kv, sink, idx, 0.125)))
    assert_exact(outs[0][0], outs[1][0])
    assert_exact(outs[0][1], outs[1][1])
    assert_exact(nki_ops.linear_f32(x[0:1], w), outs[0][0][0:1])
    assert_exact(nki_ops.linear_f32(x[1:6], w), outs[0][0][1:6])
    assert_exact(nki_ops.sparse_attn(q[:, 33:36], kv, sink, idx[:, 33:36], 0.125), outs[0][1][:, 33:36])


# ---- K tiling of the linears (issue 18) ----------------------------------------------------------------
def _linear_args(name, lead, k, n):
    x = _randn(*lead, k, seed=21, dtype=BF16)
    if name == "linear_fp8":
        x[..., 32:64] = 0  # an all-zero group takes the 1e-4 amax floor
        return (x, *quant.quantize_fp8_weight(_randn(n, k, seed=22)))
    if name == "linear_fp4":
        return (x, *quant.quantize_fp4_weight(_randn(n, k, seed=23)))
    if name == "linear_f32":
        return x.float(), _randn(n, k, seed=24)
    if name == "grouped":
        return x.reshape(*lead, 2, k // 2), _randn(2, n, k // 2, seed=25, scale=0.2, dtype=BF16)
    return x, _randn(n, k, seed=26, dtype=BF16)


@pytest.mark.parametrize("name", ["linear_fp8", "linear_fp4", "linear_bf16", "linear_f32", "grouped"])
def test_linear_k_tiles_keep_every_bit(grid, monkeypatch, name):
    """Tiling along K (`linear.KT`) and shorter row blocks (`linear.XT_BUDGET`) move tiles, not sums:
    every output stays one fp32 PSUM accumulation over the 128-row K chunks in ascending order with one
    rounding, so 128-column K tiles (K = 640: 5 tiles, the fp8 / fp4 activation and scale groups split
    across them) and 128-row blocks (133 rows: 2 blocks) must equal the one-tile schedule bit for bit
    (EXACT), and the result stays within the GEMM tolerance of the reference."""
    from v4flash_backend.kernels import linear

    op = "linear_bf16" if name == "grouped" else name
    args = _linear_args(name, (1, 133), 640, 200)
    monkeypatch.setattr(linear, "KT", 1 << 20)
    monkeypatch.setattr(linear, "XT_BUDGET", 1 << 30)
    whole = getattr(nki_ops, op)(*args)
    monkeypatch.setattr(linear, "KT", 128)
    monkeypatch.setattr(linear, "XT_BUDGET", 1)  # m_block -> 128 rows
    assert linear.m_block(640, 2) == 128
    tiled = getattr(nki_ops, op)(*args)
    assert_exact(tiled, whole)
    if op != "linear_f32":
        assert_gemm(tiled, getattr(torch_ops, op)(*args))


def test_linear_k_tile_must_keep_pe_chunks_whole(monkeypatch):
    """A K tile that is not a multiple of 128 would split a PE chunk (and a 32-group): refused."""
    from v4flash_backend.kernels import linear

    monkeypatch.setattr(linear, "KT", 96)
    with pytest.raises(AssertionError):
        nki_ops.linear_bf16(*_linear_args("linear_bf16", (3,), 256, 64))
