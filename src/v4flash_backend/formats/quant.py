"""Number formats of V4.1: e4m3fn, e2m1 (MXFP4), ue8m0, and the model's fake-quant points.

Everything here reproduces the official reference's rounding bit for bit:
- power-of-two scales are computed from the fp32 bits of `amax * float32(1/max)` (exponent plus one
  when the mantissa is non-zero), i.e. 2^ceil(log2(.)) without a float log;
- e4m3fn casts are round-to-nearest-even and saturate at +-448 (torch alone would give NaN);
- e2m1 rounding is to the nearest grid value with ties to the even code.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
FP8_MAX_INV = torch.tensor(1.0 / FP8_MAX, dtype=torch.float32)
FP4_MAX_INV = torch.tensor(1.0 / FP4_MAX, dtype=torch.float32)

_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_GRID = torch.tensor(_GRID, dtype=torch.float32)
# value of each 4-bit code: bit 3 is the sign
E2M1_TABLE = torch.cat([E2M1_GRID, -E2M1_GRID])
# midpoints between consecutive magnitudes; at an exact midpoint RNE goes to the even code,
# which is the upper one for midpoints 0.75, 1.75 and 3.5
_MIDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIE_UP = (False, True, False, True, False, True, False)
_E2M1_MIDS = torch.tensor(_MIDS, dtype=torch.float32)
_E2M1_TIE_UP = torch.tensor(_TIE_UP)
_TABLE = _GRID + tuple(-v for v in _GRID)


_ON_DEVICE: dict = {}  # (table id, device) -> the table made there once (device-resident, like the weights)


def _table(t: torch.Tensor, values: tuple, like: torch.Tensor) -> torch.Tensor:
    """Module table t (holding `values`) on `like`'s device: t itself, or the same values there --
    made once per device and kept (made per call, each would be a host-to-device copy inside the
    step: the GPU stand-in's sync guard caught it). Inside a trace (torch.compile, or fake tensors)
    it is made in place: a constant of the graph, never a tensor cached from the trace."""
    dev = like.device
    if t.device == dev:
        return t
    tracing = torch.compiler.is_compiling() or dev.type == "meta" or _is_fake(like)
    key = (id(t), dev)
    if not tracing and key in _ON_DEVICE:
        return _ON_DEVICE[key]
    made = torch.tensor(values, dtype=t.dtype, device=dev)
    if not tracing:
        _ON_DEVICE[key] = made
    return made


def _is_fake(x: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(x)


def place_tables(device) -> int:
    """Make the format tables on `device` now (place_resident: at load, not inside a first step)."""
    like = torch.empty(0, device=device)
    for t, values in ((_E2M1_MIDS, _MIDS), (_E2M1_TIE_UP, _TIE_UP), (E2M1_TABLE, _TABLE)):
        _table(t, values, like)
    return 3


# ---- scalar formats ---------------------------------------------------------------------
def pow2_scale(amax: torch.Tensor, max_inv: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(amax * max_inv)) in fp32, from the IEEE bits (as the reference kernel does)."""
    x = (amax.float() * max_inv).contiguous()
    # adding an all-ones mantissa carries into the exponent exactly when the mantissa is non-zero;
    # clearing the mantissa then leaves 2^(exponent + (mantissa != 0)) -- the reference's rule
    # for the positive normal values that reach here (amax is floored). In place on the fresh
    # product: the eager step pays per op call, not per byte, at these sizes.
    return x.view(torch.int32).add_(0x7FFFFF).bitwise_and_(-0x800000).view(torch.float32)


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn with RNE and saturation at +-448."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def e8m0_to_float(s: torch.Tensor) -> torch.Tensor:
    """float8_e8m0fnu (or its raw uint8 bytes) -> fp32 power of two 2^(byte - 127)."""
    b = s.view(torch.uint8).to(torch.int32)
    return (b << 23).view(torch.float32)


def float_to_e8m0(p: torch.Tensor) -> torch.Tensor:
    """Exact powers of two (fp32) -> float8_e8m0fnu."""
    bits = p.float().contiguous().view(torch.int32)
    return ((bits >> 23) & 0xFF).to(torch.uint8).view(torch.float8_e8m0fnu)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """fp32 values already in [-6, 6] -> 4-bit codes (uint8), round to nearest, ties to even code."""
    mag = x.abs().unsqueeze(-1)
    mids, tie_up = _table(_E2M1_MIDS, _MIDS, x), _table(_E2M1_TIE_UP, _TIE_UP, x)
    code = (mag > mids).sum(-1) + ((mag == mids) & tie_up).sum(-1)
    return code.to(torch.uint8) | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    return _table(E2M1_TABLE, _TABLE, x)[e2m1_codes(x).long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] -> int8 bytes [..., K/2]; element 2j in the low nibble."""
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous().view(torch.int8)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """int8 (or float4_e2m1fn_x2 / uint8) bytes [..., K/2] -> fp32 values [..., K]."""
    b = packed.contiguous().view(torch.uint8)
    table = _table(E2M1_TABLE, _TABLE, b)
    vals = torch.stack([table[(b & 0x0F).long()], table[(b >> 4).long()]], dim=-1)
    return vals.flatten(-2)


# ---- activation fake-quant points -------------------------------------------------------
def _ste(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Straight-through estimator: the value of y, the gradient of x (used when training)."""
    return x + (y - x).detach()


def _fp8_blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3fn codes [..., K/block, block], fp32 pow2 scales [..., K/block, 1]) of x [..., K].

    A decode step calls this ~100 times on a few rows, where each op call costs more than its
    arithmetic: the scales keep their block dim (no unsqueeze per use) and the ops that own a fresh
    result work in place. The values are those of the plain form, bit for bit (test_quant)."""
    xg = (x.detach() if x.requires_grad else x).float().unflatten(-1, (-1, block))
    s = pow2_scale(xg.abs().amax(-1, keepdim=True).clamp_min_(1e-4), FP8_MAX_INV)
    # no saturation needed: s >= fl(amax * fl(1/448)), so |x / s| <= 448 (1 + 2^-23) (two fp32
    # roundings), which the cast rounds to 448 as the reference's clamp would (it makes NaN only above 464)
    return (xg / s).to(torch.float8_e4m3fn), s


def fp8_act_quant(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-`block` fp8 quantization of an activation (bf16 at inference, as the reference's kernel
    requires; fp32 when training): (e4m3fn codes, fp32 pow2 scales)."""
    q, s = _fp8_blocks(x, block)
    return q.flatten(-2), s.squeeze(-1)


