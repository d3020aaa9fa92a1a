"""The Neuron compile path of the static graphs: `compile_step` is torch.compile(fullgraph=True,
dynamic=False) through a checking backend that rejects a graph with a host sync left in it
(`static_step.graph_host_syncs`) and then hands the graph to the Neuron backend (`neuron` =
torch-neuronx / TorchNeuron, or `neuron_libtorch` = libtorch-neuronx-lite, which takes the flags as
`compiler_args`). Every Neuron-only import happens inside `import_neuron()`; with `backend="none"` or
`"eager"` (what the CPU tests use) nothing Neuron is loaded.

With compiled artifacts (`trn2.artifacts.ArtifactSource`: the server's `compiled_artifacts`, or the
compile command's capture) a traced graph is first keyed (`trn2.graph_key`) and loaded by its key
instead of compiled. Under `compile_only()` a compiled graph's call returns empty outputs of its
shapes without running it: a rank's warm-up compiles or loads every graph that way, meets the other
ranks, and only then runs them (`trn2.startup`), so no collective waits on another rank's compile.
Where the artifacts also hold each graph's binding (`trn2.binding`: where each input comes from, the
result's structure), a graph is not traced at all: its first call binds the artifact by the graph's
name (entry point and bucket) on this process's objects and calls it directly (`trn2.express`).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass, field

import torch
import torch._dynamo

from v4flash_backend import ops

from .express import Express
from .launch import NeuronSettings
from .static_step import graph_host_syncs

COMPILER_ARGS = NeuronSettings().compiler_args  # the default neuronx-cc flags (trn2.launch builds them)
# Every bucket's graph of one entry point is a dynamo cache entry of one code object (the function
# closing over the bucket: StaticGraphs' round and verify functions), and dynamo stops at
# recompile_limit entries per code object (8 in torch 2.13): the 9th bucket's compile failed
# (fullgraph: FailOnRecompileLimitHit) -- 12 decode buckets by default. The served graphs' count is
# bounded by the buckets (trn2.graphs.startup_graphs), far below this.
RECOMPILE_LIMIT = 1024
NEURON_BACKENDS = {"neuron": "torch_neuronx", "neuron_libtorch": "libtorch_neuronx_lite"}


class HostSyncInGraph(RuntimeError):
    """A graph of the static step still reads device values on the host."""


def import_neuron(s: NeuronSettings):
    """Import the package that registers `s.backend` with torch.compile (Neuron images only)."""
    mod = NEURON_BACKENDS.get(s.backend)
    if mod is None:
        return None
    import importlib

    try:
        return importlib.import_module(mod)
    except ImportError as e:
        raise RuntimeError(f"torch.compile backend {s.backend!r} needs {mod} from the Neuron pip repository "
                           "(see requirements-neuron.txt and docker/Dockerfile.neuron)") from e


@dataclass
class CompileStats:
    graphs: int = 0  # graphs handed to the backend (one per bucket and entry point)
    seconds: float = 0.0
    collectives: list = field(default_factory=list)  # per compiled graph: {op: count} of traced collectives
    input_dtypes: set = field(default_factory=set)  # dtypes of the compiled graphs' tensor inputs
    express_calls: int = 0  # calls that went to a compiled graph without dynamo's guards (trn2.express)
    names: list = field(default_factory=list)  # graphs handed to the backend or loaded, by name


_PHASE = threading.local()


@contextlib.contextmanager
def compile_only():
    """Calls of compiled graphs in this thread compile (or load) them and return empty outputs of the
    graphs' shapes instead of running them: no device work, no collective (trn2.startup's first phase)."""
    _PHASE.compile_only = True
    try:
        yield
    finally:
        _PHASE.compile_only = False


def _check_cc_flags(s: NeuronSettings) -> None:
    """Backend neuron takes no compiler_args: neuronx-cc gets its flags from NEURON_CC_FLAGS only, which
    group.rank_entry sets. Compiling without them would drop --lnc / --auto-cast=none / the fp8 flag, so
    every flag of `s` must be there (flags added by others may be too) and no other LNC degree."""
    import shlex

    from v4flash_backend.settings_values import flag_lnc

    have = os.environ.get("NEURON_CC_FLAGS", "")
    missing = [a for a in s.compiler_args if a not in shlex.split(have)]
    if missing or flag_lnc(have) != s.lnc:
        raise RuntimeError(f"NEURON_CC_FLAGS {have!r} lacks {missing} or names another LNC than {s.lnc}: start "
                           "the rank through group.rank_entry (or trn2.launch.apply_env before torch loads)")


# g++'s optimisation level for inductor's C++ (the graph's kernels and its C++ wrapper, one file;
# inductor's own is -O3). Read at each compile; $V4FLASH_CXX_OPT sets it.
CXX_OPT = os.environ.get("V4FLASH_CXX_OPT", "O3")


@contextlib.contextmanager
def _cxx_opt(level: str):
    """Inductor's C++ compiled at `level` instead of -O3 (its command line, hence its cache key, says
    so). torch 2.13 builds the flags in cpp_builder._get_optimization_cflags, in the compiling
    thread; a torch without it is refused here rather than compiled at another level unseen."""
    if level == "O3":
        yield
        return
    from torch._inductor import cpp_builder

    inner = cpp_builder._get_optimization_cflags

    def flags(*args, **kwargs):
        cflags, ldflags = inner(*args, **kwargs)
        return [level if f == "O3" else f for f in cflags], ldflags

    cpp_builder._get_optimization_cflags = flags
    try:
        yield
    finally:
        cpp_builder._get_optimization_cflags = inner


def _inductor_config():
    """How `graph_backend inductor` compiles. emulate_precision_casts: eager's rounding between fused
    ops (a bf16 or fp8 result rounded before the next op reads it); without it the compiled rounds'
    greedy tokens drifted from the eager path's (perf/bench_decode.py: same_tokens=no; with it, yes).
    cpp_wrapper: the graph's driver in C++ too, not a Python function calling ~800 kernels and BLAS
    calls one by one (a batch-1 plain decode round of the embedded model: ~8.2 -> ~6.8 ms a call in a
    one-off profile; perf/bench_decode.py has the tokens/s)."""
    from torch._inductor import config

    stack = contextlib.ExitStack()  # (entered here: a new one for each compile)
    stack.enter_context(config.patch(emulate_precision_casts=True, cpp_wrapper=True))
    stack.enter_context(_cxx_opt(CXX_OPT))
    return stack


def compile_step(fn, s: NeuronSettings, stats: CompileStats | None = None, lock=None, name: str = "",
                 artifacts=None):
    """torch.compile(fn) as one graph for the Neuron backend of `s`, refusing host syncs. lock: held
    while the compiled graph runs (not while it compiles): a graph compiled in the background
    (trn2.warmup) runs its padding rounds between the serving thread's eager steps, which hold it --
    a compiled graph may write a state tensor whole (a functionalized scatter copied back), which
    must not interleave with an eager step writing other slots of it. name: the graph's name (in
    messages, the compile command's manifest). artifacts: a `trn2.artifacts.ArtifactSource` (load the
    graph by its key; or the compile command's capture)."""
    ops.backend_module()  # resolve the ops backend now: the graph must not trace an import
    if s.backend == "none":  # no compilation: the static step runs op by op (CPU tests, projection)
        return fn
    import_neuron(s)
    if s.backend == "neuron":
        _check_cc_flags(s)
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, RECOMPILE_LIMIT)
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, RECOMPILE_LIMIT)
    inner = torch._dynamo.lookup_backend(s.backend)
    kwargs = {"options": {"compiler_args": list(s.compiler_args)}} if s.backend == "neuron_libtorch" else {}
    backend_config = _inductor_config if s.backend == "inductor" else contextlib.nullcontext
    stats = stats if stats is not None else CompileStats()

    def checked(gm, example_inputs):
        syncs = graph_host_syncs(gm)
        if syncs:
            raise HostSyncInGraph(f"host syncs in a static graph: {syncs}")
        from v4flash_backend.parallel.collectives import graph_collectives

        traced["collectives"] = graph_collectives(gm)
        stats.input_dtypes |= {t.dtype for t in example_inputs if isinstance(t, torch.Tensor)}
        stats.collectives.append(traced["collectives"])
        stats.names.append(name)

        def compile_now():
            t0 = time.perf_counter()
            with backend_config():
                out = inner(gm, example_inputs, **kwargs)
            stats.graphs += 1
            stats.seconds += time.perf_counter() - t0
            return out

        if artifacts is None:
            out = compile_now()
        else:
            from .graph_key import graph_key, key_flags

            key = graph_key(gm, example_inputs, key_flags(s), artifacts.roles)
            out = artifacts.resolve(name, key, compile_now, gm=gm, example_inputs=example_inputs)
        if lock is not None:
            out = _holding(lock, out)
        out = _gated(out, gm)
        return out if express is None else express.plan(gm, example_inputs, out, portable=recording)

    traced: dict = {}
    compiled = torch.compile(fn, backend=checked, fullgraph=True, dynamic=False)
    express = None if s.guard_every_call else Express(fn)
    # with artifacts that hold where each graph input comes from (trn2.binding): the first call binds the
    # graph's artifact on this process's objects and calls it without dynamo (no trace, no guards)
    recording = express is not None and hasattr(artifacts, "record")
    loading = [express is not None and hasattr(artifacts, "bind")]

    def wrap(graph, rec):
        graph = _gated_specs(graph, rec["outputs"], rec["out_tuple"])
        return graph if lock is None else _holding(lock, graph)

    def run(*args):
        if loading[0]:
            loading[0] = False
            rec = artifacts.bind(name, fn, express, wrap)
            if rec is not None:
                traced["collectives"] = rec.get("collectives") or {}
                stats.names.append(name)
        if express is not None and express.fits(args):
            stats.express_calls += 1
            return express(args)
        out = compiled(*args)
        if express is not None:
            express.learn(args, out)
            if recording and express.record() is not None:
                artifacts.record(name, dict(express.record(), collectives=traced.get("collectives") or {}))
        return out

    run.traced = traced  # {"collectives": {op: count}} of the captured graph, once compiled
    run.express = express
    run.graph_name = name
    return run


