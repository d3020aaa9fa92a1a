"""Calibration of the DSpark confidence head: Sequential Temperature Scaling (STS), offline and online.

The head predicts c_k = P(draft k accepted | drafts < k accepted) as sigmoid(logit_k); `admit` plans
with the prefix survivals a_k = prod_{i<=k} c_i, so a head that is systematically under- or
over-confident makes the scheduler stop too early or verify too much. STS (paper section 3.2.1;
../shared/notes/dspark.md 1.3) fits one temperature per position, left to right: T_k is the value
on a grid that minimises the expected calibration error of a_k = prod_{i<=k} c_i against the
observed accepted-prefix indicator [accepted >= k + 1], with positions 0..k-1 already fixed.

One addition, measured: a temperature alone only moves sigmoid(logit / T) towards or away from 1/2,
so it cannot calibrate a head whose logits sit on the wrong side of 0 (the embedded model's head
says c ~ 0.45 where 0.8 of the drafts are accepted). Each position therefore gets a temperature and
a shift, c_k = sigmoid(logit_k / T_k + b_k) (Platt scaling), fitted by the same sequential search
over a (T, b) grid; b = 0 is plain STS. Both keep the order of the logits at a position (T > 0), so
AUROC is unchanged.

Online: the engine observes every verified block (the logits the head produced, how many drafts
were admitted, how many were accepted). `OnlineCalibrator` keeps a bounded window per temperature
regime (greedy / sampled: acceptance differs between them) and refits every `refit_every` blocks.
Position k is only observed in blocks that verified it (admitted > k), and those were admitted
*because* the earlier survivals were high, so the online fit uses the conditional form: T_k
calibrates sigmoid(logit_k / T_k) against [accepted > k] among blocks with admitted > k and
accepted >= k (every earlier draft accepted). Calibrated conditionals make calibrated products.

The fitted temperatures are stored beside the checkpoint (`dspark_calibration.json`, format below)
and loaded by the engine; `python -m v4flash_backend.training.calibrate` fits them on held-out text.

Dtypes: `Calibration.confidence`, which the engine's admission reads, computes in
`precision.loop_dtype()` (fp32 under the kernels' numerics) through `calibrated_confidence`, which the static
rounds run in the graph; the fits (offline and the online refits) stay float64:
they run on the host over observed logits and never inside a graph.
"""

from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .precision import loop_dtype

FILE_NAME = "dspark_calibration.json"
FORMAT = "v4flash-dspark-calibration"
REGIMES = ("greedy", "sampled")
# log-spaced temperatures 0.1 .. 10 (a logit may need sharpening or flattening by up to 10x) and
# shifts -6 .. 6 in the logit (c from 0.0025 to 0.9975 for a zero logit)
T_GRID = torch.logspace(-1, 1, 41, dtype=torch.float64)
B_GRID = torch.linspace(-6, 6, 61, dtype=torch.float64)
# the online refit's neighbourhood (T steps, b steps) around the current calibration: 9 x 13 points,
# a factor 1.6 in T and 1.2 in b either way per refit before the whole grid is searched
LOCAL_RADIUS = (4, 6)


def regime(temperature: float) -> str:
    return "greedy" if temperature <= 0 else "sampled"


def ece(conf: torch.Tensor, label: torch.Tensor, bins: int = 10) -> float:
    """Expected calibration error with equal-width bins: sum_b |mean conf_b - mean label_b| * n_b / n."""
    conf, label = conf.double().reshape(-1), label.double().reshape(-1)
    if conf.numel() == 0:
        return 0.0
    idx = (conf * bins).long().clamp(0, bins - 1)
    sc = torch.bincount(idx, conf, minlength=bins)
    sl = torch.bincount(idx, label, minlength=bins)
    return float((sc - sl).abs().sum() / conf.numel())


def auroc(score: torch.Tensor, label: torch.Tensor) -> float:
    """Area under the ROC curve (ties count one half); nan when one class is missing."""
    score, label = score.double().reshape(-1), label.bool().reshape(-1)
    pos, neg = score[label], score[~label]
    if pos.numel() == 0 or neg.numel() == 0:
        return float("nan")
    s = torch.cat([pos, neg])
    ranks = _average_ranks(s)
    return float((ranks[: pos.numel()].sum() - pos.numel() * (pos.numel() + 1) / 2) / (pos.numel() * neg.numel()))


