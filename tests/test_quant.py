"""Number formats and fake-quant points, checked against independent definitions (ml_dtypes casts,
hand-computed grid points) rather than against our own outputs."""

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from v4flash_backend.formats import quant as Q


def test_e4m3_round_to_nearest_even_and_saturation():
    # 1.0 and 1.125 are neighbours: the midpoint goes to the even mantissa (1.0); 1.1875 -> 1.25
    x = torch.tensor([1.0625, 1.1875, 447.0, 460.0, 1000.0, -1e6, 2.0**-9, 2.0**-10 * 1.5])
    got = Q.to_e4m3(x).float()
    want = torch.tensor([1.0, 1.25, 448.0, 448.0, 448.0, -448.0, 2.0**-9, 2.0**-9])
    assert torch.equal(got, want)


def test_e4m3_matches_ml_dtypes_in_range():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(20000, generator=g) * torch.exp2(torch.randint(-12, 9, (20000,), generator=g).float()))
    x = x.clamp(-448, 448)
    ours = Q.to_e4m3(x).float().numpy()
    ref = x.numpy().astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert np.array_equal(ours, ref)


def test_e2m1_grid_ties_to_even_code():
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -5.0])
    # codes: 0 0.5 1 1.5 2 3 4 6 -> even codes are 0, 1.0, 2.0, 4.0
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -1.0, -4.0])
    assert torch.equal(Q.e2m1_round(mids), want)


def test_e2m1_matches_ml_dtypes():
    x = torch.linspace(-6, 6, 4801)
    ref = x.numpy().astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    assert np.array_equal(Q.e2m1_round(x).numpy(), ref)


def test_mxfp4_packing_even_element_low_nibble():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)  # 0.5, 1.0, -6, 0
    packed = Q.pack_fp4(codes)
    assert packed.view(torch.uint8).tolist() == [[0x21, 0x0F]]
    assert Q.unpack_fp4(packed).tolist() == [[0.5, 1.0, -6.0, 0.0]]


def test_pow2_scale_is_ceil_log2_from_bits():
    amax = torch.tensor([448.0, 449.0, 56.0, 1e-4, 3.0])
    got = Q.pow2_scale(amax, Q.FP8_MAX_INV)
    want = [2.0 ** math.ceil(math.log2(float(np.float32(a) * np.float32(1 / 448)))) for a in amax.tolist()]
    assert got.tolist() == want


def test_fp8_activation_amax_floor_and_exactness():
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    x[1, 3] = 5.0
    q, s = Q.fp8_act_quant(x)
    # all-zero group: amax floored at 1e-4 -> scale 2^ceil(log2(1e-4/448))
    assert s[0, 0].item() == 2.0 ** math.ceil(math.log2(1e-4 / 448))
    assert Q.fp8_act_qdq(x)[1, 3].item() == 5.0  # 5/2^-6... representable exactly
    # the quantized activation times its scale is on the e4m3 grid
    y = torch.randn(4, 128).bfloat16()
    qdq = Q.fp8_act_qdq(y)
    assert torch.equal(Q.fp8_act_qdq(qdq), qdq)  # idempotent: a fixed point of the format


@pytest.mark.parametrize("fmt,block", [("e4m3", 16), ("ue8m0", 32)])
def test_fp4_qdq_floors_and_grid(fmt, block):
    z = torch.zeros(1, 64, dtype=torch.bfloat16)
    assert torch.equal(Q.fp4_qdq(z, block, fmt), z)  # tiny-amax floor keeps the scale finite
    x = torch.randn(8, 64).bfloat16()
    y = Q.fp4_qdq(x, block, fmt)
    g = y.float().view(8, -1, block)
    amax = x.float().view(8, -1, block).abs().amax(-1, keepdim=True)
    if fmt == "ue8m0":
        s = torch.exp2(torch.ceil(torch.log2(amax / 6)))
    else:
        s = torch.from_numpy((amax / 6).numpy().astype(ml_dtypes.float8_e4m3fn).astype(np.float32))
    grid = set(Q.E2M1_TABLE.tolist())
    vals = (g / s).flatten().tolist()
    assert all(v in grid for v in vals)


