"""Clamped SwiGLU with an optional per-row routing weight: silu(min(gate, L)) * clamp(up, -L, L) (* w),
fp32, rounded once to bf16. L = 0 disables the clamps.

Rounding points reproduced (bit-exact): bf16 inputs widened exactly, clamps, fp32 silu, the fp32 product(s),
one rounding to bf16."""

from . import _nki  # noqa: F401
import nki
import nki.isa as nisa
import nki.language as nl

from ._common import P, row_tiles


def _swiglu(gate, up, weight, limit):
    n, i = gate.shape
    f32 = nl.float32
    out = nl.ndarray((n, i), dtype=nl.bfloat16, buffer=nl.shared_hbm)
    for t0, m in row_tiles(n):
        g = nl.ndarray((P, i), dtype=f32, buffer=nl.sbuf)
        nisa.dma_copy(dst=g[0:m], src=gate[t0:t0 + m])
        u = nl.ndarray((P, i), dtype=f32, buffer=nl.sbuf)
        nisa.dma_copy(dst=u[0:m], src=up[t0:t0 + m])
        if limit > 0:
            nisa.tensor_scalar(dst=u[0:m], data=u[0:m], op0=nl.maximum, operand0=-float(limit), op1=nl.minimum,
                               operand1=float(limit))
            nisa.tensor_scalar(dst=g[0:m], data=g[0:m], op0=nl.minimum, operand0=float(limit))
        nisa.activation(dst=g[0:m], op=nl.silu, data=g[0:m])
        o = nl.ndarray((P, i), dtype=nl.bfloat16, buffer=nl.sbuf)
        if weight is None:
            nisa.tensor_tensor(dst=o[0:m], data1=g[0:m], data2=u[0:m], op=nl.multiply)
        else:
            nisa.tensor_tensor(dst=g[0:m], data1=g[0:m], data2=u[0:m], op=nl.multiply)
            wc = nl.ndarray((P, 1), dtype=f32, buffer=nl.sbuf)
            nisa.dma_copy(dst=wc[0:m], src=weight[t0:t0 + m])
            nisa.tensor_scalar(dst=o[0:m], data=g[0:m], op0=nl.multiply, operand0=wc[0:m])
        nisa.dma_copy(dst=out[t0:t0 + m], src=o[0:m])
    return out


@nki.jit
def swiglu_kernel(gate, up, limit):
    """gate, up bf16 [n, I] -> bf16 [n, I]."""
    return _swiglu(gate, up, None, limit)


@nki.jit
def swiglu_weighted_kernel(gate, up, weight, limit):
    """gate, up bf16 [n, I], weight f32 [n, 1] -> bf16 [n, I]."""
    return _swiglu(gate, up, weight, limit)
