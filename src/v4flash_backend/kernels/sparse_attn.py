"""Gathered sparse attention with a learned sink (one shared K = V head), as the reference kernel computes it.

Query rows (b, m) are processed in groups of R = 128 // H rows, their R*H (row, head) pairs on the
partitions of the softmax state. Slots are taken in blocks of 64 (the reference's online-softmax block):
for each row the block's slot indices pick rows of kv by indirect DMA, one slot per partition, from the
base tensor reshaped to [B*N, D] (the device steps an index by the size of the base tensor's trailing dims
and ignores the pattern's stride, so one index must select one row); empty (-1) and out-of-range slots are
skipped and masked to -inf. Scores s = (q . kv[idx]) * scale accumulate in fp32 PSUM; the softmax runs
online over the 64-slot blocks with the probabilities exp(s - running max) rounded to bf16 before P.V, the
denominator summing the fp32 probabilities plus exp(sink_h - max). A row with no valid slot gives 0.

Each row's gathered slots multiply the whole group's queries on the Tensor Engine, and a 0/1 partition mask
keeps that row's (row, head) partitions (mask * value + 0 is exact). Engines cannot move data across
partitions and may start a short access only at partition 0/32/64/96, so slicing the (row, head)
partitions per row is not an option; the PE array has the columns to spare. Every tile starts at
partition 0 (no Tensor Engine tile_position needed).

Rounding points reproduced: fp32 scores (PE sums over <= 128-row chunks of D: an fp32 reordering of the
reference's dot products), * scale, the running max, exp in fp32, bf16 probabilities, fp32 P.V per block,
the rescaled fp32 accumulator and denominator, the sink term, acc / l rounded like the reference's fp32
division (`div_exact`: no divide instruction; one fp32 ulp off with probability ~1e-6), one bf16 rounding.

The index width K must be a multiple of 64 (the caller pads to 128 with -1; padding does not change the
result because a fully empty block leaves max, sum and accumulator untouched).
"""

from . import _nki  # noqa: F401
import nki
import nki.isa as nisa
import nki.language as nl

from ._common import PSUM_N, P, cdiv, div_exact, my_share, transpose

BLOCK = 64  # online-softmax block of the reference kernel
NEG_INIT = -1e30  # the reference's finite initial running max (an all-empty row stays finite)


@nki.jit
def sparse_attn_kernel(q, kv, sink, idxs, scale):
    """q bf16 [B, M, H, D], kv bf16 [B, N, D], sink f32 [H], idxs int32 [B, M, K] -> bf16 [B, M, H, D]."""
    b_n, m_n, h, d = q.shape
    n, k = kv.shape[1], idxs.shape[2]
    assert k % BLOCK == 0 and h <= P and b_n * n < 2 ** 24  # global rows stay exact in the fp32 index math
    out = nl.ndarray((b_n, m_n, h, d), dtype=nl.bfloat16, buffer=nl.shared_hbm)
    rows, r_max = b_n * m_n, P // h
    groups = [(g0, min(r_max, rows - g0)) for g0 in range(0, rows, r_max)]
    kv_rows = kv.reshape((b_n * n, d))  # base of the indirect gather: one index = one kv row
    for gi in my_share(len(groups)):
        _group(q, kv_rows, n, sink, idxs, out, groups[gi][0], groups[gi][1], scale)
    return out


def _row_masks(h, nr):
    """[P, nr] f32: mask[p, r] = 1 where partition p belongs to query row r (r*h <= p < (r+1)*h), else 0."""
    io = nl.ndarray((P, nr), dtype=nl.int32, buffer=nl.sbuf)
    nisa.iota(dst=io, pattern=[[-h, nr]], offset=0, channel_multiplier=1)  # p - h*r
    ge = nl.ndarray((P, nr), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=ge, data=io, op0=nl.greater_equal, operand0=0.0)
    lt = nl.ndarray((P, nr), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=lt, data=io, op0=nl.less, operand0=float(h))
    nisa.tensor_tensor(dst=ge, data1=ge, data2=lt, op=nl.multiply)
    return ge


