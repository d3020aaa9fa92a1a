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


def _dispatch(name):
    def call(*args, **kwargs):
        return getattr(backend_module(), name)(*args, **kwargs)

    call.__name__ = name
    call.__doc__ = f"ops.{name}: dispatched to the active backend (see torch_ops.{name} for the contract)."
    return call


for _name in FAMILIES:
    globals()[_name] = _dispatch(_name)
