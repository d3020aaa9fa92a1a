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

The same plan, written down (`record`: each captured tensor by its portable path, `trn2.binding`,
the result's structure, the inputs' and outputs' specs, the global state), lets another process
call the graph's artifact with no dynamo at all (`bind`: a rank starting from compiled artifacts).
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
        self.rec = self.unbound = self.bound_rec = None  # the plan written down (`record`), or why not; `bind`'s

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

    def plan(self, gm, example_inputs, compiled, portable: bool = False):
        """Map the graph's inputs; returns the callable to hand dynamo (it records the outputs).
        portable: also write the plan down for another process (`record`)."""
        self.graph, self.ready = compiled, False
        self.flat, self.arg_slots, self.why_not = [], [], None
        self.rec, self.unbound, self.bound_rec = None, None, None
        sources = []
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
            else:
                sources.append((k, src))
        if portable and self.why_not is None:
            self._write_plan(gm, example_inputs, sources)

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
        if self.rec is not None:
            self.rec.update(take=[t if isinstance(t, int) else _const(t[1]) for t in self.take],
                            spec=pytree.treespec_dumps(self.spec), state=_state_json(self.state),
                            aliases=list(self.key[1]))

    # ---- written down for another process --------------------------------------------------------------
    def _write_plan(self, gm, example_inputs, sources) -> None:
        from .binding import Unbindable, portable_paths

        try:
            from torch._dynamo.symbolic_convert import InstructionTranslator

            tx = InstructionTranslator.current_tx().output.root_tx
            paths = portable_paths([s for _, s in sources], {"L": tx.f_locals, "G": tx.f_globals})
        except Unbindable as e:
            self.unbound = str(e)
            return
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        outs = out if isinstance(out, (tuple, list)) else (out,)
        vals = [a.meta.get("example_value", a.meta.get("val")) if isinstance(a, torch.fx.Node) else None
                for a in outs]
        self.rec = {"captured": [[k, p] for (k, _), p in zip(sources, paths)],
                    "args": [list(s) for s in self.arg_slots],
                    "inputs": [_spec(t) for t in example_inputs],
                    "outputs": [_spec(v) if isinstance(v, torch.Tensor) else None for v in vals],
                    "out_tuple": isinstance(out, (tuple, list))}

    def record(self) -> dict | None:
        """The plan of the last compiled graph as JSON (None: it has none: side effects, an input with
        no portable path, or no call through dynamo yet)."""
        return self.rec if self.ready and self.rec is not None and "take" in self.rec else None

    def bind(self, rec: dict, scope: dict, graph) -> None:
        """Make this the express call of `graph` (an artifact's callable) as `rec` (`record` of the
        process that compiled it) says, each captured tensor resolved on the live objects of `scope`
        ({"L": the traced function's closure variables, "G": its globals}) and checked against its
        recorded spec. The first call's arguments are checked the same way (`fits`). Raises
        LookupError naming the input that cannot be bound."""
        from .binding import resolve, show

        flat = [None] * len(rec["inputs"])
        for k, path in rec["captured"]:
            t = resolve(path, scope)
            if not isinstance(t, torch.Tensor) or _spec(t) != rec["inputs"][k]:
                got = _spec(t) if isinstance(t, torch.Tensor) else type(t).__name__
                raise LookupError(f"graph input {k} ({show(path)}) is {got}, compiled for {rec['inputs'][k]}")
            flat[k] = t
        self.graph, self.flat, self.arg_slots = graph, flat, [tuple(s) for s in rec["args"]]
        self.take = [t if isinstance(t, int) else ("const", _unconst(t)) for t in rec["take"]]
        self.spec = pytree.treespec_loads(rec["spec"])
        self.bound_rec, self.key, self.why_not, self.ready = rec, None, None, True

    def _first_fit(self, args: tuple) -> bool:
        """The first call of a bound graph: its arguments and the global state as recorded."""
        rec = self.bound_rec
        if _state_json(_global_state()) != rec["state"] or len(args) < 1 + max((i for _, i in self.arg_slots),
                                                                                default=-1):
            return False
        for k, i in self.arg_slots:
            a = args[i]
            if not isinstance(a, torch.Tensor) or a.requires_grad or _spec(a) != rec["inputs"][k]:
                return False
        key = _arg_key(args)
        if list(key[1]) != rec["aliases"]:
            return False
        self.key, self.state, self.bound_rec = key, _global_state(), None
        return True

    # ---- afterwards ----------------------------------------------------------------------------------
    def fits(self, args: tuple) -> bool:
        if self.ready and self.key is None and getattr(self, "bound_rec", None) is not None:
            return self._first_fit(args)
        return self.ready and _arg_key(args) == self.key and _global_state() == self.state

    def __call__(self, args: tuple):
        flat = list(self.flat)
        for k, i in self.arg_slots:
            flat[k] = args[i]
        raw = self.graph(*flat)
        return pytree.tree_unflatten([t[1] if isinstance(t, tuple) else raw[t] for t in self.take], self.spec)


def _spec(t: torch.Tensor) -> list:
    """What a bound input must be: shape, stride, dtype and device type (a rank's core is its device 0)."""
    return [list(t.shape), list(t.stride()), str(t.dtype).removeprefix("torch."), t.device.type]


def _state_json(state: tuple) -> list:
    return [str(x) if isinstance(x, torch.dtype) else x for x in state]


def _const(v) -> list:
    if isinstance(v, torch.dtype):
        return ["dtype", str(v).removeprefix("torch.")]
    if isinstance(v, torch.device):
        return ["device", str(v)]
    return ["value", v]


def _unconst(c: list):
    kind, v = c
    return getattr(torch, v) if kind == "dtype" else torch.device(v) if kind == "device" else v
