"""Where a compiled decode round's time goes: the plain-decode round, the drafting round's verify
graph and its draft graph, timed apart on the graphs `perf/bench_dspark.py --fast` compiles.

    .venv/bin/python perf/round_profile.py [--batch 1] [--rounds 200] [--ops 25] [--tau 4.70] [--kernels]

Builds the bench's fast runner (the same bucket, so inductor's cache serves both), then times, in
interleaved rounds on padding plans (fixed shapes: the same work as a real round), graph 1 of the
plain-decode round (1 row a sequence: what a stepped-aside round runs), graph 1 of the drafting round
(1 + G rows: verify, acceptance) and graph 2 (ring writes, draft stages, Markov drafting, confidence,
admission). `--ops N` adds torch.profiler's top N operators by self time per graph (the BLAS and
aten calls the graphs make; inductor's own fused C++ kernels show as the remainder). `--kernels`
compiles the graphs with inductor's per-kernel profiling (`config.cpp.enable_kernel_profile`: each
fused C++ kernel records a profiler event; other code, so a cold compile into the cache), lists each
graph's top `--ops` events with their full names, and prints per graph

    kernel-split: graph=<g> profiled_ms=<a call under the profiler> recorded_ms=<its events' self
        times> fused_kernels_ms=<inductor's C++ kernels> unrecorded_ms=<the rest>      (one line)

The graph's own event (`Call CompiledFxGraph`) keeps as self time the C++ wrapper's code and the
instrumentation, which costs time per kernel call whether or not the profiler runs (the batch-1 plain
round took 8.4 ms instrumented against 3.7 ms): read the graphs' differences, not their totals. It
prints

    round-profile: batch=<B> f64_weights=<w> numerics=<n> plain_ms=<p> verify_ms=<v> draft_ms=<d>
        drafting_round_ms=<v+d> ratio=<(v+d)/p>      (one line)
    round-bound: tau=<t> drafting_pays_below_ratio=<t> max_gain=<t/ratio>

(medians [min-max] over rounds on the line before): a drafting round commits tau tokens a sequence
where a plain round commits 1, so drafting pays while ratio < tau, and gains at most tau / ratio at
that acceptance, before the host's work per round and the prefill, which both modes pay. The numerics
are `exact` (the CPU default's) unless `--numerics` names others; $V4FLASH_F64_WEIGHTS
(torch_ops.F64_WEIGHTS) picks which weights keep an fp64 copy. `--f64-weights none,experts` and / or
`--numerics exact,reference` build a runner under each combination and time all their graphs in one
interleaved loop (one round-profile line each): the A/B on one host at one time. `--cxx-opt O3,O2`
does the same for g++'s optimisation level of inductor's C++ (trn2.compiler.CXX_OPT; a level not in
inductor's cache compiles its C++ anew, ~1 min a graph), and `fast-compile` says each variant's
compile seconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch._dynamo

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "perf"))

from bench_dspark import default_checkpoint, fast_max_len, fast_runner, load_prompts  # noqa: E402

from v4flash_backend import ops  # noqa: E402
from v4flash_backend.engine.round_plan import STOP_WIDTH  # noqa: E402
from v4flash_backend.model.loading import load_model  # noqa: E402
from v4flash_backend.ops import torch_ops  # noqa: E402
from v4flash_backend.trn2 import compiler  # noqa: E402
from v4flash_backend.trn2.static_step import Bucket  # noqa: E402

ARGS = ("slot", "start", "n", "pending", "temperature", "top_k", "top_p", "seed", "rnd", "budget", "stop_ids")
DRAFT_ARGS = ("slot", "start", "n", "temperature", "top_k", "top_p", "seed", "rnd", "budget", "len_left", "sps_t",
              "t_draft", "cal", "fixed_ell")


def graph_calls(runner, batch: int) -> dict:
    """{name: zero-argument call} of the three graphs on padding plans of the runner's one bucket."""
    b = runner.buckets[0]
    nb = Bucket(b.seqs, 1, b.ctx)
    x = runner.graphs.round_padding(b, STOP_WIDTH, False)
    xn = runner.ngraphs.round_padding(nb, STOP_WIDTH, False)
    g1 = runner.graphs.round_verify_graph(b, False)
    g2 = runner.graphs.round_draft_graph(b, "dspark", 0, False)
    gp = runner.ngraphs.round_verify_graph(nb, False)
    out1 = g1(*(x[k] for k in ARGS))
    tokens_out, committed, accepted, stopped, taps, _ = out1

    def draft():
        return g2(taps, committed, tokens_out, accepted, stopped, *(x[k] for k in DRAFT_ARGS))

    return {"plain": lambda: gp(*(xn[k] for k in ARGS)), "verify": lambda: g1(*(x[k] for k in ARGS)),
            "draft": draft}


