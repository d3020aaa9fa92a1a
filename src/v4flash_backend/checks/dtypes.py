"""The trn2 dtype rule over a captured graph (`dtype_problems`): what NeuronCore engines can run
exactly, checked by `trn2-check` on every static graph; and the FX helpers the checks share."""

from __future__ import annotations

import torch

# ---- the dtype rule -------------------------------------------------------------------------------
# NeuronCore engines take cFP8, FP16, BF16, TF32, FP32, INT8, INT16, INT32: no float64 at all. For
# 64-bit integers neuronx-cc (Neuron 2.32 release notes,
# https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/release-notes/components/compiler.html):
#   "--native-int64=enabled runs int64 ops natively without precision loss on trn2 and later;
#    --implicit-integer-downcast controls which ops with no native integer datapath (dot, scatter,
#    all_reduce, reduce_scatter, pow) are silently downcast versus hard-errored. The default
#    posture preserves backward compatibility: int64 ops are downcast to int32"
# (options listed in https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/compiler/neuronx-cc/
# api-reference-guide/index.html). So an int64 value is exact on trn2 when it stays below 2^31
# (downcast keeps it), or when --native-int64=enabled is in the flags and the value never enters an op
# without a native integer datapath. The rule checked on every graph:
# - a "wide" value is an int64 one that may reach 2^31: the product of two int64 tensors or of one and
#   a constant >= 2^16 (hash multipliers; positions x a ratio stay small), a left shift, a power, and
#   anything computed from a wide value -- except `& c` with 0 <= c < 2^31 and `%` (the divisors
#   here are ring sizes and bucket primes, all < 2^31), which bring it back below 2^31;
# - without --native-int64=enabled, every wide value is a problem (int32 arithmetic would wrap);
# - with it, a wide value feeding dot / matmul, a scatter (index_put, scatter, scatter_add, ...), a
#   collective or pow is a problem (those ops are downcast).
# Indices, positions, token ids, counters and compressed ids are int64 values below 2^31: allowed.
SMALL_MULTIPLIER = 1 << 16
_WIDE_MAKERS = {"mul", "lshift", "bitwise_left_shift", "__lshift__", "pow"}
_NO_INT_DATAPATH = {"mm", "bmm", "addmm", "matmul", "dot", "mv", "baddbmm", "index_put", "index_put_",
                    "_unsafe_index_put", "scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce",
                    "index_add", "index_add_", "index_copy", "index_copy_", "pow", "all_reduce", "all_reduce_",
                    "reduce_scatter_tensor", "all_gather_into_tensor"}
def _op_name(target) -> str:
    """'mul' for aten.mul.Tensor, 'all_reduce' for _c10d_functional.all_reduce.default."""
    name = getattr(target, "__name__", str(target))
    return name.split(".")[0]


def _val(node):
    return node.meta.get("val") if hasattr(node, "meta") else None


def _tensors(v):
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for x in v for t in _tensors(x)]
    return []


def dtype_problems(gm, native_int64: bool) -> list[str]:
    """The dtype rule above over a captured graph: a list of '<node> <reason>' (empty: ok)."""
    wide: set = set()
    bad = []
    for node in gm.graph.nodes:
        vals = _tensors(_val(node))
        for v in vals:
            if v.dtype in (torch.float64, torch.complex128):
                bad.append(f"{node.name}: {v.dtype}")
                break
        if node.op != "call_function":
            continue
        op = _op_name(node.target)
        args = [a for a in node.args] + list(node.kwargs.values())
        in_nodes = [a for a in _flat(args) if hasattr(a, "meta")]
        consts = [a for a in _flat(args) if isinstance(a, (int, float)) and not isinstance(a, bool)]
        is_int64 = any(v.dtype == torch.int64 for v in vals)
        if is_int64 and op in _WIDE_MAKERS:
            big_const = any(abs(c) >= SMALL_MULTIPLIER for c in consts)
            two_tensors = sum(1 for a in in_nodes if any(t.dim() for t in _tensors(_val(a)))) >= 2
            if op != "mul" or big_const or two_tensors:
                wide.add(node)
                if not native_int64:  # reported where it starts (what follows from it is the same value)
                    bad.append(f"{node.name}: int64 {op} may exceed 2^31 (downcast to int32 without "
                               "--native-int64=enabled)")
        if is_int64 and any(a in wide for a in in_nodes) and not _narrows(op, consts):
            wide.add(node)
        if native_int64 and op in _NO_INT_DATAPATH:
            # the data operand (not an index list) of an op without a native integer datapath
            data = [a for a in in_nodes if a in wide]
            if data:
                bad.append(f"{node.name}: wide int64 into {op} (no native integer datapath: downcast to int32)")
    return bad


def _narrows(op: str, consts) -> bool:
    if op in ("remainder", "fmod"):
        return True
    return op in ("bitwise_and", "__and__") and any(0 <= c < (1 << 31) for c in consts)


def _flat(x):
    if isinstance(x, (list, tuple)):
        return [y for e in x for y in _flat(e)]
    if isinstance(x, dict):
        return [y for e in x.values() for y in _flat(e)]
    return [x]
