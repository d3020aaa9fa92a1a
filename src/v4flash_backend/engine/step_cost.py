"""What a decode step really costs, and whether drafting pays for itself at the current batch.

A DSpark step is not only the target forward over B tokens: the draft stages run for the R
requests that draft, and the host samples the Markov chain, runs the confidence head and admits.
`StepCost` holds both, profiled on the engine's own runner:
    t(B, R) = t_forward(B) + t_draft(R)        (t_draft(0) = 0: a step that does not draft)
`admit` then plans with SPS(B) = 1 / t(B, R) for the step's R, so a draft's verify row is charged
what the step pays for it, and `drafting_pays` compares the best expected rate with drafting
against plain decoding before any draft is sampled (only past acceptance enters, so skipping a
step's drafts is a decision independent of its draws: losslessness is untouched).

Profiling is robust to a shared machine: sizes are measured in interleaved rounds (a burst of
load hits every size, not one), each size keeps its median, and the eager forward's medians are
fitted by one model t = a + s R + b B (`fit_seq_model`, a point more than 30 % off the fit left
out), so no single median sets the cost of a row.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Callable, Sequence

import torch

from .dspark_sched import DraftStepSPS, SPSTable

FORMAT = "v4flash-step-cost"


def interleaved_medians(fn: Callable[[int], object], sizes: Sequence[int], rounds: int,
                        clock: Callable[[], float] = time.perf_counter) -> dict[int, float]:
    """Median seconds of fn(size), measured round-robin over sizes (one warm-up call each)."""
    for b in sizes:
        fn(int(b))
    samples: dict[int, list[float]] = {int(b): [] for b in sizes}
    for _ in range(rounds):
        for b in sizes:
            t0 = clock()
            fn(int(b))
            samples[int(b)].append(clock() - t0)
    return {b: statistics.median(v) for b, v in samples.items()}


def fit_seq_model(points: dict[tuple[int, int], float]) -> tuple[tuple[float, float, float], list]:
    """The eager forward's seconds over (R sequences, B tokens) as t = a + s R + b B, least squares
    over the profiled medians, refitted once without the points more than 30 % off the first fit
    (a burst of load; at most a third of them). Three numbers from a dozen or more points: one
    noisy median moves the marginal cost of a row (b, what admission weighs a draft against) far
    less than it moved a per-R table's slope (measured on the embedded model: a per-R table put
    40 verify rows of 8 sequences at +84 ms, the engine's own steps at +50-60 ms). Returns
    ((a, s, b), the points left out); s, b >= 0 (a negative one is refitted as 0)."""
    keys = sorted(points)

    def solve(use):
        # a column that does not vary (one R profiled: max_num_seqs 1) is not identifiable: its
        # share goes to the intercept (lstsq on a rank-deficient design returned nonsense)
        cols = [0] + [c for c in (1, 2) if len({k[c - 1] for k in use}) > 1]
        while True:
            X = torch.tensor([[1.0, float(r), float(b)] for r, b in use], dtype=torch.float64)[:, cols]
            y = torch.tensor([points[k] for k in use], dtype=torch.float64)
            coef = torch.linalg.lstsq(X, y.reshape(-1, 1)).solution.reshape(-1).tolist()
            full = [0.0, 0.0, 0.0]
            for c, v in zip(cols, coef):
                full[c] = v
            neg = [c for c in cols[1:] if full[c] < 0]
            if not neg:
                return full
            cols = [c for c in cols if c not in neg]

    coef = solve(keys)
    pred = {k: coef[0] + coef[1] * k[0] + coef[2] * k[1] for k in keys}
    off = sorted((abs(points[k] / max(pred[k], 1e-9) - 1), k) for k in keys)
    drop = [k for e, k in off if e > 0.3][-(len(keys) // 3):] if len(keys) >= 6 else []
    if drop:
        coef = solve([k for k in keys if k not in drop])
    return (coef[0], coef[1], coef[2]), drop


def round_seconds_by_tokens(sizes: Sequence[int], rows_per_seq: int,
                            seconds_by_seqs: dict[int, float]) -> dict[int, float]:
    """A static runner's step time by B verify tokens: the measured decode round of
    S = ceil(B / rows_per_seq) sequences (which runs its bucket's fixed-shape graphs whatever B is
    inside it: a staircase, so no fitted model)."""
    return {int(b): seconds_by_seqs[-(-int(b) // rows_per_seq)] for b in sizes}


class StepCost:
    """forward: the forward's steps/s by B tokens (the static rounds' staircase; eager: one
    sequence). by_seqs (the eager profile): one such table per number of sequences R in the
    forward, B = R x rows per sequence, since an eager forward's cost is not a function of B alone:
    its attention runs per sequence (measured on the embedded model at context 60: 8 sequences x 1
    row cost 1.6x one sequence of 8 rows). t_forward(B, R) interpolates linearly in R between the
    profiled R."""

    def __init__(self, forward: SPSTable, draft_seconds: dict[int, float] | None = None, replaced=(),
                 by_seqs: dict[int, SPSTable] | None = None):
        self.forward = forward
        self.draft_seconds = {int(k): float(v) for k, v in (draft_seconds or {}).items()}
        self.replaced = list(replaced)  # profiled points the fit left out (reported)
        self.by_seqs = {int(k): v for k, v in sorted((by_seqs or {}).items())}

    def t_draft(self, R: int) -> float:
        """Seconds of the draft stages + host drafting work for R requests (floor bucket; 0 for R=0)."""
        if R <= 0 or not self.draft_seconds:
            return 0.0
        keys = sorted(self.draft_seconds)
        below = [k for k in keys if k <= R]
        if not below:
            return self.draft_seconds[keys[0]]
        k = below[-1]
        # past the largest profiled R, scale linearly (never more optimistic than the floor value)
        return self.draft_seconds[k] * (R / k if R > keys[-1] else 1.0)

    def t_forward(self, B, R: int | None = None) -> torch.Tensor | float:
        """Seconds of a forward over B tokens of R sequences (R None or no by_seqs: `forward`)."""
        if R is None or not self.by_seqs:
            return 1.0 / self.forward.lookup(B)
        keys = list(self.by_seqs)
        lo = max([k for k in keys if k <= R], default=keys[0])
        hi = min([k for k in keys if k >= R], default=keys[-1])
        t_lo = 1.0 / self.by_seqs[lo].lookup(B)
        if hi == lo:
            return t_lo
        w = (R - lo) / (hi - lo)
        return t_lo + w * (1.0 / self.by_seqs[hi].lookup(B) - t_lo)

    def t_step(self, B, S: int, R: int):
        """Seconds of a decode step over B verify rows of S sequences that drafts for R requests:
        t_forward(B, S) + t_draft(R) (what `admit` and `drafting_pays` price; a learned model,
        step_learn.LearnedStepCost, corrects it from the engine's measured steps)."""
        return self.t_forward(B, S) + self.t_draft(R)

    def forward_for(self, R: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """SPS(B) of a forward over R sequences (no draft stages)."""
        if not self.by_seqs:
            return self.forward  # the table itself (callable): admit then knows the static rounds' form
        return lambda B: 1.0 / self.t_forward(B, R)

    def sps_for(self, R: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """SPS(B) of a step that drafts for R requests, for `admit`."""
        td = self.t_draft(R)
        if td == 0:  # the forward's table itself (what the static rounds' admission reads then)
            return self.forward_for(R)
        if not self.by_seqs:  # the static rounds' form (admit_static's t_draft input): admit knows it
            return DraftStepSPS(self.forward, td)
        return lambda B: 1.0 / (self.t_forward(B, R) + td)

    # ---- persistence ---------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = {"format": FORMAT, "forward": self.forward.to_dict(),
             "draft_seconds": {str(k): v for k, v in sorted(self.draft_seconds.items())},
             "replaced": self.replaced}
        if self.by_seqs:
            d["forward_by_seqs"] = {str(k): t.to_dict() for k, t in self.by_seqs.items()}
        return d

    def save(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def load(cls, path) -> "StepCost":
        with open(path) as f:
            d = json.load(f)
        if d.get("format") == SPSTable.FORMAT:  # a forward-only table (older files): no draft cost
            return cls(SPSTable.from_dict(d))
        if d.get("format") != FORMAT:
            raise ValueError(f"{path}: not a step-cost file (format={d.get('format')!r})")
        return cls(SPSTable.from_dict(d["forward"]), {int(k): v for k, v in d["draft_seconds"].items()},
                   d.get("replaced", ()),
                   {int(k): SPSTable.from_dict(t) for k, t in d.get("forward_by_seqs", {}).items()})

    def __repr__(self) -> str:
        by = "".join(f", R={r}: " + " ".join(f"{b}:{1e3 / v:.1f}" for b, v in zip(t.sizes, t.sps))
                     for r, t in self.by_seqs.items())
        return (f"StepCost(forward={self.forward}, "
                f"draft_ms={ {k: round(v * 1e3, 2) for k, v in self.draft_seconds.items()} }"
                f"{', forward_ms by B' + by if by else ''}"
                f"{', replaced ' + str(self.replaced) if self.replaced else ''})")


def expected_survivals(rates: Sequence[float]) -> list[float]:
    """a_k = prod_{i<=k} r_i from per-position conditional acceptance rates."""
    out, a = [], 1.0
    for r in rates:
        a *= r
        out.append(a)
    return out


def drafting_pays(cost: StepCost, survivals_per_seq: list[list[float]], extra_tokens: int = 0,
                  resume_blocks: int = 0) -> tuple[bool, int]:
    """(draft this step?, the uniform draft length that looked best). Plain decoding commits R
    tokens in t_forward(R + extra); drafting l per request commits sum_r (1 + a_r[:l].sum()) in
    t_forward(R (1 + l) + extra) + t_draft(R).

    resume_blocks = H > 0: speculation stepped aside last step, so this step's drafting has no block
    to verify yet: it commits R tokens in t_step(R + extra, R, R) (on static rounds the whole drafting
    round), and the H steps after it commit the blocks. The verdict then prices that stretch,
    (R + H tokens(l)) / (t_step(R + extra, R, R) + H t_step(R (1 + l) + extra, R, R)), against plain
    decoding: resuming must pay for its first step."""
    R = len(survivals_per_seq)
    if R == 0:
        return False, 0
    G = len(survivals_per_seq[0])
    plain = R / float(cost.t_step(R + extra_tokens, R, 0))
    H = resume_blocks
    first = float(cost.t_step(R + extra_tokens, R, R)) if H else 0.0
    best, best_l = plain, 0
    for ell in range(1, G + 1):
        tokens = sum(1 + sum(a[:ell]) for a in survivals_per_seq)
        t = float(cost.t_step(R * (1 + ell) + extra_tokens, R, R))
        rate = (R + H * tokens) / (first + H * t) if H else tokens / t
        if rate > best:
            best, best_l = rate, ell
    return best_l > 0, best_l
