"""Continuous-batching engine on rank 0: admission, segmented prefill, decode with DSpark
speculation, slot management, stop conditions, cancellation and per-request streaming.

One `step()` is one target forward over a flattened batch: prefill chunks of new requests and,
for each decoding request, [pending token, admitted drafts]. Verification commits tokens
(losslessly, dspark_accept), the DSpark rings receive the committed rows, the draft stages run on
[bonus, noise...] and `admit` picks how many drafts each request verifies next step.
With a runner that has static rounds (decode_graph static), a step with only decode rows runs as
one `runner.decode_round`: verification, sampling, drafting, confidence and admission inside the
runner's graphs, the committed tokens the one read-back (`_step_static`). All randomness is
counter-based (`noise`), keyed by request seed and sampling round, so both kinds of step draw the
same noise and a request's tokens do not depend on the mode.
Every request gets exactly one final event (finish_reason stop / length / cancelled, or an
error), also after errors and cancellations; no slot outlives its request.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from typing import Callable

import torch

from v4flash_backend.engine.round_plan import STOP_WIDTH
from v4flash_backend.request import GenerateRequest, RequestError
from v4flash_backend.settings import Settings

from .adaptive import AdaptivePolicy
from .calibration import regime
from .eager_step import EagerStep
from .fixed_guard import FixedGuard
from .logits import LogitProcessing
from .prefix_cache import PrefixCache
from .round_step import StaticRoundStep
from .runner import Runner
from .seq import CONTEXT_IDS, KIND_OF, ON_DEVICE, STEP_KINDS, Event, Seq
from .stats import EngineStats
from .step_cost import StepCost
from .step_learn import StepCostLearner
from .step_profile import StepProfiler
from .validation import check_request

# the engine's public names, importable from here as before the split into modules
# (STOP_WIDTH, a graph-shape constant, is the round plan types': engine.round_plan)
__all__ = ["CONTEXT_IDS", "KIND_OF", "ON_DEVICE", "STEP_KINDS", "STOP_WIDTH", "Engine", "Event", "Seq"]


class Engine(EngineStats, AdaptivePolicy, LogitProcessing, EagerStep, StaticRoundStep):
    """The scheduler core (admission, segments, the step loop, finishing, events); the concerns it
    combines live in their own modules: `stats` (counters), `adaptive` (stepping aside, probes,
    calibration feed), `step_profile` (the step cost), `eager_step` / `round_step` (the two kinds
    of step), `logits` (logit processing and sampling inputs). Mixins rather than objects of their
    own: every concern reads and updates the same requests (`Seq`) and counters within one step, and
    callers override single methods of an Engine (perf/bench_dspark's oracle `_confidence_logits`,
    tests' `_drafting_decision`). The step-cost profile is an object (`StepProfiler`): it shares
    nothing with a step but the runner."""

    def __init__(self, runner: Runner, config: Settings | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.runner = runner
        self.settings = config or Settings()
        self.mcfg = runner.cfg
        if self.settings.spec_mode != "off" and runner.drafter is None:
            self.settings = self.settings.replace(spec_mode="off")  # a checkpoint without DSpark stages
        self.gamma = self.mcfg.dspark_block_size if self.spec else 0
        self._init_policy()
        self.free = list(range(self.settings.max_num_seqs))
        self.waiting: deque[GenerateRequest] = deque()
        self.running: list[Seq] = []
        self.cancelled: set[str] = set()
        self.lock = threading.Lock()
        self.wakeup = threading.Condition(self.lock)
        # held for a whole step: stats() waits for the step in progress, so a client that reads the
        # stats after its final event sees that step's accounting (the event is sent mid-step)
        self.step_lock = threading.RLock()
        # a runner whose graphs compile in the background: its exec_lock (trn2.warmup.StepGate), held
        # for a whole step and profile -- no compiled graph runs beside it, and the compile pauses
        self._exec_lock = runner.exec_lock or contextlib.nullcontext()
        self.cost: StepCost | None = None
        self._cost_provisional = False  # the eager profile of a runner whose graphs are still compiling
        self.clock = clock  # the step-cost profile's and the decode steps' timer (step_profile, step_learn)
        # every decode step's measured seconds enter the learner (step_learn); with step_cost_online
        # admission reads the learned cost and the fixed-length guard (fixed_guard) watches admission
        self.learner = StepCostLearner()
        self.learn_admit = self.settings.step_cost_online
        self.guard = (FixedGuard(self.settings.fixed_len, self.gamma)
                      if self.spec and self.settings.step_cost_online else None)
        self._explore = False  # the step in progress drafts a fixed length for the guard (fixed_guard)
        self._ran_static = False  # the last step ran as a static round (the learner's path)
        self._step_blocks: list = []  # the step's verified blocks that admission chose (the guard's input)
        self._init_stats()
        self._kind = "draft"  # the decision of the step in progress
        self._seed_gen = torch.Generator().manual_seed(int(time.time_ns()) & ((1 << 62) - 1))
        self.prefix = PrefixCache(runner, self.settings.prefix_cache_bytes)

    @property
    def spec(self) -> bool:
        return self.settings.spec_mode != "off"

    # ---- public API (thread-safe) -----------------------------------------------------------
    def validate(self, r: GenerateRequest) -> None:
        """Raise RequestError (INVALID_ARG) for a request this engine cannot serve (engine.validation:
        the one check, which the Triton side runs too)."""
        check_request(r, self.mcfg.vocab_size, self.settings.max_model_len)

    def submit(self, r: GenerateRequest) -> str:
        self.validate(r)
        with self.lock:
            # Bounded wait queue: requests that a free slot will take at the next step do not
            # count, so a burst onto an idle engine is not refused; beyond max_queue_size more,
            # the client hears at once that the server is full (and may retry elsewhere or
            # later) instead of waiting up to queue_timeout_s while memory grows with the queue.
            if len(self.waiting) - len(self.free) >= self.settings.max_queue_size:
                self.totals["rejected"] += 1
                raise RequestError(
                    f"server at capacity: all {self.settings.max_num_seqs} KV slots are busy and "
                    f"{self.settings.max_queue_size} requests are already waiting (max_queue_size); retry later",
                    "UNAVAILABLE")
            self.waiting.append(r)
            self.totals["requests"] += 1
            self.wakeup.notify()
        return r.id

    def cancel(self, request_id: str) -> None:
        with self.lock:
            self.cancelled.add(request_id)
            self.wakeup.notify()

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.cancelled)

    def run(self, stop: threading.Event, idle_wait: float = 0.05) -> None:
        """Serve until `stop` is set (the worker's engine thread)."""
        while not stop.is_set():
            with self.lock:
                if not self.has_work():
                    self.wakeup.wait(idle_wait)
                    continue
            self.step()

    def run_request(self, r: GenerateRequest) -> list[Event]:
        """Run one request to completion in this thread (CLI, tests)."""
        events: list[Event] = []
        cb = r.callback
        r.callback = lambda e: (events.append(e), cb and cb(e))
        self.submit(r)
        while not (events and events[-1].final):
            self.step()
        return events

    # ---- the step's cost -----------------------------------------------------------------------
    def warmup(self) -> None:
        """Start-of-service work: profile (or load) the step cost before the first request."""
        if self.settings.spec_mode == "dspark":
            self.ensure_cost()

    def ensure_cost(self) -> StepCost:
        """The step cost admission reads: the learned one (step_learn) over the profile with
        step_cost_online, else the profile."""
        prior = self.prior_cost()
        return self.learned_cost() if self.learn_admit else prior

    @property
    def decode_path(self) -> str:
        """eager | static: the decode steps this engine's runner runs (the learner's cells by path)."""
        return "static" if self.runner.static_rounds else "eager"

    def learned_cost(self, sampled: bool | None = None) -> StepCost:
        """The profile corrected by the measured decode steps of this runner's path (step_learn), of
        the regime of the running requests (sampled: any of them samples) unless `sampled` says."""
        if sampled is None:
            sampled = self._sampled_step()
        return self.learner.view(self.prior_cost(), self.decode_path, 1 + self.gamma, sampled)

    def _sampled_step(self) -> bool:
        """Does a step over the running requests sample (the learner's regime of the step: sampled
        when any request is in the calibration's and the guard's sampled regime)?"""
        return any(regime(s.req.temperature) == "sampled" for s in self.running)

    def prior_cost(self) -> StepCost:
        """The step cost, profiled once (step_profile.StepProfiler on this engine's clock) on the free
        slots and the scratch slot, or loaded from sps_file; a profile it timed is saved there."""
        if self.cost is not None:
            return self.cost
        prof = StepProfiler(self.runner, self.settings, self.gamma, clock=self.clock)
        loaded = prof.load()
        if loaded is None and not self.runner.graphs_ready:
            # graphs still compiling in the background: the eager steps that serve meanwhile are
            # priced by the eager path's profile (its own file in the state directory; never
            # sps_path, which names the rounds' profile), and the rounds' profile replaces it once
            # they are all warm (`_step`)
            self._cost_provisional = True
            eager = self.settings.replace(decode_graph="eager", graph_backend="", graph_warmup="",
                                          resident_device="", sps_path="")
            prof = StepProfiler(self.runner, eager, self.gamma, clock=self.clock)
            loaded = prof.load()
        if loaded is not None:
            self.cost = loaded
            return self.cost
        with self._exec_lock:
            self.cost = prof.measure(self.free)
        prof.save(self.cost)
        return self.cost

    # ---- one step ------------------------------------------------------------------------------
    def step(self) -> None:
        # an eager engine's step (sampling, drafting, acceptance around the forward) without autograd's
        # bookkeeping, as LocalRunner's forward (`LocalRunner._inference`)
        with self.step_lock, self._exec_lock, torch.inference_mode(not self.runner.static_rounds):
            self._step()

    def _step(self) -> None:
        self._handle_cancellations()
        self._admit_waiting()
        if not self.running:
            return
        if hasattr(self._exec_lock, "traffic"):  # a background compile's gate (trn2.warmup.StepGate)
            # the server's start-up request alone is not traffic: the sets its steps lack are not asked for
            self._exec_lock.traffic = not all(s.req.warmup for s in self.running)
        if self._cost_provisional and self.runner.graphs_ready:
            # the graphs are warm: the rounds' own profile (loaded, or timed and saved) replaces the
            # eager one, and what the learner measured against the eager profile goes with it
            self.cost, self._cost_provisional, self.learner = None, False, StepCostLearner()
        if self.settings.spec_mode == "dspark" and self.cost is None:
            self.ensure_cost()  # before the step's forward: profiling runs forwards of its own
        try:
            self._step_running()
            self._flush_observations()
        except Exception as e:  # a failed forward fails the requests in flight, not the server
            for s in list(self.running):
                self._finish(s, error=f"engine step failed: {type(e).__name__}: {e}", code="UNAVAILABLE")
            raise

    def _handle_cancellations(self) -> None:
        with self.lock:
            ids, self.cancelled = self.cancelled, set()
            gone = [r for r in self.waiting if r.id in ids]
            for r in gone:
                self.waiting.remove(r)
        for r in gone:
            self._emit(r, Event(r.id, [], [], finish_reason="cancelled", num_prompt_tokens=len(r.prompt)))
        for s in [s for s in self.running if s.req.id in ids]:
            self._finish(s, reason="cancelled")

    def _admit_waiting(self) -> None:
        now = time.monotonic()
        with self.lock:
            new = []
            while self.waiting and self.free:
                r = self.waiting.popleft()
                new.append(Seq(r, self.free.pop(0), list(r.prompt)))
            expired = [r for r in self.waiting if now - r.arrival > self.settings.queue_timeout_s]
            for r in expired:
                self.waiting.remove(r)
            self.totals["expired"] += len(expired)
        for r in expired:
            self._emit(r, Event(r.id, [], [], error=f"no free slot within {self.settings.queue_timeout_s:.0f} s "
                                                    f"(max_num_seqs={self.settings.max_num_seqs})",
                                error_code="UNAVAILABLE"))
        for s in new:
            self.runner.reset_slot(s.slot)
            self.prefix.admit(s)  # the longest cached prefix of its prompt into the slot
            s.seed = int(s.req.seed) if s.req.seed is not None else int(
                torch.randint(0, 1 << 62, (1,), generator=self._seed_gen))
            self.running.append(s)
            self.totals["prompt_tokens"] += len(s.req.prompt)

    def _step_running(self) -> None:
        """One step; a decode-only step's seconds (the engine's clock) feed the step-cost learner and
        the fixed-length guard (`_learn_step`)."""
        timed = self.spec and not any(s.prefilling for s in self.running)
        if not timed:
            return self._run_step()
        B, S, drafted0 = sum(1 + s.ell for s in self.running), len(self.running), self.totals["drafted"]
        sampled = self._sampled_step()
        self._step_blocks = []
        t0 = self.clock()
        self._run_step()
        seconds = self.clock() - t0
        self._learn_step("static" if self._ran_static else "eager", B, S,
                         (self.totals["drafted"] - drafted0) // self.gamma, seconds, sampled)

    def _learn_step(self, path: str, B: int, S: int, R: int, seconds: float, sampled: bool = False) -> None:
        """The guard first (the step's blocks against fixed-length drafting, priced by the learned cost
        before this step enters it, once fixed's row count is measured: before, the learned cost
        there is the profile under suspicion, extrapolated), then the learner."""
        prior = self.cost
        if prior is None:
            return
        blocks, self._step_blocks = self._step_blocks, []
        if self.guard is not None and blocks and path == self.decode_path:
            view = self.learned_cost(sampled)
            F = self.guard.F
            B_fixed = B + sum(max(0, min(F, room)) - ell for _, ell, _, _, room in blocks)
            if self.learner.measured(path, B_fixed, drafting=True, sampled=sampled):
                self.guard.observe_step(blocks, seconds, float(view.t_step(B, S, R)),
                                        float(view.t_step(B_fixed, S, R)), S)
        self.learner.observe(path, B, S, R, seconds, prior, sampled)

    def _run_step(self) -> None:
        # a decode-only step decides first whether it drafts (from earlier steps only, as each kind of
        # step would), so a static runner can tell which of its graphs the round needs: the plain-decode
        # graph may be warm before the drafting round's (trn2.warmup)
        decision = None
        if self.running and not any(s.prefilling for s in self.running):
            decision = self._drafting_decision(list(self.running)) if self.spec else "draft"
        self._ran_static = self._static_ok(decision or "draft")
        if not self._ran_static and decision in ("draft", "probe") and self._plain_would_fit():
            # the drafting round's graphs are still compiling (trn2.warmup: the largest bucket announces
            # its plain-decode round alone) while a plain-decode graph takes the round: a compiled plain
            # round beats an eager drafting step several times over, so the round steps aside (the
            # drafting set was asked for above); drafts still pending are verified by one eager step
            decision = "skip"
            self._ran_static = self._static_ok(decision)
        if self._ran_static:
            return self._step_static(decision)
        before = dict(self.runner.counters)
        for s in self.running:  # an eager step after static rounds reads the draft blocks back
            if s.draft == ON_DEVICE:
                s.draft = self.runner.read_block(s.slot) if s.ell else None
        decode_only = not any(s.prefilling for s in self.running)
        if decode_only and self.runner.static_rounds:
            self.decode_totals["static_fallback_steps"] += 1  # a decode step the static rounds did not take
        prefilling = self.prefix.prefilling(self.running)
        self._step_eager(decision)
        self.prefix.after_step(self.running, prefilling)  # entries at the prefills' new boundaries
        if decode_only:
            self._count_step(before)
        else:
            self._count_prefill_step(before)

    # ---- bookkeeping -------------------------------------------------------------------------
    def _commit(self, s: Seq, new: list[int], stopped: bool, logprobs: list | None = None) -> None:
        ctx = s.tokens[max(0, len(s.tokens) - CONTEXT_IDS):]
        s.tokens += new
        s.n_out += len(new)
        s.draft, s.ell = None, 0
        self.totals["output_tokens"] += len(new)
        reason = None
        if stopped:
            reason = "stop"
        elif s.n_out >= s.req.max_tokens or len(s.tokens) >= self.settings.max_model_len:
            reason = "length"
        s.finish = reason
        self._emit(s.req, Event(s.req.id, new, ctx, finish_reason=reason, num_prompt_tokens=len(s.req.prompt),
                                num_cached_tokens=s.num_cached_tokens, num_output_tokens=s.n_out,
                                drafted=s.drafted, admitted=s.admitted,
                                accepted=s.accepted, verify_steps=s.verify_steps, logprobs=logprobs))

    @staticmethod
    def _done(s: Seq) -> bool:
        return s.finish is not None

    def _retire_finished(self) -> None:
        """Free the slots of the requests that ended in this step; they leave `running`."""
        for s in [s for s in self.running if self._done(s)]:
            self._release(s)
        self.running = [s for s in self.running if not self._done(s)]

    def _release(self, s: Seq) -> None:
        self.prefix.release(s)
        with self.lock:
            self.free.append(s.slot)
            self.free.sort()
        self.totals["finished"] += 1

    def _finish(self, s: Seq, reason: str | None = None, error: str | None = None, code: str | None = None) -> None:
        """End a running request from outside the normal flow (cancel, failure) and free its slot."""
        if s in self.running:
            self.running.remove(s)
            self._release(s)
        s.finish = reason or "error"
        self._emit(s.req, Event(s.req.id, [], [], finish_reason=reason, error=error, error_code=code,
                                num_prompt_tokens=len(s.req.prompt), num_cached_tokens=s.num_cached_tokens,
                                num_output_tokens=s.n_out, drafted=s.drafted, admitted=s.admitted, accepted=s.accepted,
                                verify_steps=s.verify_steps))

    def _emit(self, r: GenerateRequest, e: Event) -> None:
        if r.callback is not None:
            try:
                r.callback(e)
            except Exception:  # a broken consumer must not take the engine down
                pass
