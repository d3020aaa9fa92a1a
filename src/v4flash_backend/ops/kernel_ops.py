"""The NKI kernels as PyTorch custom ops: one op per kernel in the namespace `v4flash`
(`torch.ops.v4flash.<name>`), each with a fake (shape / dtype) implementation, so that a graph
captured by `torch.compile(fullgraph=True)` holds every kernel call as one node (the target an
OpOverload whose `namespace` is "v4flash"; `kernel_nodes` counts them) instead of breaking on the
simulator's NumPy work.

The ops take what the kernels take: the host-side reshapes, dtype promotions and byte views stay in
`nki_ops` (traceable torch code around the node). Non-tensor kernel arguments are schema scalars.

Two registration routes, one per process (the first NKI backend used decides; `ensure`):
- 'sim' (ops backend `nki-sim`): `torch.library.custom_op`; the implementation runs the kernel in
  the CPU simulator exactly as a direct launch does (tensors -> NumPy -> kernel -> torch), so the
  results are bit-identical to it. A torch function mode (the host-sync counter, the boundary spy)
  sees the op call, not the simulator's conversions inside it.
- 'nki' (ops backend `nki`, trn2): TorchNeuron's documented route, `torch_neuronx.nki_op`, whose
  body calls the `@nki.jit` kernel on Neuron tensors with the LNC as the launch grid
  (`kernel[lnc](...)`); inside `torch.compile(backend="neuron")` the op is one node of the graph.
  Docs read (Neuron SDK 2.33+, torch-neuronx 2.14):
  https://awsdocs-neuron.readthedocs-hosted.com/en/latest/torch/guides/how-to-work-with-nki.html
  https://awsdocs-neuron.readthedocs-hosted.com/en/latest/torch/get-started/quickstart-nki-kernel.html
  https://awsdocs-neuron.readthedocs-hosted.com/en/v2.31.0/nki/api/generated/nki.jit.html (LNC grid)
  Neuron packages are imported on this route only.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from v4flash_backend import ops as _ops_api

NAMESPACE = "v4flash"
_GRID_ENV = "V4FLASH_NKI_GRID"
DEVICE = "neuron"
# inputs a kernel call had to copy to the device (by kernel); a resident serving path keeps it 0
device_copies: dict[str, int] = {}

_route: str | None = None  # the route the ops of this process are registered for


def _grid(device: bool) -> int:
    if os.environ.get(_GRID_ENV):
        return int(os.environ[_GRID_ENV])
    # the grid must equal the LNC degree: 2 on a trn2 rank, 1 in the simulator unless told
    return int(os.environ.get("NEURON_LOGICAL_NC_CONFIG", "2" if device else "1"))


def device_args(tensors, kernel_name: str = "", device_type: str = DEVICE):
    """The kernel's arguments on the device: a tensor already there is passed as it is (weights and
    caches are placed on the device at load, activations are produced there); any other is copied,
    counted in `device_copies`, and refused when V4FLASH_NKI_STRICT=1 (the served path sets it: a
    weight or cache left on the host would be copied on every call, the pattern this backend avoids)."""
    out = []
    for t in tensors:
        if t.device.type == device_type:
            out.append(t)
            continue
        if os.environ.get("V4FLASH_NKI_STRICT") == "1":
            raise RuntimeError(f"{kernel_name}: a {tuple(t.shape)} {t.dtype} input on {t.device}, not on the "
                               f"{device_type} device (place weights and caches at load)")
        device_copies[kernel_name] = device_copies.get(kernel_name, 0) + 1
        out.append(t.to(device_type))
    return out


def _kernel(module: str, name: str):
    from v4flash_backend import kernels  # first use installs the simulator when the Neuron nki is absent

    return getattr(getattr(kernels, module), name)


def _sim_launch(kernel, tensors, static):
    from nki_sim._torch_bridge import numpy_to_torch, torch_to_numpy
    from v4flash_backend.kernels import _nki

    arrays = [torch_to_numpy(t) for t in tensors]
    if _nki.USING_SIMULATOR:
        res = kernel[_grid(False)](*arrays, **static)
    else:  # the Neuron package's own CPU simulator runs the same kernel source
        import nki

        res = nki.simulate(kernel[_grid(False)])(*arrays, **static)
    if isinstance(res, (tuple, list)):
        return tuple(numpy_to_torch(r) for r in res)
    return numpy_to_torch(res)


def _device_launch(kernel, tensors, static):
    name = getattr(kernel, "__name__", str(kernel))
    dev = device_args(tensors, name)
    res = kernel[_grid(True)](*[t.contiguous() for t in dev], **static)
    return tuple(res) if isinstance(res, (tuple, list)) else res  # results stay on the device


def _run(module: str, name: str, *tensors, **static):
    """The body of every op: launch kernels.<module>.<name> on the route the ops are registered for."""
    kernel = _kernel(module, name)
    if _route == "nki":
        return _device_launch(kernel, tensors, static)
    return _sim_launch(kernel, tensors, static)


# ---- the ops: the kernels' signatures (the schema is inferred from the annotations) -----------------
def linear_fp8(x: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
    return _run("linear", "linear_fp8_kernel", x, weight, scale)


def linear_fp4(x: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
    return _run("linear", "linear_fp4_kernel", x, weight, scale)


def linear_fp4_routed(x: Tensor, weight: Tensor, scale: Tensor, experts: Tensor) -> Tensor:
    return _run("linear", "linear_fp4_routed_kernel", x, weight, scale, experts)


def linear_bf16(x: Tensor, weight: Tensor) -> Tensor:
    return _run("linear", "linear_bf16_kernel", x, weight)


def linear_bf16_grouped(x: Tensor, weight: Tensor) -> Tensor:
    return _run("linear", "linear_bf16_grouped_kernel", x, weight)


def linear_f32(x: Tensor, weight: Tensor) -> Tensor:
    return _run("linear", "linear_f32_kernel", x, weight)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return _run("rms_norm", "rms_norm_kernel", x, weight, eps=eps)


def swiglu(gate: Tensor, up: Tensor, limit: float) -> Tensor:
    return _run("swiglu", "swiglu_kernel", gate, up, limit=limit)


def swiglu_weighted(gate: Tensor, up: Tensor, weight: Tensor, limit: float) -> Tensor:
    return _run("swiglu", "swiglu_weighted_kernel", gate, up, weight, limit=limit)


def engram_gate(h: Tensor, key: Tensor, value: Tensor, qk_weight: Tensor, eps: float) -> Tensor:
    return _run("engram", "engram_gate_kernel", h, key, value, qk_weight, eps=eps)


def sparse_attn(q: Tensor, kv: Tensor, sink: Tensor, idxs: Tensor, scale: float) -> Tensor:
    return _run("sparse_attn", "sparse_attn_kernel", q, kv, sink, idxs, scale=scale)


def indexer_scores(q: Tensor, k: Tensor, w: Tensor) -> Tensor:
    return _run("indexer", "indexer_scores_kernel", q, k, w)


def softmax_pool(kv: Tensor, score: Tensor) -> Tensor:
    return _run("softmax_pool", "softmax_pool_kernel", kv, score)


def hc_mixes(x: Tensor, fn: Tensor, scale: Tensor, base: Tensor, hc: int, iters: int, hc_eps: float,
             norm_eps: float) -> tuple[Tensor, Tensor, Tensor]:
    return _run("hc", "hc_mixes_kernel", x, fn, scale, base, hc=hc, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps)


def hc_expand(x: Tensor, hc: int) -> Tensor:
    return _run("hc", "hc_expand_kernel", x, hc=hc)


def hc_collapse(x: Tensor, mix: Tensor) -> Tensor:
    return _run("hc", "hc_collapse_kernel", x, mix)


def hc_post(f: Tensor, residual: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    return _run("hc", "hc_post_kernel", f, residual, post, comb)


# ---- fake implementations: the shapes and dtypes the kernels allocate (their `nl.ndarray` outputs) --
BF16, F32 = torch.bfloat16, torch.float32


def _out(like: Tensor, shape, dtype):
    return like.new_empty(tuple(shape), dtype=dtype)


FAKES = {
    "linear_fp8": lambda x, weight, scale: _out(x, (x.shape[0], weight.shape[0]), BF16),
    "linear_fp4": lambda x, weight, scale: _out(x, (x.shape[0], weight.shape[0]), BF16),
    "linear_fp4_routed": lambda x, weight, scale, experts: _out(x, (x.shape[0], x.shape[1], weight.shape[1]), BF16),
    "linear_bf16": lambda x, weight: _out(x, (x.shape[0], weight.shape[0]), BF16),
    "linear_bf16_grouped": lambda x, weight: _out(x, (x.shape[0], weight.shape[0], weight.shape[1]), BF16),
    "linear_f32": lambda x, weight: _out(x, (x.shape[0], weight.shape[0]), F32),
    "rms_norm": lambda x, weight, eps: _out(x, x.shape, x.dtype),
    "swiglu": lambda gate, up, limit: _out(gate, gate.shape, BF16),
    "swiglu_weighted": lambda gate, up, weight, limit: _out(gate, gate.shape, BF16),
    "engram_gate": lambda h, key, value, qk_weight, eps: _out(h, h.shape, h.dtype),
    "sparse_attn": lambda q, kv, sink, idxs, scale: _out(q, q.shape, BF16),
    "indexer_scores": lambda q, k, w: _out(q, (q.shape[0], q.shape[1], k.shape[1]), BF16),
    "softmax_pool": lambda kv, score: _out(kv, (kv.shape[0], kv.shape[2]), F32),
    "hc_mixes": lambda x, fn, scale, base, hc, iters, hc_eps, norm_eps: (
        _out(x, (x.shape[0], hc), F32), _out(x, (x.shape[0], hc), F32), _out(x, (x.shape[0], hc * hc), F32)),
    "hc_expand": lambda x, hc: _out(x, (x.shape[0], hc, x.shape[1]), x.dtype),
    "hc_collapse": lambda x, mix: _out(x, (x.shape[0], x.shape[2]), x.dtype),
    "hc_post": lambda f, residual, post, comb: _out(f, residual.shape, f.dtype),
}
OPS = {name: globals()[name] for name in FAKES}  # op name -> its (annotated) implementation


# ---- registration ------------------------------------------------------------------------------------
def _definer(route: str):
    if route == "sim":
        return torch.library.custom_op
    try:
        from torch_neuronx import nki_op  # the documented route (see the module docstring)
    except ImportError as e:
        raise RuntimeError("the 'nki' ops backend runs on Trainium and needs torch-neuronx (>= 2.14, with "
                           "nki_op) and nki (requirements-neuron.txt); use 'nki-sim' on CPU") from e
    return nki_op


def ensure(backend: str | None = None) -> None:
    """Register the `v4flash` ops for the route of `backend` (default: the active ops backend), once per
    process; a process cannot switch routes (an op is defined once)."""
    global _route
    route = "nki" if (backend or _ops_api.get_backend()) == "nki" else "sim"
    if route == _route:
        return
    definer = _definer(route)  # first: without torch-neuronx the nki route fails with its own message
    if _route is not None:
        raise RuntimeError(f"the {NAMESPACE} kernel ops are registered for the '{_route}' route in this process; "
                           f"the '{route}' route needs a fresh process")
    _register(definer)
    _route = route


def _register(definer, namespace: str = NAMESPACE) -> list[str]:
    """Define every op through the route's definer, and register our fake (shape) implementation only
    where the definer registered none: a route that brings its own (torch-neuronx's `nki_op` may infer
    one from the kernel) keeps it, and registering a second one would raise (a Library op) or silently
    replace it (a custom_op). Returns the ops whose fake is ours."""
    ours = []
    for name, fn in OPS.items():
        qualname = f"{namespace}::{name}"
        definer(qualname, mutates_args=())(fn)
        if not has_fake(qualname):
            torch.library.register_fake(qualname, FAKES[name])
            ours.append(name)
    return ours


def has_fake(qualname: str) -> bool:
    """Whether op `qualname` has a fake implementation, asked of torch.library: an op defined by
    `torch.library.custom_op` (a CustomOpDef) carries one once `register_fake` ran on it; an op defined
    through a `torch.library.Library` has one in the op registry's fake-impl holder."""
    opdef = torch.library._maybe_get_opdef(qualname)
    if opdef is not None:
        return opdef._abstract_fn is not None
    from torch._library.simple_registry import singleton

    return singleton.find(qualname).fake_impl.kernel is not None


def op(name: str) -> torch._ops.OpOverload:
    """The op's default overload (an OpOverload carries `namespace`; graph nodes target it)."""
    return getattr(getattr(torch.ops, NAMESPACE), name).default


def kernel_op_name(target) -> str | None:
    """The op name when `target` (a called function, an FX node target) is one of these ops (an
    OpOverload or OpOverloadPacket of `v4flash`), else None: the one test the host-sync counter, the
    graph counts and trn2-check share."""
    if isinstance(target, torch._ops.OpOverload) and target.namespace == NAMESPACE:
        return target._schema.name.split("::")[1]
    if isinstance(target, torch._ops.OpOverloadPacket) and target._qualified_op_name.startswith(NAMESPACE + "::"):
        return target._qualified_op_name.split("::")[1]
    return None


def is_kernel_target(target) -> bool:
    return kernel_op_name(target) is not None


def kernel_nodes(gm) -> dict[str, int]:
    """{op name: count} of the kernel op nodes of a captured FX graph."""
    found: dict[str, int] = {}
    for node in gm.graph.nodes:
        name = kernel_op_name(node.target) if node.op == "call_function" else None
        if name is not None:
            found[name] = found.get(name, 0) + 1
    return found
