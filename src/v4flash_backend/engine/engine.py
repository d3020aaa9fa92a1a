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

import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from v4flash_backend.request import GenerateRequest, RequestError
from v4flash_backend.settings import Settings

from . import dspark_accept as acc
from .calibration import Calibration, OnlineCalibrator, regime
from .dspark_sched import SPSTable, admit, admit_fixed, sps_tensors
from .noise import STREAM_DRAFT, STREAM_VERIFY, CounterSampler
from .precision import loop_dtype, unpack_bits
from .sampling import (
    LOGPROB_COLS,
    LOGPROB_WIDTH,
    SamplingParams,
    apply_penalties,
    mask_stop_tokens,
    token_logprobs,
    unpack_logprobs,
)
from .step_cost import StepCost, drafting_pays, expected_survivals, fit_seq_model, interleaved_medians

# the draft block of a sequence lives in the runner's per-slot state (a static decode round wrote it)
ON_DEVICE = "device"
STOP_WIDTH = 8  # stop ids per request a static decode round takes (more: the eager path)


def unpack_confidence(row: list[int], G: int) -> torch.Tensor:
    """The new block's [G] f32 confidence logits in a static round's read-back row (columns
    2G+5.., `loop_dtype` bits: trn2.static_round.pack, `precision.pack_bits`)."""
    return unpack_bits(row[G + 5:2 * G + 5]).float()


STEP_KINDS = ("draft", "probe", "aside")  # decode steps by DSpark decision (stats)
KIND_OF = {"draft": "draft", "probe": "probe", "skip": "aside"}

CONTEXT_IDS = 8  # committed ids sent before each chunk, for exact stateless detokenization


