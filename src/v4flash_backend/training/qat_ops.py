"""A training-time ops backend: the 'torch' reference with three families rewritten for speed and
memory under autograd, same math, fp32 accumulation, same output dtypes.

- sparse_attn: the reference gathers a [queries, slots, head_dim] copy of the keys (and scatters
  its gradient back), which dominates a training step; here every query scores all rows of its
  sequence's kv once (one GEMM) and a mask built from the slot indices keeps exactly the selected
  slots (indices within a row are distinct in this model: window and compressed slots do not
  overlap). Probabilities are not rounded to bf16 before P.V.
- hc_collapse / hc_post: einsums instead of materialising [T, hc, hc, D] products.

Only `train_tiny` selects it (`ops.set_backend('train')` after `register()`); inference never does.
Outputs agree with the 'torch' backend to about one bf16 ulp (tests/test_train_tiny.py).
"""

from __future__ import annotations

import contextlib

import torch

from v4flash_backend import ops
from v4flash_backend.formats import quant
from v4flash_backend.ops import torch_ops

NAME = "train"


def register() -> None:
    """Make `ops.set_backend('train')` select this module."""
    ops.BACKENDS.setdefault(NAME, __name__)


def __getattr__(name):  # every family not overridden below is the reference implementation
    if name in ops.FAMILIES:
        return getattr(torch_ops, name)
    raise AttributeError(name)


def sparse_attn(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idxs: torch.Tensor,
                scale: float) -> torch.Tensor:
    """q [b,m,h,d], kv [b,n,d], sink [h], idxs [b,m,k] (-1 = empty) -> [b,m,h,d] bf16."""
    b, m, h, d = q.shape
    n = kv.shape[1]
    ix = idxs.long()
    mask = torch.zeros(b, m, n + 1, dtype=torch.bool)
    mask.scatter_(2, torch.where(ix >= 0, ix, n), True)  # -1 goes to a dummy column n
    mask = mask[..., :n]
    s = torch.einsum("bmhd,bnd->bmhn", q.float(), kv.float()) * scale
    s = s.masked_fill(~mask.unsqueeze(2), -torch.inf)
    sk = sink.float().view(1, 1, h, 1).expand(b, m, h, 1)
    mx = torch.maximum(s.amax(-1, keepdim=True), sk).detach()
    p = torch.exp(s - mx)
    denom = p.sum(-1, keepdim=True) + torch.exp(sk - mx)
    o = torch.einsum("bmhn,bnd->bmhd", p / denom, kv.float())
    return o.to(torch.bfloat16)


def hc_collapse(x: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    return torch.einsum("tj,tjd->td", mix.float(), x.float()).to(x.dtype)


def hc_post(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    y = post.float().unsqueeze(-1) * f.float().unsqueeze(-2) + torch.einsum("tjk,tjd->tkd", comb.float(),
                                                                             residual.float())
    return y.to(f.dtype)


# ---- exact fast fake quantization ----------------------------------------------------------
# quant.py rounds to e2m1 with a 7-way comparison per element (about 5x the CPU time of the
# arithmetic below) and the MXFP4 fake quantization packs and unpacks nibbles. The same grid is
# reached with fp32 arithmetic: scale by a power of two so that the grid step is 1, round half to
# even, scale back (every step exact). Bit-identical to quant.py (tests/test_train_tiny.py checks
# every grid value, every midpoint and random data). (The fp8 cast of torch is already fast.)

def _round_to_grid(x: torch.Tensor, mant_bits: int, min_exp: int) -> torch.Tensor:
    """Round fp32 x to a float grid with `mant_bits` explicit mantissa bits and smallest normal
    exponent `min_exp` (subnormals below it), ties to even."""
    x = x.contiguous()
    lead = ((x.view(torch.int32) >> 23) & 0xFF) - 127  # exponent of the leading bit (fp32 normals)
    step = lead.clamp_min_(min_exp) - mant_bits  # the grid step is 2^step
    up = ((127 - step) << 23).view(torch.float32)  # 2^-step and 2^step, exact powers of two
    down = ((127 + step) << 23).view(torch.float32)
    return torch.round(x * up) * down


def e2m1_values(x: torch.Tensor) -> torch.Tensor:
    """quant.e2m1_round(x) for x in [-6, 6]: the e2m1 grid, ties to the even code."""
    return _round_to_grid(x.float(), 1, 0)


def fake_quant_fp4_weight(w: torch.Tensor, block: int = 32) -> torch.Tensor:
    n, k = w.shape
    g = w.detach().float().view(n, k // block, block)
    s = quant.pow2_scale(g.abs().amax(-1).clamp_min(6 * 2.0**-126), quant.FP4_MAX_INV).unsqueeze(-1)
    y = (e2m1_values((g / s).clamp(-quant.FP4_MAX, quant.FP4_MAX)) * s).view(n, k)
    return quant._ste(w, y)


_FAST = {"e2m1_round": e2m1_values, "fake_quant_fp4_weight": fake_quant_fp4_weight}


@contextlib.contextmanager
def fast_quant():
    """Within the block, quant.py's e2m1 rounding (compressed KV, index q/k) and the MXFP4 expert
    fake quantization are the fp32-arithmetic versions above (same values)."""
    saved = {name: getattr(quant, name) for name in _FAST}
    try:
        for name, fn in _FAST.items():
            setattr(quant, name, fn)
        yield
    finally:
        for name, fn in saved.items():
            setattr(quant, name, fn)
