"""A static rank's start-up: every graph it serves compiled (or loaded from the compiled artifacts),
then run once, in an order in which no collective waits on another rank's compile.

Each graph of the static path is a collective of the whole group (functional collectives traced into
it). Compiled and run one after the other, as a one-rank server may, the first rank to finish a
compile would meet the others at that graph's first collective while they are still compiling --
minutes apart on trn2, against a collective timeout of a minute (`collective_timeout_s`) and the
runtime's execution timeout. So a rank group's warm-up (`warm_up`) is:

0. the control-plane barrier (gloo; `warmup_timeout_s`): every rank has loaded its weights; then the
   uncompiled priming round, whose collectives meet at once (`StaticGraphs.prime`);
1. every start-up graph (`startup_steps`, in the order `startup_graphs` counts them) called under
   `compiler.compile_only()`: dynamo traces it and the backend compiles it, or the artifacts
   provide it -- bound by name without a trace where they hold its binding (`trn2.binding`), else
   looked up by the traced graph's key -- and nothing runs: no device work, no collective;
2. the control-plane barrier again: every rank holds every graph;
3. every graph run once on its padding plan (it changes no real slot), with the device groups'
   collective timeout raised to `warmup_timeout_s` for this phase alone (a first run loads a NEFF
   onto the core), then set back.

The compile command (`group.aot`) runs steps 0-1 with fake tensors to capture what a rank compiles.
A one-rank CPU server that compiles in the background keeps its own order (`trn2.warmup`).
"""

from __future__ import annotations

import time

from .compiler import compile_only
from .graphs import _Progress, uncounted


def startup_steps(runner, mode: str, fixed_len: int, stop_width: int, processed: bool, nodraft: bool):
    """[(label, step)]: each step calls graphs of `runner` (a StaticRunner) on a padding plan, in the
    order a rank warms them: every decode bucket's round graphs of spec mode `mode` (and the
    logit-processing variant), the plain-decode rounds where the server may step aside (`nodraft`),
    every prefill bucket and every decode bucket's bare verify graph (`startup_graphs` counts them)."""
    g, steps = runner.graphs, []
    variants = (False, True)[:1 + processed]
    for b in runner.buckets:
        for proc in variants:
            steps.append((f"rounds {b}{' processed' if proc else ''}",
                          lambda b=b, proc=proc: g.round(b, mode, fixed_len, g.round_padding(b, stop_width, proc))))
    if nodraft and runner.ngraphs is not None:
        ng = runner.ngraphs
        for b in ng.buckets:
            for proc in variants:
                steps.append((f"plain decode {b}{' processed' if proc else ''}",
                              lambda b=b, proc=proc: ng.round(b, "off", 0, ng.round_padding(b, stop_width, proc))))
    for pb in (runner.pgraphs.buckets if runner.pgraphs is not None else []):
        steps.append((f"prefill {pb}", lambda pb=pb: runner.warm_prefill_bucket(pb)))
    for b in runner.buckets:
        steps.append((f"forward {b}", lambda b=b: runner.warm_forward(b)))
    return steps


def prime(runner, mode: str, fixed_len: int, stop_width: int) -> None:
    """The uncompiled padding rounds that fill the host-side caches before any graph is traced
    (`StaticGraphs.prime`): the round graphs' (spec mode `mode`) and the plain-decode graphs', each
    once per runner. Both, because the forms differ by rows: under `reference` numerics the drafting
    round's 1 + G-row MoE runs the per-expert loop and the 1-row plain round the routed form on the
    stacked experts, whose dequantized copy only a plain round fills. Traced unfilled, the plain
    round's graph dequantized the stacks in every call and took their e8m0 scales as inputs, which
    inductor's C++ code generator has no type for (KeyError: torch.float8_e8m0fnu)."""
    if not runner.graphs.primed:
        runner.graphs.prime(mode, fixed_len, stop_width)
    if runner.ngraphs is not None and not runner.ngraphs.primed:
        runner.ngraphs.prime("off", 0, stop_width)


def warm_up(runner, mode: str, fixed_len: int, stop_width: int, processed: bool, nodraft: bool, coll=None,
            warmup_timeout_s: float = 3600.0, collective_timeout_s: float | None = None, progress=None,
            execute: bool = True) -> dict:
    """The start-up of the module docstring for `runner` (a StaticRunner whose graphs compile:
    backend other than none). coll: the rank's `parallel.collectives.Collectives` (None or one rank:
    no barriers). execute False: phases 0-1 only (the compile command). Returns seconds per phase and
    the graphs compiled and loaded."""
    from torch._dynamo.utils import counters

    steps = startup_steps(runner, mode, fixed_len, stop_width, processed, nodraft)
    traced0 = counters["stats"]["unique_graphs"]  # graphs dynamo captured in this process
    t = run_in_phases(steps, lambda: prime(runner, mode, fixed_len, stop_width), coll, warmup_timeout_s,
                      collective_timeout_s, progress, execute)
    stats = [runner.graphs.stats] + ([runner.pgraphs.stats] if runner.pgraphs is not None else [])
    t["compiled"] = sum(s.graphs for s in stats)
    src = runner.graphs.artifacts
    t["loaded"] = getattr(src, "loaded", 0)
    t["traced"] = counters["stats"]["unique_graphs"] - traced0  # 0 where every graph was bound (no trace)
    runner.counters.update(startup_graphs_compiled=t["compiled"], startup_graphs_loaded=t["loaded"],
                           startup_graphs_traced=t["traced"])
    runner.startup_times = t  # perf/bench_artifact_load.py reads the phases
    return t


def run_in_phases(steps, prime_fn=None, coll=None, warmup_timeout_s: float = 3600.0,
                  collective_timeout_s: float | None = None, progress=None, execute: bool = True) -> dict:
    """Phases 0-3 of the module docstring over `steps` ([(label, callable)], each calling compiled
    graphs); prime_fn: phase 0's priming round. Returns {"compile_s", "run_s"}."""
    t = {}
    t0 = time.perf_counter()
    group = coll is not None and coll.size("control") > 1
    if group:
        coll.barrier("control", warmup_timeout_s, "warmup_loaded")
    if prime_fn is not None:
        prime_fn()
    bar = _Progress(len(steps), progress, "compile/load")
    with compile_only(), uncounted():
        for i, (label, step) in enumerate(steps):
            step()
            bar.show(i + 1, label)
    t["compile_s"] = time.perf_counter() - t0
    if group:
        coll.barrier("control", warmup_timeout_s, "warmup_compiled")
    t1 = time.perf_counter()
    if execute:
        bar = _Progress(len(steps), progress, "first run")
        if group:
            coll.set_timeout(warmup_timeout_s)
        try:
            with uncounted():
                for i, (label, step) in enumerate(steps):
                    step()
                    bar.show(i + 1, label)
        finally:
            if group and collective_timeout_s is not None:
                coll.set_timeout(collective_timeout_s)
    t["run_s"] = time.perf_counter() - t1
    return t
