"""Compiling a one-rank static server's graphs in the background (`graph_warmup background`).

A CPU server compiles its static round graphs with inductor: minutes per bucket on a few cores,
under a minute for all of them from inductor's FX graph cache. Compiled at start, a fresh clone's
`make serve` would not be ready for many minutes. In the background it is ready at once: the
serving thread runs eager steps (the op-by-op forward on the same caches: the same tokens under
the exact numerics) while a thread compiles bucket by bucket, smallest first (one sequence, the
shortest context: what a first user sends), and each decode bucket's rounds take over once all of
its graphs are warm (`StaticRunner.ready`: (kind, bucket) pairs, read by `round_fits` and `forward_plan`).

What keeps the two threads apart:
- the compiled graphs run under the runner's `exec_lock` (compile_step's `lock`), which the engine
  holds for a whole step: a padding round never interleaves with an eager step (a compiled graph may
  copy a whole state tensor back), while compiling -- most of the time -- holds no lock;
- padding rounds touch only the scratch slot, which the serving thread's eager steps do not use
  (the step-cost profile does, under the same lock, and the profile of a warming runner is the
  eager one: `Engine.prior_cost`);
- the host-side caches a trace must not see filled (dequantized weights, stacked experts) are filled
  before the thread starts (`StaticGraphs.prime`, here in the caller's thread);
- the thread's graph runs are not counted as executions (`graphs.uncounted`).
One rank only: on several ranks each graph is a collective and both threads would issue them.

Progress: a log line per warm bucket on stderr, and the runner's counters `graph_buckets_warm` /
`graph_buckets` (the engine stats). A compile that fails is logged and ends the thread; the buckets
not warm keep serving eager steps (the server stays up).
"""

from __future__ import annotations

import os
import sys
import threading
import time

from .graphs import uncounted

NICE = 10  # the thread's scheduling priority on Linux (a thread id is a PRIO_PROCESS target there)


class BackgroundWarmup:
    """Compiles `runner`'s graphs (a StaticRunner) in a daemon thread, bucket by bucket."""

    def __init__(self, runner, mode: str, fixed_len: int, stop_width: int, processed: bool, nodraft: bool,
                 log=None):
        self.runner = runner
        self.args = (mode, fixed_len, stop_width, processed, nodraft)
        self.log = log or (lambda msg: print(f"[v4flash] {msg}", file=sys.stderr, flush=True))
        decode = sorted(runner.buckets, key=lambda b: (b.seqs, b.ctx))
        prefill = sorted(runner.pgraphs.buckets, key=lambda b: (b.ctx, b.rows)) if runner.pgraphs else []
        self.jobs = [("decode", b) for b in decode] + [("prefill", b) for b in prefill]
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        """Prime (this thread), mark nothing warm, start compiling."""
        r = self.runner
        mode, fixed_len, stop_width, _, _ = self.args
        if not (r.graphs.primed or (r.ngraphs is not None and r.ngraphs.primed)):
            r.graphs.prime(mode, fixed_len, stop_width)
        r.ready = set()
        r.counters.update(graph_buckets_warm=0, graph_buckets=len(self.jobs))
        self.t0 = time.monotonic()
        self.thread = threading.Thread(target=self._run, name="v4flash-graph-warmup", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Compile no further bucket (the one in progress finishes)."""
        self._stop.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)

    def _run(self) -> None:
        r = self.runner
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)  # the serving thread first
        except (AttributeError, OSError):
            pass
        try:
            with uncounted():
                for i, (kind, b) in enumerate(self.jobs):
                    if self._stop.is_set():
                        return
                    t0 = time.monotonic()
                    if kind == "decode":
                        r.warm_bucket(b, *self.args)
                    else:
                        r.warm_prefill_bucket(b)
                    r.ready.add((kind, b))
                    r.counters["graph_buckets_warm"] = i + 1
                    self.log(f"graphs warm: {kind} bucket {b} in {time.monotonic() - t0:.1f} s "
                             f"({i + 1}/{len(self.jobs)}, {time.monotonic() - self.t0:.0f} s since start)")
            r.ready = None  # every bucket: the profile may now time the rounds (Engine.prior_cost)
            self.log(f"graphs warm: all {len(self.jobs)} buckets in {time.monotonic() - self.t0:.0f} s")
        except BaseException as e:  # noqa: BLE001 - a failed compile must not take the server down
            self.error = e
            self.log(f"background compile failed ({type(e).__name__}: {e}); the buckets not warm keep "
                     "serving eager steps")
        finally:
            self.done.set()