def _use(mode) -> None:
    """Make (numerics, F64_WEIGHTS, g++ level) the process's: before a variant's runner traces and each
    call (the level is read at compile time only)."""
    ops.set_numerics(mode[0])
    torch_ops.F64_WEIGHTS = mode[1]
    compiler.CXX_OPT = mode[2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=48, help="the bench's (sets the bucket's context)")
    ap.add_argument("--ops", type=int, default=0, help="torch.profiler's top N operators per graph")
    ap.add_argument("--tau", type=float, default=4.70, help="tokens a drafting round commits per sequence")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--f64-weights", default=None,
                    help="F64_WEIGHTS modes to compare, comma-separated (e.g. none,experts): a runner "
                         "each, their graphs timed interleaved; default $V4FLASH_F64_WEIGHTS's one")
    ap.add_argument("--numerics", default="exact",
                    help="ops numerics to compare, comma-separated (exact,reference): a runner each (with "
                         "every --f64-weights mode), all graphs timed in one interleaved loop")
    ap.add_argument("--cxx-opt", default=None,
                    help="g++ levels of inductor's C++ to compare, comma-separated (O3,O2): a runner each; "
                         "default trn2.compiler.CXX_OPT")
    ap.add_argument("--kernels", action="store_true",
                    help="compile with per-kernel profiler events and list each graph's top kernels")
    args = ap.parse_args(argv)
    if args.kernels:
        from torch._inductor import config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True  # read at code generation: set before compiling
        args.ops = args.ops or 25
    torch.set_num_threads(args.threads)
    ckpt = args.checkpoint or default_checkpoint()
    numerics = args.numerics.split(",")
    for n in numerics:
        if n not in ops.NUMERICS:
            ap.error(f"--numerics {n!r}: choose from {', '.join(ops.NUMERICS)}")
    f64_modes = args.f64_weights.split(",") if args.f64_weights else [torch_ops.F64_WEIGHTS]
    # a variant: (numerics, F64_WEIGHTS); both are read while tracing and by the graphs' guards
    levels = args.cxx_opt.split(",") if args.cxx_opt else [compiler.CXX_OPT]
    modes = [(n, w, c) for n in numerics for w in f64_modes for c in levels]
    if len(modes) > 1:
        # every mode's graphs are re-traces of the same functions (a guard per weight copy)
        torch._dynamo.config.recompile_limit = 16 * len(modes)
        torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit,
                                                               256 * len(modes))
    by_mode = {}
    with torch.inference_mode():  # traced as they run below (a grad-mode change would re-trace them)
        for mode in modes:
            _use(mode)  # read while tracing, and by the graphs' guards: set per call
            if len(levels) > 1:  # (the generated modules loaded for another level would be reused)
                from torch._inductor.codecache import PyCodeCache

                PyCodeCache.cache_clear()
            model = load_model(ckpt)
            prompts, _ = load_prompts(ckpt, model, 16, None)
            runner, secs, graphs = fast_runner(model, args.batch, fast_max_len(prompts, args.max_tokens))
            print(f"fast-compile: batch={args.batch} f64_weights={mode[1]} numerics={mode[0]} cxx_opt={mode[2]} "
                  f"graphs={graphs} "
                  f"seconds={secs:.1f}", flush=True)
            by_mode[mode] = (runner, graph_calls(runner, args.batch))
        keys = [(m, k) for m in modes for k in by_mode[m][1]]
        samples: dict = {key: [] for key in keys}

        def call(key):
            _use(key[0])
            return by_mode[key[0]][1][key[1]]()

        for _ in range(5):
            for key in keys:
                call(key)
        for r in range(args.rounds):  # interleaved, the order rotating: a burst of load hits all alike
            for key in keys[r % len(keys):] + keys[:r % len(keys)]:
                t0 = time.perf_counter()
                call(key)
                samples[key].append(time.perf_counter() - t0)
    for mode in modes:
        med = {k: statistics.median(v) * 1e3 for (m, k), v in samples.items() if m == mode}
        for (m, k), v in samples.items():
            if m == mode:
                print(f"  {k:>6}: {med[k]:.3f} ms [{min(v) * 1e3:.3f}-{max(v) * 1e3:.3f}] over {len(v)} calls")
        full = med["verify"] + med["draft"]
        ratio = full / med["plain"]
        print(f"round-profile: batch={args.batch} f64_weights={mode[1]} numerics={mode[0]} cxx_opt={mode[2]} "
              f"plain_ms={med['plain']:.3f} "
              f"verify_ms={med['verify']:.3f} "
              f"draft_ms={med['draft']:.3f} drafting_round_ms={full:.3f} ratio={ratio:.2f}")
        print(f"round-bound: tau={args.tau:.2f} drafting_pays_below_ratio={args.tau:.2f} "
              f"max_gain={args.tau / ratio:.2f}", flush=True)
    _use(modes[0])
    calls = by_mode[modes[0]][1]
    if args.ops:
        from torch.profiler import ProfilerActivity, profile

        for k, fn in calls.items():
            with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
                t0 = time.perf_counter()
                for _ in range(20):
                    fn()
                wall_ms = (time.perf_counter() - t0) / 20 * 1e3  # a call's time under the profiler
            print(f"--- {k} (20 calls) ---")
            avg = prof.key_averages()
            print(avg.table(sort_by="self_cpu_time_total", row_limit=args.ops,
                            max_name_column_width=120 if args.kernels else 55))
            if args.kernels:
                # a call's time under the profiler against what its recorded events account for
                # (self times: nested events are not counted twice)
                seen = sum(e.self_cpu_time_total for e in avg) / 20 / 1e3
                kern = sum(e.self_cpu_time_total for e in avg if "cpp_fused" in e.key) / 20 / 1e3
                print(f"kernel-split: graph={k} profiled_ms={wall_ms:.3f} recorded_ms={seen:.3f} "
                      f"fused_kernels_ms={kern:.3f} unrecorded_ms={max(wall_ms - seen, 0.0):.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
