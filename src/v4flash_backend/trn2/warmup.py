"""Compiling a one-rank static server's graphs in the background (`graph_warmup background`).

A CPU server compiles its static round graphs with inductor: minutes per bucket on a few cores,
much less from inductor's FX graph cache. Compiled at start, a fresh clone's
`make serve` would not be ready for many minutes. In the background it is ready at once: the
serving thread runs eager steps (the op-by-op forward on the same caches: the same tokens under
the exact numerics) while a thread compiles in sets that take over one by one once warm
(`StaticRunner.ready`, read by `round_fits` and `forward_plan`): the announced sets, the plain-decode
round (one graph) and the drafting round (two) of the smallest decode bucket (one sequence: what a
first user sends), then the largest bucket's plain-decode round (a batch whose own bucket is cold runs
padded in it); the other sets -- the drafting rounds of more sequences, the buckets between,
logit-processing variants, forward graphs, prefill buckets -- when a step first needs one, and a
set a step waits for goes to the front of the queue (`want`; not the steps of the server's start-up
request, which is no traffic: `StepGate.traffic`). A server's background compile takes one context
bucket per sequence count (group/build.py: every context bound its own graphs tripled the count).

What keeps the two threads apart:
- the compiled graphs run under the runner's `graph_lock` (compile_step's `lock`), which the engine
  holds for a whole step (through `StepGate`, the runner's exec_lock): a padding round never
  interleaves with an eager step (a compiled graph may copy a whole state tensor back), while
  compiling -- most of the time -- holds no lock;
- the compile pauses while a step runs. Both threads run Python under one GIL, and an eager step
  gives it up in every torch call (~9,000 a plain decode step): with a tracing thread beside it,
  each call waited out the thread's switch interval, and a server's first 2-token request (with
  the step-cost profile) took 168 s; with the pause 4.2 s (the embedded model, this 2-core
  machine). A profile hook on the compile thread (`sys.setprofile`: every Python and C call; it
  makes the trace ~2x slower) waits while the gate is held; a wait ends after MAX_PAUSE_S anyway
  (the thread may hold a lock the step needs: dynamo's compile lock, an import's) with a burst of
  BURST_S beside the step, then it waits again. So that a busy server still compiles, a step
  begins after a pause of SHARE x the last step's seconds (at most MAX_SLICE_S) while the compile
  runs: about a fifth of the wall time goes to the compile under full load, all of it when idle;
- padding rounds touch only the scratch slot, which the serving thread's eager steps do not use
  (the step-cost profile does, under the same gate, and the profile of a warming runner is the
  eager one: `Engine.prior_cost`);
- the host-side caches a trace must not see filled (dequantized weights, stacked experts) are filled
  before the thread starts (`StaticGraphs.prime`, here in the caller's thread);
- the thread's graph runs are not counted as executions (`graphs.uncounted`).
One rank only: on several ranks each graph is a collective and both threads would issue them.

Progress: a log line per warm set on stderr, and the runner's counters `warmup_done` /
`warmup_total` (the engine stats, the metrics v4flash:warmup_graph_sets_warm / _total; a set wanted
by traffic adds to the total). A compile that fails is logged and ends the thread; what is not warm
keeps serving eager steps (the server stays up). While no set is queued the thread waits for a `want`
and the gate is told the compile is off (no slice before steps, no memory counted as the compile's).

Stopping: `close()` (the rank's exit) ends the thread within a moment, mid-set: the profile hook raises
`CompileStopped` at the thread's next Python or C call. A daemon thread still inside torch when the
interpreter finalizes is killed by CPython 3.11 with pthread_exit, whose forced unwind through torch's
C++ frames calls std::terminate: the rank died of SIGABRT ("terminate called without an active
exception") and a clean shutdown of a server stopped while compiling read as a failed rank group.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque

from . import compile_helper
from .graphs import uncounted
from .startup import prime

NICE = 10  # the thread's scheduling priority on Linux (a thread id is a PRIO_PROCESS target there)
MAX_PAUSE_S = 1.0  # the longest the compile waits at once for a step (module docstring) ...
BURST_S = 0.05  # ... before it runs this long beside it
SHARE = 0.25  # the compile's slice before each step, as a share of the last step's seconds
MAX_SLICE_S = 0.1


class CompileStopped(BaseException):
    """Raised in the compile thread by its profile hook once `stop()` was called (a BaseException:
    dynamo's and inductor's `except Exception` handlers must not swallow it)."""


class StepGate:
    """The runner's exec_lock: what the engine holds for a whole step (and its profile). It holds
    the graph lock (no compiled graph runs beside the step) and tells a background compile to pause
    (`serving`, `idle`); before a step it yields the compile a slice while one runs (`share`). Only
    the engine's thread enters it (re-entrant: the profile runs inside a step).

    While a compile runs it also counts the compile's memory (`compile_rss_bytes`): the resident
    memory that grew while the compile thread ran, not waiting in its hook for a step to end
    (`compile_paused` / `compile_resumed`): dynamo's and inductor's state, the graphs they made, their
    transient garbage -- bounded by the graph sets. It is an upper bound: what the serving thread
    allocates while the compile runs beside it (the compile's slice, about a fifth of a busy server's
    time) counts too. The compile helper process (compile_helper.py), which exists for the compile
    alone, counts whole (`helper`): its resident set is the compile's too, and left out it read as
    memory nothing explained -- a soak's restarted rank group on a 2-core AMD EPYC grew 74-86 MiB
    beside a 1.7-6.9 MiB compile share, the helper 420 -> 529 MiB of it (its trace, ps every 2 s).
    perf/soak.py reports it apart from the rest."""

    def __init__(self, lock):
        self.lock = lock
        self.depth = 0
        self.serving = False
        self.idle = threading.Event()
        self.idle.set()
        self.share = 0.0  # SHARE while a background compile runs
        self.last_step_s = 0.0
        self._t0 = 0.0
        self._compile_rss = 0  # resident bytes that grew while the compile thread ran
        self._rss_mark: int | None = None  # the resident set when it last resumed (None: paused or done)
        self.helper = None  # the compile helper (compile_helper.CompileHelper), if one was spawned
        # False while the engine's step serves only the server's start-up request (request.warmup, set
        # by Engine._step): its steps ask for no set (`BackgroundWarmup.want`). That request's prompt
        # is no user's: its prefill wanted a forward graph that chat traffic (prompts past a round's
        # rows go to the prefill graphs) seldom runs, and that graph compiled before the first
        # round set (268.5 s of a 2-core AMD EPYC's helper, ahead of the one-sequence plain round)
        self.traffic = True

    def compiling(self, on: bool) -> None:
        """A background compile starts (the slice and the memory count begin) or ends."""
        if on:
            self.share = SHARE
            self.compile_resumed()
        else:
            self.compile_paused()
            self.share = 0.0

    def compile_resumed(self) -> None:
        self._rss_mark = compile_helper.rss_bytes()

    def compile_paused(self) -> None:
        self._compile_rss, self._rss_mark = self._own_rss_bytes(), None

    def _own_rss_bytes(self) -> int:
        """What grew in this process while the compile thread ran (summed over its runs)."""
        mark = self._rss_mark
        return self._compile_rss + (max(0, compile_helper.rss_bytes() - mark) if mark is not None else 0)

    def compile_rss_bytes(self) -> int:
        """Resident memory the background compile added so far: this process's share, and its helper
        process's resident set now (class docstring)."""
        helper = self.helper
        return self._own_rss_bytes() + (helper.rss_bytes() if helper is not None else 0)

    def __enter__(self):
        if self.depth == 0 and self.share and self.last_step_s:
            time.sleep(min(MAX_SLICE_S, self.share * self.last_step_s))
        self.lock.acquire()
        self.depth += 1
        if self.depth == 1:
            self.idle.clear()
            self.serving = True
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.depth -= 1
        if self.depth == 0:
            self.last_step_s = time.perf_counter() - self._t0
            self.serving = False
            self.idle.set()
        self.lock.release()
        return False


