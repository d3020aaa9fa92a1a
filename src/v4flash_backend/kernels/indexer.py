"""Indexer scores: score[b, s, t] = sum_h w[b, s, h] * relu(q[b, s, h] . k[b, t]), with the reference's
rounding points: the dot products rounded to bf16, ReLU, the product with w rounded to bf16, the sum over
heads accumulated in fp32 and rounded to bf16 once.

Layout: (token, head) pairs of up to 128 // H tokens on the partitions. q.k^T on the Tensor Engine (d on
the partitions: q and k rows are transposed), ReLU and the per-(token, head) weight on the engines, and the
sum over heads as a second matmul against a 0/1 selection matrix sel[(s, h), s'] = (s == s').

Rounding points reproduced: q . k in fp32 (PE sums over 128-row chunks of D: an fp32 reordering), rounded to
bf16, ReLU, the bf16 product with w, the fp32 sum over heads (exact products of 0/1 selections, summed in
fp32) rounded once to bf16.
"""

from . import _nki  # noqa: F401
import nki
import nki.isa as nisa
import nki.language as nl

from ._common import PSUM_N, P, cdiv, my_share, transpose


@nki.jit
def indexer_scores_kernel(q, k, w):
    """q bf16 [B, S, H, D], k bf16 [B, T, D], w bf16 [B, S, H] -> bf16 [B, S, T]."""
    b_n, s_n, h, d = q.shape
    t_n = k.shape[1]
    assert h <= P and k.shape[2] == d and w.shape == (b_n, s_n, h)
    out = nl.ndarray((b_n, s_n, t_n), dtype=nl.bfloat16, buffer=nl.shared_hbm)
    ts_max = P // h
    sel = _selection(h, ts_max)
    tiles = [(b, s0) for b in range(b_n) for s0 in range(0, s_n, ts_max)]
    for ti in my_share(len(tiles)):
        b, s0 = tiles[ti]
        _tile(q, k, w, out, sel, b, s0, min(ts_max, s_n - s0))
    return out


def _selection(h, ts):
    """sel[p, j] = 1 where partition p = (token j, some head), i.e. 0 <= p - h*j < h; bf16 0/1."""
    io = nl.ndarray((P, ts), dtype=nl.int32, buffer=nl.sbuf)
    nisa.iota(dst=io, pattern=[[-h, ts]], offset=0, channel_multiplier=1)
    ge = nl.ndarray((P, ts), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=ge, data=io, op0=nl.greater_equal, operand0=0.0)
    lt = nl.ndarray((P, ts), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=lt, data=io, op0=nl.less, operand0=float(h))
    sel = nl.ndarray((P, ts), dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=sel, data1=ge, data2=lt, op=nl.multiply)
    return sel


def _tile(q, k, w, out, sel, b, s0, ts):
    b_n, s_n, h, d = q.shape
    t_n = k.shape[1]
    rows, dc_n = ts * h, cdiv(d, P)
    qr = nl.ndarray((P, d), dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.dma_copy(dst=qr[0:rows], src=q[b, s0:s0 + ts])
    qT = nl.ndarray((P, dc_n, rows), dtype=nl.bfloat16, buffer=nl.sbuf)
    for dc in range(dc_n):
        dsz = min(P, d - dc * P)
        transpose(qT[0:dsz, dc, 0:rows], qr[0:rows, dc * P:dc * P + dsz])
    wc = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=wc[0:rows], src=w[b, s0:s0 + ts])  # bf16 -> fp32, exact
    for t0 in range(0, t_n, PSUM_N):
        tb = min(PSUM_N, t_n - t0)
        kT = nl.ndarray((P, dc_n, tb), dtype=nl.bfloat16, buffer=nl.sbuf)
        for c0 in range(0, tb, P):
            tsz = min(P, tb - c0)
            kr = nl.ndarray((P, d), dtype=nl.bfloat16, buffer=nl.sbuf)
            nisa.dma_copy(dst=kr[0:tsz], src=k[b, t0 + c0:t0 + c0 + tsz])
            for dc in range(dc_n):
                dsz = min(P, d - dc * P)
                transpose(kT[0:dsz, dc, c0:c0 + tsz], kr[0:tsz, dc * P:dc * P + dsz])
        dp = nl.ndarray((P, tb), dtype=nl.float32, buffer=nl.psum)
        for dc in range(dc_n):
            dsz = min(P, d - dc * P)
            nisa.nc_matmul(dst=dp[0:rows], stationary=qT[0:dsz, dc, 0:rows], moving=kT[0:dsz, dc, 0:tb],
                           accumulate=dc > 0)
        r = nl.ndarray((P, tb), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.activation(dst=r[0:rows], op=nl.relu, data=dp[0:rows])  # relu, rounded to bf16
        nisa.tensor_scalar(dst=r[0:rows], data=r[0:rows], op0=nl.multiply, operand0=wc[0:rows])  # bf16 product
        sp = nl.ndarray((P, tb), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=sp[0:ts], stationary=sel[0:rows, 0:ts], moving=r[0:rows], accumulate=False)
        o = nl.ndarray((P, tb), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.tensor_copy(dst=o[0:ts], src=sp[0:ts])
        nisa.dma_copy(dst=out[b, s0:s0 + ts, t0:t0 + tb], src=o[0:ts])
