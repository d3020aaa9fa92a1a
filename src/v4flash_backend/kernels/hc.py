"""Hyper-connection (mHC) kernels: hc_mixes (projection + Sinkhorn), hc_expand, hc_collapse, hc_post.

Tokens on the partitions, the hc streams and channels on the free axis; every sum over streams runs in
the reference's order (stream 0 first), so collapse and post reproduce the fp32 reference exactly.

Rounding points of hc_mixes: the mixes GEMM x . fn in fp32 (PE column sums over 128-row chunks added in
PSUM: an fp32 reordering of the reference's F.linear), the sum of squares of the whole row in one fp32
reduction, mean = sum / (hc*d) correctly rounded (`div_const`), + eps, rsqrt, mixes * rsqrt, then pre / post /
comb as the reference (fp32 sigmoid, exp, sums); the Sinkhorn divisions are rounded like the reference's
(`div_exact`, no divide instruction; one ulp off with probability ~1e-6 per element). hc_expand / hc_collapse / hc_post
are bit-exact.
"""

from . import _nki  # noqa: F401
import nki
import nki.isa as nisa
import nki.language as nl

from ._common import P, cdiv, div_const, div_exact, load_bcast, row_tiles, transpose


@nki.jit
def hc_mixes_kernel(x, fn, scale, base, hc, iters, hc_eps, norm_eps):
    """x bf16 [T, hc*d], fn f32 [(2+hc)*hc, hc*d], scale f32 [3], base f32 [(2+hc)*hc] ->
    pre f32 [T, hc], post f32 [T, hc], comb f32 [T, hc*hc] (row-major [hc, hc])."""
    n, hd = x.shape
    mix = fn.shape[0]
    assert mix == (2 + hc) * hc and mix <= P and fn.shape[1] == hd and iters >= 1
    f32 = nl.float32
    pre = nl.ndarray((n, hc), dtype=f32, buffer=nl.shared_hbm)
    post = nl.ndarray((n, hc), dtype=f32, buffer=nl.shared_hbm)
    comb = nl.ndarray((n, hc * hc), dtype=f32, buffer=nl.shared_hbm)
    kc_n = cdiv(hd, P)
    # fn^T in 128-row chunks of hc*d (the contraction dim on the partitions)
    fT = nl.ndarray((P, kc_n, mix), dtype=f32, buffer=nl.sbuf)
    for kc in range(kc_n):
        ks = min(P, hd - kc * P)
        fr = nl.ndarray((P, P), dtype=f32, buffer=nl.sbuf)
        nisa.dma_copy(dst=fr[0:mix, 0:ks], src=fn[:, kc * P:kc * P + ks])
        transpose(fT[0:ks, kc, 0:mix], fr[0:mix, 0:ks])
    rows = min(P, n)
    sc = nl.ndarray((P, 3), dtype=f32, buffer=nl.sbuf)
    load_bcast(sc[0:rows], scale, rows, 3)
    bs = nl.ndarray((P, mix), dtype=f32, buffer=nl.sbuf)
    load_bcast(bs[0:rows], base, rows, mix)
    for t0, m in row_tiles(n):
        xt = nl.ndarray((P, hd), dtype=f32, buffer=nl.sbuf)
        nisa.dma_copy(dst=xt[0:m], src=x[t0:t0 + m])  # bf16 -> fp32, exact
        mp = nl.ndarray((P, mix), dtype=f32, buffer=nl.psum)
        for kc in range(kc_n):
            ks = min(P, hd - kc * P)
            xT = nl.ndarray((P, P), dtype=f32, buffer=nl.sbuf)
            transpose(xT[0:ks, 0:m], xt[0:m, kc * P:kc * P + ks])
            nisa.nc_matmul(dst=mp[0:m], stationary=xT[0:ks, 0:m], moving=fT[0:ks, kc, 0:mix], accumulate=kc > 0)
        # sum of squares of the whole hc*d row in one reduction (the reference's single mean), squares written
        # over xt, which the matmul no longer needs (no [P, hc*d] scratch)
        ss = nl.ndarray((P, 1), dtype=f32, buffer=nl.sbuf)
        nisa.activation(dst=xt[0:m], op=nl.square, data=xt[0:m], reduce_op=nl.add, reduce_res=ss[0:m],
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
        div_const(ss[0:m], ss[0:m], hd, m)  # mean: correctly rounded sum / (hc*d), without a divide
        nisa.tensor_scalar(dst=ss[0:m], data=ss[0:m], op0=nl.add, operand0=float(norm_eps))
        rs = nl.ndarray((P, 1), dtype=f32, buffer=nl.sbuf)
        nisa.activation(dst=rs[0:m], op=nl.rsqrt, data=ss[0:m])
        mm = nl.ndarray((P, mix), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=mm[0:m], data=mp[0:m], op0=nl.multiply, operand0=rs[0:m])
        # pre = sigmoid(m * s0 + b) + eps ; post = 2 * sigmoid(m * s1 + b)
        a = nl.ndarray((P, hc), dtype=f32, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=a[0:m], data=mm[0:m, 0:hc], op0=nl.multiply, operand0=sc[0:m, 0:1],
                                  op1=nl.add, operand1=bs[0:m, 0:hc])
        nisa.activation(dst=a[0:m], op=nl.sigmoid, data=a[0:m])
        nisa.tensor_scalar(dst=a[0:m], data=a[0:m], op0=nl.add, operand0=float(hc_eps))
        nisa.dma_copy(dst=pre[t0:t0 + m], src=a[0:m])
        bq = nl.ndarray((P, hc), dtype=f32, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=bq[0:m], data=mm[0:m, hc:2 * hc], op0=nl.multiply, operand0=sc[0:m, 1:2],
                                  op1=nl.add, operand1=bs[0:m, hc:2 * hc])
        nisa.activation(dst=bq[0:m], op=nl.sigmoid, data=bq[0:m])
        nisa.tensor_scalar(dst=bq[0:m], data=bq[0:m], op0=nl.multiply, operand0=2.0)
        nisa.dma_copy(dst=post[t0:t0 + m], src=bq[0:m])
        c = nl.ndarray((P, hc * hc), dtype=f32, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=c[0:m], data=mm[0:m, 2 * hc:mix], op0=nl.multiply, operand0=sc[0:m, 2:3],
                                  op1=nl.add, operand1=bs[0:m, 2 * hc:mix])
        _sinkhorn(c[0:m].reshape((m, hc, hc)), m, hc, iters, float(hc_eps))
        nisa.dma_copy(dst=comb[t0:t0 + m], src=c[0:m])
    return pre, post, comb


def _sinkhorn(c, m, hc, iters, eps):
    """In place on c [m, hc(j), hc(k)]: row softmax + eps, then column / row normalisations."""
    f32 = nl.float32
    v = nl.ndarray((P, hc), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=v[0:m], op=nl.maximum, data=c, axis=2)
    nisa.tensor_tensor(dst=c, data1=c, data2=v[0:m].reshape((m, hc, 1)).broadcast(2, hc), op=nl.subtract)
    nisa.activation(dst=c, op=nl.exp, data=c)
    _normalize(c, v, m, hc, 0.0, rows=True)
    nisa.tensor_scalar(dst=c, data=c, op0=nl.add, operand0=eps)
    _normalize(c, v, m, hc, eps, rows=False)
    for _ in range(iters - 1):
        _normalize(c, v, m, hc, eps, rows=True)
        _normalize(c, v, m, hc, eps, rows=False)


def _normalize(c, v, m, hc, eps, rows):
    """c /= (sum over k (rows) or over j (columns) + eps), rounded like the reference's fp32 division
    (`div_exact`: the ALU has no divide)."""
    src = c if rows else c.permute((0, 2, 1))
    nisa.tensor_reduce(dst=v[0:m], op=nl.add, data=src, axis=2)
    if eps:
        nisa.tensor_scalar(dst=v[0:m], data=v[0:m], op0=nl.add, operand0=eps)
    if rows:
        def bc(t):
            return t.reshape((m, hc, 1)).broadcast(2, hc)
    else:
        def bc(t):
            return t.reshape((m, 1, hc)).broadcast(1, hc)
    div_exact(c, c, v[0:m], m, bc)


@nki.jit
def hc_expand_kernel(x, hc):
    """x [T, d] -> [T, hc, d]: the embedding repeated into hc streams."""
    n, d = x.shape
    out = nl.ndarray((n, hc, d), dtype=x.dtype, buffer=nl.shared_hbm)
    for t0, m in row_tiles(n):
        xt = nl.ndarray((P, d), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=xt[0:m], src=x[t0:t0 + m])
        for i in range(hc):
            nisa.dma_copy(dst=out[t0:t0 + m, i, :], src=xt[0:m])
    return out


@nki.jit
def hc_collapse_kernel(x, mix):
    """x [T, hc, d], mix f32 [T, hc] -> x.dtype [T, d] = sum_i mix_i * x_i (fp32, stream 0 first)."""
    n, hc, d = x.shape
    f32 = nl.float32
    out = nl.ndarray((n, d), dtype=x.dtype, buffer=nl.shared_hbm)
    for t0, m in row_tiles(n):
        xt = nl.ndarray((P, hc, d), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=xt[0:m], src=x[t0:t0 + m])
        mx = nl.ndarray((P, hc), dtype=f32, buffer=nl.sbuf)
        nisa.dma_copy(dst=mx[0:m], src=mix[t0:t0 + m])
        acc = nl.ndarray((P, d), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=acc[0:m], data=xt[0:m, 0, :], op0=nl.multiply, operand0=mx[0:m, 0:1])
        o = nl.ndarray((P, d), dtype=x.dtype, buffer=nl.sbuf)
        for i in range(1, hc):
            dst = o if i == hc - 1 else acc  # the last add rounds straight into x.dtype
            nisa.scalar_tensor_tensor(dst=dst[0:m], data=xt[0:m, i, :], op0=nl.multiply, operand0=mx[0:m, i:i + 1],
                                      op1=nl.add, operand1=acc[0:m])
        if hc == 1:
            nisa.tensor_copy(dst=o[0:m], src=acc[0:m])
        nisa.dma_copy(dst=out[t0:t0 + m], src=o[0:m])
    return out


@nki.jit
def hc_post_kernel(f, residual, post, comb):
    """f [T, d], residual [T, hc, d], post f32 [T, hc], comb f32 [T, hc*hc] (comb[j, k] at j*hc + k) ->
    f.dtype [T, hc, d]: out_k = post_k * f + sum_j comb[j, k] * residual_j (fp32, one rounding)."""
    n, hc, d = residual.shape
    f32 = nl.float32
    out = nl.ndarray((n, hc, d), dtype=f.dtype, buffer=nl.shared_hbm)
    for t0, m in row_tiles(n):
        ft = nl.ndarray((P, d), dtype=f.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=ft[0:m], src=f[t0:t0 + m])
        rt = nl.ndarray((P, hc, d), dtype=residual.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=rt[0:m], src=residual[t0:t0 + m])
        pt = nl.ndarray((P, hc), dtype=f32, buffer=nl.sbuf)
        nisa.dma_copy(dst=pt[0:m], src=post[t0:t0 + m])
        ct = nl.ndarray((P, hc * hc), dtype=f32, buffer=nl.sbuf)
        nisa.dma_copy(dst=ct[0:m], src=comb[t0:t0 + m])
        o = nl.ndarray((P, hc, d), dtype=f.dtype, buffer=nl.sbuf)
        for kk in range(hc):
            acc = nl.ndarray((P, d), dtype=f32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=acc[0:m], data=rt[0:m, 0, :], op0=nl.multiply, operand0=ct[0:m, kk:kk + 1])
            for j in range(1, hc):
                c = j * hc + kk
                nisa.scalar_tensor_tensor(dst=acc[0:m], data=rt[0:m, j, :], op0=nl.multiply,
                                          operand0=ct[0:m, c:c + 1], op1=nl.add, operand1=acc[0:m])
            nisa.scalar_tensor_tensor(dst=o[0:m, kk, :], data=ft[0:m], op0=nl.multiply, operand0=pt[0:m, kk:kk + 1],
                                      op1=nl.add, operand1=acc[0:m])
        nisa.dma_copy(dst=out[t0:t0 + m], src=o[0:m])
    return out
