"""A guard that fixed-length speculation is not silently better than DSpark's schedule.

Per regime (greedy | sampled), over the decode steps whose blocks `admit` chose, the engine compares
the tokens per second the schedule realised with what drafting a fixed `fixed_len` would have
yielded on the same verified blocks:
- tokens: a block that admitted ell drafts and had n accepted commits 1 + n. Fixed-length drafting
  verifies F = min(fixed_len, the request's room) of the same drafts, whose draws are the same
  (counter-based noise): where a draft was rejected within min(ell, F) fixed stops there too; where
  all ell were accepted and ell < F, the un-admitted positions count in expectation under the
  block's calibrated conditionals (n + sum_k prod_{ell <= i <= k} c_i);
- seconds: the schedule's are the step's measured seconds; fixed's the same step scaled by the
  learned step cost at fixed's verify rows over the schedule's (`StepCostLearner`, fed by every
  step's measured time, and by the occasional fixed-length step the guard asks for -- `explore` --
  so fixed's row count is measured, not only modelled by the profile under suspicion).
A regime's step time is shared by its requests' share of the batch. Sums decay by DECAY a step.

When the schedule falls behind (rate < (1 - MARGIN) x fixed's, at least MIN_BLOCKS of evidence), the
guard moves admission toward fixed: the regime's floor on admitted drafts rises by one (at most F:
then the schedule is fixed-length drafting); once the schedule is ahead by more than RELAX, or has
held EASE_EVERY steps, the floor eases back by one (a floor still needed comes back). A request's
drafts are max(admit's, its regime's floor), on eager steps and in the static rounds alike (their
`fixed_ell` input, -1 - floor: engine.round_plan). The floor is a function of past steps, fixed before
the draws it gates, so admission stays lossless: whether draft j is verified depends on admit's
early-stopped walk (lossless) or on j < floor (no draw at all). A shift of the confidences was
tried first: under a profile that prices a verify row above what even a sure draft returns, no
shift makes admit verify one (measured on the embedded model: the guard saw the gap, admission did
not move); a floor always can.
"""

from __future__ import annotations

DECAY = 0.98  # per step: about the last 50 steps
MARGIN = 0.02
RELAX = 0.05
MIN_BLOCKS = 16.0
MOVE_EVERY = 4  # steps of a regime between two moves (the decayed sums need time to show a move's effect)
EASE_EVERY = 64  # steps in the hold band before the shift eases one STEP toward 0 (is it still needed?)
EXPLORE_EVERY = 32  # one fixed-length step in this many drafting steps (its row count measured)
EXPLORE_FAST = 4  # ... while the learner has too few steps at fixed's row count to price it


def fixed_tokens(ell: int, n_acc: int, c: list[float], F: int) -> float:
    """Expected committed tokens of fixed-length drafting (F drafts) on a block that admitted ell and
    had n_acc accepted (see the module doc)."""
    if n_acc < min(ell, F) or ell >= F:
        return 1.0 + min(n_acc, F)
    exp, reach = float(n_acc), 1.0
    for k in range(ell, F):
        reach *= float(c[k])
        exp += reach
    return 1.0 + exp


class Regime:
    def __init__(self):
        self.sched_tok = self.sched_s = self.fixed_tok = self.fixed_s = self.blocks = self.ell_sum = 0.0
        self.floor = 0  # the regime's least admitted drafts
        self.moves = 0
        self.since = 0  # steps since the last move

    def decay(self) -> None:
        for k in ("sched_tok", "sched_s", "fixed_tok", "fixed_s", "blocks", "ell_sum"):
            setattr(self, k, getattr(self, k) * DECAY)

    def rates(self) -> tuple[float, float]:
        return self.sched_tok / max(self.sched_s, 1e-12), self.fixed_tok / max(self.fixed_s, 1e-12)


class FixedGuard:
    def __init__(self, fixed_len: int, gamma: int):
        self.F = max(0, min(int(fixed_len), int(gamma)))
        self.regimes: dict[str, Regime] = {}
        self.drafting_steps = 0

    def floor(self, reg: str) -> int:
        r = self.regimes.get(reg)
        return r.floor if r is not None else 0

    def explore(self, measured: bool = True) -> bool:
        """Is the next drafting step a fixed-length one? Every EXPLORE_EVERY-th, every EXPLORE_FAST-th
        while fixed's row count is not `measured` (the learner's cell there below its floor: until
        then the learned cost extrapolates the profile there). Counted per call."""
        self.drafting_steps += 1
        return self.F > 0 and self.drafting_steps % (EXPLORE_EVERY if measured else EXPLORE_FAST) == 0

    def observe_step(self, blocks: list[tuple[str, int, int, list[float], int]], seconds: float,
                     t_sched: float, t_fixed: float, S: int) -> None:
        """One step's verified blocks (regime, ell, n_acc, the block's calibrated c, the request's
        room) that admission chose, the step's measured seconds, the learned step cost of its verify
        rows (t_sched) and of fixed's on the same blocks (t_fixed), S sequences in the step."""
        for r in self.regimes.values():
            r.decay()
        if not blocks or not (seconds > 0 and t_sched > 0 and t_fixed > 0):
            return
        share = 1.0 / max(S, len(blocks))
        for reg, ell, n_acc, c, room in blocks:
            r = self.regimes.setdefault(reg, Regime())
            F = max(0, min(self.F, room))
            r.sched_tok += 1.0 + n_acc
            r.fixed_tok += fixed_tokens(ell, n_acc, c, F)
            r.sched_s += share * seconds
            r.fixed_s += share * seconds * t_fixed / t_sched
            r.blocks += 1.0
            r.ell_sum += ell
        for reg in {b[0] for b in blocks}:
            self._control(self.regimes[reg])

    def _control(self, r: Regime) -> None:
        r.since += 1
        if r.blocks < MIN_BLOCKS or r.since < MOVE_EVERY:
            return
        sched, fixed = r.rates()
        if sched < (1.0 - MARGIN) * fixed and r.floor < self.F:
            new = r.floor + 1
        elif r.floor and (sched > (1.0 + RELAX) * fixed or r.since >= EASE_EVERY):
            new = r.floor - 1  # ahead, or held long enough: ease back (a floor still needed comes back)
        else:
            return
        r.moves += 1
        r.floor, r.since = new, 0

    def stats(self) -> dict:
        out = {}
        for k, r in sorted(self.regimes.items()):
            s, f = r.rates()
            out[k] = dict(sched_tok_s=round(s, 2), fixed_tok_s=round(f, 2), floor=r.floor, moves=r.moves,
                          mean_ell=round(r.ell_sum / r.blocks, 2) if r.blocks else 0.0)
        return dict(fixed_guard=out)