def _average_ranks(x: torch.Tensor) -> torch.Tensor:
    order = torch.argsort(x, stable=True)
    xs = x[order]
    ranks = torch.empty_like(x)
    i = 0
    n = x.numel()
    while i < n:
        j = i
        while j + 1 < n and xs[j + 1] == xs[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def scaled(logits: torch.Tensor, params) -> torch.Tensor:
    """c = sigmoid(logits / T_k + b_k); params: [(T_k, b_k)] per position (the last dim of logits)."""
    p = torch.as_tensor(params, dtype=torch.float64).reshape(-1, 2)
    return torch.sigmoid(logits.double() / p[:, 0] + p[:, 1])


def survivals(logits: torch.Tensor, params) -> torch.Tensor:
    """a [N, G] = cumprod_k sigmoid(logits[:, k] / T_k + b_k)."""
    return torch.cumprod(scaled(logits, params), dim=1)


IDENTITY = (1.0, 0.0)


def nll(conf: torch.Tensor, label: torch.Tensor) -> float:
    """Mean log loss of conf against a 0/1 label (a proper scoring rule)."""
    c = conf.double().clamp(1e-9, 1 - 1e-9)
    y = label.double()
    return float(-(y * c.log() + (1 - y) * (1 - c).log()).mean())


OBJECTIVES = ("ece", "nll")


def _scores(c: torch.Tensor, label: torch.Tensor, bins: int, objective: str) -> torch.Tensor:
    """`ece` / `nll` of every row of c [..., N] against label [N] at once (the same binning and
    sums as the scalar functions)."""
    y = label.double().reshape(-1)
    n = y.numel()
    if objective == "nll":
        cc = c.clamp(1e-9, 1 - 1e-9)
        return -(y * cc.log() + (1 - y) * (1 - cc).log()).mean(-1)
    idx = (c * bins).long().clamp(0, bins - 1)
    sc = torch.zeros(*c.shape[:-1], bins, dtype=torch.float64).scatter_add_(-1, idx, c)
    sl = torch.zeros_like(sc).scatter_add_(-1, idx, y.expand_as(c))
    return (sc - sl).abs().sum(-1) / n


def _window(around: tuple[float, float]) -> tuple[range, range]:
    """The grid's T and b index ranges within LOCAL_RADIUS steps of the point nearest to around=(T, b)."""
    rt, rb = LOCAL_RADIUS
    it = int((T_GRID.log() - math.log(max(float(around[0]), 1e-12))).abs().argmin())
    ib = int((B_GRID - float(around[1])).abs().argmin())
    return (range(max(0, it - rt), min(len(T_GRID), it + rt + 1)),
            range(max(0, ib - rb), min(len(B_GRID), ib + rb + 1)))


def _on_edge(p: tuple[float, float], ti: range, bi: range) -> bool:
    """Whether grid point p lies on the window's edge where the whole grid goes on past it."""
    jt = int((T_GRID - p[0]).abs().argmin())
    jb = int((B_GRID - p[1]).abs().argmin())
    return ((jt in (ti.start, ti.stop - 1) and jt not in (0, len(T_GRID) - 1))
            or (jb in (bi.start, bi.stop - 1) and jb not in (0, len(B_GRID) - 1)))


def _finer_grid(p: tuple[float, float]) -> tuple[list[float], list[float]]:
    """A 4x finer grid around p: T within one coarse step, b within one coarse step."""
    t0, b0 = p
    t_step = float(T_GRID[1] / T_GRID[0])
    b_step = float(B_GRID[1] - B_GRID[0])
    return [t0 * t_step ** (i / 4) for i in range(-4, 5)], [b0 + b_step * j / 4 for j in range(-4, 5)]


def _grid_fit(score_fn, label: torch.Tensor, bins: int, objective: str = "ece",
              refine: bool = False, around: tuple[float, float] | None = None,
              stats: dict | None = None) -> tuple[float, float]:
    """The (T, b) of the grid whose score_fn(c) scores best against label: lowest ECE, or lowest log
    loss (first on ties, scanning T from small to large, b from 0 outwards, so the identity wins a
    flat objective). refine: then search a 4x finer grid around the best point (T within one coarse
    step, b within one coarse step of 0.2), which the offline fit uses: a shift off by half a
    coarse step moves c by up to 2.5 points near 1/2, most of a 3 % ECE budget.

    score_fn(t, b) takes t [nT, 1, 1] and b [1, nB, 1] and returns c [nT, nB, N]: the whole grid is
    scored in a few tensor ops (in chunks of T rows, to bound memory), then scanned in order. (The
    online refit scored its 2501 points one by one: 0.6 s a refit, 20 % of a batch-8 DSpark run's
    time on the embedded model; profiled with cProfile over perf/bench_dspark.py's prompts.)

    around=(T, b): search only the grid points within LOCAL_RADIUS steps of the point nearest to
    (T, b) -- the online refit's warm start from the current calibration, 117 of the 2501 points --
    and the whole grid when the best of them lies on the neighbourhood's edge (the optimum moved
    further: a change of workload). The scan order is the whole grid's, so when the whole grid's
    best point lies inside the neighbourhood both searches return it. `stats` counts the points
    scored ("points")."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    n = max(1, label.numel())

    def grid_scores(ts: torch.Tensor, bs: torch.Tensor) -> list[list[float]]:
        rows = max(1, (1 << 21) // (len(bs) * n))  # T rows per chunk: ~2 M elements
        out = []
        for i in range(0, len(ts), rows):
            t = ts[i:i + rows].reshape(-1, 1, 1)
            out += _scores(score_fn(t, bs.reshape(1, -1, 1)), label, bins, objective).tolist()
        return out

    def scan(ts: list[float], bs: list[float], scores: list[list[float]], best: float, best_p):
        for t, row in zip(ts, scores):
            for b, e in zip(bs, row):
                if e < best - 1e-12:
                    best, best_p = e, (t, b)
        return best, best_p

    def search(ti: range, bi: range):
        ts = T_GRID[ti.start:ti.stop]
        bs = torch.tensor(sorted(B_GRID[bi.start:bi.stop].tolist(), key=abs), dtype=torch.float64)
        if stats is not None:
            stats["points"] = stats.get("points", 0) + len(ts) * len(bs)
        return scan(ts.tolist(), bs.tolist(), grid_scores(ts, bs), math.inf, IDENTITY)

    full = (range(0, len(T_GRID)), range(0, len(B_GRID)))
    if around is None:
        best, best_p = search(*full)
    else:
        ti, bi = _window(around)
        best, best_p = search(ti, bi)
        if _on_edge(best_p, ti, bi):
            best, best_p = search(*full)
    if refine:
        ts, bs = _finer_grid(best_p)
        tt, bb = torch.tensor(ts, dtype=torch.float64), torch.tensor(bs, dtype=torch.float64)
        best, best_p = scan(ts, bs, grid_scores(tt, bb), best, best_p)
    return best_p


def prefix_labels(accepted: torch.Tensor, G: int) -> torch.Tensor:
    """[N, G] indicator that drafts 0..k were all accepted (accepted >= k + 1)."""
    return accepted.reshape(-1, 1) > torch.arange(G).reshape(1, -1)


def fit_sts(logits: torch.Tensor, accepted: torch.Tensor, bins: int = 10,
            objective: str = "ece", refine: bool = False) -> list[tuple[float, float]]:
    """Offline STS on fully verified blocks: logits [N, G] of the confidence head, accepted [N] the
    number of accepted drafts (all G verified). Returns [(T_k, b_k)] for k = 0..G-1."""
    N, G = logits.shape
    labels = prefix_labels(accepted, G).double()
    params: list[tuple[float, float]] = []
    prev = torch.ones(N, dtype=torch.float64)
    for k in range(G):
        x = logits[:, k].double()
        p = _grid_fit(lambda t, b: prev * torch.sigmoid(x / t + b), labels[:, k], bins, objective, refine)
        params.append(p)
        prev = prev * torch.sigmoid(x / p[0] + p[1])
    return params


def fit_conditional(logits: torch.Tensor, admitted: torch.Tensor, accepted: torch.Tensor, G: int,
                    current, min_rows: int = 24, bins: int = 10, local: bool = False,
                    stats: dict | None = None) -> list[tuple[float, float]]:
    """The online fit (see the module docstring): per position, among blocks that verified k with
    every earlier draft accepted, the (T_k, b_k) minimising the ECE of sigmoid(logit_k / T_k + b_k)
    against [accepted > k]. Positions with fewer than `min_rows` such blocks keep their current values.
    local: search around each position's current (T_k, b_k) (`_grid_fit` around=)."""
    params = [tuple(p) for p in current]
    for k in range(G):
        rows = (admitted > k) & (accepted >= k)
        if int(rows.sum()) < min_rows:
            continue
        x = logits[rows, k].double()
        params[k] = _grid_fit(lambda t, b: torch.sigmoid(x / t + b), (accepted[rows] > k).double(), bins,
                              around=params[k] if local else None, stats=stats)
    return params


def calibrated_confidence(conf: torch.Tensor, cal: torch.Tensor) -> torch.Tensor:
    """c [R, G] f32 from the head's logits [R, G]: sigmoid(logit / T_k + b_k) in `loop_dtype()` where
    T > 0, the raw head's f32 sigmoid where T = 0 (the static rounds' input for dspark_adaptive off:
    what the eager engine computes then). cal [R, G, 2]: (T_k, b_k) per row and position. No host
    read: `Calibration.confidence` (eager) and the static draft graph both run this."""
    dt = loop_dtype()
    T, b = cal[..., 0].to(dt), cal[..., 1].to(dt)
    scaled = torch.sigmoid(conf.to(dt) / torch.where(T > 0, T, torch.ones_like(T)) + b).float()
    return torch.where(T > 0, scaled, torch.sigmoid(conf))


@dataclass
class Calibration:
    """Per-regime (T_k, b_k) of the confidence head ((1, 0) everywhere = uncalibrated)."""

    gamma: int
    params: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    report: dict = field(default_factory=dict)  # how it was fitted (stored with the file)

    def of(self, reg: str) -> list[tuple[float, float]]:
        return self.params.get(reg) or [IDENTITY] * self.gamma

    def confidence(self, logits: torch.Tensor, regimes: list[str]) -> torch.Tensor:
        """c [R, G] = sigmoid(logits / T_k + b_k) with each row's regime."""
        # the static rounds run `calibrated_confidence` with this same [R, G, 2] input
        cal = torch.tensor([self.of(r) for r in regimes], dtype=loop_dtype()).reshape(*logits.shape, 2)
        return calibrated_confidence(logits, cal)

    def to_json(self) -> dict:
        return {"format": FORMAT, "gamma": self.gamma,
                "params": {r: [list(p) for p in v] for r, v in self.params.items()}, "report": self.report}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path, gamma: int) -> "Calibration":
        obj = json.loads(Path(path).read_text())
        if obj.get("format") != FORMAT:
            raise ValueError(f"{path}: not a {FORMAT} file")
        if obj.get("gamma") != gamma:
            raise ValueError(f"{path}: calibrated for a block of {obj.get('gamma')} drafts, the model drafts {gamma}")
        params = {}
        for r, v in obj.get("params", {}).items():
            if r not in REGIMES:
                raise ValueError(f"{path}: unknown regime {r!r} (known: {', '.join(REGIMES)})")
            ok = len(v) == gamma and all(len(p) == 2 and p[0] > 0 and all(map(math.isfinite, p)) for p in v)
            if not ok:
                raise ValueError(f"{path}: params[{r!r}] must be {gamma} pairs [T > 0, b]")
            params[r] = [(float(p[0]), float(p[1])) for p in v]
        return cls(gamma, params, obj.get("report", {}))

    @classmethod
    def for_checkpoint(cls, checkpoint_dir: str | Path | None, gamma: int) -> "Calibration":
        """The checkpoint's dspark_calibration.json when present, else uncalibrated."""
        if checkpoint_dir:
            path = Path(checkpoint_dir) / FILE_NAME
            if path.is_file():
                return cls.load(path, gamma)
        return cls(gamma)