def _gated(compiled, gm):
    """`compiled`, returning empty outputs of the graph's shapes instead of running while
    `compile_only()` is on (the outputs are what the graph's output node recorded)."""
    def call(*args):
        if getattr(_PHASE, "compile_only", False):
            return _empty_outputs(gm)
        return compiled(*args)

    return call


def _gated_specs(compiled, specs: list, as_tuple: bool):
    """`_gated` for a bound artifact: the empty outputs from the specs its compile recorded."""
    def call(*args):
        if getattr(_PHASE, "compile_only", False):
            out = [None if s is None else torch.empty_strided(s[0], s[1], dtype=getattr(torch, s[2]), device=s[3])
                   for s in specs]
            return tuple(out) if as_tuple else out[0]
        return compiled(*args)

    return call


def _empty_outputs(gm):
    out = next(n for n in gm.graph.nodes if n.op == "output")

    def empty(a):
        v = a.meta.get("example_value", a.meta.get("val")) if isinstance(a, torch.fx.Node) else a
        if isinstance(v, torch.Tensor):
            return torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device=v.device)
        return v

    res = out.args[0]
    return type(res)(empty(a) for a in res) if isinstance(res, (tuple, list)) else empty(res)


def _holding(lock, compiled):
    """`compiled` run while holding `lock` (an uncontended RLock costs well under a microsecond)."""
    def call(*args):
        with lock:
            return compiled(*args)

    return call
