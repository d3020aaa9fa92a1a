"""A static step: every running request decodes, and the runner's static round graphs run the
whole round (`runner.decode_round`); the host builds the round's plan and commits its read-back.
A mixin of `Engine`."""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from v4flash_backend.engine.round_plan import STOP_WIDTH, RoundPlan, RoundResult, filters_sampling

from .dspark_sched import sps_tensors
from .seq import KIND_OF, ON_DEVICE, Seq


def filters(seqs: list[Seq], vocab: int) -> bool:
    """Whether any request of the round filters its sampling: such a round runs the processed
    variant of the round graphs, the only one whose sampling has the filters."""
    return filters_sampling([s.req.temperature for s in seqs], [s.req.top_k for s in seqs],
                            [s.req.top_p for s in seqs], vocab)


@contextlib.contextmanager
def asking_nothing(runner):
    """The runner's `round_fits` answers without asking a background compile for the set it lacks
    (trn2.warmup.StepGate.traffic): a question, not the round that runs."""
    gate = runner.exec_lock
    traffic = getattr(gate, "traffic", None)
    if traffic is None:
        yield
        return
    gate.traffic = False
    try:
        yield
    finally:
        gate.traffic = traffic


class StaticRoundStep:
    def _static_ok(self, decision: str = "draft", drafts_aside: bool = False) -> bool:
        """A step runs as a static decode round when every running request decodes (no prefill
        rows) and the runner has a bucket for it whose graphs are warm: the plain-decode graph for a
        round that neither verifies a draft nor drafts (`decision` skip, or no speculation), else the
        drafting round's graphs (a background compile warms them apart: trn2.warmup). drafts_aside:
        as if no request had a draft to verify (would the plain-decode graph take the round?)."""
        r = self.runner
        if not r.static_rounds or not self.running or any(s.prefilling for s in self.running):
            return False
        if any(len(x) > STOP_WIDTH for x in self._stop_lists(self.running)):
            return False
        plain = (decision == "skip" or not self.spec) and (drafts_aside or not any(s.ell for s in self.running))
        # min_tokens, penalties, log-probs and top-k / top-p filters run in the rounds' processed variant
        # (static_round; the plain one samples without the filters), whose graphs may still be compiling
        return r.round_fits(len(self.running), max(s.n_cached + 1 + s.ell for s in self.running),
                            self._round_processed(self.running), plain=plain)

    def _plain_would_fit(self) -> bool:
        """Would the plain-decode graph take this round were no draft pending? (asks for no set)"""
        with asking_nothing(self.runner):
            return self._static_ok("skip", drafts_aside=True)

    def _round_processed(self, seqs: list[Seq]) -> bool:
        """Does the round run the processed variant (min_tokens, penalties, log-probs, filters)?"""
        return self._processed(seqs) or any(s.req.logprobs >= 0 for s in seqs) or \
            filters(seqs, self.mcfg.vocab_size)

    def _step_static(self, decision: str | None = None) -> None:
        """One decode round in the runner's static graphs: verify + acceptance + sampling, then
        the DSpark rings, the draft block, Markov drafting, confidence and admission, all inside
        the graphs; the committed tokens (with their counts, the next admitted lengths and the new
        block's confidence logits) are the one read-back. dspark_adaptive: the same decision as an
        eager step, taken on the host before the round from host state only (`_drafting_decision`):
        draft (calibrated admission with the whole step's cost), probe (one draft each) or skip (the
        round steps aside: graph 1 alone, no ring writes, no draft stages)."""
        before = dict(self.runner.counters)
        seqs = list(self.running)
        if decision is None:  # (the step's decision, when the engine took it before picking the graphs)
            decision = self._drafting_decision(seqs) if self.spec else "draft"
        self._kind = KIND_OF[decision]
        self._explore = self._guard_explores(decision)
        dspark = self.spec and self.settings.spec_mode == "dspark"
        processed = self._round_processed(seqs)
        self._sync_round_state(seqs, processed)
        in_sync = [s.counted == s.n_out for s in seqs]
        plan = self._round_plan(seqs, decision, dspark, processed)
        # one row a sequence: its committed tokens, counts, next ell, confidences (+ log-probs when processed)
        out = RoundResult.rows(self.runner.decode_round(plan), processed)
        self.totals["steps"] += 1
        drafted = [s for s, row, synced in zip(seqs, out, in_sync)
                   if self._commit_round_row(s, row, decision, processed, synced)]
        if drafted and decision == "probe":
            self.totals["draft_probes"] += 1
        if drafted and self.adaptive and dspark:  # as _draft: the next decision reads these survivals
            self._calibrated(drafted, torch.stack([s.conf_logits for s in drafted]))
        self._retire_finished()
        self.decode_totals["static_steps"] += 1
        self._count_step(before)

    def _first_blocks_static(self, writes, seqs: list[Seq], decision: str) -> bool:
        """After a step that only prefilled (no decode rows), the first draft blocks of the requests
        whose prefill it completed, drafted by the static round's draft graph (`runner.first_blocks`)
        instead of the eager drafter; False (nothing done) where the runner has no warm round graphs
        for them or the round would be the processed variant, and `_draft` drafts on the host. Why:
        drafting eagerly made a drafting mode's prefill +27 ms a 49-token prompt on an AMD EPYC (the
        eager draft stages ~21 ms of it), +15 ms with the graph (`perf/bench_dspark.py --fast`'s
        split: lines), and the block stays on the device for the first round. Same
        block, same tokens: the graph drafts from the same rings at the same anchor with the same
        round's noise, admission and calibration as the eager `_draft` (tests/test_static_round.py)."""
        r = self.runner
        if (decision == "skip" or not seqs or not r.static_rounds
                or self._round_processed(seqs) or any(len(x) > STOP_WIDTH for x in self._stop_lists(seqs))
                or not r.round_fits(len(seqs), max(s.n_cached for s in seqs), False, plain=False)):
            return False
        if writes:  # the prompt rows into the rings (the draft graph writes the last one again)
            r.dspark(writes, [])
        dspark = self.settings.spec_mode == "dspark"
        plan = self._round_plan(seqs, decision, dspark, False)
        # as if a round had just committed the first token: it sits at the last prompt position + 1,
        # the budget counts it, and its drafting noise is the prefill's round (eager: rounds - 1)
        plan = dataclasses.replace(plan, start=[s.n_cached - 1 for s in seqs],
                                   budget=[s.req.max_tokens - s.n_out + 1 for s in seqs],
                                   rnd=[s.rounds - 1 for s in seqs])
        out = RoundResult.rows(r.first_blocks(plan), False)
        for s, row in zip(seqs, out):
            self._hold_block(s, row, decision)
        self.totals["drafted"] += self.gamma * len(seqs)
        if decision == "probe":
            self.totals["draft_probes"] += 1
        if self.adaptive and dspark:  # as _draft: the blocks' calibrated confidences become last_c
            self._calibrated(seqs, torch.stack([s.conf_logits for s in seqs]))
        return True

    def _hold_block(self, s: Seq, row: RoundResult, decision: str) -> None:
        """A block the draft graph left on the device for s (a round's, or a prefill's first): its
        admitted length, kind of admission and confidence logits from the read-back row."""
        s.ell, s.draft = row.next_ell, ON_DEVICE
        s.adm = ("probe" if decision == "probe" else "explore" if self._explore else "admit") \
            if self.settings.spec_mode == "dspark" else "fixed"
        s.conf_logits = row.confidence()
        s.drafted += self.gamma

    def _sync_round_state(self, seqs: list[Seq], processed: bool) -> None:
        """What the round reads from the runner's per-slot state made current: a block drafted on
        the host (eager step) moves into it, and, for a processed round, the penalties'
        generated-token counts."""
        for s in seqs:  # a block drafted on the host (eager step) moves into the runner's state
            if s.draft is not None and s.draft != ON_DEVICE:
                if s.ell:
                    self.runner.load_block(s.slot, s.draft)
                s.draft = ON_DEVICE
        if processed:  # the penalties' generated-token counts on the device must be current
            for s in seqs:
                if (s.req.frequency_penalty or s.req.presence_penalty) and s.counted != s.n_out:
                    self.runner.set_counts(s.slot, s.tokens[len(s.req.prompt):])
                    s.counted = s.n_out

    def _round_plan(self, seqs: list[Seq], decision: str, dspark: bool, processed: bool) -> RoundPlan:
        """The round's plan (the inputs `runner.decode_round` takes; trn2.static_round). A round that
        steps aside is a plain round: spec mode off, and neither the SPS table nor dspark_adaptive's
        admission inputs (only the draft graph reads them), so the host builds what plain decoding
        builds."""
        dspark = dspark and decision != "skip"
        L = self.settings.max_model_len
        stops = self._stop_lists(seqs)
        kw = dict(
            slot=[s.slot for s in seqs], start=[s.n_cached for s in seqs],
            pending=[s.tokens[s.n_cached] for s in seqs], ell=[s.ell for s in seqs],
            temperature=[float(s.req.temperature) for s in seqs], top_k=[int(s.req.top_k) for s in seqs],
            top_p=[float(s.req.top_p) for s in seqs], seed=[s.seed for s in seqs],
            rnd=[s.rounds for s in seqs], budget=[s.req.max_tokens - s.n_out for s in seqs],
            len_left=[L - s.n_cached - 1 for s in seqs],
            stop_ids=[x + [-1] * (STOP_WIDTH - len(x)) for x in stops],
            spec_mode=self.settings.spec_mode if self.spec and decision != "skip" else "off",
            fixed_len=self.settings.fixed_len, sps=sps_tensors(self.ensure_cost().forward) if dspark else None)
        if dspark:
            kw.update(self._adaptive_plan(seqs, decision))
        if processed:
            kw.update(n_out=[s.n_out for s in seqs], min_tokens=[s.req.min_tokens for s in seqs],
                      frequency=[float(s.req.frequency_penalty) for s in seqs],
                      presence=[float(s.req.presence_penalty) for s in seqs])
        return RoundPlan(**kw)

    def _commit_round_row(self, s: Seq, row: RoundResult, decision: str, processed: bool, in_sync: bool) -> bool:
        """Commit one request's row of the round's read-back; True when the round drafted it a new
        block (on the device, with its confidence logits from the row)."""
        k, n_acc, stopped = row.committed, row.accepted, row.stopped
        self._account_verify(s, n_acc)
        s.rounds += 1
        s.n_cached += k
        if decision == "skip":  # stepped aside: the rings miss these positions (as on an eager step)
            self.totals["ring_rows_skipped"] += k
        lps = row.logprobs(s.req.logprobs) if processed and s.req.logprobs >= 0 else None
        if processed and in_sync:
            s.counted += k  # the round added its committed tokens to the device counts
        self._commit(s, row.tokens, stopped, lps)
        if self._done(s) or not self.spec:
            return False
        if decision == "skip":
            s.draft, s.conf_logits, s.last_c, s.ell = None, None, None, 0
            self.totals["draft_skipped"] += 1
            return False
        self._hold_block(s, row, decision)
        self.totals["drafted"] += self.gamma
        return True