class OnlineCalibrator:
    """Keeps `Calibration` current from the blocks the engine verifies: a bounded window per regime,
    a refit every `refit_every` observed blocks. Observations are kept also when refitting is off
    (`enabled` False): the offline fit reads them.

    Cheap at a full window (`perf/calibration_cost.py`, 2048 blocks of 5 drafts on the 2-core dev
    machine): a refit of the whole (T, b) grid took 190-310 ms, every 64 blocks -- 3-5 ms a block,
    about a third of a batch-8 DSpark step once a server's window is full. A
    refit therefore searches around the current calibration (`_grid_fit` around=; the whole grid
    when the optimum left the neighbourhood, and every `full_every`-th refit), and the per-position
    acceptance the stepping-aside decision reads every step is kept as running counts (it stacked
    the whole window each step: 1.1 ms)."""

    def __init__(self, calibration: Calibration, window: int = 2048, refit_every: int = 64,
                 enabled: bool = True, full_every: int = 16):
        self.cal = calibration
        self.enabled = enabled
        self.window = window
        self.refit_every = refit_every
        self.full_every = full_every
        self._obs = {r: deque(maxlen=window) for r in REGIMES}
        self._since = {r: 0 for r in REGIMES}
        self.refits = {r: 0 for r in REGIMES}
        self.points_scored = {r: 0 for r in REGIMES}  # grid points the refits scored (cost, for stats)
        G = calibration.gamma
        # per position k over the window: blocks that verified k with every earlier draft accepted,
        # and those of them that accepted k (the counts acceptance_rates reads)
        self._trials = {r: [0] * G for r in REGIMES}
        self._hits = {r: [0] * G for r in REGIMES}
        self.counted = 0  # moves whenever those counts do: acceptance_rates is unchanged while it stands

    def _count(self, reg: str, admitted: int, accepted: int, sign: int) -> None:
        trials, hits = self._trials[reg], self._hits[reg]
        self.counted += 1
        for k in range(min(admitted, accepted + 1, len(trials))):  # admitted > k and accepted >= k
            trials[k] += sign
            hits[k] += sign * (accepted > k)

    def observe(self, reg: str, logits: torch.Tensor, admitted: int, accepted: int) -> None:
        """One verified block: the head's logits [G] for it, drafts admitted and accepted."""
        if admitted <= 0:
            return
        obs = self._obs[reg]
        if len(obs) == obs.maxlen:  # the oldest block leaves the window
            self._count(reg, obs[0][1], obs[0][2], -1)
        obs.append((logits.detach().double().reshape(-1), admitted, accepted))
        self._count(reg, admitted, accepted, +1)
        self._since[reg] += 1
        if self.enabled and self._since[reg] >= self.refit_every:
            self.refit(reg)

    def observations(self, reg: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits [N, G], admitted [N], accepted [N]) of the window."""
        obs = self._obs[reg]
        if not obs:
            G = self.cal.gamma
            return (torch.zeros(0, G, dtype=torch.float64), torch.zeros(0, dtype=torch.long),
                    torch.zeros(0, dtype=torch.long))
        return (torch.stack([o[0] for o in obs]), torch.tensor([o[1] for o in obs]), torch.tensor([o[2] for o in obs]))

    def acceptance_rates(self, reg: str, min_rows: int = 8, fallback: list[float] | None = None) -> list[float]:
        """Observed conditional acceptance per position over the window (blocks that verified k with
        every earlier draft accepted). A position with fewer than `min_rows` observations takes
        fallback[k] when given, else the previous position's rate (1.0 for the first: no evidence
        yet means "try drafting")."""
        rates, prev = [], 1.0
        for k, (n, h) in enumerate(zip(self._trials[reg], self._hits[reg])):
            prev = h / n if n >= min_rows else (fallback[k] if fallback is not None else prev)
            rates.append(prev)
        return rates

    def refit(self, reg: str) -> None:
        self._since[reg] = 0
        logits, adm, acc = self.observations(reg)
        if not len(adm):
            return
        # the first refit and every full_every-th search the whole grid: a local optimum is left there
        local = self.refits[reg] % max(1, self.full_every) != 0
        st: dict = {}
        self.cal.params[reg] = fit_conditional(logits, adm, acc, self.cal.gamma, self.cal.of(reg), local=local,
                                               stats=st)
        self.refits[reg] += 1
        self.points_scored[reg] += st.get("points", 0)

    def stats(self) -> dict:
        return {"calibration": {r: [[round(t, 4), round(b, 4)] for t, b in self.cal.of(r)] for r in REGIMES},
                "calibration_refits": dict(self.refits), "calibration_points_scored": dict(self.points_scored)}
