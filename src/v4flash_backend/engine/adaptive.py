"""The adaptive DSpark policy: stepping aside (draft | probe | skip per step, from acceptances
observed in earlier steps only), the per-request acceptance evidence, calibrated confidences and the
online calibration feed, and the static rounds' admission inputs. A mixin of `Engine`: it reads the
engine's `cfg`, `gamma`, `spec` and `ensure_cost()`; its own state (`calib`, `adaptive`, `_observed`,
`_skipped`, `_probe_gap`) is set by `_init_policy`.
"""

from __future__ import annotations

import math

import torch

from .calibration import Calibration, OnlineCalibrator, regime
from .seq import Seq
from .step_cost import drafting_pays, expected_survivals


class AdaptivePolicy:
    def _init_policy(self) -> None:
        """The policy's state (called by Engine.__init__ once spec and gamma are known)."""
        self.calib = (OnlineCalibrator(self._load_calibration(), enabled=self.settings.calibration_online)
                      if self.spec else None)
        # calibrated confidences, draft-cost-aware admission and stepping aside, on eager steps and in
        # the static rounds alike (the calibration and the step table are round inputs, a stepped-aside
        # round is graph 1 alone): the same request and seed give the same tokens in both modes
        self.adaptive = self.settings.dspark_adaptive
        # a step's verified blocks enter the online calibration after the step's drafting, in both
        # modes: the static draft graph reads the calibration as an input taken before the round
        self._observed: list[tuple] = []
        self._skipped = 0  # consecutive steps whose drafts stepped aside
        self._probe_gap = self.settings.probe_every  # steps aside before the next probe (see _drafting_decision)
        self._pays_memo = None  # ((cost, survivals, resume blocks), verdict) of the last `_pays`
        # (cost, R, floor) of the last `_probe_floor`: once the probe gap is reached it is asked
        # again whenever the verdict's inputs move (`_aside`: a block's worth of steps), and its four
        # step-cost lookups were the decision's largest host cost; the learned cost is one object
        # until the learner refreshes
        self._floor_memo = None
        # [inputs, objects, probe floor] of the last verdict to step aside (`_aside_inputs`): while the
        # inputs stand still the verdict does, and a step aside decides without pricing anything
        self._aside = None

    def _load_calibration(self) -> Calibration:
        if self.settings.calibration_path:
            return Calibration.load(self.settings.calibration_path, self.gamma)
        return Calibration.for_checkpoint(self.settings.checkpoint_dir, self.gamma)

    def _drafting_decision(self, seqs: list[Seq]) -> str:
        """draft | probe | skip for this step (dspark_adaptive; see step_cost.drafting_pays). Uses only
        acceptances observed in earlier steps, never this step's draws."""
        if self.settings.spec_mode != "dspark" or not self.adaptive:
            return "draft"
        resume = self._resume_blocks(seqs)
        inputs = self._aside_inputs(seqs, resume)
        aside = self._aside
        if aside is None or aside[0] != inputs:
            surv = [self._expected_survivals(s) for s in seqs]
            if self._pays(self.ensure_cost(), surv, resume):
                self._aside = None
                self._skipped = 0
                self._probe_gap = self.settings.probe_every
                return "draft"
            # (the objects the inputs name by id stay referenced, so no new object takes their id)
            aside = self._aside = [inputs, (self.cost, self.learner, self.calib), None]
        self._skipped += 1
        for s in seqs:  # their evidence ages while they step aside (_expected_survivals)
            s.aside += 1
        # (the floor is priced only once the gap is reached: most steps aside stop at the first test;
        # it is the same while the verdict's inputs are, the step cost among them)
        if self._skipped >= self._probe_gap:
            if aside[2] is None:
                aside[2] = self._probe_floor(len(seqs))
            if self._skipped >= aside[2]:
                # back-off: a probe that leaves speculation aside doubles the gap to the next one (up to
                # probe_max_every). Where drafts keep failing (T = 1 on the embedded model) a probe's
                # draft stages cost ~20 ms against a ~47 ms plain step (cProfile of a batch-1 run), so a
                # fixed gap of 16 paid ~3 % (an estimate from those two times); a workload change is
                # still seen within probe_max_every steps. On the compiled path a probe and the round
                # that verifies it cost ~4 plain rounds over two plain ones (perf/round_profile.py), so
                # the floor (_probe_floor), not this back-off, sets the gap there
                self._skipped = 0
                st = self.settings
                self._probe_gap = max(st.probe_every, min(2 * self._probe_gap, st.probe_max_every))
                return "probe"
        return "skip"

    def _aside_inputs(self, seqs: list[Seq], resume: int) -> tuple:
        """What the verdict to step aside is decided from, in a form that is cheap to compare: the
        step cost (the engine's profile and the learner's version; the regime of the step follows
        from the requests), the regimes' observed acceptance (the calibrator's count of blocks), the
        blocks a resumption is priced over, and per request its id, its verified blocks and the age
        of that evidence in whole blocks (`_age`). Why: deciding again every step aside -- survivals,
        the learned cost, the floor -- was ~45 us of host work a compiled plain round does not do
        (a 5.7 ms round at batch 1 on an AMD EPYC, the decision stubbed out in a diagnostic outside
        the repo: ~0.8 %); these inputs move once a block's worth of steps or when the learner
        refreshes."""
        G1 = 1 + self.gamma
        learner = self.learner
        return (id(self.cost), id(learner), learner.version, id(self.calib), self.calib.counted, resume,
                [(s.req.id, s.ev_blocks, s.aside // G1) for s in seqs])

    def _pays(self, cost, surv: list[list[float]], resume: int = 0) -> bool:
        """`drafting_pays`, memoized on its inputs: while speculation steps aside they stay the same
        from step to step (the learned cost is one object until the learner refreshes, the survivals
        move only with new evidence), and its dozen step-cost lookups were a third of the host work
        a stepped-aside round added to a plain one (~35 of ~100 us a step, batch 1)."""
        key = (cost, surv, resume)
        memo = self._pays_memo
        if memo is None or memo[0][0] is not cost or memo[0][1:] != key[1:]:
            memo = self._pays_memo = (key, drafting_pays(cost, surv, resume_blocks=resume)[0])
        return memo[1]

    # the drafting steps over which resuming must pay for its first one (drafting_pays'
    # resume_blocks): a request's evidence forgets at EVIDENCE_DECAY a block, so it remembers
    # 1 / (1 - 0.75) = 4 blocks, about how long a resumed stretch lasts before new evidence decides
    # again. Why: resuming after a stretch aside pays a whole drafting step before its first block
    # is verified (on the compiled path ~13.6 ms against a ~3.7 ms plain round, for one token).
    # Priced as an ordinary drafting step, a request at break-even (unseen code, batch 1, T = 0:
    # fixed-5 1.00x plain) switched between drafting and stepping aside 138 times in 3 bench rounds,
    # and those first steps cost ~4-5 % (DSpark 0.93x max(plain, fixed-5); a traced run).
    RESUME_BLOCKS = 4

    def _resume_blocks(self, seqs: list[Seq]) -> int:
        """0 while speculation drafts (or probed last step: the probe's block is pending), and for
        requests that have not stepped aside (a new request pays its first drafting step whatever
        the step before did, as fixed-length drafting does: pricing that step into its verdict kept
        a regime whose first blocks went badly aside for good -- held-out prompts, batch 1, T = 0:
        0.87x fixed-5 -- since a probe verifies one draft a row); after a step aside of a request
        under way, the blocks a resumed stretch is priced over: RESUME_BLOCKS, fewer where the
        requests have fewer blocks' worth of tokens left (at most 1 + G tokens a block), at least 1."""
        if not self._skipped or not any(s.aside for s in seqs):
            return 0
        left = sum(s.req.max_tokens - s.n_out for s in seqs) / len(seqs)
        return max(1, min(self.RESUME_BLOCKS, math.ceil((left - 1) / (1 + self.gamma))))

    # the share of plain decoding's time that probing may take while speculation steps aside. 1 %, not
    # the 3 % the budget allows: where speculation steps aside DSpark should read >= 0.98x plain, and
    # on the compiled CPU path at 3 % the probes alone took ~1.5-2.4 % of a batch-1 server's time
    # (4 probes in 750 steps, a cProfile of perf/bench_dspark.py --fast); the host work of a
    # stepped-aside step is ~15 us (decision and learner, timed at batch 1) against a ~3.7 ms round
    PROBE_SHARE = 0.01

    def _probe_floor(self, R: int) -> int:
        """The fewest steps aside between two probes for R requests, so that probing costs at most
        PROBE_SHARE of plain decoding's time: a probe's extra seconds over a plain step (its draft
        stages, then a step verifying one draft a request: t_step(2R, R, R) - t_step(R, R, 0)) over
        PROBE_SHARE x the plain step, twice (the round after it verifies its drafts); at most
        probe_max_every. Why: on the compiled CPU path a
        drafting round costs ~3-4x a plain one (perf/bench_dspark.py --fast prints the profile):
        probing every 16 steps, backing off to 128, cost a batch-8 server ~10 % where speculation
        stays aside (0.87-0.90x plain; with the floor 0.95-0.96x). There the floor is ~540 steps at
        batch 1 (~2 s of decoding); eagerly, where the draft stages cost about half a plain step,
        ~85 steps (~4 s)."""
        cost = self.ensure_cost()
        memo = self._floor_memo
        if memo is not None and memo[0] is cost and memo[1] == R:
            return memo[2]
        plain = float(cost.t_step(R, R, 0))
        # x2: a probe's drafts are verified by the next round. On static rounds that round runs the
        # drafting round's verify graph (1 + G rows a sequence) instead of the plain one, and the static
        # profile prices a round by what it drafts (its forward table has one figure at every size:
        # step_profile), so its extra -- verify graph over plain round, 9.5 vs 3.7 ms at batch 1, ~0.6 of
        # the draft seconds (perf/round_profile.py) -- is not in `extra`. Counted as the draft seconds
        # again, an upper bound; on both paths (eagerly `extra` holds the verified rows already), so an
        # eager and a static engine probe at the same steps and a seeded request's tokens stay equal
        extra = 2 * (float(cost.t_step(2 * R, R, R)) - plain)
        floor = 0 if not plain > 0 or not extra > 0 else \
            min(math.ceil(extra / (self.PROBE_SHARE * plain)), self.settings.probe_max_every)
        self._floor_memo = (cost, R, floor)
        return floor

    def _adaptive_plan(self, seqs: list[Seq], decision: str) -> dict:
        """The draft graph's admission inputs (static_round.draft_round), as `RoundPlan` fields
        (t_draft, cal, fixed_ell; engine.round_plan): with dspark_adaptive, each
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
        if decision == "probe" or self._explore:
            fixed = [1 if decision == "probe" else self.settings.fixed_len] * S
        else:  # admission, with the guard's floor as -1 - floor (-1: none; engine.round_plan)
            fixed = [-1 - f for f in self._guard_floors(seqs)]
        return dict(cal=cal, t_draft=t_draft, fixed_ell=fixed)

    def _guard_explores(self, decision: str) -> bool:
        """Does this drafting step verify fixed_len drafts for the fixed-length guard (fixed_guard:
        one step in EXPLORE_EVERY, so fixed's verify rows are measured)? Decided from a step counter,
        before any draw."""
        if not (self.guard is not None and decision == "draft" and self.adaptive
                and self.settings.spec_mode == "dspark"):
            return False
        B_fixed = len(self.running) * (1 + self.guard.F)
        return self.guard.explore(self.learner.measured(self.decode_path, B_fixed, drafting=True,
                                                        sampled=self._sampled_step()))

    def _guard_floors(self, seqs: list[Seq]) -> list[int]:
        """The fixed-length guard's floor on admitted drafts, per seq (its regime's; 0 without a guard)."""
        if self.guard is None or not self.adaptive:
            return [0] * len(seqs)
        return [self.guard.floor(regime(s.req.temperature)) for s in seqs]

    # the stepping-aside estimate (docs/dspark.md, "Speculation that steps aside"): a request's acceptance
    # per position, its regime's observed rate as a prior worth PRIOR_BLOCKS blocks, then its own
    # blocks with weight EVIDENCE_DECAY^age. Measured on the embedded model (batch 1, greedy): the
    # last block's survivals alone, one noisy block, stepped aside on 191 of 290 steps where
    # drafting every step (fixed-5) was 1.4x faster. A prior worth 2 blocks still let one early
    # rejection put a request below break-even on the compiled path, where drafting pays narrowly
    # (batch 1, T = 0, held-out: DSpark drafted at tau 3.11 for 0.94x fixed-5); worth 4 blocks it
    # drafted throughout (tau 4.70, 0.97x fixed-5; 8 blocks: 0.98x), and at T = 1 it stays aside
    # (perf/bench_dspark.py --fast --batches 1, one run each)
    PRIOR_BLOCKS = 4.0
    EVIDENCE_DECAY = 0.75

    def _age(self, s: Seq) -> float:
        """The weight left on a request's own evidence after the steps it stepped aside since its
        last verified block: EVIDENCE_DECAY for every 1 + G of them (a block's worth of tokens), in
        whole blocks (the survivals, hence the memoized verdict, change once a block's worth, not every
        step). Why: a request that steps aside verifies nothing, so without aging one unlucky block
        kept it aside for good -- on the compiled path at batch 1, T = 0 (held-out prompts) a request
        whose first block went badly never drafted again within its 48 tokens (the next probe is
        ~540 steps away). Aged, its estimate returns to the regime's observed acceptance, which
        decides again: where the regime's drafts pay (T = 0 there) the request drafts again after a
        few blocks' worth of tokens, where they do not (T = 1) it stays aside."""
        return self.EVIDENCE_DECAY ** (s.aside // (1 + self.gamma)) if s.aside else 1.0

    def _expected_survivals(self, s: Seq) -> list[float]:
        """The prefix survivals a request's next block is expected to reach, from past blocks only
        (never this step's draws: the decision they feed is independent of them, so lossless).
        The prior: the regime's observed acceptance over the calibration window, a position with
        fewer than 8 verified blocks taking the previous position's rate, and 1 while the regime has
        none: a new engine's prior is 1 until a regime's window has 8 blocks (one drafting step at
        batch 8; a request's own blocks still move it), then observed acceptance decides. Not the
        head's calibrated confidences: they were the prior of a new engine once (at T = 1 the first
        block's c ~ 0.3 stepped aside at once), but where the head is less sure than the drafts are
        good they starve the regime of evidence -- on the compiled path at batch 1, T = 0 (held-out
        prompts) the first block's c put drafting below break-even, nothing more was verified, and
        DSpark stayed aside (0.97x plain) where fixed-5 read 1.10x with its drafts accepted at
        0.87-0.96 a position."""
        reg = regime(s.req.temperature)
        prior = self.calib.acceptance_rates(reg)
        if s.ev_trials is None:
            return expected_survivals(prior)
        P, w = self.PRIOR_BLOCKS, self._age(s)
        return expected_survivals([(P * r + w * h) / (P + w * n) for r, h, n in zip(prior, s.ev_hits, s.ev_trials)])

    def _observe_block(self, s: Seq, n_acc: int) -> None:
        """A verified block enters the request's evidence: position k < ell was reached if drafts
        < k were accepted, and accepted if n_acc > k; a position admit left unverified counts in
        expectation under the calibrated head (reached with probability prod c_i over the
        unverified i < k, accepted with c_k), so a block that admit declined still speaks -- a
        request whose blocks admit keeps declining stops paying for the draft stages."""
        G, c = self.gamma, s.last_c
        if s.ev_trials is None:
            s.ev_trials, s.ev_hits = [0.0] * G, [0.0] * G
        elif s.aside:  # the aging of the steps it stepped aside becomes part of the counts
            w = self._age(s)
            s.ev_trials, s.ev_hits = [w * n for n in s.ev_trials], [w * h for h in s.ev_hits]
        s.aside = 0
        s.ev_blocks += 1
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
    def _flush_observations(self) -> None:
        """The step's verified blocks into the online calibration (after its drafting: see __init__)."""
        obs, self._observed = self._observed, []
        for o in obs:
            self.calib.observe(*o)

    def _calibrated(self, seqs: list[Seq], conf_logits: torch.Tensor) -> torch.Tensor:
        """The calibrated confidences [R, G] of the seqs' new blocks (each in its request's regime).
        Every drafted block's conditionals, a probe's included, become the request's `last_c`: when
        the block is verified they enter the request's evidence (`_observe_block`), which the
        decision to step aside reads (a probe that left them stale kept a request aside for good).
        Eager drafting and static rounds alike."""
        regs = [regime(s.req.temperature) for s in seqs]
        c = self.calib.cal.confidence(conf_logits, regs)
        for s, ck in zip(seqs, c.tolist()):
            s.last_c = ck
        return c
