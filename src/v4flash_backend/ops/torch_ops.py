"""The 'torch' ops backend: the CPU reference every kernel is checked against.

Each function reproduces the rounding points of the official V4.1 reference (see the golden
README section 6.1): fp32 math inside, one rounding to the output dtype where the reference has one.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F

from v4flash_backend import ops as _ops
from v4flash_backend.formats import quant


@torch.compiler.assume_constant_result
def _f32(v: float) -> float:
    """v rounded to fp32, as a Python float: a constant of a traced graph (dynamo would otherwise put
    the numpy call into the graph, which a compiled artifact's source cannot name)."""
    return float(np.float32(v))

def _exact() -> bool:
    return _ops.get_numerics() == "exact"


def _mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [.., K] @ w[N, K].T: fp64 accumulation in 'exact' numerics (fp32 / bf16 operands multiply
    exactly in fp64), else the framework's fp32 GEMM."""
    if _exact():
        return (x.double() @ w.double().T)
    return matmul_f32(x.float(), w.float().T)


def matmul_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., K] @ b [..., K, N] in fp32 in the configured GEMM order (`ops.get_gemm_order`): the
    platform's kernels, the two halves of K summed ('split-k', the suite's second order), or fp64
    accumulation rounded once ('invariant': the same row whatever the row count)."""
    order = _ops.get_gemm_order()
    if order == "split-k" and a.shape[-1] > 1:
        h = a.shape[-1] // 2
        return a[..., :h] @ b[..., :h, :] + a[..., h:] @ b[..., h:, :]
    if order == "invariant":
        return (a.double() @ b.double()).float()
    return a @ b

_SPARSE_BLOCK = 64  # the reference kernel's online-softmax block; p is rounded per block max


# ---- linear layers --------------------------------------------------------------------------
class _DequantCache:
    """Dequantized fp32 copies of quantized weights, keyed by tensor identity.

    The fp8 x fp8 and fp4 x fp8 block products are exact in fp32, so one fp32 matmul of the
    dequantized operands equals the reference's block-scaled GEMM (measured bit-identical on the
    golden fixture); caching the fp32 weight keeps CPU decoding fast.
    """

    def __init__(self):
        self._d: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, w: torch.Tensor, make):
        hit = self._d.get(id(w))
        if hit is not None and hit[0] is w:
            return hit[1]
        val = make()
        if len(self._d) > 100_000:
            self._d.clear()
        self._d[id(w)] = (w, val)
        return val


_cache = _DequantCache()
_cache64 = _DequantCache()  # fp64 copies of weights ('exact' numerics: `_f64`)

# Which weights 'exact' numerics keep an fp64 copy of, rather than converting them in every call:
# 'none'; 'f32' (the fp32 ones: the LM head, the Markov and confidence heads, the compressors, the mHC
# projections); 'experts' (the expert stacks where the dense form runs every expert on every row: the
# compiled drafting round's 6-row verify, the draft stages, batch 8's rounds); 'all' (every fp32 and
# dequantized fp8 / fp4 weight). The same fp64 operands either way (the conversion is exact), so the
# same bits. Default 'experts': `perf/round_profile.py --f64-weights none,experts` put the batch-1
# verify graph 4 % faster with the plain round unchanged; 'all' and 'f32' made the plain round slower
# or did not measure beyond the noise of a shared 2-core machine.
F64_MODES = ("none", "f32", "experts", "all")
F64_WEIGHTS = os.environ.get("V4FLASH_F64_WEIGHTS", "experts")
if F64_WEIGHTS not in F64_MODES:
    raise ValueError(f"V4FLASH_F64_WEIGHTS={F64_WEIGHTS!r}: choose one of {', '.join(F64_MODES)}")


def _f64(w: torch.Tensor, kind: str = "f32", make=None) -> torch.Tensor:
    """w (a weight: a tensor of the model's W, or a `_cache` entry) in fp64, from `_cache64` when
    F64_WEIGHTS keeps `kind`; make: how to build it (default w.double())."""
    make = make or w.double
    if F64_WEIGHTS == "all" or F64_WEIGHTS == kind:
        return _cache64.get(w, make)
    return make()


def _f64_quantized(weight: torch.Tensor, wf: torch.Tensor, experts: torch.Tensor | None) -> torch.Tensor:
    """The dequantized fp32 copy wf of a quantized weight, or its kept fp64 copy where F64_WEIGHTS
    keeps it: 'all', or 'experts' for an expert stack (3-D) that the dense form runs whole (experts
    None). The routed form gathers its slots' entries from the fp32 copy: gathering fp64 entries made
    the batch-1 plain round slower than gathering fp32 ones and converting them."""
    if _exact() and (F64_WEIGHTS == "all" or (F64_WEIGHTS == "experts" and weight.dim() == 3 and experts is None)):
        return _cache64.get(weight, wf.double)
    return wf


def _batched(deq, weight, scale):
    """Stacked weights [E, N, ...] (a group of experts): dequantize expert by expert."""
    if weight.dim() == 3:
        return torch.stack([deq(w, s) for w, s in zip(weight, scale)])
    return deq(weight, scale)


def _bmm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if w.dim() == 2:
        return _mm(x, w)
    if x.dim() == 3 and x.shape[1] == 1 and torch.compiler.is_compiling():
        # inductor lowers a CPU bmm with one row per batch to a fused reduction that recomputes the
        # row's producers (here the fp8 activation quantization) for every output column: ~0.8 ms
        # per MoE layer of the embedded model at batch 1. One GEMM per batch entry keeps it BLAS
        # (a zero second row would too, at twice the fp64 work: measured slower). Both numerics:
        # under 'reference' the batch-1 plain round took 7.6 ms against exact's 3.9 while its bmm
        # stayed one (perf/round_profile.py --numerics exact,reference)
        exact = _exact()
        xd, wd = (x.double(), w.double()) if exact else (x.float(), w.float())
        return torch.stack([xd[e] @ wd[e].T if exact else matmul_f32(xd[e], wd[e].T) for e in range(x.shape[0])])
    if not _exact():
        return matmul_f32(x.float(), w.float().transpose(-1, -2))
    return x.double() @ w.double().transpose(-1, -2)


def linear_fp8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               experts: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] bf16 @ fp8 weight [N, K] (or a stack [E, N, K] with x [E, T, K]; with `experts` [E']
    x [E', T, K] meets those entries of the stack, gathered from its dequantized copy)."""
    wf = _cache.get(weight, lambda: _batched(quant.dequant_fp8_weight, weight, scale))
    return _routed(quant.fp8_act_dequant_f32(x), _f64_quantized(weight, wf, experts), experts)


def _routed(xq: torch.Tensor, wf: torch.Tensor, experts: torch.Tensor | None) -> torch.Tensor:
    """The GEMM on the whole weight, or (experts [S]) slot s of xq on stack entry experts[s], zeros for
    an empty slot (-1: the kernel reads no weight there; here it must not read entry -1, the last)."""
    if experts is None:
        return _bmm(xq, wf).to(torch.bfloat16)
    y = _bmm(xq, wf[experts.clamp_min(0)]).to(torch.bfloat16)
    return torch.where((experts >= 0).view(-1, 1, 1), y, 0)


def linear_fp4(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               experts: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] bf16 @ MXFP4 weight [N, K/2] (or a stack [E, N, K/2] with x [E, T, K]; `experts` as
    linear_fp8's)."""
    wf = _cache.get(weight, lambda: _batched(quant.dequant_fp4_weight, weight, scale))
    return _routed(quant.fp8_act_dequant_f32(x), _f64_quantized(weight, wf, experts), experts)


def linear_bf16(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """bf16 GEMM, fp32 accumulation, one rounding. A 3-D weight [G, N, K] is a block-diagonal
    (grouped) projection: x [..., G, K] -> [..., G, N] (the attention's wo_a)."""
    if weight.dim() == 3:
        if _exact():
            return torch.einsum("...gd,grd->...gr", x.double(), weight.double()).to(torch.bfloat16)
        if _ops.get_gemm_order() != "platform":  # per group, fp32 (exact products), one rounding
            xg = x.float().movedim(-2, 0)
            y = matmul_f32(xg.reshape(xg.shape[0], -1, xg.shape[-1]), weight.float().transpose(-1, -2))
            return y.view(xg.shape[:-1] + (-1,)).movedim(0, -2).to(torch.bfloat16)
        return torch.einsum("...gd,grd->...gr", x.to(torch.bfloat16), weight.to(torch.bfloat16))
    if _exact() or _ops.get_gemm_order() != "platform":  # bf16 products are exact in fp32: one rounding
        return _mm(x, weight).to(torch.bfloat16)
    return F.linear(x.to(torch.bfloat16), weight.to(torch.bfloat16))


def linear_f32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if _exact():
        return (x.double() @ _f64(weight).T).float()
    if _ops.get_gemm_order() != "platform":
        return _mm(x, weight).float()
    return F.linear(x.float(), weight.float())


# ---- norms and elementwise ----------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _exact():
        xd = x.double()
        return (weight.double() * (xd * torch.rsqrt(xd.square().mean(-1, keepdim=True) + eps))).to(x.dtype)
    xf = x.float()
    var = xf.square().mean(-1, keepdim=True)
    return (weight * (xf * torch.rsqrt(var + eps))).to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor | None, limit: float) -> torch.Tensor:
    g, u = (gate.double(), up.double()) if _exact() else (gate.float(), up.float())
    if limit > 0:
        u = torch.clamp(u, min=-limit, max=limit)
        g = torch.clamp(g, max=limit)
    y = F.silu(g) * u
    if weight is not None:
        y = weight.to(y.dtype) * y
    return y.to(torch.bfloat16)


# ---- attention ----------------------------------------------------------------------------
def sparse_attn(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idxs: torch.Tensor,
                scale: float) -> torch.Tensor:
    """Single-KV-head attention over gathered slots with a learned sink in the denominator.

    q [b,m,h,d] bf16, kv [b,n,d] bf16, sink [h] f32, idxs [b,m,k] int32 (-1 = empty).
    Online softmax over blocks of 64 slots in idxs order; p rounded to bf16 before P.V.
    """
    if _exact():
        return _sparse_attn_exact(q, kv, sink, idxs, scale)
    b, m, h, d = q.shape
    k = idxs.shape[-1]
    sc = torch.tensor(scale, dtype=torch.float32)
    qf, kvf = q.float(), kv.float()
    dev = q.device
    acc = torch.zeros(b, m, h, d, dtype=torch.float32, device=dev)
    denom = torch.zeros(b, m, h, dtype=torch.float32, device=dev)
    run_max = torch.full((b, m, h), -1e30, dtype=torch.float32, device=dev)  # finite: empty rows give 0, not NaN
    bidx = torch.arange(b, device=dev).view(b, 1, 1)
    for t in range(0, k, _SPARSE_BLOCK):
        ix = idxs[:, :, t:t + _SPARSE_BLOCK].long()
        valid = ix >= 0
        blk = kvf[bidx, ix.clamp_min(0)] * valid.unsqueeze(-1)
        s = _bmm_f32("bmhd,bmkd->bmhk", qf, blk)
        s = torch.where(valid.unsqueeze(2), s, -torch.inf) * sc
        prev = run_max
        run_max = torch.maximum(prev, s.amax(-1))
        corr = torch.exp(prev - run_max)
        p = torch.exp(s - run_max.unsqueeze(-1))
        denom = denom * corr + p.sum(-1)
        pb = p.to(torch.bfloat16).float()
        acc = acc * corr.unsqueeze(-1) + _bmm_f32("bmhk,bmkd->bmhd", pb, blk)
    denom = denom + torch.exp(sink.float() - run_max)
    return (acc / denom.unsqueeze(-1)).to(torch.bfloat16)


def _bmm_f32(spec: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The attention's per-query fp32 products ('bmhd,bmkd->bmhk': a [b,m,h,x] with b [b,m,k,x] or
    [b,m,x,d]) in the configured GEMM order."""
    if _ops.get_gemm_order() == "platform":
        return torch.einsum(spec, a, b)
    return matmul_f32(a, b.transpose(-1, -2) if spec == "bmhd,bmkd->bmhk" else b)


def _dense_scores(m: int, n: int, k: int) -> bool:
    """Which form of _sparse_attn_exact for m queries over a bank of n slots, k listed per query
    (measured on 1 CPU thread: equal at a few queries, the dense form ahead while n <= 4k, and for
    a prompt chunk of 32+ queries while n <= 8k)."""
    return m > 1 and (n <= 4 * k or (m >= 32 and n <= 8 * k))


def _sparse_attn_exact(q, kv, sink, idxs, scale):
    """fp64 throughout over the whole slot set at once (one max per row), so the result depends
    neither on slot order nor on -1 padding; p is still rounded to bf16 before P.V.

    Two equal forms (every product of bf16 operands and their short sums are exact in fp64, so the
    order of accumulation does not show): the gathered one copies each query's k slots out of the
    bank; the dense one scores every query against the whole bank and picks its slots. The copy
    ([b, m, k, d] in fp64) dominates when many queries share a bank (a prompt chunk: 5x slower at
    125 queries over 187 slots), the dense scores when the bank is much longer than k."""
    b, m, h, d = q.shape
    n, k = kv.shape[1], idxs.shape[-1]
    ix = idxs.long()
    valid = ix >= 0
    sc = _f32(scale)  # fp32-rounded, no tensor
    dense = _dense_scores(m, n, k)
    if dense:
        kvd = kv.double()
        g = ix.clamp_min(0).unsqueeze(2).expand(b, m, h, k)
        s = torch.einsum("bmhd,bnd->bmhn", q.double(), kvd).gather(-1, g) * sc
    else:
        bidx = torch.arange(b, device=q.device).view(b, 1, 1)
        blk = kv[bidx, ix.clamp_min(0)].double() * valid.unsqueeze(-1)
        s = torch.einsum("bmhd,bmkd->bmhk", q.double(), blk) * sc
    s = torch.where(valid.unsqueeze(2), s, -torch.inf)
    mx = torch.full((b, m, h), -1e30, dtype=torch.float64, device=q.device)
    if s.shape[-1]:
        mx = torch.maximum(mx, s.amax(-1))
    p = torch.exp(s - mx.unsqueeze(-1))
    denom = p.sum(-1) + torch.exp(sink.double() - mx)
    pb = p.to(torch.bfloat16).double()
    if dense:  # p back onto the bank's slots (added: a slot listed twice counts twice, as gathered)
        bank = torch.zeros(b, m, h, n, dtype=torch.float64, device=q.device).scatter_add_(-1, g, pb)
        o = torch.einsum("bmhn,bnd->bmhd", bank, kvd)
    else:
        o = torch.einsum("bmhk,bmkd->bmhd", pb, blk)
    return (o / denom.unsqueeze(-1)).to(torch.bfloat16)


def indexer_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum_h w[b,s,h] * relu(q[b,s,h] . k[b,t]) with the reference's bf16 roundings -> [b,s,t]."""
    if _exact():
        dots = torch.einsum("bshd,btd->bsht", q.double(), k.double()).to(torch.bfloat16)
        prod = (dots.relu_() * w.unsqueeze(-1)).double()  # the bf16 product is one rounding of an exact value
        return prod.sum(dim=2).to(torch.bfloat16)
    if _ops.get_gemm_order() == "platform":
        dots = torch.einsum("bshd,btd->bsht", q, k)
    else:  # fp32 (exact bf16 products) in the configured order, one rounding to bf16
        b, s, h, d = q.shape
        dots = matmul_f32(q.float().reshape(b, s * h, d), k.float().transpose(1, 2))
        dots = dots.view(b, s, h, -1).to(torch.bfloat16)
    return (dots.relu_() * w.unsqueeze(-1)).sum(dim=2)


def softmax_pool(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """Compressor pooling: kv, score f32 [..., r, d] -> sum_r kv * softmax_r(score), f32 [..., d]."""
    if _exact():
        return (kv.double() * score.double().softmax(dim=-2)).sum(dim=-2).float()
    return (kv * score.softmax(dim=-2)).sum(dim=-2)


# ---- hyper-connections --------------------------------------------------------------------
def hc_mixes(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int,
             iters: int, hc_eps: float, norm_eps: float):
    """pre / post / Sinkhorn-normalized comb coefficients from the flattened stream (all fp32)."""
    if _exact():
        xd = x.flatten(-2).double()
        m = (xd @ _f64(fn).T) * torch.rsqrt(xd.square().mean(-1, keepdim=True) + norm_eps)
        pre, post, c = _split_sinkhorn(m, scale.double(), base.double(), hc, iters, hc_eps)
        return pre.float(), post.float(), c.float()
    xf = x.flatten(-2).float()
    rs = torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps)
    m = (F.linear(xf, fn.float()) if _ops.get_gemm_order() == "platform" else matmul_f32(xf, fn.float().T)) * rs
    return _split_sinkhorn(m, scale.float(), base.float(), hc, iters, hc_eps)


def _split_sinkhorn(m, scale, base, hc, iters, hc_eps):
    pre = torch.sigmoid(m[..., :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(m[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    c = (m[..., 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc))
    c = torch.exp(c - c.amax(-1, keepdim=True))
    c = c / c.sum(-1, keepdim=True) + hc_eps
    if _numpy_sinkhorn(c):
        _sinkhorn_numpy(c.numpy(), iters, hc_eps)
        return pre, post, c
    c = c / (c.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + hc_eps)
        c = c / (c.sum(-2, keepdim=True) + hc_eps)
    return pre, post, c


# Up to this many [hc, hc] matrices the normalizations run in numpy: ~115 tiny ops a call, and a
# numpy op on a few rows costs about half a torch op (a decode forward of the embedded model: 16
# calls, 214 -> 139 us each at 1 row, 225 -> 156 at 6; at 48 rows numpy's axis sums are slower).
_NUMPY_SINKHORN_MAX = 16


def _numpy_sinkhorn(c: torch.Tensor) -> bool:
    """A plain CPU tensor outside any trace, autograd or watcher: not under torch.compile (whose
    traced tensors look plain), not a subclass (fake, functional: other traces), no torch-function
    mode on (the runners' host-sync counter: `.numpy()` is a device read it must see, and on a
    device the static path never takes this loop, so its counts must not differ on a CPU)."""
    return (not torch.compiler.is_compiling() and not torch._C._is_torch_function_mode_enabled()
            and type(c) is torch.Tensor and c.device.type == "cpu" and not c.requires_grad
            and c.shape[-1] == c.shape[-2] <= 4  # sums of <= 4 values: the same order in both
            and c.numel() <= _NUMPY_SINKHORN_MAX * c.shape[-1] * c.shape[-2] and c.is_contiguous())


def _sinkhorn_numpy(a: np.ndarray, iters: int, hc_eps: float) -> None:
    """The torch loop's column / row normalizations in place, the same IEEE operations in the same
    order: a sum over 4 values is ((a + b) + c) + d in both libraries, along either axis
    (test_torch_ops checks the two loops bit for bit)."""
    rows = np.empty(a.shape[:-1] + (1,), a.dtype)
    cols = np.empty(a.shape[:-2] + (1, a.shape[-1]), a.dtype)
    add, div = np.add, np.divide
    add.reduce(a, axis=-2, keepdims=True, out=cols)
    div(a, add(cols, hc_eps, out=cols), out=a)
    for _ in range(iters - 1):
        add.reduce(a, axis=-1, keepdims=True, out=rows)
        div(a, add(rows, hc_eps, out=rows), out=a)
        add.reduce(a, axis=-2, keepdims=True, out=cols)
        div(a, add(cols, hc_eps, out=cols), out=a)


def hc_expand(x: torch.Tensor, hc: int) -> torch.Tensor:
    return x.unsqueeze(-2).repeat(*([1] * (x.dim() - 1)), hc, 1)


def hc_collapse(x: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    if _exact():
        return torch.sum(mix.double().unsqueeze(-1) * x.double(), dim=-2).to(x.dtype)
    return torch.sum(mix.unsqueeze(-1) * x.float(), dim=-2).to(x.dtype)


def hc_post(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    if _exact():
        f64, r64 = f.double(), residual.double()
        y = post.double().unsqueeze(-1) * f64.unsqueeze(-2) + torch.sum(
            comb.double().unsqueeze(-1) * r64.unsqueeze(-2), dim=-3)
        return y.to(f.dtype)
    y = post.unsqueeze(-1) * f.unsqueeze(-2) + torch.sum(comb.unsqueeze(-1) * residual.unsqueeze(-2), dim=-3)
    return y.to(f.dtype)


# ---- engram -------------------------------------------------------------------------------
def engram_gate(h: torch.Tensor, key: torch.Tensor, value: torch.Tensor, qk_weight: torch.Tensor,
                eps: float) -> torch.Tensor:
    """h + sigmoid(signed-sqrt(normalized <h, w*key>)) * value, per (token, stream)."""
    dt = torch.float64 if _exact() else torch.float32
    hf, kf, qk_weight, value = h.to(dt), key.to(dt), qk_weight.to(dt), value.to(dt)
    d = h.shape[-1]
    rstd = torch.rsqrt(hf.square().mean(-1) + eps) * torch.rsqrt(kf.square().mean(-1) + eps)
    dot = (hf * qk_weight * kf).sum(-1) * rstd * d ** -0.5
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
    return (hf + gate.unsqueeze(-1) * value.unsqueeze(-2)).to(h.dtype)
