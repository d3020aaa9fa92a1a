"""Linear layers y[M, N] = x[M, K] @ W[N, K].T on the Tensor Engine (fp32 PSUM accumulation, one rounding).

Trainium2 has no e4m3fn / e8m0 / e2m1 tiles at all (NCC_EVRF051), so the checkpoint bytes come in as uint8
(int8 for the packed fp4) and are decoded exactly with bitvec and fp32 instructions (see `_common`), then
dequantized in SBUF to bf16 (exact: e4m3 and e2m1 values times a power-of-two scale fit bf16), and the fp8
activation fake-quant of the reference (1x32 groups, ue8m0 scale = 2^ceil(log2(amax/448)), RNE to e4m3fn
saturating at 448) is applied to x before the GEMM with fp32 / bitvec ops (`act_qdq`), so every product
equals the reference's block-scaled product.

Rounding points reproduced: the activation fake-quant (bit-exact), the bf16 dequantized weights (exact), one
fp32 accumulation per output and one rounding to the output dtype. Not reproduced: the order of the fp32
sum (PE columns over 128-row K chunks, chunks added in PSUM) -- an fp32 reordering, which flips the bf16
output by one ulp in a small fraction of elements.

Layout: both operands need K on the partitions, so x row tiles and W row tiles are transposed with the
Tensor Engine. Work split: a grid of G programs splits N into G 32-aligned column ranges ("both cores").
"""

from . import _nki  # noqa: F401
import nki
import nki.isa as nisa
import nki.language as nl

from ._common import PSUM_N, P, bytes_to_i32, cdiv, e4m3fn_to_f32, e8m0_to_f32, load_bcast, transpose

FP8_MAX = 448.0
FP8_MAX_INV = 1.0 / 448.0  # rounded to fp32 as an operand: the reference multiplies by float32(1/448)
AMAX_FLOOR = 1e-4
MB = 512  # x rows whose transposes stay in SBUF while every weight block of the column range streams by
XT_BUDGET = 64 * 1024  # bytes per partition for that x^T block (fewer rows at large K, see m_block)
KT = 2048  # K columns of x / the weights brought on chip at once (a multiple of 128: PE chunks, 32-groups)
QB = 32  # quantization group (activations 1x32, weights 32x32 for fp8, 1x32 for fp4)
CH = 512  # columns decoded / fake-quantized per step: bounds the fp32 temporaries in SBUF


def _col_range(n):
    """Columns [n0, n1) of this program: G 32-aligned slices (a 32-row scale block never straddles)."""
    g, pid = nl.num_programs(0), nl.program_id(0)
    per = cdiv(cdiv(n, g), QB) * QB
    n0 = min(n, pid * per)
    return n0, min(n, n0 + per)


def act_qdq(xt, m, k):
    """fp8 fake-quant of the rows xt[0:m, 0:k] (bf16) per 32 consecutive channels -> new bf16 tile.

    Reference: s = 2^ceil(log2(max(amax, 1e-4) * fl(1/448))), q = e4m3fn(clamp(x / s, +-448)) (RNE), x' = q * s.
    trn2 has no e4m3fn tiles and no divide, so the same values are produced with fp32 and bitvec ops only:
    - s from the fp32 bits of t = max(amax, 1e-4) * fl(1/448): 2^floor(log2 t) = bits & 0x7F800000, doubled when
      t is not that power of two (exact);
    - x / s is exact (power of two), so clamp(x / s, +-448) * s = clamp(x, +-448 s), and RNE to the e4m3fn grid
      scaled by s is fp32 RNE to 3 mantissa bits below the binade 2^e of the value (e floored at the scaled
      subnormal binade 2^-6 s): (v + C) - C with C = 1.5 * 2^(e + 20) rounds v at 2^(e - 3), ties to even, and
      the subtraction is exact. Result = q * s exactly, which bf16 holds.
    Rounding points: only the ones of the reference (the fp32 product t, the e4m3fn RNE); valid while the
    block maxima stay below 2^100 (C stays finite)."""
    xq = nl.ndarray((P, k), dtype=nl.bfloat16, buffer=nl.sbuf)
    for c0 in range(0, k, CH):  # column chunks bound the fp32 temporaries (live SBUF, nki_sim R8)
        cw = min(CH, k - c0)
        _qdq_chunk(xt[0:m, c0:c0 + cw], xq[0:m, c0:c0 + cw], m, cw)
    return xq


