"""Step-cost profiling: the target forward's steps/s by tokens and sequences, and the draft stages'
seconds by requests (`step_cost.StepCost`), timed once on the runner the engine serves with (eager
forwards on a LocalRunner, the decode round graphs on a static runner), or loaded from sps_file.

The timer is `clock` (default time.perf_counter), passed to every `interleaved_medians` call, so a
test can run the profile on a clock that only its stand-ins advance.
"""

from __future__ import annotations

import os
import time
from typing import Callable

import torch

from v4flash_backend.engine.round_plan import STOP_WIDTH, RoundPlan
from v4flash_backend.settings import Settings

from . import dspark_accept as acc
from .dspark_sched import SPSTable, admit
from .noise import STREAM_DRAFT, CounterSampler
from .round_step import asking_nothing
from .sampling import SamplingParams
from .step_cost import StepCost, fit_seq_model, interleaved_medians, round_seconds_by_tokens


class StepProfiler:
    """Times the step cost of one runner under the engine's settings (see `Engine.ensure_cost`)."""

    def __init__(self, runner, settings: Settings, gamma: int, clock: Callable[[], float] = time.perf_counter):
        self.runner, self.settings, self.gamma, self.clock = runner, settings, gamma, clock

    def _medians(self, fn, sizes) -> dict[int, float]:
        return interleaved_medians(fn, sizes, rounds=3, clock=self.clock)

    def load(self) -> StepCost | None:
        """The profile at sps_file when one is there (a server restarted on the same machine)."""
        if self.settings.sps_file and os.path.exists(self.settings.sps_file):
            return StepCost.load(self.settings.sps_file)
        return None

    def measure(self, free: list[int]) -> StepCost:
        """The target forward's steps/s by B tokens of R sequences and the draft stages' seconds by
        R requests (interleaved rounds, medians, a fitted model; step_cost.py) on the free slots and
        the scratch slot. A profile taken while requests hold slots covers R up to the free ones
        (t_forward holds the largest R's table beyond)."""
        scratch = self.runner.state.num_slots - 1
        top = self.settings.max_num_seqs * (1 + self.gamma)
        sizes = sorted({1, 2, 4, 8, 16, 32, 64, top} & set(range(1, top + 1)) | {top})
        if self.runner.static_rounds and self.runner.graphs_ready:
            return self._static_cost(sizes, scratch)  # (still compiling: the eager steps that serve meanwhile)
        return self._eager_cost(scratch, free)

    def _eager_cost(self, scratch: int, free: list[int]) -> StepCost:
        """Eager: forwards shaped like decode steps -- R sequences x k rows each after a context of
        C tokens, on the free slots (all of them at start), so the per-sequence work is in the
        table; the context is written once and each timed call overwrites the same positions
        (a reset inside the timed call had added its own cost to every size)."""
        Q = 1 + self.gamma
        slots = ([scratch] + [s for s in free if s != scratch])[:self.settings.max_num_seqs]
        ctx = max(1, min(48, self.settings.max_model_len - Q - 2))
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

        med = self._medians(fwd, range(len(pairs)))
        (a, s_r, b_r), dropped = fit_seq_model({(R, R * k): med[i] for i, (R, k) in enumerate(pairs)})
        replaced = [list(p) for p in dropped]
        # each R's table holds the fitted model at its profiled sizes (linear in B: interpolated)
        by_seqs = {R: SPSTable([R * k for k in ks], [1.0 / max(a + s_r * R + b_r * R * k, 1e-6) for k in ks],
                               interpolate=True) for R in Rs}
        draft_s = self._eager_draft_seconds(slots, ctx)
        for slot in slots:
            self.runner.reset_slot(slot)
        return StepCost(by_seqs[1], draft_s, replaced, by_seqs=by_seqs)

    def _eager_draft_seconds(self, slots: list[int], ctx: int) -> dict[int, float]:
        """Seconds of the draft stages + the host drafting work for R requests (none: no drafter)."""
        d = self.runner.drafter

        def draft(R: int):
            out = self.runner.dspark([], [(slots[j], ctx - 1, 3) for j in range(R)])
            params = SamplingParams.make(R, [1.0] * R, [0] * R, [1.0] * R)  # sampled: the costlier host path
            block = acc.markov_draft(out.base_logits, torch.full((R,), 3), d.markov_bias,
                                     params, self._sampler_for(R))
            admit(torch.sigmoid(d.confidence(out.hidden, d.markov_embed(block.prev))),
                  lambda B: torch.ones_like(B, dtype=torch.float64))

        rs = sorted({r for r in (1, 2, 4, 8, 16, 32) if r <= len(slots)} | {len(slots)})
        return self._medians(draft, rs) if d is not None else {}

    def _static_cost(self, sizes: list[int], scratch: int) -> StepCost:
        """The step cost of a static runner, timed on the graphs it serves: each sequence bucket's
        decode round (through the runner's `decode_round`, so every rank of a group runs it) on a
        plan of padding sequences (scratch slot, no valid row; same shapes and work as a real
        round), interleaved rounds, medians -- twice: the round that steps aside (graph 1 alone:
        verify + acceptance) gives t_forward, the full round (+ graph 2: rings, draft stages,
        Markov drafting, confidence, admission) minus it gives the draft seconds of R requests
        (R's bucket), so `drafting_pays` compares a stepped-aside round with a drafting one.

        While graphs compile in the background (trn2.warmup) a drafting round of more sequences than
        a warm drafting set holds is not timed (it would compile in this thread); its draft seconds
        are the largest timed bucket's per sequence times R: the draft graph's work per sequence
        does not grow with R, so drafting is priced no cheaper there than measured. The profile's
        rounds ask the compile for nothing (they are not traffic: `StepGate.traffic`)."""
        Q = 1 + self.gamma
        N = self.settings.max_num_seqs
        timed = sorted({min(1 << (S - 1).bit_length(), N) for S in range(1, N + 1)})  # the sequence buckets
        seqs = sorted({-(-b // Q) for b in sizes} | set(range(1, N + 1)))  # a round of S pads to its bucket

        def round_(S: int, mode: str):
            self.runner.decode_round(RoundPlan(
                slot=[scratch] * S, start=[0] * S, pending=[0] * S, ell=[-1] * S, temperature=[1.0] * S,
                top_k=[0] * S, top_p=[1.0] * S, seed=list(range(S)), rnd=[0] * S, budget=[0] * S,
                len_left=[0] * S, stop_ids=[[-1] * STOP_WIDTH] * S, spec_mode=mode, fixed_len=0,
                sps=None))

        spec = self.settings.spec_mode
        drafted = [S for S in timed if self._drafting_warm(S)] or timed
        both = [(S, m) for S in timed for m in ("off", spec) if m == "off" or S in drafted]  # interleaved
        med = self._medians(lambda i: round_(*both[i]), range(len(both)))
        bucket = {S: min(t for t in timed if t >= S) for S in seqs}
        alone = {S: med[both.index((bucket[S], "off"))] for S in seqs}
        full = {S: med[both.index((bucket[S], spec))] for S in seqs if bucket[S] in drafted}
        fwd_s = round_seconds_by_tokens(sizes, Q, alone)
        top = max(drafted)
        per_seq = max(full[top] - alone[top], 0.0) / top  # (past the drafted buckets: docstring)
        draft_s = {S: max(full[S] - alone[S], 0.0) if S in full else per_seq * S for S in range(1, N + 1)}
        self.runner.reset_slot(scratch)
        return StepCost(SPSTable(sorted(fwd_s), [1.0 / fwd_s[b] for b in sorted(fwd_s)]), draft_s, [])

    def _drafting_warm(self, S: int) -> bool:
        """Whether a drafting round of S sequences has warm graphs, asking the compile for nothing."""
        with asking_nothing(self.runner):
            return self.runner.round_fits(S, 1, False, plain=False)

    def save(self, cost: StepCost) -> None:
        """The profile to sps_path or the state directory (`Settings.sps_file`), never elsewhere:
        written beside and renamed, so a server starting meanwhile reads a whole file or none."""
        path = self.settings.sps_file
        if not path:
            return
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        cost.save(tmp)
        os.replace(tmp, path)

    def _sampler_for(self, R: int):
        return CounterSampler(list(range(R)), [0] * R, STREAM_DRAFT)
