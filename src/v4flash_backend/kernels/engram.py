"""Engram gated add: per (token, stream) a normalised dot of the stream with its n-gram key decides how much
of the shared value enters the stream.

dot = sum_d(h * qk_weight * key) * rsqrt(mean h^2 + eps) * rsqrt(mean key^2 + eps) / sqrt(d)
gate = sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6)));  out = h + gate * value  (fp32, one rounding)

Rounding points reproduced (bit-exact in the simulator): fp32 products h * w * key and their row sum, the two
rstd (sum of squares, mean = sum / d correctly rounded by `div_const`, + eps, rsqrt), the products with
rstd and d^-0.5, sqrt / sigmoid in fp32, one rounding of h + gate * value to h.dtype.
"""

from . import _nki  # noqa: F401
import nki
import nki.isa as nisa
import nki.language as nl

from ._common import P, load_bcast, row_tiles
from .rms_norm import rstd

GATE_FLOOR = 1e-6


@nki.jit
def engram_gate_kernel(h, key, value, qk_weight, eps):
    """h bf16 [T, hc, d], key bf16 [T, hc, d], value bf16 [T, d], qk_weight f32 [hc, d] -> h.dtype [T, hc, d]."""
    n, hc, d = h.shape
    f32 = nl.float32
    out = nl.ndarray((n, hc, d), dtype=h.dtype, buffer=nl.shared_hbm)
    inv_sqrt_d = float(d) ** -0.5
    for t0, m in row_tiles(n):
        vt = nl.ndarray((P, d), dtype=f32, buffer=nl.sbuf)
        nisa.dma_copy(dst=vt[0:m], src=value[t0:t0 + m])
        for i in range(hc):  # one stream at a time keeps the SBUF footprint at a few [P, d] tiles
            hi = nl.ndarray((P, d), dtype=f32, buffer=nl.sbuf)
            nisa.dma_copy(dst=hi[0:m], src=h[t0:t0 + m, i, :])
            ki = nl.ndarray((P, d), dtype=f32, buffer=nl.sbuf)
            nisa.dma_copy(dst=ki[0:m], src=key[t0:t0 + m, i, :])
            wi = nl.ndarray((P, d), dtype=f32, buffer=nl.sbuf)
            load_bcast(wi[0:m], qk_weight, m, d, offset=i * d)
            rr = rstd(hi[0:m], m, d, eps)
            rk = rstd(ki[0:m], m, d, eps)
            nisa.tensor_tensor(dst=rr[0:m], data1=rr[0:m], data2=rk[0:m], op=nl.multiply)
            hw = nl.ndarray((P, d), dtype=f32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=hw[0:m], data1=hi[0:m], data2=wi[0:m], op=nl.multiply)
            nisa.tensor_tensor(dst=hw[0:m], data1=hw[0:m], data2=ki[0:m], op=nl.multiply)
            dot = nl.ndarray((P, 1), dtype=f32, buffer=nl.sbuf)
            nisa.tensor_reduce(dst=dot[0:m], op=nl.add, data=hw[0:m], axis=1)
            nisa.tensor_scalar(dst=dot[0:m], data=dot[0:m], op0=nl.multiply, operand0=rr[0:m], op1=nl.multiply,
                               operand1=inv_sqrt_d)
            mag = nl.ndarray((P, 1), dtype=f32, buffer=nl.sbuf)
            nisa.activation(dst=mag[0:m], op=nl.abs, data=dot[0:m])
            nisa.tensor_scalar(dst=mag[0:m], data=mag[0:m], op0=nl.maximum, operand0=GATE_FLOOR)
            nisa.activation(dst=mag[0:m], op=nl.sqrt, data=mag[0:m])
            sg = nl.ndarray((P, 1), dtype=f32, buffer=nl.sbuf)  # +1 for dot >= 0, else -1
            nisa.tensor_scalar(dst=sg[0:m], data=dot[0:m], op0=nl.greater_equal, operand0=0.0, op1=nl.multiply,
                               operand1=2.0)
            nisa.tensor_scalar(dst=sg[0:m], data=sg[0:m], op0=nl.subtract, operand0=1.0)
            nisa.tensor_tensor(dst=mag[0:m], data1=mag[0:m], data2=sg[0:m], op=nl.multiply)
            nisa.activation(dst=mag[0:m], op=nl.sigmoid, data=mag[0:m])
            o = nl.ndarray((P, d), dtype=h.dtype, buffer=nl.sbuf)
            nisa.scalar_tensor_tensor(dst=o[0:m], data=vt[0:m], op0=nl.multiply, operand0=mag[0:m],
                                      op1=nl.add, operand1=hi[0:m])
            nisa.dma_copy(dst=out[t0:t0 + m, i, :], src=o[0:m])
    return out