def _group(q, kv_rows, n, sink, idxs, out, r0, nr, scale):
    f32, bf16 = nl.float32, nl.bfloat16
    b_n, m_n, h, d = q.shape
    k = idxs.shape[2]
    rh, dc_n = nr * h, cdiv(d, P)
    # queries of the group, (row, head) on partitions, and their transposes (d on partitions)
    qa = nl.ndarray((P, d), dtype=bf16, buffer=nl.sbuf)
    nisa.dma_copy(dst=qa[0:rh], src=q.reshape((b_n * m_n * h, d))[r0 * h:r0 * h + rh, :])
    qT = nl.ndarray((P, dc_n, rh), dtype=bf16, buffer=nl.sbuf)
    for dc in range(dc_n):
        dsz = min(P, d - dc * P)
        transpose(qT[0:dsz, dc, 0:rh], qa[0:rh, dc * P:dc * P + dsz])
    sel = _row_masks(h, nr)
    sk = nl.ndarray((P, 1), dtype=f32, buffer=nl.sbuf)
    nisa.dma_copy(dst=sk[0:rh], src=sink.ap(pattern=[[0, nr], [1, h], [1, 1]]))
    mrun = nl.ndarray((P, 1), dtype=f32, buffer=nl.sbuf)
    nisa.memset(dst=mrun[0:rh], value=NEG_INIT)
    lrun = nl.ndarray((P, 1), dtype=f32, buffer=nl.sbuf)
    nisa.memset(dst=lrun[0:rh], value=0.0)
    acc = nl.ndarray((P, d), dtype=f32, buffer=nl.sbuf)
    nisa.memset(dst=acc[0:rh], value=0.0)
    for k0 in range(0, k, BLOCK):
        g = _slot_rows(idxs, r0, nr, k0, n)
        kvg = nl.ndarray((BLOCK, nr, d), dtype=bf16, buffer=nl.sbuf)
        nisa.memset(dst=kvg, value=0.0)  # skipped slots must hold finite values (0 * p stays 0)
        s = nl.ndarray((P, BLOCK), dtype=f32, buffer=nl.sbuf)
        for r in range(nr):
            nisa.dma_copy(dst=kvg[0:BLOCK, r, :], oob_mode=nisa.oob_mode.skip,
                          src=kv_rows.ap(pattern=[[d, BLOCK], [1, d]], offset=0, vector_offset=g[0:BLOCK, r:r + 1],
                                         indirect_dim=0))
            kT = nl.ndarray((P, dc_n, BLOCK), dtype=bf16, buffer=nl.sbuf)
            for dc in range(dc_n):
                dsz = min(P, d - dc * P)
                transpose(kT[0:dsz, dc, 0:BLOCK], kvg[0:BLOCK, r, dc * P:dc * P + dsz])
            sp = nl.ndarray((P, BLOCK), dtype=f32, buffer=nl.psum)
            for dc in range(dc_n):
                dsz = min(P, d - dc * P)
                nisa.nc_matmul(dst=sp[0:rh, 0:BLOCK], stationary=qT[0:dsz, dc, 0:rh],
                               moving=kT[0:dsz, dc, 0:BLOCK], accumulate=dc > 0)
            # keep this row's heads: s (+)= mask_r * scores (exact: the other rows contribute +0)
            if r == 0:
                nisa.tensor_scalar(dst=s[0:rh], data=sp[0:rh, 0:BLOCK], op0=nl.multiply, operand0=sel[0:rh, 0:1])
            else:
                nisa.scalar_tensor_tensor(dst=s[0:rh], data=sp[0:rh, 0:BLOCK], op0=nl.multiply,
                                          operand0=sel[0:rh, r:r + 1], op1=nl.add, operand1=s[0:rh])
        nisa.tensor_scalar(dst=s[0:rh], data=s[0:rh], op0=nl.multiply, operand0=float(scale))  # score * scale
        lim = _slot_limits(idxs, r0, nr, k0, h, n)
        nisa.tensor_tensor(dst=s[0:rh], data1=s[0:rh], data2=lim[0:rh], op=nl.minimum)
        _block(s, kvg, sel, mrun, lrun, acc, nr, h, d)
    # denominator: sum of exp(s - max) plus the sink's exp(sink_h - max)
    nm = nl.ndarray((P, 1), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=nm[0:rh], data=mrun[0:rh], op0=nl.multiply, operand0=-1.0)
    es = nl.ndarray((P, 1), dtype=f32, buffer=nl.sbuf)
    nisa.activation(dst=es[0:rh], op=nl.exp, data=sk[0:rh], bias=nm[0:rh])
    nisa.tensor_tensor(dst=lrun[0:rh], data1=lrun[0:rh], data2=es[0:rh], op=nl.add)
    div_exact(acc[0:rh], acc[0:rh], lrun[0:rh], rh, lambda t: t.broadcast(1, d))  # acc / l, no divide
    o = nl.ndarray((P, d), dtype=bf16, buffer=nl.sbuf)
    nisa.tensor_copy(dst=o[0:rh], src=acc[0:rh])
    nisa.dma_copy(dst=out.reshape((b_n * m_n * h, d))[r0 * h:r0 * h + rh, :], src=o[0:rh])