class BackgroundWarmup:
    """Compiles `runner`'s graphs (a StaticRunner) in a daemon thread, set by set: the announced sets
    (`jobs`) smallest first, and any other set a step asks for (`want`) as traffic needs it."""

    def __init__(self, runner, mode: str, fixed_len: int, stop_width: int, processed: bool, nodraft: bool,
                 log=None, helper_settings: str | None = None):
        self.runner = runner
        self.helper_settings = helper_settings  # the settings' JSON: a compile helper process (compile_helper.py)
        self.helper = None
        self.hooked = True  # the pause hook (False: the helper process, which serves no steps)
        self.args = (mode, fixed_len, stop_width, nodraft)
        self.processed = processed
        self.log = log or (lambda msg: print(f"[v4flash] {msg}", file=sys.stderr, flush=True))
        decode = sorted(runner.buckets, key=lambda b: (b.seqs, b.ctx))
        plain = nodraft and runner.ngraphs is not None  # rounds that neither verify nor draft: their own graph
        drafting = mode != "off" or runner.ngraphs is None
        # the announced graph sets, compiled in this order (each usable once warm): for the fewest
        # sequences the plain-decode round (one graph: what a round runs that steps aside or does not
        # speculate; the first set a fresh server gets warm) and the drafting round (its verify and
        # draft graphs); for the most, its plain-decode round alone. Once that one is warm every batch
        # has a compiled round: one whose own bucket is not warm yet runs padded in it (`round_fits`)
        # and asks for its own; a round that would draft while its drafting set compiles steps aside
        # into it (Engine._run_step: a compiled plain round beats an eager drafting step several times
        # over). The largest bucket's drafting round (two graphs: the one-sequence one's took 600.9 s of
        # the compile helper on a 2-core AMD EPYC, the plain-decode round's 284.4 s) waits
        # for traffic: on the CPU drafting at 8 sequences does not pay (docs/performance.md), and a
        # server that never sees them never pays for it. So the buckets between, the drafting rounds
        # of more than one sequence, the logit-processing variants, the forward graphs (short segments
        # of mixed steps) and the prefill buckets compile when a step first needs them (`want`): a
        # cold graph takes minutes on a few cores (~3-5 on this project's 2-core machines), and a server
        # that never sees 3 sequences at once, a penalty, a log-prob request or a prompt of some length
        # never pays for those graphs.
        first = [b for b in decode if b.seqs == decode[0].seqs]
        last = [b for b in decode if b.seqs == decode[-1].seqs and b.seqs != decode[0].seqs]
        self.jobs = [k for b in first for k in ([("plain", b, False)] if plain else [])
                     + ([("round", b, False)] if drafting else [])]
        self.jobs += [("plain", b, False) if plain else ("round", b, False) for b in last]
        self.announced = list(self.jobs)
        self._queue: deque = deque(self.jobs)
        self._cv = threading.Condition()
        self._current = None
        self.done = threading.Event()  # every set known so far is warm
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self.thread: threading.Thread | None = None

    def _begin(self) -> None:
        """Prime (this thread), mark nothing warm, open the gate's compile accounting."""
        r = self.runner
        mode, fixed_len, stop_width, _ = self.args
        prime(r, mode, fixed_len, stop_width)
        r.ready = set()
        r.counters.update(warmup_done=0, warmup_total=len(self.jobs))
        self.t0 = time.monotonic()
        self._burst_end = 0.0
        self._gate = r.exec_lock  # read by the hook on every call of the compile thread
        self._gate.compiling(True)

    def start(self) -> None:
        """Prime (this thread), mark nothing warm, start compiling."""
        self._begin()
        if self.helper_settings is not None and compile_helper.enabled():
            self.helper = compile_helper.CompileHelper.spawn(self.helper_settings, self.log)
            if self.helper is not None:  # its memory is the compile's (StepGate.compile_rss_bytes)
                self.runner.exec_lock.helper = self.helper
        self.thread = threading.Thread(target=self._run, name="v4flash-graph-warmup", daemon=True)
        self.thread.start()

    def want(self, key: tuple) -> None:
        """A step needs set `key` and it is not warm: compile it next (after the one in progress). A set
        no server of these settings runs (a logit-processing variant without warm_processed) is left out,
        and so is what the server's start-up request's steps lack (not traffic: `StepGate.traffic`)."""
        if key[0] in ("plain", "round") and key[2] and not self.processed:
            return
        if not getattr(self.runner.exec_lock, "traffic", True):
            return
        if self.helper is not None:
            self.helper.want(key)
        with self._cv:
            if key == self._current or key in (self.runner.ready or ()) or self.error is not None:
                return
            if key in self._queue:
                if self._queue[0] == key:
                    return
                self._queue.remove(key)
            else:
                self.jobs.append(key)
                self.runner.counters["warmup_total"] = len(self.jobs)
                self.done.clear()
            self._queue.appendleft(key)
            self._cv.notify()

    @property
    def announced_warm(self) -> bool:
        """Every announced set is warm (the step-cost profile may time the rounds)."""
        ready = self.runner.ready
        return ready is None or all(k in ready for k in self.announced)

    def stop(self) -> None:
        """Compile no further: the set in progress is abandoned at the thread's next call."""
        self._stop.set()
        with self._cv:
            self._cv.notify()

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)

    def close(self, timeout: float = 10.0) -> bool:
        """Stop and wait for the thread to end (before the process exits: module docstring); False
        when it is still running after `timeout` (inside one long C call)."""
        self.stop()
        if self.helper is not None:
            self.helper.close()
        if self.thread is not None:  # not `done`: that is set while the thread waits for a `want`
            self.thread.join(timeout)
        return self.thread is None or not self.thread.is_alive()

    def _pause(self, frame, event, arg) -> None:
        """The compile thread's profile hook: wait while the engine runs a step (module docstring);
        raise CompileStopped once stopped."""
        if self._stop.is_set():
            sys.setprofile(None)  # once: the handlers the exception unwinds through run unhooked
            raise CompileStopped
        g = self._gate
        if not g.serving or (self._burst_end and time.monotonic() < self._burst_end):
            return
        # a wait that times out lets the compile run a short burst beside the step: it may hold what
        # the step waits for; a long step (the step-cost profile) stays mostly alone
        g.compile_paused()
        self._burst_end = 0.0 if g.idle.wait(MAX_PAUSE_S) else time.monotonic() + BURST_S
        g.compile_resumed()

    def _next(self):
        """The next set to compile; None: stop. With nothing queued the thread waits for a `want`."""
        with self._cv:
            if not self._queue and not self._stop.is_set():
                # idle: no compile to pause, no slice before each step, no memory counted as the compile's
                if self.hooked:
                    sys.setprofile(None)
                self._gate.compiling(False)
                if not self.done.is_set():
                    self.log(f"graphs warm: all {len(self.jobs)} sets in {time.monotonic() - self.t0:.0f} s")
                    self.done.set()
                while not self._queue and not self._stop.is_set():
                    self._cv.wait(1.0)
                if self._stop.is_set():
                    return None
                self._gate.compiling(True)
                if self.hooked:
                    sys.setprofile(self._pause)
            if self._stop.is_set():
                return None
            self._current = self._queue.popleft()
            return self._current

    def _run(self) -> None:
        r = self.runner
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)  # the serving thread first
        except (AttributeError, OSError):
            pass
        sys.setprofile(self._pause)  # this thread only
        try:
            with uncounted():
                while (job := self._next()) is not None:
                    t0 = time.monotonic()
                    if self.helper is not None:  # compiled into inductor's cache by the helper first
                        job = self._helper_first(job)
                    self._warm(job)
                    with self._cv:
                        r.ready.add(job)
                        self._current = None
                    done = len(r.ready)
                    r.counters["warmup_done"] = done
                    self.log(f"graphs warm: {_name(job)} in {time.monotonic() - t0:.1f} s ({done}/{len(self.jobs)}, "
                             f"{time.monotonic() - self.t0:.0f} s since start)")
        except CompileStopped:
            self.log(f"background compile stopped ({r.counters['warmup_done']} of {len(self.jobs)} sets warm)")
        except BaseException as e:  # noqa: BLE001 - a failed compile must not take the server down
            self.error = e
            self.log(f"background compile failed ({type(e).__name__}: {e}); what is not warm keeps "
                     "serving eager steps")
        finally:
            sys.setprofile(None)
            r.exec_lock.compiling(False)
            self.done.set()

    def _helper_first(self, job: tuple) -> tuple:
        """With a compile helper (compile_helper.py): the set to compile now, once the helper has
        reported it -- `job`, or a set queued behind it that the helper reported first (it follows the
        wants too, so a want that came after this thread took `job` reorders the helper's work, not
        this thread's; waiting for `job` then waited out the other set's compile too). A helper that
        exited: `job`, compiled here from scratch."""
        h = self.helper
        h.want(job)
        while True:
            with self._cv:
                keys = [job] + list(self._queue)
            got = h.first_reported(keys, 0.5)
            if self._stop.is_set():
                raise CompileStopped
            if got is None:
                if h.exited:
                    return job
                continue
            if got == job:
                return job
            with self._cv:
                if got in self._queue:  # take it now; `job` goes back to the front
                    self._queue.remove(got)
                    self._queue.appendleft(job)
                    self._current = got
                    return got

    def run_here(self, report) -> None:
        """The compile helper's loop (compile_helper.py): the same sets in the same order, in this thread,
        without the pause hook; report(key, None) once a set is compiled, report(key, error) if it failed
        (the server then compiles that one itself). Returns only when stopped."""
        r = self.runner
        self.hooked = False
        self._begin()
        with uncounted():
            while (job := self._next()) is not None:
                t0 = time.monotonic()
                try:
                    self._warm(job)
                except Exception as e:  # noqa: BLE001 - reported; the next set goes on
                    report(job, e)
                else:
                    report(job, None)
                    self.log(f"compiled {_name(job)} in {time.monotonic() - t0:.1f} s")
                with self._cv:
                    r.ready.add(job)
                    self._current = None

    def _warm(self, job: tuple) -> None:
        r = self.runner
        mode, fixed_len, stop_width, _ = self.args
        if job[0] == "round":
            r.warm_round(job[1], job[2], mode, fixed_len, stop_width)
        elif job[0] == "plain":
            r.warm_plain_round(job[1], job[2], stop_width)
        elif job[0] == "forward":
            r.warm_forward(job[1])
        else:
            r.warm_prefill_bucket(job[1])


def _name(job: tuple) -> str:
    if job[0] in ("round", "plain"):
        what = "plain-decode round" if job[0] == "plain" else "drafting round"
        return f"{what}{' (logit processing)' if job[2] else ''} {job[1]}"
    return f"{job[0]} {job[1]}"
