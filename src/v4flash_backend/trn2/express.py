"""Calling a compiled static graph without dynamo's guards, once it has run through them.

A static graph of this package reads hundreds of tensors besides its arguments (~260 in a batch-1
plain round of the embedded model: weights, their dequantized caches, the state, the draft blocks,
RoPE tables), all resident: allocated before the graphs are traced and only ever written in place
(`static_runner.place_resident` runs before any warm-up). On every call dynamo still evaluates
~5,000 guards over them (tensor metadata, the weight dict's keys, duplicate inputs, module
constants) and gathers them again: ~1.2 ms of guard evaluation plus ~0.25 ms of input gathering per
call of that round, about a fifth of it (one-off profile; perf/bench_decode.py has the tokens/s).

`Express` records, while dynamo compiles a graph, which graph input is which argument of the traced
function and holds the others (the captured tensors) itself; after a call through dynamo that ran
the graph it learns where each leaf of the result comes from. Later calls build the flat input list
and call the compiled artifact directly, when

- the call's arguments match the learned call's: tensors in shape, stride, dtype, device and
  requires_grad, other values equal, the same arguments aliased (`_arg_key`);
- the global state dynamo guards that a server could change is the same (grad and inference mode,
  default dtype, deterministic algorithms, the ops seam's numerics and backend: `_global_state`);

and go through dynamo otherwise (which re-guards, and recompiles where it must). A graph whose trace
left Python side effects for dynamo to replay, reads a non-tensor input, an argument's attribute, or
whose result has a leaf that is no graph output (e.g. a view dynamo rebuilds), never takes the express
path. What it cannot see: a captured tensor replaced by another (a different object at the same
attribute) -- which is why those tensors must stay resident (NeuronSettings.guard_every_call keeps
dynamo's guards on every call, for code that swaps them).
"""

from __future__ import annotations

import inspect

import torch
import torch.utils._pytree as pytree

from v4flash_backend import ops


def _global_state() -> tuple:
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.get_default_dtype(),
            torch.are_deterministic_algorithms_enabled(), ops.get_numerics(), ops.get_backend())


def _arg_key(args: tuple) -> tuple:
    """What a call's arguments must match: per argument its tensor metadata (or value), and which
    earlier argument it is the same object as (dynamo folds one tensor passed twice into one input)."""
    ids = [id(a) for a in args]
    meta = tuple((a.shape, a.stride(), a.dtype, a.device, a.requires_grad) if isinstance(a, torch.Tensor)
                 else (type(a), a) for a in args)
    return meta, tuple(ids.index(i) for i in ids)


def _root(src):
    while getattr(src, "base", None) is not None:
        src = src.base
    return src


def trace_side_effects() -> bool | None:
    """Whether the graph dynamo is compiling left Python side effects for its code to replay after
    the graph: a mutated object that existed before the trace (objects the trace created count only
    where they escape, through such an object or the result, which `Express.learn` checks). None: not
    known -- the compile is not dynamo's, or its internals moved."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        from torch._dynamo.variables.base import AttributeMutationNew, ValueMutationNew

        se = InstructionTranslator.current_tx().output.side_effects
        new = (AttributeMutationNew, ValueMutationNew)
        return bool(se.tensor_hooks or se.save_for_backward or any(
            se.is_modified(v) and not isinstance(v.mutation_type, new) for v in se.id_to_variable.values()))
    except Exception:  # noqa: BLE001 -- an internal API: unknown means no express path
        return None


_CONSTANTS = (type(None), bool, int, float, str, torch.dtype, torch.device)


class Express:
    """The express call of one compiled graph (see the module docstring). `plan(gm, example_inputs,
    compiled)` inside the compile backend; `learn(args, result)` after each call through dynamo;
    `fits(args)` and `__call__(args)` before the next one."""

    def __init__(self, fn):
        sig = inspect.signature(fn)
        kinds = inspect.Parameter
        self.params = [p.name for p in sig.parameters.values()
                       if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
        self.varargs = next((p.name for p in sig.parameters.values() if p.kind == kinds.VAR_POSITIONAL), None)
        self.graph = None  # the compiled artifact (what dynamo's code calls)
        self.why_not = "not compiled yet"
        self.ready = False
        self.raw = None  # the compiled artifact's last outputs (for `learn`)

    # ---- while dynamo compiles -------------------------------------------------------------------
    def _arg_index(self, src) -> int | None:
        """The argument of the traced function a graph input is, None: a captured tensor; -1: an
        argument's attribute or item (not supported)."""
        root = _root(src)
        name = getattr(root, "local_name", None)
        is_arg = name is not None and getattr(root, "is_input", False) and (name in self.params or name == self.varargs)
        if not is_arg:
            return None
        if src is root and name in self.params:
            return self.params.index(name)
        if name == self.varargs and getattr(src, "base", None) is root and isinstance(getattr(src, "index", None), int):
            return len(self.params) + src.index
        return -1

    def plan(self, gm, example_inputs, compiled):
        """Map the graph's inputs; returns the callable to hand dynamo (it records the outputs)."""
        self.graph, self.ready = compiled, False
        self.flat, self.arg_slots, self.why_not = [], [], None
        if trace_side_effects() is not False:
            self.why_not = "the trace has Python side effects (or they are unknown)"
        for k, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
            ex = example_inputs[k]
            grapharg = node.meta.get("grapharg")
            src = getattr(grapharg, "source", None)
            if not isinstance(ex, torch.Tensor) or src is None:
                self.why_not = self.why_not or f"graph input {k} is not a tensor with a source"
                break
            i = self._arg_index(src)
            if i == -1:
                self.why_not = self.why_not or f"graph input {k} is part of an argument ({src.name})"
                break
            self.flat.append(ex if i is None else None)
            if i is not None:
                self.arg_slots.append((k, i))

        def run(*flat):
            raw = compiled(*flat)
            if self.graph is compiled:  # (not an older graph dynamo keeps for other arguments)
                self.raw = raw
            return raw

        return run

    def learn(self, args: tuple, result) -> None:
        """After a call through dynamo that ran this graph (its guards passed for `args`): where each
        leaf of `result` comes from, and the arguments and global state later calls must match."""
        raw, self.raw = self.raw, None
        if self.why_not is not None or raw is None:
            return
        self.ready = False
        leaves, self.spec = pytree.tree_flatten(result)
        outs = {id(t): k for k, t in enumerate(raw) if isinstance(t, torch.Tensor)}
        self.take = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                if id(leaf) not in outs:
                    self.why_not = "a result leaf is not a graph output"
                    return
                self.take.append(outs[id(leaf)])
            elif isinstance(leaf, _CONSTANTS):  # a constant of the trace (dynamo guarded its inputs)
                self.take.append(("const", leaf))
            else:  # an object dynamo builds anew on each call
                self.why_not = f"a result leaf is a {type(leaf).__name__}"
                return
        self.key, self.state, self.ready = _arg_key(args), _global_state(), True

    # ---- afterwards ----------------------------------------------------------------------------------
    def fits(self, args: tuple) -> bool:
        return self.ready and _arg_key(args) == self.key and _global_state() == self.state

    def __call__(self, args: tuple):
        flat = list(self.flat)
        for k, i in self.arg_slots:
            flat[k] = args[i]
        raw = self.graph(*flat)
        return pytree.tree_unflatten([t[1] if isinstance(t, tuple) else raw[t] for t in self.take], self.spec)