def _slot_rows(idxs, r0, nr, k0, n):
    """[BLOCK, nr] int32: column r holds the global kv rows b*N + idx of the 64 slots k0.. of query row r0+r,
    or -1 for empty / out-of-range slots (a negative row is out of bounds: the skip-mode gather drops it)."""
    f32 = nl.float32
    m_n, k = idxs.shape[1], idxs.shape[2]
    ip = nl.ndarray((BLOCK, nr), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=ip, src=idxs.ap(pattern=[[1, BLOCK], [k, nr]], offset=r0 * k + k0))  # slots on partitions
    ge = nl.ndarray((BLOCK, nr), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=ge, data=ip, op0=nl.greater_equal, operand0=0.0)
    lt = nl.ndarray((BLOCK, nr), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=lt, data=ip, op0=nl.less, operand0=float(n))
    nisa.tensor_tensor(dst=ge, data1=ge, data2=lt, op=nl.multiply)
    base = nl.ndarray((BLOCK, nr), dtype=f32, buffer=nl.sbuf)  # b*N + 1 per column (rows of one batch share it)
    r = 0
    while r < nr:
        b = (r0 + r) // m_n
        r_end = min(nr, (b + 1) * m_n - r0)
        nisa.memset(dst=base[0:BLOCK, r:r_end], value=float(b * n + 1))
        r = r_end
    nisa.tensor_tensor(dst=lt, data1=ip, data2=base, op=nl.add)  # fp32: exact below 2^24 (asserted)
    nisa.tensor_tensor(dst=lt, data1=lt, data2=ge, op=nl.multiply)
    g = nl.ndarray((BLOCK, nr), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=g, data=lt, op0=nl.subtract, operand0=1.0)
    return g


def _slot_limits(idxs, r0, nr, k0, h, n):
    """[nr*h, 64] f32: +inf where the slot is valid, -inf where it is empty; min(score, limit) masks."""
    f32 = nl.float32
    k, rh = idxs.shape[2], nr * h
    ir = nl.ndarray((P, BLOCK), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=ir[0:rh], src=idxs.ap(pattern=[[k, nr], [0, h], [1, BLOCK]], offset=r0 * k + k0))
    ge = nl.ndarray((P, BLOCK), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=ge[0:rh], data=ir[0:rh], op0=nl.greater_equal, operand0=0.0)
    lt = nl.ndarray((P, BLOCK), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=lt[0:rh], data=ir[0:rh], op0=nl.less, operand0=float(n))
    nisa.tensor_tensor(dst=ge[0:rh], data1=ge[0:rh], data2=lt[0:rh], op=nl.multiply)
    nisa.tensor_scalar(dst=ge[0:rh], data=ge[0:rh], op0=nl.subtract, operand0=0.5, op1=nl.multiply,
                       operand1=float("inf"))  # (v - 0.5) * inf: +inf / -inf, never NaN
    return ge


