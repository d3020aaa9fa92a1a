"""The step cost learned from the engine's own decode steps: the start-up profile is the prior.

The profile (`step_profile`) is taken once, often beside compiles, cache warm-up or other load, and
was measured 1.4-1.8x off the steps the engine then ran at batch 8 (issue 32). Every decode step's
measured seconds therefore enter a `StepCostLearner`, keyed by cell (decode path: eager | static;
drafting or not; greedy or sampled; B, the verify rows, in half-octave buckets). A cell keeps a window of ratios
measured / the prior's t_step(B, S, R), and its median is the cell's factor; `LearnedStepCost`
prices a step as factor(B) x prior, the factor interpolated linearly in B between the cells that
have one (by their mean B) and held beyond them, so admission's marginal row cost is the measured
one where steps were seen. A factor, not an offset: a profile taken on a loaded machine is off by a
factor (issue 32: 0.55-0.73 x at batch 8), and on a fake clock 2x off a held offset priced B = 6 of
the embedded model 12 % high after learning from B >= 9, a median offset over a cell's mixed B 1 %.

Greedy and sampled steps learn apart (a step is sampled when any of its requests samples): a sampled
step's host work -- top-k / top-p over every verify row, the drafts drawn from processed logits --
made a batch-8 drafting step on the embedded model cost ~1.2x the greedy step of the same rows. With
one set of cells, the greedy cells' factors priced sampled drafting (few sampled drafting steps ever
fill a cell: stepping aside keeps them rare), DSpark drafted at batch 8, T = 1 where plain was faster
and read 0.74x plain (perf/bench_dspark.py, held-out, a quiet machine). A regime without cells
borrows the other's; within a regime, a drafting step without cells borrows the plain steps'.

Robust and bounded, because a shared machine's bursts must not steer admission:
- a cell moves only with `floor` samples (before: the prior alone);
- a sample's ratio is winsorised to the cell's median +- max(4 MAD, 0.1) before it enters (a
  burst of load counts as a bounded sample, not as its size), and a new cell's samples to [1/4, 4];
- the window holds the cell's last `window` samples (old regimes age out), the median takes half of
  them to move;
- the learned step stays within [1/4, 4] x the prior.

The learner reads timing only, never a draw: the schedule it changes is decided before the draws it
gates (lossless as before: dspark_sched's early stop is untouched).
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from typing import Callable

import torch

from .dspark_sched import DraftStepSPS, SPSTable
from .step_cost import StepCost

PATHS = ("eager", "static")
BOUND = 4.0  # the learned step within [prior / BOUND, prior * BOUND]
REFRESH = 8  # samples between two rebuilds of the learned view (or a cell reaching its floor): a
# rebuild (the cells' medians, a new table) cost ~0.5-1 ms on the CI machine, a step 20-60 ms


def bucket(B: int) -> int:
    """Half-octave bucket of B verify rows (1 | 2 | 3 | 4-5 | 6-7 | 8-11 | 12-15 | 16-22 | ...)."""
    return int(math.floor(2.0 * math.log2(max(int(B), 1))))


class Cell:
    """One (path, drafting, sampled, B bucket) cell: the last `window` ratios (measured / prior) and the B
    they were measured at."""

    def __init__(self, window: int):
        self.res: deque[float] = deque(maxlen=window)
        self.bs: deque[int] = deque(maxlen=window)
        self._limits: tuple[float, float] | None = None  # (median, MAD) as of `_since` samples ago
        self._since = 0

    def __len__(self) -> int:
        return len(self.res)

    def median(self) -> float:
        return statistics.median(self.res)

    def mad(self) -> float:
        m = self.median()
        return statistics.median(abs(r - m) for r in self.res)

    def limits(self) -> tuple[float, float]:
        """(median, MAD) of the window, recomputed once every REFRESH samples: every step paid
        three sorts of the 64-sample window for them, the largest part of the learner's host work
        on a stepped-aside compiled step (a ~4 ms round at batch 1), and they move slowly."""
        if self._limits is None or self._since >= REFRESH:
            self._limits, self._since = (self.median(), self.mad()), 0
        return self._limits

    def add(self, r: float, B: int) -> None:
        self.res.append(r)
        self.bs.append(int(B))
        self._since += 1

    def mean_b(self) -> float:
        return sum(self.bs) / len(self.bs)


class StepCostLearner:
    """Measured decode steps by cell (see the module doc); `view(prior, path)` is the learned cost.
    One per engine (a bench may carry it from engine to engine, as a server's lifetime)."""

    def __init__(self, window: int = 64, floor: int = 8):
        self.window, self.floor = int(window), int(floor)
        self._cells: dict[tuple[str, bool, bool, int], Cell] = {}
        # steps observed and not yet taken into the cells (`observe`). Why: taking each at once cost a
        # stepped-aside compiled round ~35 us of host work (a 5.7 ms plain round at batch 1 on an AMD
        # EPYC; the learner stubbed out in a diagnostic outside the repo), and its decision reads the
        # learner only when the version moves
        self._pending: list[tuple] = []
        self._prior_memo: tuple = (None, {})
        self.version = 0  # bumped by a sample that makes the views stale (REFRESH, a cell at its floor)
        self._fresh = 0  # samples since the last bump
        self.samples = 0
        self.damped = 0  # samples the winsorisation moved
        self._views: dict = {}

    def observe(self, path: str, B: int, S: int, R: int, seconds: float, prior: StepCost,
                sampled: bool = False) -> None:
        """One decode step of `path` over B verify rows of S sequences that drafted for R requests,
        measured `seconds` (the engine's clock); sampled: any of its requests samples. A step whose
        cell has its floor is held until the sample that moves the version (every REFRESH) or until
        the learner is read (`_settle`); every other is taken at once. So the version moves at the
        same sample as if each were taken at once, and a reader sees the same cells."""
        cell = self._cells.get((path, R > 0, bool(sampled), bucket(B)))
        self._pending.append((path, B, S, R, seconds, prior, sampled))
        if cell is None or len(cell) < self.floor or self._fresh + len(self._pending) >= REFRESH:
            self._settle()

    def _settle(self) -> None:
        """Take the held steps into the cells, in order."""
        pending, self._pending = self._pending, []
        for p in pending:
            self._take(*p)

    @property
    def cells(self) -> dict[tuple[str, bool, bool, int], Cell]:
        """The cells, the held steps taken (every reader but `measured` and the version goes through here)."""
        if self._pending:
            self._settle()
        return self._cells

    def _take(self, path: str, B: int, S: int, R: int, seconds: float, prior: StepCost, sampled: bool) -> None:
        if path not in PATHS or B < 1 or not (seconds > 0 and math.isfinite(seconds)):
            return
        memo = self._prior_memo  # the prior's t_step of the shapes seen (a stepped-aside server sees one)
        if memo[0] is not prior:
            memo = self._prior_memo = (prior, {})
        p = memo[1].get((B, S, R))
        if p is None:
            p = memo[1][B, S, R] = float(prior.t_step(B, S, R))
        if not p > 0:
            return
        key = (path, R > 0, bool(sampled), bucket(B))
        cell = self._cells.get(key)
        if cell is None:
            cell = self._cells[key] = Cell(self.window)
        r = seconds / p
        lo, hi = 1.0 / BOUND, BOUND
        if len(cell) >= self.floor:
            m, mad = cell.limits()
            lim = max(4.0 * 1.4826 * mad, 0.1)
            lo, hi = max(lo, m - lim), min(hi, m + lim)
        rc = min(max(r, lo), hi)
        self.damped += rc != r
        cell.add(rc, B)
        self.samples += 1
        self._fresh += 1
        if self._fresh >= REFRESH or len(cell) == self.floor:
            self.version, self._fresh = self.version + 1, 0

    def measured(self, path: str, B: int, drafting: bool, sampled: bool = False) -> bool:
        """Has the cell of B its floor of samples? (a held step's cell has it already)"""
        c = self._cells.get((path, drafting, bool(sampled), bucket(B)))
        return c is not None and len(c) >= self.floor

    def points(self, path: str, drafting: bool, sampled: bool = False) -> list[tuple[float, float]]:
        """(mean B, median ratio) of the cells of (path, drafting, sampled) with `floor` samples, by B."""
        return sorted((c.mean_b(), c.median()) for (p, d, smp, _), c in self.cells.items()
                      if p == path and d == drafting and smp == bool(sampled) and len(c) >= self.floor)

    def view(self, prior: StepCost, path: str, rows_per_seq: int = 1, sampled: bool = False) -> StepCost:
        """The learned cost over `prior` for steps on `path` of the regime `sampled` (the other
        regime's where this one has no cell yet; the prior itself while no cell moved); rows_per_seq
        (1 + gamma): a static table's size B holds about B / rows_per_seq drafting rows."""
        key = (id(prior), path, bool(sampled))
        got = self._views.get(key)
        if got is not None and got[0] == self.version and got[1] is prior:
            return got[2]
        pts = {d: self.points(path, d, sampled) for d in (False, True)}
        if not (pts[False] or pts[True]):
            pts = {d: self.points(path, d, not sampled) for d in (False, True)}
        v = prior if not (pts[False] or pts[True]) else LearnedStepCost(prior, pts, rows_per_seq)
        self._views = {k: g for k, g in self._views.items() if g[0] == self.version}
        self._views[key] = (self.version, prior, v)
        return v

    def stats(self, path: str | None = None) -> dict:
        """The cells' factors (measured / profile; reported by the engine's stats)."""
        cells = {f"{p}/{'draft' if d else 'plain'}/{'sampled' if smp else 'greedy'}/B~{c.mean_b():.0f}":
                 (len(c), round(c.median(), 3))
                 for (p, d, smp, _), c in sorted(self.cells.items()) if path in (None, p)}
        return dict(step_cost_samples=self.samples, step_cost_damped=self.damped, step_cost_cells=cells)


def _factor(points: list[tuple[float, float]], B: float) -> float:
    """Piecewise-linear through points (x ascending), held constant beyond the ends."""
    i = bisect.bisect_left(points, (B,))
    if i == 0:
        return points[0][1]
    if i == len(points):
        return points[-1][1]
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (B - x0) / max(x1 - x0, 1e-9)


class LearnedStepCost(StepCost):
    """A prior StepCost corrected by the learner's cells: t_step(B, S, R) = factor(B, R > 0) x prior
    (factors within [1/BOUND, BOUND]). A drafting step's factor falls back on the plain steps' cells
    when it has none, and the other way round (in steady DSpark nearly every step drafts).

    The split form admission reads besides t_step -- `forward` (the static rounds' SPS input) and
    `t_draft(R)` (their t_draft input) -- carries the drafting factor at the table's sizes and at
    B = R x rows_per_seq (a drafting round of R sequences, the full block each): 1 / (1 / forward(B)
    + t_draft(R)) is then the learned step exactly where the factor does not vary between those two
    B (a profile off by one factor, issue 32's case), and close where it does. Same table width,
    tensor inputs of the round: no graph sees a new shape, nothing recompiles."""

    def __init__(self, prior: StepCost, points: dict[bool, list[tuple[float, float]]], rows_per_seq: int = 1):
        self.prior = prior
        self.points = {d: points[d] or points[not d] for d in (False, True)}
        self.rows_per_seq = max(1, int(rows_per_seq))
        fwd = [sps / self.factor(b, True) for b, sps in zip(prior.forward.sizes, prior.forward.sps)]
        super().__init__(SPSTable(prior.forward.sizes, fwd, interpolate=prior.forward.interpolate),
                         prior.draft_seconds, prior.replaced, by_seqs=prior.by_seqs)

    def factor(self, B, drafting: bool) -> float:
        return _factor(self.points[drafting], float(B))

    def t_draft(self, R: int) -> float:
        return self.factor(R * self.rows_per_seq, True) * self.prior.t_draft(R) if R > 0 else 0.0

    def t_step(self, B, S: int, R: int):
        if isinstance(B, torch.Tensor):  # admit's B range: the prior's tensor ops, the factors per B
            f = torch.tensor([self.factor(b, R > 0) for b in B.reshape(-1).tolist()], dtype=torch.float64)
            return f.reshape(B.shape) * torch.as_tensor(self.prior.t_step(B, S, R), dtype=torch.float64)
        return self.factor(B, R > 0) * float(self.prior.t_step(B, S, R))

    def forward_for(self, R: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """Admission without draft seconds (dspark_adaptive off) prices a drafting step's forward:
        the static form's learned table, or the learned step over R sequences."""
        if not self.by_seqs:
            return self.forward
        return lambda B: 1.0 / (self.t_step(B, R, R) - self.t_draft(R))

    def sps_for(self, R: int) -> Callable[[torch.Tensor], torch.Tensor]:
        td = self.t_draft(R)
        if not self.by_seqs:
            return DraftStepSPS(self.forward, td) if td else self.forward
        return lambda B: 1.0 / self.t_step(B, R, R)

    def __repr__(self) -> str:
        f = {d: [(round(b), round(v, 3)) for b, v in p] for d, p in self.points.items()}
        return f"LearnedStepCost(factor plain={f[False]} draft={f[True]}, prior={self.prior})"
