"""The op seam between model code and kernels: one function per op family, one backend switch.

Backends: 'torch' (the CPU reference, `torch_ops`), 'nki-sim' (the NKI kernels run by the CPU
simulator) and 'nki' (the same kernels on Neuron devices); both NKI flavours live in `nki_ops`.
Model code calls `ops.<family>(...)` and never a backend module directly. The active backend comes
from `set_backend()`, else the V4FLASH_OPS environment variable, else 'torch'.
"""

from __future__ import annotations

import importlib
import os

FAMILIES = (
    "linear_fp8",
    "linear_fp4",
    "linear_bf16",
    "linear_f32",
    "rms_norm",
    "sparse_attn",
    "indexer_scores",
    "softmax_pool",
    "hc_mixes",
    "hc_expand",
    "hc_collapse",
    "hc_post",
    "swiglu",
    "engram_gate",
)

BACKENDS = {"torch": "v4flash_backend.ops.torch_ops", "nki-sim": "v4flash_backend.ops.nki_ops",
            "nki": "v4flash_backend.ops.nki_ops"}

_backend = os.environ.get("V4FLASH_OPS", "torch")
_module = None

# 'reference': the official reference's accumulation order and slot layouts, bit-compatible with its
# outputs. 'exact': every dot product accumulated in fp64 and rounded once at the reference's rounding
# points, so a row's result does not depend on how many rows share the step, which sequences are
# batched together or where chunks start -- decode then equals a prefill recompute bit for bit, and
# greedy speculative decoding equals plain greedy decoding.
NUMERICS = ("reference", "exact")
_numerics = os.environ.get("V4FLASH_NUMERICS", "exact")


def set_numerics(mode: str) -> None:
    global _numerics
    if mode not in NUMERICS:
        raise ValueError(f"unknown numerics {mode!r}; choose one of {NUMERICS}")
    _numerics = mode


def get_numerics() -> str:
    return _numerics


# The summation order of the torch backend's fp32 and bf16 GEMMs under 'reference' numerics (exact
# numerics accumulate in fp64 and do not depend on it). 'platform': the BLAS's own kernels -- MKL on
# x86, whose kernel, and so whose order, depends on the CPU (its Intel paths against the generic one
# AMD CPUs get) and on the row count; the golden fixture's bits are those of one such path.
# 'split-k': every projection GEMM as two half-K GEMMs summed, an order that differs from the
# platform's on any CPU: `make test` reruns the numerics tests under it where MKL offers no second
# path of its own (checks/gemm_probe.py chooses). 'invariant': fp64 accumulation rounded to fp32 once,
# so a row's result does not depend on the row count or the CPU (as 'exact' numerics' dot products):
# the tests that compare steps of different shapes under the fp32 decode loop use it.
# $V4FLASH_GEMM_ORDER sets it for a process.
GEMM_ORDERS = ("platform", "split-k", "invariant")
_gemm_order = os.environ.get("V4FLASH_GEMM_ORDER", "platform")


def set_gemm_order(order: str) -> None:
    global _gemm_order
    if order not in GEMM_ORDERS:
        raise ValueError(f"unknown GEMM order {order!r}; choose one of {GEMM_ORDERS}")
    _gemm_order = order


def get_gemm_order() -> str:
    if _gemm_order not in GEMM_ORDERS:
        raise ValueError(f"unknown GEMM order {_gemm_order!r} (V4FLASH_GEMM_ORDER); choose one of {GEMM_ORDERS}")
    return _gemm_order


def set_backend(name: str) -> None:
    global _backend, _module
    if name not in BACKENDS:
        raise ValueError(f"unknown ops backend {name!r}; choose one of {sorted(BACKENDS)}")
    _backend, _module = name, None


def get_backend() -> str:
    return _backend


def backend_module():
    global _module
    if _module is None:
        if _backend not in BACKENDS:
            raise ValueError(f"unknown ops backend {_backend!r} (V4FLASH_OPS); choose one of {sorted(BACKENDS)}")
        _module = importlib.import_module(BACKENDS[_backend])
    return _module


# ---- the op families: explicit functions, each dispatched to the active backend ------------------------
# (written out rather than generated so that go-to-definition and linters find them; the contracts and
# shapes are in torch_ops, the reference implementation)


def linear_fp8(x, weight, scale, experts=None):
    """x [..., K] bf16 @ fp8 e4m3fn weight [N, K] with 32x32 e8m0 scales (or stacks [E, N, K] / [E, T, K]);
    experts [E'] int64: x [E', T, K] meets the stack's entries `experts` (the routed experts only)."""
    return backend_module().linear_fp8(x, weight, scale, experts)


def linear_fp4(x, weight, scale, experts=None):
    """x [..., K] bf16 @ MXFP4 weight [N, K/2] with e8m0 scales per 32 along K (or stacks, `experts` as
    linear_fp8's)."""
    return backend_module().linear_fp4(x, weight, scale, experts)


def linear_bf16(x, weight):
    """bf16 GEMM, fp32 accumulation, one rounding; a 3-D weight [G, N, K] is block-diagonal."""
    return backend_module().linear_bf16(x, weight)


def linear_f32(x, weight):
    """fp32 GEMM (router, mHC, heads that stay in fp32)."""
    return backend_module().linear_f32(x, weight)


def rms_norm(x, weight, eps: float):
    return backend_module().rms_norm(x, weight, eps)


def sparse_attn(q, kv, sink, idxs, scale: float):
    """Single-KV-head attention over gathered slots (idxs, -1 = empty) with a learned sink."""
    return backend_module().sparse_attn(q, kv, sink, idxs, scale)


def indexer_scores(q, k, w):
    """sum_h w[b,s,h] * relu(q[b,s,h] . k[b,t]) -> [b, s, t]."""
    return backend_module().indexer_scores(q, k, w)


def softmax_pool(kv, score):
    """Compressor pooling: sum_r kv * softmax_r(score), f32 [..., d]."""
    return backend_module().softmax_pool(kv, score)


def hc_mixes(x, fn, scale, base, hc: int, iters: int, hc_eps: float, norm_eps: float):
    """mHC pre / post / Sinkhorn-normalized comb coefficients from the flattened streams."""
    return backend_module().hc_mixes(x, fn, scale, base, hc, iters, hc_eps, norm_eps)


def hc_expand(x, hc: int):
    return backend_module().hc_expand(x, hc)


def hc_collapse(x, mix):
    return backend_module().hc_collapse(x, mix)


def hc_post(f, residual, post, comb):
    return backend_module().hc_post(f, residual, post, comb)


def swiglu(gate, up, weight, limit: float):
    """Clamped SwiGLU, optionally times a per-token routing weight."""
    return backend_module().swiglu(gate, up, weight, limit)


def engram_gate(h, key, value, qk_weight, eps: float):
    """h + sigmoid(signed-sqrt(normalized <h, w*key>)) * value, per (token, stream)."""
    return backend_module().engram_gate(h, key, value, qk_weight, eps)
