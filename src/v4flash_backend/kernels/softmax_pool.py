"""Softmax pooling of the compressor: out[..., c] = sum_r kv[..., r, c] * softmax_r(score[..., r, c]), fp32.

Rows (the leading dims, flattened by the caller) on the partitions, [r, d] on the free axis; the softmax
runs per channel over r through a permuted view.

Rounding points: max, exp(score - max), sum over r, probabilities, products and the sum over r in fp32 like
the reference; the normalisation is e * fl(1 / sum) (no divide instruction) instead of e / sum, at most
1.5 fp32 ulps from the correctly rounded quotient (torch's own fused softmax is not the plain quotient
either); the output stays fp32 (within a few ulps of the reference, as the parity test requires).
"""

from . import _nki  # noqa: F401
import nki
import nki.isa as nisa
import nki.language as nl

from ._common import P, row_tiles


@nki.jit
def softmax_pool_kernel(kv, score):
    """kv, score f32 [R, r, d] -> f32 [R, d]."""
    n, r, d = kv.shape
    assert score.shape == kv.shape
    f32 = nl.float32
    out = nl.ndarray((n, d), dtype=f32, buffer=nl.shared_hbm)
    for t0, m in row_tiles(n):
        sc = nl.ndarray((P, r, d), dtype=f32, buffer=nl.sbuf)
        nisa.dma_copy(dst=sc[0:m], src=score[t0:t0 + m])
        kt = nl.ndarray((P, r, d), dtype=f32, buffer=nl.sbuf)
        nisa.dma_copy(dst=kt[0:m], src=kv[t0:t0 + m])
        mx = nl.ndarray((P, d), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=mx[0:m], op=nl.maximum, data=sc[0:m].permute((0, 2, 1)), axis=2)
        e = nl.ndarray((P, r, d), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=e[0:m], data1=sc[0:m], data2=mx[0:m].reshape((m, 1, d)).broadcast(1, r),
                           op=nl.subtract)
        nisa.activation(dst=e[0:m], op=nl.exp, data=e[0:m])
        sm = nl.ndarray((P, d), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=sm[0:m], op=nl.add, data=e[0:m].permute((0, 2, 1)), axis=2)
        rs = nl.ndarray((P, d), dtype=f32, buffer=nl.sbuf)  # no divide: multiply by the reciprocal
        nisa.reciprocal(dst=rs[0:m], data=sm[0:m])
        nisa.tensor_tensor(dst=e[0:m], data1=e[0:m], data2=rs[0:m].reshape((m, 1, d)).broadcast(1, r),
                           op=nl.multiply)
        acc = nl.ndarray((P, d), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=acc[0:m], data1=kt[0:m, 0, :], data2=e[0:m, 0, :], op=nl.multiply)
        for i in range(1, r):
            t = nl.ndarray((P, d), dtype=f32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=t[0:m], data1=kt[0:m, i, :], data2=e[0:m, i, :], op=nl.multiply)
            nisa.tensor_tensor(dst=acc[0:m], data1=acc[0:m], data2=t[0:m], op=nl.add)
        nisa.dma_copy(dst=out[t0:t0 + m], src=acc[0:m])
    return out
