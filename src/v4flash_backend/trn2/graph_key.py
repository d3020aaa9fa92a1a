"""The graph key: what identifies one compiled graph, computed one way, here, for every user --
`trn2-check` (its traced graphs, two ranks compared: `rank_agnostic`), the compile command
(`group.aot`: one artifact per distinct key) and the server (`trn2.compiler.compile_step`: a graph
is loaded by its key from the artifacts' manifest, or refused).

A key hashes what the compiled program depends on, and nothing a rank or a process names
differently:
- the graph's nodes in order: op kind, target (an aten / custom op by its qualified name, a Python
  function by module and name, a method by name), the arguments with every node reference replaced by
  its position, literals (ints, floats, dtypes, devices, slices, strings) as they are;
- each node's value (shape, dtype, device) where the tracer recorded one;
- the inputs' shapes, strides, dtypes and devices;
- constants the graph holds (get_attr tensors): shape, dtype, device, and the values where they are
  known (a real tensor; a fake tensor's recorded constant), because a compiled program bakes them in;
- the compiler flags (neuronx-cc's, and the backend's name).
Placeholder and node names are not hashed (dynamo names an input after the Python name it came
from: the expert weights of rank r carry r's expert ids in their names, not in the program). A
process-group name in a collective's arguments is replaced by the group's role (`roles`: {name:
'world' | 'stage' | 'attn' | ...}): ranks of different attention groups run one program whose
replica groups are the same partition of the world, as a NEFF's are.
"""

from __future__ import annotations

import hashlib
import math

import torch

KEY_VERSION = 1  # bump when what is hashed changes: old manifests then miss every key (refused, by name)


def graph_key(gm, example_inputs=(), flags=(), roles: dict | None = None) -> str:
    """The key of FX graph `gm` called with `example_inputs` and compiled with `flags`."""
    return hashlib.sha256(canonical(gm, example_inputs, flags, roles).encode()).hexdigest()[:32]


def key_flags(ns) -> tuple[str, ...]:
    """The compiler flags a key carries for `ns` (a `trn2.launch.NeuronSettings`): the backend, and
    neuronx-cc's flags (NEURON_CC_FLAGS) on the Neuron backends."""
    return (f"backend={ns.backend}",) + (tuple(ns.compiler_args) if ns.backend.startswith("neuron") else ())


def keys_digest(keys) -> str:
    """One hash of a set of graph keys (sorted: independent of the order the graphs were traced)."""
    return hashlib.sha256("\n".join(sorted(keys)).encode()).hexdigest()[:16]


def canonical(gm, example_inputs=(), flags=(), roles: dict | None = None) -> str:
    """The text the key hashes (also what two ranks' graphs are compared by when they differ)."""
    roles = roles or {}
    index: dict = {}
    lines = [f"v{KEY_VERSION}", "flags " + " ".join(map(str, flags))]
    lines += [f"in{i} {_spec(t)}" for i, t in enumerate(example_inputs)]
    for i, node in enumerate(gm.graph.nodes):
        index[node] = i
        if node.op == "placeholder":
            what = "placeholder"
        elif node.op == "get_attr":
            what = "get_attr " + _attr(gm, node.target)
        else:  # only a collective's string arguments can name a process group
            r = roles if "c10d_functional" in str(node.target) else {}
            what = f"{node.op} {_target(node)} {_arg(node.args, index, r)} {_arg(node.kwargs, index, r)}"
        val = node.meta.get("val", node.meta.get("example_value"))
        lines.append(f"{i} {what} -> {_val(val)}")
    return "\n".join(lines)


def first_difference(a: str, b: str) -> str:
    """The first line where two canonical texts differ (for a message naming what made two ranks'
    graphs differ), or ''."""
    for x, y in zip(a.splitlines(), b.splitlines()):
        if x != y:
            return f"{x[:200]!r} != {y[:200]!r}"
    na, nb = len(a.splitlines()), len(b.splitlines())
    return "" if na == nb else f"{na} != {nb} lines"


def _target(node) -> str:
    t = node.target
    if node.op == "call_method":
        return f".{t}"
    if node.op == "call_module":
        return f"module {type(node.graph.owning_module.get_submodule(t)).__qualname__}"
    if isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(t)
    return f"{getattr(t, '__module__', '') or ''}.{getattr(t, '__qualname__', getattr(t, '__name__', repr(t)))}"


def _arg(a, index: dict, roles: dict) -> str:
    if isinstance(a, torch.fx.Node):
        return f"%{index[a]}"
    if isinstance(a, (list, tuple)):
        inner = ",".join(_arg(x, index, roles) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner})"
    if isinstance(a, dict):
        return "{" + ",".join(f"{k}:{_arg(v, index, roles)}" for k, v in a.items()) + "}"
    if isinstance(a, str):
        return f"@{roles[a]}" if a in roles else repr(a)
    if isinstance(a, float):
        return "nan" if math.isnan(a) else repr(a)
    if isinstance(a, slice):
        return f"slice({_arg(a.start, index, roles)},{_arg(a.stop, index, roles)},{_arg(a.step, index, roles)})"
    if isinstance(a, torch.Tensor):
        return "tensor " + _tensor(a)
    if isinstance(a, (int, bool, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return repr(a)
    return type(a).__qualname__  # an object the graph holds by reference: its type, not its address


def _spec(t) -> str:
    if not isinstance(t, torch.Tensor):
        return repr(t) if isinstance(t, (int, float, bool, type(None))) else type(t).__qualname__
    return f"{tuple(t.shape)} {tuple(t.stride())} {t.dtype} {t.device}"


def _val(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"{tuple(v.shape)} {v.dtype} {v.device}"
    if isinstance(v, (list, tuple)):
        return "(" + ",".join(_val(x) for x in v) + ")"
    return "" if v is None else type(v).__qualname__


def _tensor(t: torch.Tensor) -> str:
    """A constant tensor: its spec, and its values where they are known."""
    from torch._subclasses.fake_tensor import FakeTensor

    spec = f"{tuple(t.shape)} {t.dtype} {t.device}"
    if isinstance(t, FakeTensor):
        t = getattr(t, "constant", None)
        if t is None:
            return spec
    if t.device.type == "meta":
        return spec
    data = t.detach().cpu().contiguous()
    if data.dtype.is_floating_point or data.dtype.is_complex:
        data = data.view(torch.uint8) if data.dim() else data.reshape(1).view(torch.uint8)
    return spec + " = " + hashlib.sha256(data.numpy().tobytes()).hexdigest()[:16]


def _attr(gm, target: str) -> str:
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return _tensor(obj) if isinstance(obj, torch.Tensor) else type(obj).__qualname__