@dataclass
class Event:
    request_id: str
    token_ids: list[int]
    context_ids: list[int]
    finish_reason: str | None = None  # stop | length | cancelled (None while streaming)
    error: str | None = None
    error_code: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    drafted: int = 0  # drafts produced for this request so far
    admitted: int = 0  # drafts verified
    accepted: int = 0  # drafts accepted
    verify_steps: int = 0  # decode steps (each commits accepted drafts + one target token)
    # per token of token_ids when the request asked for log-probs (GenerateRequest.logprobs >= 0):
    # [logprob, rank, [[id, logprob], ...top alternatives]]
    logprobs: list | None = None

    def to_wire(self) -> dict:
        """The protocol event dict (what rank 0 sends over its socket; serving/response.py reads it)."""
        if self.error is not None:
            return {"event": "error", "code": self.error_code or "INTERNAL", "message": self.error}
        d = {"event": "chunk", "token_ids": list(self.token_ids), "context_ids": list(self.context_ids),
             "finish_reason": self.finish_reason, "num_prompt_tokens": self.num_prompt_tokens,
             "num_output_tokens": self.num_output_tokens, "drafted": self.drafted, "accepted": self.accepted}
        if self.logprobs is not None:
            d["logprobs"] = self.logprobs
        return d

    @property
    def tau(self) -> float:
        """Tokens committed per verify step, the bonus included."""
        return (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass
class _Seq:
    req: GenerateRequest
    slot: int
    tokens: list[int]  # prompt + committed output
    n_cached: int = 0  # leading tokens whose rows are in the cache
    n_out: int = 0
    drafted: int = 0
    admitted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    seed: int = 0  # the request's seed (drawn at admission when it gives none): keys its noise
    rounds: int = 0  # sampling rounds so far (first token, then one per verify): keys its noise
    counted: int = 0  # generated tokens the static runner's device-resident counts hold (penalties)
    draft: tuple | str | None = None  # (tokens [G], prev [G], q [G], z [G, V]) or ON_DEVICE
    conf_logits: torch.Tensor | None = None  # [G] the confidence head's logits for a host-drafted block
    last_c: list[float] | None = None  # calibrated conditional confidences of the block it verifies next
    # per position k: decayed counts of "draft k reached" (trials) and "draft k accepted" (hits) over
    # its verified blocks, unverified positions counted in expectation (see Engine._observe_block)
    ev_trials: list[float] | None = None
    ev_hits: list[float] | None = None
    ell: int = 0  # drafts admitted for the next verify
    first_token_time: float | None = None
    finish: str | None = None  # why it ended (stop / length / cancelled / error); None while running

    @property
    def prefilling(self) -> bool:
        return self.n_cached < len(self.req.prompt)


class Engine:
    def __init__(self, runner, config: Settings | None = None):
        self.runner = runner
        self.cfg = config or Settings()
        self.mcfg = runner.cfg
        if self.cfg.spec_mode != "off" and runner.drafter is None:
            self.cfg = self.cfg.replace(spec_mode="off")  # a checkpoint without DSpark stages
        self.gamma = self.mcfg.dspark_block_size if self.spec else 0
        self.calib = (OnlineCalibrator(self._load_calibration(), enabled=self.cfg.calibration_online)
                      if self.spec else None)
        # calibrated confidences, draft-cost-aware admission and stepping aside, on eager steps and in
        # the static rounds alike (the calibration and the step table are round inputs, a stepped-aside
        # round is graph 1 alone): the same request and seed give the same tokens in both modes
        self.adaptive = self.cfg.dspark_adaptive
        # a step's verified blocks enter the online calibration after the step's drafting, in both
        # modes: the static draft graph reads the calibration as an input taken before the round
        self._observed: list[tuple] = []
        self.free = list(range(self.cfg.max_num_seqs))
        self.waiting: deque[GenerateRequest] = deque()
        self.running: list[_Seq] = []
        self.cancelled: set[str] = set()
        self.lock = threading.Lock()
        self.wakeup = threading.Condition(self.lock)
        # held for a whole step: stats() waits for the step in progress, so a client that reads the
        # stats after its final event sees that step's accounting (the event is sent mid-step)
        self.step_lock = threading.RLock()
        self.cost: StepCost | None = None
        self._skipped = 0  # consecutive steps whose drafts stepped aside
        self._probe_gap = self.cfg.probe_every  # steps aside before the next probe (see _drafting_decision)
        self._c_mean: dict[str, list[float]] = {}  # per regime: mean calibrated confidences (a prior)
        # rejected: refused at submit because the wait queue was full; expired: failed after
        # queue_timeout_s without a slot (both are UNAVAILABLE answers).
        self.totals = dict(requests=0, finished=0, prompt_tokens=0, output_tokens=0, drafted=0, admitted=0,
                           accepted=0, steps=0, verify_rows=0, draft_skipped=0, draft_probes=0, rejected=0,
                           expired=0, ring_rows_skipped=0)
        # per draft position j = 1..gamma: verify rows where draft j was admitted / accepted
        self.admitted_at = [0] * self.gamma
        self.accepted_at = [0] * self.gamma
        # decode-step accounting (engine stats, Prometheus, the CLI's step report): decode steps
        # (steps with no prefill rows), graph executions, host syncs (device-to-host reads other
        # than the final read-back of committed tokens) and host-to-device bytes in those steps
        # static_fallback_steps: decode steps a static runner ran eagerly (more than STOP_WIDTH stop
        # ids, no bucket); prefill_steps: steps with prefill rows, with their graph executions
        self.decode_totals = dict(decode_steps=0, static_steps=0, graph_executions=0, host_syncs=0,
                                  host_to_device_bytes=0, static_fallback_steps=0, prefill_steps=0,
                                  prefill_step_graph_executions=0, prefill_step_eager_forwards=0)
        # decode steps by DSpark decision (draft | probe | aside: stepped aside) with their graph
        # executions (a static round that steps aside runs graph 1 alone)
        self.kind_totals = {k: [0, 0] for k in STEP_KINDS}
        self._kind = "draft"  # the decision of the step in progress
        self._seed_gen = torch.Generator().manual_seed(int(time.time_ns()) & ((1 << 62) - 1))

    @property
    def spec(self) -> bool:
        return self.cfg.spec_mode != "off"

    def _load_calibration(self) -> Calibration:
        if self.cfg.calibration_path:
            return Calibration.load(self.cfg.calibration_path, self.gamma)
        return Calibration.for_checkpoint(self.cfg.checkpoint_dir, self.gamma)

    # ---- public API (thread-safe) -----------------------------------------------------------
    def validate(self, r: GenerateRequest) -> None:
        V = self.mcfg.vocab_size
        if not r.prompt:
            raise RequestError("empty prompt: give at least one token")
        if len(r.prompt) >= self.cfg.max_model_len:
            raise RequestError(f"prompt has {len(r.prompt)} tokens; max_model_len is {self.cfg.max_model_len} "
                               "(prompt + at least one generated token must fit)")
        bad = [t for t in r.prompt if not 0 <= int(t) < V]
        if bad:
            raise RequestError(f"token id {bad[0]} outside the vocabulary [0, {V})")
        if r.max_tokens <= 0:
            raise RequestError(f"max_tokens must be > 0, got {r.max_tokens}")
        if not r.temperature >= 0:
            raise RequestError(f"temperature must be >= 0, got {r.temperature}")
        if not 0 < r.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {r.top_p}")
        if r.top_k < 0:
            raise RequestError(f"top_k must be >= 0, got {r.top_k}")
        bad = [t for t in r.stop_token_ids if not 0 <= int(t) < V]
        if bad:
            raise RequestError(f"stop token id {bad[0]} outside the vocabulary [0, {V})")
        if not 0 <= r.min_tokens <= r.max_tokens:
            raise RequestError(f"min_tokens must be in [0, max_tokens={r.max_tokens}], got {r.min_tokens}")
        if not -1 <= r.logprobs <= 20:
            raise RequestError(f"logprobs must be in [0, 20] (-1: none), got {r.logprobs}")

    def submit(self, r: GenerateRequest) -> str:
        self.validate(r)
        with self.lock:
            # Bounded wait queue: requests that a free slot will take at the next step do not
            # count, so a burst onto an idle engine is not refused; beyond max_queue_size more,
            # the client hears at once that the server is full (and may retry elsewhere or
            # later) instead of waiting up to queue_timeout_s while memory grows with the queue.
            if len(self.waiting) - len(self.free) >= self.cfg.max_queue_size:
                self.totals["rejected"] += 1
                raise RequestError(
                    f"server at capacity: all {self.cfg.max_num_seqs} KV slots are busy and "
                    f"{self.cfg.max_queue_size} requests are already waiting (max_queue_size); retry later",
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

    def stats(self) -> dict:
        # Wait for the step in progress (a client reading the stats after its final event, sent
        # mid-step, then sees that step counted), but not for ever: the lock is not fair, and a busy
        # engine thread takes it again at once after each step, which starved the gauges (the KV-slot
        # gauge read 0 while a request ran). After the bound the numbers are those of the last step.
        got = self.step_lock.acquire(timeout=0.25)
        try:
            with self.lock:
                d = dict(self.totals)
                d.update(waiting=len(self.waiting), running=len(self.running),
                         slots_in_use=self.cfg.max_num_seqs - len(self.free), slots_total=self.cfg.max_num_seqs)
        finally:
            if got:
                self.step_lock.release()
        d["tau"] = (d["accepted"] + d["verify_rows"]) / d["verify_rows"] if d["verify_rows"] else 0.0
        dt = dict(self.decode_totals)
        n = dt["decode_steps"]
        d.update(dt, decode_graph=getattr(self.runner, "decode_graph", "eager"),
                 graphs_compiled=getattr(self.runner, "counters", {}).get("graphs_compiled", 0),
                 prefill_graphs=getattr(self.runner, "counters", {}).get("prefill_graphs", 0),
                 boundary_resident_moves=getattr(self.runner, "counters", {}).get("boundary_resident_moves"),
                 boundary_reads=getattr(self.runner, "counters", {}).get("boundary_reads"),
                 plain_decode_rounds=getattr(self.runner, "counters", {}).get("plain_decode_rounds", 0),
                 graphs_per_step=dt["graph_executions"] / n if n else 0.0,
                 graphs_per_prefill_step=(dt["prefill_step_graph_executions"] / dt["prefill_steps"]
                                          if dt["prefill_steps"] else 0.0),
                 host_syncs_per_step=((dt["host_syncs"] / n if n else 0.0)
                                      if getattr(self.runner, "counts_host_syncs", True) else None),
                 host_to_device_bytes_per_step=dt["host_to_device_bytes"] / n if n else 0.0)
        d["decode_steps_by_kind"] = {k: v[0] for k, v in self.kind_totals.items()}
        d["graphs_per_step_by_kind"] = {k: v[1] / v[0] if v[0] else 0.0 for k, v in self.kind_totals.items()}
        d["accept_rate_at"] = [a / n if n else 0.0 for a, n in zip(self.accepted_at, self.admitted_at)]
        if self.calib is not None:
            d.update(self.calib.stats())
        return d

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
        if self.cfg.spec_mode == "dspark":
            self.ensure_cost()

    def ensure_cost(self) -> StepCost:
        """The target forward's steps/s by B tokens of R sequences and the draft stages' seconds by
        R requests, profiled once (interleaved rounds, medians, a fitted model; step_cost.py) on the
        free slots and the scratch slot, or loaded from sps_path. A profile taken while requests
        hold slots covers R up to the free ones (t_forward holds the largest R's table beyond)."""
        if self.cost is not None:
            return self.cost
        import os

        if self.cfg.sps_file and os.path.exists(self.cfg.sps_file):
            self.cost = StepCost.load(self.cfg.sps_file)
            return self.cost
        scratch = self.runner.state.num_slots - 1
        top = self.cfg.max_num_seqs * (1 + self.gamma)
        sizes = sorted({1, 2, 4, 8, 16, 32, 64, top} & set(range(1, top + 1)) | {top})
        if getattr(self.runner, "static_rounds", False):
            return self._static_cost(sizes, scratch)

        # eager: forwards shaped like decode steps -- R sequences x k rows each after a context of
        # C tokens, on the free slots (all of them at start), so the per-sequence work is in the
        # table; the context is written once and each timed call overwrites the same positions
        # (a reset inside the timed call had added its own cost to every size)
        Q = 1 + self.gamma
        slots = ([scratch] + [s for s in self.free if s != scratch])[:self.cfg.max_num_seqs]
        ctx = max(1, min(48, self.cfg.max_model_len - Q - 2))
        ks = sorted(k for k in {1, 2, (Q + 2) // 2, Q} if 1 <= k <= Q)
        Rs = sorted({r for r in (1, 2, 4, 8, 16, 32, 64) if r <= len(slots)} | {len(slots)})
        for slot in slots:
            self.runner.reset_slot(slot)
            self.runner.forward(torch.zeros(ctx, dtype=torch.long), [(slot, 0, ctx)], torch.tensor([ctx - 1]), True)
            self.runner.dspark([(slot, torch.arange(ctx), torch.arange(ctx))], [])
        pairs = [(R, k) for R in Rs for k in ks]

        def fwd(i: int):
            R, k = pairs[i]
            self.runner.forward(torch.zeros(R * k, dtype=torch.long), [(slots[j], ctx, k) for j in range(R)],
                                torch.arange(R * k), True)

        med = interleaved_medians(fwd, range(len(pairs)), rounds=3)
        (a, s_r, b_r), dropped = fit_seq_model({(R, R * k): med[i] for i, (R, k) in enumerate(pairs)})
        replaced = [list(p) for p in dropped]
        # each R's table holds the fitted model at its profiled sizes (linear in B: interpolated)
        by_seqs = {R: SPSTable([R * k for k in ks], [1.0 / max(a + s_r * R + b_r * R * k, 1e-6) for k in ks],
                               interpolate=True) for R in Rs}
        d = self.runner.drafter

        def draft(R: int):  # draft stages + host drafting work for R requests
            out = self.runner.dspark([], [(slots[j], ctx - 1, 3) for j in range(R)])
            params = SamplingParams.make(R, [1.0] * R, [0] * R, [1.0] * R)  # sampled: the costlier host path
            block = acc.markov_draft(out.base_logits, torch.full((R,), 3), lambda prev: d.markov(prev)[0],
                                     params, self._sampler_for(R))
            admit(torch.sigmoid(d.confidence(out.hidden, d.markov_embed(block.prev))),
                  lambda B: torch.ones_like(B, dtype=torch.float64))

        rs = sorted({r for r in (1, 2, 4, 8, 16, 32) if r <= len(slots)} | {len(slots)})
        draft_s = interleaved_medians(draft, rs, rounds=3) if d is not None else {}
        for slot in slots:
            self.runner.reset_slot(slot)
        self.cost = StepCost(by_seqs[1], draft_s, replaced, by_seqs=by_seqs)
        self._save_cost()
        return self.cost

    def _static_cost(self, sizes: list[int], scratch: int) -> StepCost:
        """The step cost of a static runner, timed on the graphs it serves: each sequence bucket's
        decode round (through the runner's `decode_round`, so every rank of a group runs it) on a
        plan of padding sequences (scratch slot, no valid row; same shapes and work as a real
        round), interleaved rounds, medians -- twice: the round that steps aside (graph 1 alone:
        verify + acceptance) gives t_forward, the full round (+ graph 2: rings, draft stages,
        Markov drafting, confidence, admission) minus it gives the draft seconds of R requests
        (R's bucket), so `drafting_pays` compares a stepped-aside round with a drafting one."""
        from .step_cost import round_seconds_by_tokens

        Q = 1 + self.gamma
        N = self.cfg.max_num_seqs
        timed = sorted({min(1 << (S - 1).bit_length(), N) for S in range(1, N + 1)})  # the sequence buckets
        seqs = sorted({-(-b // Q) for b in sizes} | set(range(1, N + 1)))  # a round of S pads to its bucket

        def round_(S: int, mode: str):
            self.runner.decode_round(dict(
                slot=[scratch] * S, start=[0] * S, pending=[0] * S, ell=[-1] * S, temperature=[1.0] * S,
                top_k=[0] * S, top_p=[1.0] * S, seed=list(range(S)), rnd=[0] * S, budget=[0] * S,
                len_left=[0] * S, stop_ids=[[-1] * STOP_WIDTH] * S, spec_mode=mode, fixed_len=0,
                sps=None))

        both = [(S, m) for S in timed for m in ("off", self.cfg.spec_mode)]  # interleaved: aside and full
        med = interleaved_medians(lambda i: round_(*both[i]), range(len(both)), rounds=3)
        bucket = {S: min(t for t in timed if t >= S) for S in seqs}
        alone = {S: med[both.index((bucket[S], "off"))] for S in seqs}
        full = {S: med[both.index((bucket[S], self.cfg.spec_mode))] for S in seqs}
        fwd_s = round_seconds_by_tokens(sizes, Q, alone)
        draft_s = {S: max(full[S] - alone[S], 0.0) for S in range(1, N + 1)}
        self.runner.reset_slot(scratch)
        self.cost = StepCost(SPSTable(sorted(fwd_s), [1.0 / fwd_s[b] for b in sorted(fwd_s)]), draft_s, [])
        self._save_cost()
        return self.cost

    def _save_cost(self) -> None:
        """The profile to sps_path or the state directory (`Settings.sps_file`), never elsewhere:
        written beside and renamed, so a server starting meanwhile reads a whole file or none."""
        import os

        path = self.cfg.sps_file
        if not path:
            return
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        self.cost.save(tmp)
        os.replace(tmp, path)

    def _sampler_for(self, R: int):
        return CounterSampler(list(range(R)), [0] * R, STREAM_DRAFT)

    def _drafting_decision(self, seqs: list[_Seq]) -> str:
        """draft | probe | skip for this step (dspark_adaptive; see step_cost.drafting_pays). Uses only
        acceptances observed in earlier steps, never this step's draws."""
        if self.cfg.spec_mode != "dspark" or not self.adaptive:
            return "draft"
        surv = [self._expected_survivals(s) for s in seqs]
        if drafting_pays(self.ensure_cost(), surv)[0]:
            self._skipped = 0
            self._probe_gap = self.cfg.probe_every
            return "draft"
        self._skipped += 1
        if self._skipped >= self._probe_gap:
            # back-off: a probe that leaves speculation aside doubles the gap to the next one (up to
            # probe_max_every). Where drafts keep failing (T = 1 on the embedded model) a probe's
            # draft stages cost ~20 ms against a ~47 ms plain step (cProfile of a batch-1 run), so a
            # fixed gap of 16 paid ~3 % (an estimate from those two times); a workload change is
            # still seen within probe_max_every steps
            self._skipped = 0
            self._probe_gap = max(self.cfg.probe_every, min(2 * self._probe_gap, self.cfg.probe_max_every))
            return "probe"
        return "skip"

    # ---- one step ------------------------------------------------------------------------------
    def step(self) -> None:
        with self.step_lock:
            self._step()

    def _step(self) -> None:
        self._handle_cancellations()
        self._admit_waiting()
        if not self.running:
            return
        if self.cfg.spec_mode == "dspark" and self.cost is None:
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
                new.append(_Seq(r, self.free.pop(0), list(r.prompt)))
            expired = [r for r in self.waiting if now - r.arrival > self.cfg.queue_timeout_s]
            for r in expired:
                self.waiting.remove(r)
            self.totals["expired"] += len(expired)
        for r in expired:
            self._emit(r, Event(r.id, [], [], error=f"no free slot within {self.cfg.queue_timeout_s:.0f} s "
                                                    f"(max_num_seqs={self.cfg.max_num_seqs})",
                                error_code="UNAVAILABLE"))
        for s in new:
            self.runner.reset_slot(s.slot)
            s.seed = int(s.req.seed) if s.req.seed is not None else int(
                torch.randint(0, 1 << 62, (1,), generator=self._seed_gen))
            self.running.append(s)
            self.totals["prompt_tokens"] += len(s.req.prompt)

    def _params(self, seqs: list[_Seq]) -> SamplingParams:
        return SamplingParams.make(len(seqs), [s.req.temperature for s in seqs], [s.req.top_k for s in seqs],
                                   [s.req.top_p for s in seqs])

    def _sampler(self, seqs: list[_Seq], stream: int, rnd_offset: int = 0) -> CounterSampler:
        """The requests' noise of this sampling round (noise.py): the same draws the static graphs
        compute, so eager and static serving give the same tokens."""
        return CounterSampler([s.seed for s in seqs], [s.rounds + rnd_offset for s in seqs], stream)

    def _static_ok(self) -> bool:
        """A step runs as a static decode round when every running request decodes (no prefill
        rows) and the runner has a bucket for it."""
        r = self.runner
        if not getattr(r, "static_rounds", False) or not self.running or any(s.prefilling for s in self.running):
            return False
        if any(len(x) > STOP_WIDTH for x in self._stop_lists(self.running)):
            return False
        # min_tokens, penalties and log-probs run in the rounds' processed variant (static_round)
        return r.round_fits(len(self.running), max(s.n_cached + 1 + s.ell for s in self.running))

    def _step_running(self) -> None:
        if self._static_ok():
            return self._step_static()
        counters = getattr(self.runner, "counters", None)
        before = dict(counters) if counters is not None else None
        for s in self.running:  # an eager step after static rounds reads the draft blocks back
            if s.draft == ON_DEVICE:
                s.draft = self.runner.read_block(s.slot) if s.ell else None
        decode_only = not any(s.prefilling for s in self.running)
        if decode_only and getattr(self.runner, "static_rounds", False):
            self.decode_totals["static_fallback_steps"] += 1  # a decode step the static rounds did not take
        self._step_eager()
        if decode_only:
            self._count_step(before)
        else:
            self._count_prefill_step(before)

    def _count_prefill_step(self, before: dict | None) -> None:
        """Steps with prefill rows: their graph executions (prefill graphs, the verify graph of the
        step's decode rows; none on the eager runner) and forwards that ran op by op."""
        t = self.decode_totals
        t["prefill_steps"] += 1
        c = getattr(self.runner, "counters", None)
        if c is not None and before is not None:
            t["prefill_step_graph_executions"] += c.get("graph_executions", 0) - before.get("graph_executions", 0)
            t["prefill_step_eager_forwards"] += c.get("eager_forwards", 0) - before.get("eager_forwards", 0)

    def _count_step(self, before: dict | None) -> None:
        t = self.decode_totals
        t["decode_steps"] += 1
        c = getattr(self.runner, "counters", None)
        if c is not None and before is not None:
            for k in ("graph_executions", "host_syncs", "host_to_device_bytes"):
                t[k] += c.get(k, 0) - before.get(k, 0)
        if self.spec:
            kt = self.kind_totals[self._kind]
            kt[0] += 1
            if c is not None and before is not None:
                kt[1] += c.get("graph_executions", 0) - before.get("graph_executions", 0)

    def _step_static(self) -> None:
        """One decode round in the runner's static graphs: verify + acceptance + sampling, then
        the DSpark rings, the draft block, Markov drafting, confidence and admission, all inside
        the graphs; the committed tokens (with their counts, the next admitted lengths and the new
        block's confidence logits) are the one read-back. dspark_adaptive: the same decision as an
        eager step, taken on the host before the round from host state only (`_drafting_decision`):
        draft (calibrated admission with the whole step's cost), probe (one draft each) or skip (the
        round steps aside: graph 1 alone, no ring writes, no draft stages)."""
        before = dict(self.runner.counters)
        seqs = list(self.running)
        decision = self._drafting_decision(seqs) if self.spec else "draft"
        self._kind = KIND_OF[decision]
        dspark = self.spec and self.cfg.spec_mode == "dspark"
        for s in seqs:  # a block drafted on the host (eager step) moves into the runner's state
            if s.draft is not None and s.draft != ON_DEVICE:
                if s.ell:
                    self.runner.load_block(s.slot, s.draft)
                s.draft = ON_DEVICE
        L = self.cfg.max_model_len
        stops = self._stop_lists(seqs)
        processed = self._processed(seqs) or any(s.req.logprobs >= 0 for s in seqs)
        if processed:  # the penalties' generated-token counts on the device must be current
            for s in seqs:
                if (s.req.frequency_penalty or s.req.presence_penalty) and s.counted != s.n_out:
                    self.runner.set_counts(s.slot, s.tokens[len(s.req.prompt):])
                    s.counted = s.n_out
        in_sync = [s.counted == s.n_out for s in seqs]
        plan = dict(
            slot=[s.slot for s in seqs], start=[s.n_cached for s in seqs],
            pending=[s.tokens[s.n_cached] for s in seqs], ell=[s.ell for s in seqs],
            temperature=[float(s.req.temperature) for s in seqs], top_k=[int(s.req.top_k) for s in seqs],
            top_p=[float(s.req.top_p) for s in seqs], seed=[s.seed for s in seqs],
            rnd=[s.rounds for s in seqs], budget=[s.req.max_tokens - s.n_out for s in seqs],
            len_left=[L - s.n_cached - 1 for s in seqs],
            stop_ids=[x + [-1] * (STOP_WIDTH - len(x)) for x in stops],
            spec_mode=self.cfg.spec_mode if self.spec and decision != "skip" else "off",
            fixed_len=self.cfg.fixed_len, sps=sps_tensors(self.ensure_cost().forward) if dspark else None)
        if dspark:
            plan.update(self._adaptive_plan(seqs, decision))
        if processed:
            plan.update(n_out=[s.n_out for s in seqs], min_tokens=[s.req.min_tokens for s in seqs],
                        frequency=[float(s.req.frequency_penalty) for s in seqs],
                        presence=[float(s.req.presence_penalty) for s in seqs])
        # [S] rows: tokens[G+1], num, accepted, stopped, next ell (+ the log-probs pack when processed)
        out = self.runner.decode_round(plan)
        self.totals["steps"] += 1
        n = len(out[0])
        # the runner's block size (also with spec_mode off: then ell stays 0): [G+1 tokens, committed,
        # accepted, stopped, next ell, G confidence logits (+ the log-probs pack)]
        G = (n - 5 - LOGPROB_COLS) // (2 + LOGPROB_COLS) if processed else (n - 5) // 2
        drafted = []
        for i, s in enumerate(seqs):
            row = out[i]
            k, n_acc, stopped, nxt = row[G + 1], row[G + 2], bool(row[G + 3]), row[G + 4]
            self._account_verify(s, n_acc)
            s.rounds += 1
            s.n_cached += k
            if decision == "skip":  # stepped aside: the rings miss these positions (as on an eager step)
                self.totals["ring_rows_skipped"] += k
            lps = unpack_logprobs(row[2 * G + 5:], k, s.req.logprobs) if processed and s.req.logprobs >= 0 else None
            if processed and in_sync[i]:
                s.counted += k  # the round added its committed tokens to the device counts
            self._commit(s, row[:k], stopped, lps)
            if self._done(s) or not self.spec:
                continue
            if decision == "skip":
                s.draft, s.conf_logits, s.last_c, s.ell = None, None, None, 0
                self.totals["draft_skipped"] += 1
                continue
            s.ell, s.draft = nxt, ON_DEVICE
            s.conf_logits = unpack_confidence(row, G)
            drafted.append(s)
            s.drafted += self.gamma
            self.totals["drafted"] += self.gamma
        if drafted and decision == "probe":
            self.totals["draft_probes"] += 1
        if drafted and self.adaptive and dspark:  # as _draft: the next decision reads these survivals
            self._calibrated(drafted, torch.stack([s.conf_logits for s in drafted]))
        for s in [s for s in self.running if self._done(s)]:
            self._release(s)
        self.running = [s for s in self.running if not self._done(s)]
        self.decode_totals["static_steps"] += 1
        self._count_step(before)

    def _adaptive_plan(self, seqs: list[_Seq], decision: str) -> dict:
        """The draft graph's admission inputs (static_round.draft_round): with dspark_adaptive, each
        row's calibration (T_k, b_k) of its regime and the draft seconds by live rows R (admission
        then reads `StepCost.sps_for(R)`, as `_draft`); without, the raw head (T = 0) and the
        forward's table. A probe admits one draft per row."""
        G, S = self.gamma, len(seqs)
        if self.adaptive:
            cost = self.ensure_cost()
            cal = [self.calib.cal.of(regime(s.req.temperature)) for s in seqs]
            t_draft = [cost.t_draft(r) for r in range(S + 1)]
        else:
            cal, t_draft = [[(0.0, 0.0)] * G] * S, [0.0] * (S + 1)
        return dict(cal=cal, t_draft=t_draft, fixed_ell=[1 if decision == "probe" else -1] * S)

    # the stepping-aside estimate (README "Speculation that steps aside"): a request's acceptance
    # per position, its regime's observed rate as a prior worth PRIOR_BLOCKS blocks, then its own
    # blocks with weight EVIDENCE_DECAY^age. Measured on the embedded model (batch 1, greedy): the
    # last block's survivals alone, one noisy block, stepped aside on 191 of 290 steps where
    # drafting every step (fixed-5) was 1.4x faster.
    PRIOR_BLOCKS = 2.0
    EVIDENCE_DECAY = 0.75
    C_MEAN_RATE = 0.1

    def _expected_survivals(self, s: _Seq) -> list[float]:
        """The prefix survivals a request's next block is expected to reach, from past blocks only
        (never this step's draws: the decision they feed is independent of them, so lossless).
        The prior: the regime's observed acceptance where the window has evidence, else the mean
        calibrated confidence of the regime's drafted blocks (a new engine: at T = 1 the first
        blocks' calibrated c ~ 0.3 says at once what 8 observed blocks would), else 1."""
        reg = regime(s.req.temperature)
        prior = self.calib.acceptance_rates(reg, fallback=self._c_mean.get(reg))
        if s.ev_trials is None:
            return expected_survivals(prior)
        P = self.PRIOR_BLOCKS
        return expected_survivals([(P * r + h) / (P + n) for r, h, n in zip(prior, s.ev_hits, s.ev_trials)])

    def _observe_block(self, s: _Seq, n_acc: int) -> None:
        """A verified block enters the request's evidence: position k < ell was reached if drafts
        < k were accepted, and accepted if n_acc > k; a position admit left unverified counts in
        expectation under the calibrated head (reached with probability prod c_i over the
        unverified i < k, accepted with c_k), so a block that admit declined still speaks -- a
        request whose blocks admit keeps declining stops paying for the draft stages."""
        G, c = self.gamma, s.last_c
        if s.ev_trials is None:
            s.ev_trials, s.ev_hits = [0.0] * G, [0.0] * G
        lam = self.EVIDENCE_DECAY
        reach = 1.0
        for k in range(G):
            s.ev_trials[k] *= lam
            s.ev_hits[k] *= lam
            if k < s.ell:
                if n_acc >= k:
                    s.ev_trials[k] += 1.0
                    s.ev_hits[k] += float(n_acc > k)
            elif n_acc == s.ell:  # every verified draft accepted: k is reached in expectation
                s.ev_trials[k] += reach
                s.ev_hits[k] += reach * c[k]
                reach *= c[k]

    def _account_verify(self, s: _Seq, n_acc: int) -> None:
        if s.last_c is not None and s.conf_logits is not None and self.adaptive:
            self._observe_block(s, n_acc)
        if s.ell and s.conf_logits is not None:  # the block's confidences, for online calibration
            self._observed.append((regime(s.req.temperature), s.conf_logits, s.ell, n_acc))
        s.accepted += n_acc
        s.admitted += s.ell
        s.verify_steps += 1
        for j in range(s.ell):
            self.admitted_at[j] += 1
            self.accepted_at[j] += n_acc > j
        self.totals["admitted"] += s.ell
        self.totals["accepted"] += n_acc
        self.totals["verify_rows"] += 1

    def _flush_observations(self) -> None:
        """The step's verified blocks into the online calibration (after its drafting: see __init__)."""
        obs, self._observed = self._observed, []
        for o in obs:
            self.calib.observe(*o)

    def _step_eager(self) -> None:
        tokens, spec, rows = [], [], []
        decode, prefill = [], []  # (seq, segment offset, n rows)
        off = 0
        for s in self.running:  # decode rows first: they are latency-critical
            if s.prefilling:
                continue
            ids = [s.tokens[s.n_cached]] + (s.draft[0][: s.ell].tolist() if s.ell else [])
            decode.append((s, off, len(ids)))
            tokens += ids
            spec.append((s.slot, s.n_cached, len(ids)))
            rows += range(off, off + len(ids))
            off += len(ids)
        budget = self.cfg.step_token_budget
        for s in self.running:
            if not s.prefilling or budget <= 0:
                continue
            n = min(self.cfg.prefill_chunk, len(s.req.prompt) - s.n_cached, budget)
            budget -= n
            prefill.append((s, off, n))
            tokens += s.req.prompt[s.n_cached:s.n_cached + n]
            spec.append((s.slot, s.n_cached, n))
            if s.n_cached + n == len(s.req.prompt):
                rows.append(off + n - 1)
            off += n
        # stepping aside is decided before the forward, from past acceptances only (the requests that
        # draft after this step: the decoding ones and those whose prefill completes now); a step that
        # steps aside computes no taps and writes no ring rows for its decode rows, so it costs what
        # plain decoding costs (prefill rows still fill the rings: a new request's context)
        drafting = [s for s in self.running if not s.prefilling] + [s for s, o, n in prefill
                                                                     if s.n_cached + n == len(s.req.prompt)]
        decision = self._drafting_decision(drafting) if self.spec and drafting else "draft"
        self._kind = KIND_OF[decision]
        want_taps = self.spec and (decision != "skip" or bool(prefill))
        out = self.runner.forward(torch.tensor(tokens, dtype=torch.long), spec, torch.tensor(rows, dtype=torch.long),
                                  want_taps)
        self.totals["steps"] += 1
        logits_at = {r: i for i, r in enumerate(rows)}
        writes, draft_seqs = [], []
        # -- verify decode rows -------------------------------------------------------------------
        if decode:
            seqs = [d[0] for d in decode]
            ell = torch.tensor([s.ell for s in seqs], dtype=torch.long)
            lg = out.logits[[logits_at[r] for s, o, n in decode for r in range(o, o + n)]]
            # verify row j of a request predicts its output token n_out + j
            lg = self._process_target(lg, seqs, [list(range(s.n_out, s.n_out + n)) for s, o, n in decode])
            res = acc.verify(lg, self._block(seqs), ell, self._params(seqs), self._sampler(seqs, STREAM_VERIFY),
                             self._stop_ids(seqs), torch.tensor([s.req.max_tokens - s.n_out for s in seqs]))
            lp_row = 0
            for i, (s, o, n) in enumerate(decode):
                k = int(res.num_tokens[i])
                new = res.tokens[i, :k].tolist()
                lps = self._logprobs(s, lg[lp_row:lp_row + k], new)
                lp_row += n
                self._account_verify(s, int(res.accepted[i]))
                s.rounds += 1
                pos0 = s.n_cached
                s.n_cached += k  # the rows of x0 and the accepted drafts are committed context
                if decision != "skip":
                    writes.append((s.slot, torch.arange(o, o + k), torch.arange(pos0, pos0 + k)))
                else:  # the ring misses these positions: a later draft sees older context there (lossless)
                    self.totals["ring_rows_skipped"] += k
                self._commit(s, new, bool(res.stopped[i]), lps)
                if not self._done(s):
                    draft_seqs.append(s)
        # -- prefill chunks -----------------------------------------------------------------------
        first = []
        for s, o, n in prefill:
            writes.append((s.slot, torch.arange(o, o + n), torch.arange(s.n_cached, s.n_cached + n)))
            s.n_cached += n
            if not s.prefilling:
                first.append((s, logits_at[o + n - 1]))
        if first:
            seqs = [s for s, _ in first]
            lg = self._process_target(out.logits[[i for _, i in first]], seqs, [[0]] * len(seqs))
            res = acc.verify(lg, self._block(seqs), torch.zeros(len(seqs), dtype=torch.long), self._params(seqs),
                             self._sampler(seqs, STREAM_VERIFY), self._stop_ids(seqs),
                             torch.tensor([s.req.max_tokens for s in seqs]))
            for i, s in enumerate(seqs):
                s.rounds += 1
                s.first_token_time = time.monotonic()
                new = res.tokens[i, :1].tolist()
                self._commit(s, new, bool(res.stopped[i]), self._logprobs(s, lg[i:i + 1], new))
                if not self._done(s):
                    draft_seqs.append(s)
        finished = [s for s in self.running if self._done(s)]
        for s in finished:
            self._release(s)
        self.running = [s for s in self.running if not self._done(s)]
        if self.spec:
            self._draft([w for w in writes if any(w[0] == s.slot for s in self.running)], draft_seqs, decision)

    # ---- DSpark drafting ---------------------------------------------------------------------
    def _draft(self, writes, seqs: list[_Seq], decision: str = "draft") -> None:
        if decision == "skip":  # no draft stages; only prefill rows reach the rings (see _step_eager)
            if writes:
                self.runner.dspark(writes, [])
            for s in seqs:
                s.draft, s.conf_logits, s.last_c, s.ell = None, None, None, 0
            self.totals["draft_skipped"] += len(seqs)
            return
        items = [(s.slot, s.n_cached - 1, s.tokens[s.n_cached]) for s in seqs]
        out = self.runner.dspark(writes, items)
        if not seqs:
            return
        d = self.runner.drafter
        anchors = torch.tensor([a for _, _, a in items], dtype=torch.long)
        # drafting after the verify of round r draws from round r's drafting stream
        block = acc.markov_draft(out.base_logits, anchors, lambda prev: d.markov(prev)[0], self._params(seqs),
                                 self._sampler(seqs, STREAM_DRAFT, -1), logit_fn=self._draft_logit_fn(seqs))
        room = torch.tensor([min(s.req.max_tokens - s.n_out - 1, self.cfg.max_model_len - s.n_cached - 2,
                                 self.gamma) for s in seqs]).clamp_min(0)
        conf_logits = self._confidence_logits(out, block)
        c = None
        if self.adaptive and self.cfg.spec_mode == "dspark":
            c = self._calibrated(seqs, conf_logits)
        if self.cfg.spec_mode == "fixed":
            ell = admit_fixed(len(seqs), self.cfg.fixed_len, self.gamma)
        elif decision == "probe":  # one draft each, fixed before the draws: refreshes the acceptance seen
            ell = admit_fixed(len(seqs), 1, self.gamma)
            self.totals["draft_probes"] += 1
        else:
            if c is not None:
                ell = admit(c, self.ensure_cost().sps_for(len(seqs)))
            else:  # the head as it is and the forward's steps/s: what the static rounds compute
                ell = admit(torch.sigmoid(conf_logits), self.ensure_cost().forward_for(len(seqs)))
        ell = torch.minimum(ell, room)
        for i, s in enumerate(seqs):
            s.draft = (block.tokens[i], block.prev[i], block.q_token[i], block.z[i])
            s.conf_logits = conf_logits[i].detach()
            s.ell = int(ell[i])
            s.drafted += self.gamma
        self.totals["drafted"] += self.gamma * len(seqs)

    def _calibrated(self, seqs: list[_Seq], conf_logits: torch.Tensor) -> torch.Tensor:
        """The calibrated confidences [R, G] of the seqs' new blocks (each in its request's regime).
        Every drafted block's conditionals, a probe's included, become the request's `last_c`: when
        the block is verified they enter the request's evidence (`_observe_block`), which the
        decision to step aside reads (a probe that left them stale kept a request aside for good);
        the regime's mean calibrated confidence, the prior of a new engine, follows them. Eager
        drafting and static rounds alike."""
        regs = [regime(s.req.temperature) for s in seqs]
        c = self.calib.cal.confidence(conf_logits, regs)
        for s, reg, ck in zip(seqs, regs, c.tolist()):
            s.last_c = ck
            m = self._c_mean.get(reg)  # the regime's mean calibrated confidence (EWMA over blocks)
            self._c_mean[reg] = ck if m is None else [x + self.C_MEAN_RATE * (y - x) for x, y in zip(m, ck)]
        return c

    def _confidence_logits(self, out, block: acc.DraftBlock) -> torch.Tensor:
        """The confidence head on each draft's predecessor (block.prev), never the draft itself: c_k
        must not look at x_k, or admission would depend on the draws it gates (notes/dspark.md 5)."""
        d = self.runner.drafter
        return d.confidence(out.hidden, d.markov_embed(block.prev))

    def _block(self, seqs: list[_Seq]) -> acc.DraftBlock:
        """Stack the seqs' draft blocks; a seq without one gets a placeholder verified with ell 0."""
        G, V = self.gamma, self.mcfg.vocab_size
        parts = [s.draft if (s.draft is not None and s.ell) else None for s in seqs]
        t = torch.stack([p[0] if p else torch.zeros(G, dtype=torch.long) for p in parts])
        pv = torch.stack([p[1] if p else torch.zeros(G, dtype=torch.long) for p in parts])
        dt = loop_dtype()  # q(x) as verify reads it (fp32 under the kernels' numerics, like the round's state)
        q = torch.stack([p[2].to(dt) if p else torch.ones(G, dtype=dt) for p in parts])
        z = (torch.stack([p[3].float() if p else torch.zeros(G, V) for p in parts]) if G
             else torch.zeros(len(seqs), 0, V))
        return acc.DraftBlock(tokens=t, prev=pv, q_token=q, z=z)

    # ---- logit processing shared by drafts and verification ---------------------------------------
    def _process_target(self, logits: torch.Tensor, seqs: list[_Seq], positions: list[list[int]]) -> torch.Tensor:
        """The target's logit processors on verify rows: request i's rows predict its output tokens
        positions[i] (rows in request order); row j of a decoding request follows its committed
        output and its first j admitted drafts. The draft slots that predict the same positions go
        through the same function (_draft_logit_fn), which keeps DSpark lossless under them."""
        if not self._processed(seqs):
            return logits
        counts = [len(p) for p in positions]
        if any(s.req.frequency_penalty or s.req.presence_penalty for s in seqs):
            rows = []
            for s, ps in zip(seqs, positions):
                base = self._output_counts(s)
                drafts = s.draft[0][: len(ps) - 1] if len(ps) > 1 else torch.zeros(0, dtype=torch.long)
                before = torch.nn.functional.one_hot(drafts, base.shape[0]).cumsum(0).to(base.dtype)
                rows.append(torch.cat([base.unsqueeze(0), base + before], 0)[: len(ps)])
            rep = torch.tensor(counts)
            logits = apply_penalties(logits, torch.cat(rows, 0),
                                     torch.tensor([s.req.frequency_penalty for s in seqs]).repeat_interleave(rep),
                                     torch.tensor([s.req.presence_penalty for s in seqs]).repeat_interleave(rep))
        if any(s.req.min_tokens for s in seqs):
            stop = self._stop_ids(seqs).repeat_interleave(torch.tensor(counts), 0)
            active = torch.tensor([pos < s.req.min_tokens for s, ps in zip(seqs, positions) for pos in ps])
            logits = mask_stop_tokens(logits, stop, active)
        return logits

    def _draft_logit_fn(self, seqs: list[_Seq]):
        """Draft slot k of request i predicts its output token n_out + k after its committed output
        and drafts x_1..x_k: the same processors as the verify row that will check it (None when no
        request needs any)."""
        if not self._processed(seqs):
            return None
        stop = self._stop_ids(seqs)
        n_out = torch.tensor([s.n_out for s in seqs])
        min_tokens = torch.tensor([s.req.min_tokens for s in seqs])
        penalised = any(s.req.frequency_penalty or s.req.presence_penalty for s in seqs)
        base = torch.stack([self._output_counts(s) for s in seqs]) if penalised else None
        freq = torch.tensor([s.req.frequency_penalty for s in seqs])
        pres = torch.tensor([s.req.presence_penalty for s in seqs])

        def fn(k, z, drafted):
            if penalised:
                counts = base + torch.nn.functional.one_hot(drafted, base.shape[1]).sum(1).to(base.dtype)
                z = apply_penalties(z, counts, freq, pres)
            return mask_stop_tokens(z, stop, n_out + k < min_tokens)

        return fn

    @staticmethod
    def _processed(seqs: list[_Seq]) -> bool:
        return any(s.req.min_tokens or s.req.frequency_penalty or s.req.presence_penalty for s in seqs)

    def _output_counts(self, s: _Seq) -> torch.Tensor:
        """[V] how often each id occurs in the request's generated tokens (the prompt does not count)."""
        out = torch.tensor(s.tokens[len(s.req.prompt):], dtype=torch.long)
        return torch.bincount(out, minlength=self.mcfg.vocab_size).to(loop_dtype())  # exact counts either way

    def _logprobs(self, s: _Seq, logits: torch.Tensor, tokens: list[int]) -> list | None:
        """[logprob, rank, top alternatives] of each committed token under the (processed) target row
        that produced it: a token from an accepted draft is scored by the verify row that accepted
        it, exactly as if plain decoding had sampled it."""
        if s.req.logprobs < 0 or not tokens:
            return None
        params = SamplingParams.make(len(tokens), s.req.temperature, s.req.top_k, s.req.top_p)
        lp, rank, top_ids, top_lp = token_logprobs(logits[:len(tokens)], params, torch.tensor(tokens),
                                                   LOGPROB_WIDTH)  # the graphs' width; the request's first n
        n = s.req.logprobs
        out = []
        for j in range(len(tokens)):
            alts = [[int(t), float(v)] for t, v in zip(top_ids[j, :n].tolist(), top_lp[j, :n].tolist())
                    if v > float("-inf")]
            out.append([float(lp[j]), int(rank[j]), alts])
        return out

    def _stop_lists(self, seqs: list[_Seq]) -> list[list[int]]:
        return [list(s.req.stop_token_ids) + ([] if s.req.ignore_eos else [self.mcfg.eos_token_id]) for s in seqs]

    def _stop_ids(self, seqs: list[_Seq]) -> torch.Tensor:
        lists = self._stop_lists(seqs)
        width = max(1, max(len(x) for x in lists))
        return torch.tensor([x + [-1] * (width - len(x)) for x in lists], dtype=torch.long)

    # ---- bookkeeping -------------------------------------------------------------------------
    def _commit(self, s: _Seq, new: list[int], stopped: bool, logprobs: list | None = None) -> None:
        ctx = s.tokens[max(0, len(s.tokens) - CONTEXT_IDS):]
        s.tokens += new
        s.n_out += len(new)
        s.draft, s.ell = None, 0
        self.totals["output_tokens"] += len(new)
        reason = None
        if stopped:
            reason = "stop"
        elif s.n_out >= s.req.max_tokens or len(s.tokens) >= self.cfg.max_model_len:
            reason = "length"
        s.finish = reason
        self._emit(s.req, Event(s.req.id, new, ctx, finish_reason=reason, num_prompt_tokens=len(s.req.prompt),
                                num_output_tokens=s.n_out, drafted=s.drafted, admitted=s.admitted,
                                accepted=s.accepted, verify_steps=s.verify_steps, logprobs=logprobs))

    @staticmethod
    def _done(s: _Seq) -> bool:
        return s.finish is not None

    def _release(self, s: _Seq) -> None:
        with self.lock:
            self.free.append(s.slot)
            self.free.sort()
        self.totals["finished"] += 1

    def _finish(self, s: _Seq, reason: str | None = None, error: str | None = None, code: str | None = None) -> None:
        """End a running request from outside the normal flow (cancel, failure) and free its slot."""
        if s in self.running:
            self.running.remove(s)
            self._release(s)
        s.finish = reason or "error"
        self._emit(s.req, Event(s.req.id, [], [], finish_reason=reason, error=error, error_code=code,
                                num_prompt_tokens=len(s.req.prompt), num_output_tokens=s.n_out,
                                drafted=s.drafted, admitted=s.admitted, accepted=s.accepted,
                                verify_steps=s.verify_steps))

    def _emit(self, r: GenerateRequest, e: Event) -> None:
        if r.callback is not None:
            try:
                r.callback(e)
            except Exception:  # a broken consumer must not take the engine down
                pass