def test_fp8_weight_roundtrip_and_layout():
    w = torch.randn(70, 96)
    q, s = Q.quantize_fp8_weight(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu
    assert tuple(s.shape) == (3, 3)  # ceil(70/32) x ceil(96/32)
    d = Q.dequant_fp8_weight(q, s)
    # per 32x32 tile: error at most half an e4m3 step (2^-4 relative) of the tile's amax
    for i in range(0, 70, 32):
        for j in range(0, 96, 32):
            t, e = w[i:i + 32, j:j + 32], (d - w)[i:i + 32, j:j + 32]
            assert e.abs().max() <= t.abs().max() * 2.0**-4


def test_fp4_weight_roundtrip_and_layout():
    w = torch.randn(16, 64)
    q, s = Q.quantize_fp4_weight(w)
    assert q.dtype == torch.int8 and tuple(q.shape) == (16, 32) and tuple(s.shape) == (16, 2)
    assert q.shape[-1] // s.shape[-1] == 16  # the on-disk trap: 16, not 32, bytes per scale
    d = Q.dequant_fp4_weight(q, s)
    assert ((d - w).abs() <= w.view(16, 2, 32).abs().amax(-1).repeat_interleave(32, 1) / 4 + 1e-7).all()


def test_e8m0_roundtrip():
    p = torch.exp2(torch.arange(-20, 20).float())
    assert torch.equal(Q.e8m0_to_float(Q.float_to_e8m0(p)), p)
    assert torch.equal(Q.float_to_e8m0(p).float(), p)  # agrees with torch's own e8m0 decoding


def _fp8_act_reference(x: torch.Tensor, block: int = 32) -> np.ndarray:
    """The activation fake-quant from its definition, in numpy: per block of `block` values, the scale
    2^ceil(log2(fp32(max(amax, 1e-4)) * fp32(1/448))), the values divided by it, saturated at 448,
    rounded to e4m3fn (ml_dtypes), times the scale again."""
    xs = x.float().numpy().reshape(-1, block)
    amax = np.maximum(np.abs(xs).max(-1, keepdims=True), np.float32(1e-4)).astype(np.float32)
    t = (amax * np.float32(1 / 448)).astype(np.float32)
    s = np.exp2(np.ceil(np.log2(t.astype(np.float64)))).astype(np.float32)
    q = np.clip(xs / s, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return (q * s).reshape(x.shape)


@pytest.mark.parametrize("shape", [(1, 256), (3, 2, 512), (7, 32)])
def test_fp8_activation_fake_quant_equals_its_definition(shape):
    """fp8_act_quant / _qdq / _dequant_f32 (the form a decode step runs ~100 times) against the
    numpy definition above, bit for bit, over magnitudes from 2^-14 to 2^12 and all-zero blocks."""
    g = torch.Generator().manual_seed(len(shape))
    n = math.prod(shape)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-14, 12, (n // 32, 1), generator=g).float()).expand(
        -1, 32).reshape(-1)
    x[:32] = 0.0
    x[40], x[70] = 448.0, -448.0 * 2.0**-5  # amax at the format's max: the scale's rounding edge
    x = x.reshape(shape).bfloat16()
    want = _fp8_act_reference(x)
    assert np.array_equal(Q.fp8_act_dequant_f32(x).numpy(), want)
    assert np.array_equal(Q.fp8_act_qdq(x).float().numpy(), want.astype(ml_dtypes.bfloat16).astype(np.float32))
    q, s = Q.fp8_act_quant(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and s.shape == shape[:-1] + (shape[-1] // 32,)
    assert np.array_equal((q.float().unflatten(-1, (-1, 32)) * s.unsqueeze(-1)).flatten(-2).numpy(), want)
