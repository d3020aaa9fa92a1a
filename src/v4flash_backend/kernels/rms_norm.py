"""RMSNorm: y = weight * (x * rsqrt(mean(x^2) + eps)) in fp32, rounded once to x.dtype (reference order:
x * rstd first, then the weight).

Rounding points reproduced (bit-exact in the simulator): the fp32 sum of squares of the whole row (one
Scalar Engine reduction), mean = sum / d correctly rounded (`div_const`: no divide instruction), + eps,
rsqrt, x * rstd, * weight, one rounding to x.dtype. On the device the reduction order and the rsqrt
polynomial are the engine's own (see nki_sim's device-like mode)."""

from . import _nki  # noqa: F401
import nki
import nki.isa as nisa
import nki.language as nl

from ._common import P, div_const, load_bcast, row_tiles


@nki.jit
def rms_norm_kernel(x, weight, eps):
    """x [T, D] (bf16 or f32), weight [D] (bf16 or f32) -> x.dtype [T, D]."""
    n, d = x.shape
    f32 = nl.float32
    out = nl.ndarray((n, d), dtype=x.dtype, buffer=nl.shared_hbm)
    wt = nl.ndarray((P, d), dtype=f32, buffer=nl.sbuf)
    load_bcast(wt[0:min(P, n)], weight, min(P, n), d)
    for t0, m in row_tiles(n):
        xt = nl.ndarray((P, d), dtype=f32, buffer=nl.sbuf)
        nisa.dma_copy(dst=xt[0:m], src=x[t0:t0 + m])
        rs = rstd(xt[0:m], m, d, eps)
        y = nl.ndarray((P, d), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=y[0:m], data=xt[0:m], op0=nl.multiply, operand0=rs[0:m])
        o = nl.ndarray((P, d), dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=o[0:m], data1=y[0:m], data2=wt[0:m], op=nl.multiply)
        nisa.dma_copy(dst=out[t0:t0 + m], src=o[0:m])
    return out


def rstd(xt, m, d, eps):
    """[P, 1] f32 rsqrt(sum(x^2) / d + eps) of the fp32 rows xt ([m, d])."""
    f32 = nl.float32
    sq = nl.ndarray((P, d), dtype=f32, buffer=nl.sbuf)
    ss = nl.ndarray((P, 1), dtype=f32, buffer=nl.sbuf)
    nisa.activation(dst=sq[0:m], op=nl.square, data=xt, reduce_op=nl.add, reduce_res=ss[0:m],
                    reduce_cmd=nisa.reduce_cmd.reset_reduce)
    div_const(ss[0:m], ss[0:m], d, m)  # mean = sum / d, correctly rounded as the reference's division
    nisa.tensor_scalar(dst=ss[0:m], data=ss[0:m], op0=nl.add, operand0=float(eps))
    rs = nl.ndarray((P, 1), dtype=f32, buffer=nl.sbuf)
    nisa.activation(dst=rs[0:m], op=nl.rsqrt, data=ss[0:m])
    return rs