def fp8_act_qdq(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """fp8 quantize-dequantize round trip (window KV, DSpark KV, linear inputs); bf16 out."""
    q, s = _fp8_blocks(x, block)
    y = q.float().mul_(s).flatten(-2).to(x.dtype)
    return _ste(x, y) if x.requires_grad else y


def fp8_act_dequant_f32(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """The fp32 values a quantized GEMM actually multiplies (exactly representable products)."""
    q, s = _fp8_blocks(x, block)
    y = q.float().mul_(s).flatten(-2)
    return _ste(x.float(), y) if x.requires_grad else y


def fp4_qdq(x: torch.Tensor, block: int, scale_fmt: str) -> torch.Tensor:
    """fp4 (e2m1) quantize-dequantize of a bf16 tensor per `block` elements.

    scale_fmt 'ue8m0': scale 2^ceil(log2(max(amax, 6*2^-126)/6)) (indexer q/k, block 32).
    scale_fmt 'e4m3': scale = e4m3(max(amax, 6*2^-9)/6) (compressed KV, block 16).
    """
    xg = x.detach().float().unflatten(-1, (-1, block))
    amax = xg.abs().amax(-1)
    if scale_fmt == "e4m3":
        s = to_e4m3(amax.clamp_min(6 * 2.0**-9) / FP4_MAX).float()
    elif scale_fmt == "ue8m0":
        s = pow2_scale(amax.clamp_min(6 * 2.0**-126), FP4_MAX_INV)
    else:
        raise ValueError(f"unknown fp4 scale format {scale_fmt!r}")
    v = (xg / s.unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX)
    y = (e2m1_round(v) * s.unsqueeze(-1)).flatten(-2).to(x.dtype)
    return _ste(x, y) if x.requires_grad else y


def fake_quant_fp8_weight(w: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Training: the fp32 value the exported fp8 32x32-block weight will have, with an STE."""
    q, s = quantize_fp8_weight(w.detach(), block)
    return _ste(w, dequant_fp8_weight(q, s, block))


def fake_quant_fp4_weight(w: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Training: the fp32 value of the exported MXFP4 expert weight, with an STE."""
    q, s = quantize_fp4_weight(w.detach(), block)
    return _ste(w, dequant_fp4_weight(q, s, block))


# ---- weight formats ---------------------------------------------------------------------
def dequant_fp8_weight(w: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    """e4m3fn [N, K] with e8m0 scales [ceil(N/b), ceil(K/b)] -> fp32 [N, K]."""
    n, k = w.shape
    s = e8m0_to_float(scale)
    s = s.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return w.float() * s


def dequant_fp4_weight(w: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    """MXFP4 int8 [N, K/2] with e8m0 scales [N, K/32] -> fp32 [N, K]."""
    v = unpack_fp4(w)
    return v * e8m0_to_float(scale).repeat_interleave(block, -1)


def quantize_fp8_weight(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32/bf16 [N, K] -> (e4m3fn [N, K], e8m0 [ceil(N/b), ceil(K/b)]), pow2 scale per tile."""
    n, k = w.shape
    pn, pk = -n % block, -k % block
    wp = torch.nn.functional.pad(w.float(), (0, pk, 0, pn))
    tiles = wp.view((n + pn) // block, block, (k + pk) // block, block)
    amax = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-30)
    s = pow2_scale(amax, FP8_MAX_INV)
    q = to_e4m3(tiles / s[:, None, :, None]).float().view(n + pn, k + pk)[:n, :k]
    return q.to(torch.float8_e4m3fn), float_to_e8m0(s)


def quantize_fp4_weight(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32/bf16 [N, K] -> (int8 packed [N, K/2], e8m0 [N, K/32]) MXFP4 with RNE."""
    n, k = w.shape
    wg = w.float().view(n, k // block, block)
    amax = wg.abs().amax(-1).clamp_min(6 * 2.0**-126)
    s = pow2_scale(amax, FP4_MAX_INV)
    v = (wg / s.unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX)
    return pack_fp4(e2m1_codes(v).view(n, k)), float_to_e8m0(s)


def quantize_fp8_rows(t: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Engram tables: e4m3fn [R, C] with one e8m0 scale per `block` columns of each row."""
    r, c = t.shape
    g = t.float().view(r, c // block, block)
    s = pow2_scale(g.abs().amax(-1).clamp_min(1e-30), FP8_MAX_INV)
    q = to_e4m3(g / s.unsqueeze(-1)).view(r, c)
    return q, float_to_e8m0(s)


def dequant_fp8_rows(q: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Inverse of quantize_fp8_rows, fp32 out (the reference rounds this to bf16 on lookup)."""
    v = q.float().unflatten(-1, (-1, block)) * e8m0_to_float(scale).unsqueeze(-1)
    return v.flatten(-2)