def _qdq_chunk(x, xq, m, k):
    kb = k // QB
    f32, i32 = nl.float32, nl.int32
    ax = nl.ndarray((P, k), dtype=f32, buffer=nl.sbuf)
    nisa.activation(dst=ax[0:m], op=nl.abs, data=x)
    amax = nl.ndarray((P, kb), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=amax[0:m], op=nl.maximum, data=ax[0:m].reshape((m, kb, QB)), axis=2)
    t = nl.ndarray((P, kb), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=t[0:m], data=amax[0:m], op0=nl.maximum, operand0=AMAX_FLOOR,
                       op1=nl.multiply, operand1=FP8_MAX_INV)
    eb = nl.ndarray((P, kb), dtype=i32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=eb[0:m], data=t.view(i32)[0:m], op0=nl.bitwise_and, operand0=0x7F800000)
    e = eb.view(f32)  # 2^floor(log2 t)
    ne = nl.ndarray((P, kb), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=ne[0:m], data1=t[0:m], data2=e[0:m], op=nl.not_equal)  # 1.0 unless t = 2^e
    sc = nl.ndarray((P, kb), dtype=f32, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=sc[0:m], data=ne[0:m], op0=nl.add, operand0=1.0, op1=nl.multiply,
                              operand1=e[0:m])
    lim = nl.ndarray((P, kb), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=lim[0:m], data=sc[0:m], op0=nl.multiply, operand0=FP8_MAX)
    nlim = nl.ndarray((P, kb), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=nlim[0:m], data=sc[0:m], op0=nl.multiply, operand0=-FP8_MAX)
    low = nl.ndarray((P, kb), dtype=f32, buffer=nl.sbuf)  # the scaled subnormal binade 2^-6 * s
    nisa.tensor_scalar(dst=low[0:m], data=sc[0:m], op0=nl.multiply, operand0=2.0 ** -6)

    def grp(v):
        return v[0:m].reshape((m, kb, 1)).broadcast(2, QB)

    v = nl.ndarray((P, k), dtype=f32, buffer=nl.sbuf)
    v3 = v[0:m].reshape((m, kb, QB))
    nisa.tensor_tensor(dst=v3, data1=x.reshape((m, kb, QB)), data2=grp(lim), op=nl.minimum)
    nisa.tensor_tensor(dst=v3, data1=v3, data2=grp(nlim), op=nl.maximum)
    vb = nl.ndarray((P, k), dtype=i32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=vb[0:m], data=v.view(i32)[0:m], op0=nl.bitwise_and, operand0=0x7F800000)
    c = nl.ndarray((P, k), dtype=f32, buffer=nl.sbuf)
    c3 = c[0:m].reshape((m, kb, QB))
    nisa.tensor_tensor(dst=c3, data1=vb.view(f32)[0:m].reshape((m, kb, QB)), data2=grp(low), op=nl.maximum)
    nisa.tensor_scalar(dst=c[0:m], data=c[0:m], op0=nl.multiply, operand0=1.5 * 2.0 ** 20)
    nisa.tensor_tensor(dst=v[0:m], data1=v[0:m], data2=c[0:m], op=nl.add)  # rounds at 2^(e-3), RNE
    nisa.tensor_tensor(dst=xq, data1=v[0:m], data2=c[0:m], op=nl.subtract)  # exact: q * s


def _scales(dst_f32, src_u8_view, n, cols):
    """ue8m0 scale bytes already in SBUF (uint8 [n, cols]) -> fp32 powers of two."""
    si = nl.ndarray((P, cols), dtype=nl.int32, buffer=nl.sbuf)
    bytes_to_i32(si[0:n], src_u8_view)
    e8m0_to_f32(dst_f32, si[0:n])