def _block(s, kvg, sel, mrun, lrun, acc, nr, h, d):
    """One 64-slot online-softmax step over s[:, 0:64] and the gathered rows kvg[0:64]."""
    f32, bf16 = nl.float32, nl.bfloat16
    rh = nr * h
    sj = s[0:rh, 0:BLOCK]
    mnew = nl.ndarray((P, 1), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=mnew[0:rh], op=nl.maximum, data=sj, axis=1)
    nisa.tensor_tensor(dst=mnew[0:rh], data1=mrun[0:rh], data2=mnew[0:rh], op=nl.maximum)
    nm = nl.ndarray((P, 1), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=nm[0:rh], data=mnew[0:rh], op0=nl.multiply, operand0=-1.0)
    alpha = nl.ndarray((P, 1), dtype=f32, buffer=nl.sbuf)
    nisa.activation(dst=alpha[0:rh], op=nl.exp, data=mrun[0:rh], bias=nm[0:rh])  # exp(m_old - m_new)
    p = nl.ndarray((P, BLOCK), dtype=f32, buffer=nl.sbuf)
    psum_p = nl.ndarray((P, 1), dtype=f32, buffer=nl.sbuf)
    nisa.activation(dst=p[0:rh], op=nl.exp, data=sj, bias=nm[0:rh], reduce_op=nl.add, reduce_res=psum_p[0:rh],
                    reduce_cmd=nisa.reduce_cmd.reset_reduce)
    nisa.scalar_tensor_tensor(dst=lrun[0:rh], data=lrun[0:rh], op0=nl.multiply, operand0=alpha[0:rh],
                              op1=nl.add, operand1=psum_p[0:rh])
    pb = nl.ndarray((P, BLOCK), dtype=bf16, buffer=nl.sbuf)
    nisa.tensor_copy(dst=pb[0:rh], src=p[0:rh])  # probabilities rounded to bf16 before P.V
    pT = nl.ndarray((BLOCK, P), dtype=bf16, buffer=nl.sbuf)
    transpose(pT[0:BLOCK, 0:rh], pb[0:rh, 0:BLOCK])  # slots on the partitions, like kvg
    u = nl.ndarray((P, d), dtype=f32, buffer=nl.sbuf)
    for r in range(nr):
        for d0 in range(0, d, PSUM_N):
            dn = min(PSUM_N, d - d0)
            pv = nl.ndarray((P, PSUM_N), dtype=f32, buffer=nl.psum)
            nisa.nc_matmul(dst=pv[0:rh, 0:dn], stationary=pT[0:BLOCK, 0:rh],
                           moving=kvg[0:BLOCK, r, d0:d0 + dn], accumulate=False)
            if r == 0:
                nisa.tensor_scalar(dst=u[0:rh, d0:d0 + dn], data=pv[0:rh, 0:dn], op0=nl.multiply,
                                   operand0=sel[0:rh, 0:1])
            else:
                nisa.scalar_tensor_tensor(dst=u[0:rh, d0:d0 + dn], data=pv[0:rh, 0:dn], op0=nl.multiply,
                                          operand0=sel[0:rh, r:r + 1], op1=nl.add, operand1=u[0:rh, d0:d0 + dn])
    nisa.scalar_tensor_tensor(dst=acc[0:rh], data=acc[0:rh], op0=nl.multiply, operand0=alpha[0:rh],
                              op1=nl.add, operand1=u[0:rh])
    nisa.tensor_copy(dst=mrun[0:rh], src=mnew[0:rh])