def _fp8_rows(weight, scale):
    """Loader of weight rows [r0, r0+n), columns [k0, k0+k): e4m3fn bytes (uint8) decoded exactly to fp32,
    times the 32x32 ue8m0 tile scales (bytes too), rounded once to bf16 (exact: an e4m3 value times a power
    of two fits bf16). k0 and k are multiples of 32, so a K tile holds whole scale tiles."""

    def load(r0, n, k0, k):
        kb = k // QB
        wb = nl.ndarray((P, k), dtype=nl.uint8, buffer=nl.sbuf)
        nisa.dma_copy(dst=wb[0:n], src=weight[r0:r0 + n, k0:k0 + k])
        sb = nl.ndarray((P, kb), dtype=nl.uint8, buffer=nl.sbuf)
        for g in range(cdiv(n, QB)):  # one scale row per 32 weight rows, broadcast to those partitions (DMA)
            gn = min(QB, n - g * QB)
            nisa.dma_copy(dst=sb[g * QB:g * QB + gn],
                          src=scale.ap(pattern=[[0, gn], [1, kb]],
                                       offset=(r0 // QB + g) * scale.shape[1] + k0 // QB))
        sc = nl.ndarray((P, kb), dtype=nl.float32, buffer=nl.sbuf)
        _scales(sc[0:n], sb[0:n], n, kb)
        wd = nl.ndarray((P, k), dtype=nl.bfloat16, buffer=nl.sbuf)
        for c0 in range(0, k, CH):  # column chunks bound the fp32 temporaries
            cw, g0 = min(CH, k - c0), c0 // QB
            gw = cw // QB
            wi = nl.ndarray((P, CH), dtype=nl.int32, buffer=nl.sbuf)
            bytes_to_i32(wi[0:n, 0:cw], wb[0:n, c0:c0 + cw])
            wf = nl.ndarray((P, CH), dtype=nl.float32, buffer=nl.sbuf)
            e4m3fn_to_f32(wf[0:n, 0:cw], wi[0:n, 0:cw], n)
            nisa.tensor_tensor(dst=wd[0:n, c0:c0 + cw].reshape((n, gw, QB)),
                               data1=wf[0:n, 0:cw].reshape((n, gw, QB)),
                               data2=sc[0:n, g0:g0 + gw].reshape((n, gw, 1)).broadcast(2, QB), op=nl.multiply)
        return wd

    return load


def _fp4_rows(weight, scale, gather=None):
    """Loader of MXFP4 rows: two e2m1 codes per byte (even element in the low nibble), code = sign bit 3 +
    magnitude index into {0, .5, 1, 1.5, 2, 3, 4, 6}, times one ue8m0 scale (byte) per 32 elements; the
    product rounds once to bf16 (exact). gather(t, r0, n, c0, c) -> the DMA source of rows [r0, r0+n),
    columns [c0, c0+c) of t (default: a plain slice; the routed experts' indirect rows)."""
    f32, u8 = nl.float32, nl.uint8
    if gather is None:
        def gather(t, r0, n, c0, c):
            return t[r0:r0 + n, c0:c0 + c]

    def load(r0, n, k0, k):
        kb, kh = k // QB, k // 2
        wb = nl.ndarray((P, kh), dtype=nl.int8, buffer=nl.sbuf)
        nisa.dma_copy(dst=wb[0:n], src=gather(weight, r0, n, k0 // 2, kh))
        wu = wb.view(u8)
        codes = nl.ndarray((P, kh, 2), dtype=u8, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=codes[0:n, :, 0], data=wu[0:n], op0=nl.bitwise_and, operand0=0xF)
        nisa.tensor_scalar(dst=codes[0:n, :, 1], data=wu[0:n], op0=nl.right_shift, operand0=4)
        cf = codes[0:n].reshape((n, k))
        sb = nl.ndarray((P, kb), dtype=u8, buffer=nl.sbuf)
        # ue8m0 bytes (uint8: no e8m0 tiles on trn2) of the K tile's 32-groups
        nisa.dma_copy(dst=sb[0:n], src=gather(scale, r0, n, k0 // QB, kb))
        sc = nl.ndarray((P, kb), dtype=f32, buffer=nl.sbuf)
        _scales(sc[0:n], sb[0:n], n, kb)
        wd = nl.ndarray((P, k), dtype=nl.bfloat16, buffer=nl.sbuf)
        for c0 in range(0, k, CH):  # column chunks bound the fp32 temporaries
            cw, g0 = min(CH, k - c0), c0 // QB
            gw = cw // QB
            mag = nl.ndarray((P, CH), dtype=u8, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=mag[0:n, 0:cw], data=cf[:, c0:c0 + cw], op0=nl.bitwise_and, operand0=7)
            sgn = nl.ndarray((P, CH), dtype=u8, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=sgn[0:n, 0:cw], data=cf[:, c0:c0 + cw], op0=nl.right_shift, operand0=3)
            # |value| = 0.5*i + 0.5*relu(i-4) + relu(i-6) for i in 0..7 gives exactly the e2m1 grid
            t4 = nl.ndarray((P, CH), dtype=f32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=t4[0:n, 0:cw], data=mag[0:n, 0:cw], op0=nl.subtract, operand0=4.0,
                               op1=nl.maximum, operand1=0.0)
            t6 = nl.ndarray((P, CH), dtype=f32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=t6[0:n, 0:cw], data=mag[0:n, 0:cw], op0=nl.subtract, operand0=6.0,
                               op1=nl.maximum, operand1=0.0)
            nisa.scalar_tensor_tensor(dst=t4[0:n, 0:cw], data=t4[0:n, 0:cw], op0=nl.multiply, operand0=0.5,
                                      op1=nl.add, operand1=t6[0:n, 0:cw])
            nisa.scalar_tensor_tensor(dst=t4[0:n, 0:cw], data=mag[0:n, 0:cw], op0=nl.multiply, operand0=0.5,
                                      op1=nl.add, operand1=t4[0:n, 0:cw])
            nisa.tensor_scalar(dst=t6[0:n, 0:cw], data=sgn[0:n, 0:cw], op0=nl.multiply, operand0=-2.0,
                               op1=nl.add, operand1=1.0)  # +1 / -1
            nisa.tensor_tensor(dst=t4[0:n, 0:cw], data1=t4[0:n, 0:cw], data2=t6[0:n, 0:cw], op=nl.multiply)
            nisa.tensor_tensor(dst=wd[0:n, c0:c0 + cw].reshape((n, gw, QB)),
                               data1=t4[0:n, 0:cw].reshape((n, gw, QB)),
                               data2=sc[0:n, g0:g0 + gw].reshape((n, gw, 1)).broadcast(2, QB), op=nl.multiply)
        return wd

    return load


def _plain_rows(weight, dtype):
    def load(r0, n, k0, k):
        w = nl.ndarray((P, k), dtype=dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=w[0:n], src=weight[r0:r0 + n, k0:k0 + k])
        return w

    return load


def m_block(k, itemsize):
    """Rows of x whose K-long transposes stay in SBUF together: MB, or fewer (whole 128-row tiles) when
    x^T [K/128 chunks, rows] would pass XT_BUDGET bytes per partition (at K = 15360 bf16: 256 rows)."""
    per_row = cdiv(k, P) * itemsize
    return max(P, min(MB, XT_BUDGET // per_row // P * P))


def _linear(x, out, load_rows, quant, cdt):
    """Shared GEMM schedule, tiled along K. x [M, K] in HBM; out [M, N]; load_rows(r0, n, k0, kw) -> SBUF
    [P, kw] of dtype cdt: weight rows [r0, r0+n), columns [k0, k0+kw).

    Per row block (`m_block` rows): x streams in KT-column tiles (DMA, act_qdq, Tensor Engine transposes)
    into the block's x^T [K/128 chunks, rows], the only K-long tile. Per 512-column block of the
    program's columns: one PSUM accumulator (fp32, one bank) per 128-row tile of the block stays live
    across the whole K loop, and the weights stream in KT-column tiles (DMA, decode, transposes to
    w^T [KT/128, 512]) that every row tile then multiplies into its accumulator. Each output is still
    one fp32 PSUM accumulation over the 128-row K chunks in ascending order, rounded once: the same
    sums as the untiled schedule, bit for bit. Weights are read once per row block."""
    m_total, k = x.shape
    n0, n1 = _col_range(out.shape[1])
    if n0 >= n1:
        return
    assert KT % P == 0 and KT % QB == 0  # a K tile never splits a PE chunk or a quantization group
    kc_n = cdiv(k, P)
    mb = m_block(k, 4 if cdt == nl.float32 else 2)
    k_tiles = [(k0, min(KT, k - k0)) for k0 in range(0, k, KT)]
    for mb0 in range(0, m_total, mb):
        mbs = min(mb, m_total - mb0)
        m_tiles = [(mt * P, min(P, mbs - mt * P)) for mt in range(cdiv(mbs, P))]
        xT = nl.ndarray((P, kc_n, mbs), dtype=cdt, buffer=nl.sbuf)
        for mo, msz in m_tiles:
            for k0, kw in k_tiles:
                xt = nl.ndarray((P, kw), dtype=cdt, buffer=nl.sbuf)
                nisa.dma_copy(dst=xt[0:msz], src=x[mb0 + mo:mb0 + mo + msz, k0:k0 + kw])
                xs = act_qdq(xt, msz, kw) if quant else xt  # 32-column groups: K tiles are multiples of 32
                for c in range(cdiv(kw, P)):
                    ks = min(P, kw - c * P)
                    transpose(xT[0:ks, k0 // P + c, mo:mo + msz], xs[0:msz, c * P:c * P + ks])
        for nb0 in range(n0, n1, PSUM_N):
            nbs = min(PSUM_N, n1 - nb0)
            acc = [nl.ndarray((P, nbs), dtype=nl.float32, buffer=nl.psum) for _ in m_tiles]
            for k0, kw in k_tiles:
                kcs = cdiv(kw, P)
                wT = nl.ndarray((P, kcs, nbs), dtype=cdt, buffer=nl.sbuf)
                for no in range(0, nbs, P):
                    nsz = min(P, nbs - no)
                    wd = load_rows(nb0 + no, nsz, k0, kw)
                    for c in range(kcs):
                        ks = min(P, kw - c * P)
                        transpose(wT[0:ks, c, no:no + nsz], wd[0:nsz, c * P:c * P + ks])
                for (mo, msz), ps in zip(m_tiles, acc):
                    for c in range(kcs):
                        kc, ks = k0 // P + c, min(P, kw - c * P)
                        nisa.nc_matmul(dst=ps[0:msz, 0:nbs], stationary=xT[0:ks, kc, mo:mo + msz],
                                       moving=wT[0:ks, c, 0:nbs], accumulate=kc > 0)
            for (mo, msz), ps in zip(m_tiles, acc):
                o = nl.ndarray((P, nbs), dtype=out.dtype, buffer=nl.sbuf)
                nisa.tensor_copy(dst=o[0:msz, 0:nbs], src=ps[0:msz, 0:nbs])
                nisa.dma_copy(dst=out[mb0 + mo:mb0 + mo + msz, nb0:nb0 + nbs], src=o[0:msz, 0:nbs])


@nki.jit
def linear_fp8_kernel(x, weight, scale):
    """x bf16 [M, K], weight e4m3fn bytes as uint8 [N, K], scale ue8m0 bytes as uint8 [ceil(N/32), K/32] ->
    bf16 [M, N]."""
    m, k = x.shape
    n = weight.shape[0]
    assert k % QB == 0 and weight.shape[1] == k and scale.shape == (cdiv(n, QB), k // QB)
    out = nl.ndarray((m, n), dtype=nl.bfloat16, buffer=nl.shared_hbm)
    _linear(x, out, _fp8_rows(weight, scale), True, nl.bfloat16)
    return out


@nki.jit
def linear_fp4_kernel(x, weight, scale):
    """x bf16 [M, K], weight int8 [N, K/2] (MXFP4), scale ue8m0 bytes as uint8 [N, K/32] -> bf16 [M, N]."""
    m, k = x.shape
    n = weight.shape[0]
    assert k % QB == 0 and weight.shape[1] * 2 == k and scale.shape == (n, k // QB)
    out = nl.ndarray((m, n), dtype=nl.bfloat16, buffer=nl.shared_hbm)
    _linear(x, out, _fp4_rows(weight, scale), True, nl.bfloat16)
    return out


@nki.jit
def linear_bf16_kernel(x, weight):
    """x bf16 [M, K], weight bf16 [N, K] -> bf16 [M, N]."""
    m, k = x.shape
    assert weight.shape[1] == k
    out = nl.ndarray((m, weight.shape[0]), dtype=nl.bfloat16, buffer=nl.shared_hbm)
    _linear(x, out, _plain_rows(weight, nl.bfloat16), False, nl.bfloat16)
    return out


@nki.jit
def linear_f32_kernel(x, weight):
    """x f32 [M, K], weight f32 [N, K] -> f32 [M, N] (fp32 operands on the Tensor Engine)."""
    m, k = x.shape
    assert weight.shape[1] == k
    out = nl.ndarray((m, weight.shape[0]), dtype=nl.float32, buffer=nl.shared_hbm)
    _linear(x, out, _plain_rows(weight, nl.float32), False, nl.float32)
    return out


@nki.jit
def linear_bf16_grouped_kernel(x, weight):
    """Block-diagonal projection: x bf16 [M, G, K], weight bf16 [G, N, K] -> bf16 [M, G, N] (group g of x
    only meets weight[g]; the attention's wo_a)."""
    m, g_n, k = x.shape
    assert weight.shape[0] == g_n and weight.shape[2] == k
    n = weight.shape[1]
    out = nl.ndarray((m, g_n, n), dtype=nl.bfloat16, buffer=nl.shared_hbm)
    for g in range(g_n):
        _linear(x[:, g, :], out[:, g, :], _plain_rows(weight[g], nl.bfloat16), False, nl.bfloat16)
    return out


def _expert_rows(e_b, n_rows):
    """gather() of `_fp4_rows` for stack entry e (e_b: int32 [P, 1], e on every partition): the stack
    [E, N, C] seen as E*N rows, rows e*N + r0 + p fetched by indirect DMA (one row per partition)."""
    def gather(t, r0, n, c0, c):
        idx = nl.ndarray((P, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.iota(dst=idx[0:n], pattern=[[0, 1]], offset=r0, channel_multiplier=1)  # r0 + p
        # e * N + (r0 + p): exact in the engines' fp32 while E * N < 2^24 (asserted by the kernel)
        nisa.scalar_tensor_tensor(dst=idx[0:n], data=e_b[0:n], op0=nl.multiply, operand0=float(n_rows),
                                  op1=nl.add, operand1=idx[0:n])
        rows = t.reshape((t.shape[0] * t.shape[1], t.shape[2]))
        return rows.ap(pattern=[[t.shape[2], n], [1, c]], offset=c0, vector_offset=idx[0:n], indirect_dim=0)

    return gather


@nki.jit
def linear_fp4_routed_kernel(x, weight, scale, experts):
    """The MoE's routed experts, one stack entry per slot: x bf16 [S, M, K] (slot s's rows), weight int8
    [E, N, K/2] (MXFP4) and scale ue8m0 bytes [E, N, K/32] (a rank's stacked local experts), experts int32
    [S, 1] (slot s's local expert, -1 = an empty slot) -> bf16 [S, M, N], out[s] = linear_fp4(x[s],
    weight[experts[s]]) and zeros for an empty slot.

    Access pattern after nki-library's selective-expert MoE decode (aws-neuron/nki-library, read, not
    copied): the expert id is read on the device, its weight rows fetched by indirect DMA (rows
    e * N + r0 + p), so the graph holds the whole stack and no host picks the experts. Each slot's work
    sits in a compiled loop whose trip count is 1 when the slot is occupied and 0 when it is empty
    (nl.fori_loop over a register): an empty slot reads and decodes no weight byte; its rows get zeros
    (the complementary loop). The GEMM is `_linear`'s, so an occupied slot's rows are linear_fp4's bits."""
    s_n, m, k = x.shape
    e_n, n = weight.shape[0], weight.shape[1]
    assert weight.shape[2] * 2 == k and k % QB == 0 and scale.shape == (e_n, n, k // QB)
    assert experts.shape == (s_n, 1) and e_n * n < 2 ** 24
    out = nl.ndarray((s_n, m, n), dtype=nl.bfloat16, buffer=nl.shared_hbm)
    n0, n1 = _col_range(n)
    for s in range(s_n):
        e_b = nl.ndarray((P, 1), dtype=nl.int32, buffer=nl.sbuf)
        load_bcast(e_b, experts, P, 1, offset=s)  # the slot's expert id on every partition
        flags = []
        for op in (nl.greater_equal, nl.less):  # occupied, empty: 1 or 0
            f = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=f, data=e_b[0:1], op0=op, operand0=0.0)
            reg = nisa.register_alloc()
            nisa.register_load(reg, f)
            flags.append(reg)

        def occupied(_i, s=s, e_b=e_b):
            _linear(x[s], out[s], _fp4_rows(weight, scale, _expert_rows(e_b, n)), True, nl.bfloat16)

        def empty(_i, s=s):
            if n0 >= n1:
                return
            z = nl.ndarray((P, n1 - n0), dtype=nl.bfloat16, buffer=nl.sbuf)
            nisa.memset(dst=z, value=0.0)
            for r0 in range(0, m, P):
                rs = min(P, m - r0)
                nisa.dma_copy(dst=out[s, r0:r0 + rs, n0:n1], src=z[0:rs])

        nl.fori_loop(0, flags[0], occupied)
        nl.fori_loop(0, flags[1], empty)
    return out
