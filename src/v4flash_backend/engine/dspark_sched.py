"""DSpark draft admission (paper Algorithm 1) and the SPS table it trades against.

Each round the draft proposes gamma tokens per request with calibrated confidences c[r, j]
(c_j = P(x_j accepted | x_<j accepted), computed from x_{j-1}, never from x_j). `admit` decides
how many drafts ell_r each request sends to the next verify forward, maximising expected
committed tokens per second tau * SPS(B) over the whole batch, where B = sum(1 + ell_r).

Losslessness hinges on the EARLY STOP: the greedy walk over entries sorted by survival stops at
the first entry that does not improve tau * SPS(B). Whether (r, j) is admitted then depends only
on entries with survival >= a[r, j], i.e. on x_<j of row r and on other rows, never on x_j
itself (paper App. A). `admit_no_early_stop` (global argmax over prefixes) breaks this and exists
only as a negative control for the tests.
"""

from __future__ import annotations

import bisect
import json
import math
import statistics
import time
from typing import Callable, Iterable, Optional, Sequence, Tuple, Union

import torch

from .precision import loop_dtype

SPSLike = Union["SPSTable", Callable[[torch.Tensor], torch.Tensor]]


# --------------------------------------------------------------------------- SPS table


def _pav_non_increasing(values: Sequence[float], weights: Sequence[float]) -> list:
    """Weighted least-squares fit that is non-increasing (pool adjacent violators)."""
    blocks = []  # [weighted mean, total weight, count]
    for v, w in zip(values, weights):
        blocks.append([float(v), float(w), 1])
        # a later block above an earlier one violates "non-increasing": pool them
        while len(blocks) > 1 and blocks[-2][0] < blocks[-1][0]:
            m2, w2, n2 = blocks.pop()
            m1, w1, n1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    out = []
    for m, _, n in blocks:
        out.extend([m] * n)
    return out


class SPSTable:
    """Target-forward steps per second as a function of B, the number of tokens in the forward.

    Built from measured samples, smoothed to be monotone non-increasing in B (a larger forward is
    never faster; measurement noise must not make the scheduler chase a bump). Lookup is by floor
    bucket: SPS(B) = value at the largest profiled size <= B. Below the smallest profiled size the
    smallest size's value is used; above the largest, tokens/s is held constant
    (SPS(B) = SPS(Bmax) * Bmax / B), the compute-bound limit, which is never more optimistic than
    the floor value.

    interpolate=True (the eager engine's profile of its own forward, whose cost is close to affine
    in B): between two profiled sizes the step's seconds 1 / SPS are interpolated linearly, so the
    table has no cliff at a bucket edge (measured: a 15 % drop at B = 32 after a flat stretch made
    the early-stopped walk stop at the edge, where one entry cannot pay for the whole drop). A
    static runner's table stays a floor staircase: its graphs really cost their bucket's time.
    """

    FORMAT = "v4flash-sps-table"

    def __init__(self, sizes: Sequence[int], sps: Sequence[float], *,
                 weights: Optional[Sequence[float]] = None, smooth: bool = True, interpolate: bool = False):
        pairs = sorted(zip((int(b) for b in sizes), (float(s) for s in sps),
                           weights if weights is not None else [1.0] * len(sizes)))
        if not pairs:
            raise ValueError("SPSTable needs at least one (size, sps) sample")
        b = [p[0] for p in pairs]
        if len(set(b)) != len(b):
            raise ValueError("duplicate sizes: use SPSTable.from_samples to aggregate repeats")
        if b[0] < 1 or any(not (p[1] > 0 and math.isfinite(p[1])) for p in pairs):
            raise ValueError("sizes must be >= 1 and sps finite and > 0")
        self.sizes: Tuple[int, ...] = tuple(b)
        self.raw_sps: Tuple[float, ...] = tuple(p[1] for p in pairs)
        self.weights: Tuple[float, ...] = tuple(float(p[2]) for p in pairs)
        self.sps: Tuple[float, ...] = (tuple(_pav_non_increasing(self.raw_sps, self.weights))
                                       if smooth else self.raw_sps)
        self.interpolate = bool(interpolate)
        self._sizes_t = torch.tensor(self.sizes, dtype=torch.int64)
        self._sps_t = torch.tensor(self.sps, dtype=torch.float64)

    @classmethod
    def from_samples(cls, samples: Iterable[Tuple[int, float]], smooth: bool = True) -> "SPSTable":
        """Repeated measurements of one size are aggregated by their median (robust to a stray
        slow run) and weigh in the smoothing by their count."""
        by_size: dict = {}
        for b, s in samples:
            by_size.setdefault(int(b), []).append(float(s))
        sizes = sorted(by_size)
        return cls(sizes, [statistics.median(by_size[b]) for b in sizes],
                   weights=[len(by_size[b]) for b in sizes], smooth=smooth)

    def lookup(self, B: Union[int, torch.Tensor]) -> Union[float, torch.Tensor]:
        """SPS for B tokens (int -> float, int tensor -> float64 tensor of the same shape)."""
        if not isinstance(B, torch.Tensor):
            return self._lookup_scalar(int(B))
        bt = torch.as_tensor(B, dtype=torch.int64)
        idx = (torch.searchsorted(self._sizes_t, bt.reshape(-1), right=True) - 1).clamp(min=0)
        out = self._sps_t[idx]
        flat_b = bt.reshape(-1).to(torch.float64)
        if self.interpolate and len(self.sizes) > 1:
            hi = (idx + 1).clamp(max=len(self.sizes) - 1)
            b0, b1 = self._sizes_t[idx].double(), self._sizes_t[hi].double()
            w = ((flat_b - b0) / (b1 - b0).clamp_min(1.0)).clamp(0.0, 1.0)
            out = 1.0 / ((1 - w) / self._sps_t[idx] + w / self._sps_t[hi])
        bmax = self.sizes[-1]
        return torch.where(flat_b > bmax, self.sps[-1] * bmax / flat_b, out).reshape(bt.shape)

    def _lookup_scalar(self, b: int) -> float:
        """lookup for one int B in Python floats (the same float64 operations as the tensor path;
        the engine's per-step decision makes a dozen of these, which as tensor ops cost 1 ms a step)."""
        sizes, sps = self.sizes, self.sps
        if b > sizes[-1]:
            return (sps[-1] * sizes[-1]) * (1.0 / b)  # as torch's scalar / tensor: reciprocal, then product
        i = max(bisect.bisect_right(sizes, b) - 1, 0)
        if not self.interpolate or len(sizes) == 1:
            return sps[i]
        j = min(i + 1, len(sizes) - 1)
        w = min(max((float(b) - sizes[i]) / max(float(sizes[j] - sizes[i]), 1.0), 0.0), 1.0)
        return 1.0 / ((1 - w) / sps[i] + w / sps[j])

    __call__ = lookup

    def to_dict(self) -> dict:
        return {"format": self.FORMAT, "version": 1, "sizes": list(self.sizes),
                "sps": list(self.sps), "raw_sps": list(self.raw_sps), "weights": list(self.weights),
                "interpolate": self.interpolate}

    @classmethod
    def from_dict(cls, d: dict) -> "SPSTable":
        if d.get("format") != cls.FORMAT:
            raise ValueError(f"not an SPS table (format={d.get('format')!r})")
        t = cls(d["sizes"], d["sps"], weights=d.get("weights"), smooth=False, interpolate=d.get("interpolate", False))
        if "raw_sps" in d:
            t.raw_sps = tuple(float(s) for s in d["raw_sps"])
        return t

    def save(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def load(cls, path) -> "SPSTable":
        with open(path) as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def profile(cls, fn: Callable[[int], object], sizes: Sequence[int], repeats: int = 5,
                warmup: int = 1, clock: Callable[[], float] = time.perf_counter) -> "SPSTable":
        """Time fn(B) (one target forward of B tokens; it must block until the work is done, e.g.
        synchronise the device) for every size; SPS = 1 / seconds per call. `warmup` untimed calls
        per size absorb compilation and cache effects."""
        if repeats < 1:
            raise ValueError("repeats must be >= 1")
        samples = []
        for b in sizes:
            for _ in range(warmup):
                fn(int(b))
            for _ in range(repeats):
                t0 = clock()
                fn(int(b))
                dt = clock() - t0
                samples.append((int(b), 1.0 / max(dt, 1e-12)))
        return cls.from_samples(samples)

    def __repr__(self) -> str:
        return (f"SPSTable(sizes={list(self.sizes)}, sps={[round(s, 4) for s in self.sps]}"
                f"{', interpolated' if self.interpolate else ''})")


# --------------------------------------------------------------------------- admission


class DraftStepSPS:
    """SPS(B) of a step that drafts: 1 / (1 / table(B) + t_draft), the forward's staircase table plus
    the draft stages' seconds (`StepCost.sps_for`). The static rounds' admission computes the same
    function from its inputs (sps_t, t_draft), so `admit` recognises this form and runs those ops."""

    def __init__(self, table: SPSTable, t_draft: float):
        self.table, self.t_draft = table, float(t_draft)

    def __call__(self, B: torch.Tensor) -> torch.Tensor:
        return 1.0 / (1.0 / self.table.lookup(B) + self.t_draft)


def staircase_sps(sizes: torch.Tensor, vals: torch.Tensor, B: torch.Tensor,
                  t_draft: torch.Tensor | None = None) -> torch.Tensor:
    """SPS at int B of a floor table (sizes ascending, int; vals in the loop dtype), tokens/s held past
    the largest size, optionally with draft seconds t_draft (a 0-dim tensor; <= 0: none): the ops
    of `SPSTable.lookup` (floor) and `DraftStepSPS` in `vals.dtype`. Shared by the host `admit` and
    `admit_static`, so both read bit-identical values in fp32 (in fp64 they equal the table's lookup)."""
    dt = vals.dtype
    idx = (torch.searchsorted(sizes, B, right=True) - 1).clamp(min=0)
    bmax = sizes[-1]
    sps_b = torch.where(B > bmax, vals[-1] * bmax.to(dt) / B.to(dt), vals[idx])
    if t_draft is not None:
        sps_b = torch.where(t_draft > 0, 1.0 / (1.0 / sps_b + t_draft), sps_b)
    return sps_b


def _sps_values(sps: SPSLike, b: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """SPS(b) in dt. fp64: the table's own lookup (the CPU reference, as it always was). fp32 (the
    kernels' numerics): a floor table, or one with draft seconds, runs `staircase_sps` -- the static
    rounds' ops -- so eager and static admission agree bit for bit; an interpolated table (the eager
    runner's profile, which no static round reads) is looked up in fp64 and rounded."""
    if dt != torch.float64:
        table, td = (sps.table, sps.t_draft) if isinstance(sps, DraftStepSPS) else (sps, None)
        if isinstance(table, SPSTable) and not table.interpolate:
            return staircase_sps(table._sizes_t, table._sps_t.to(dt), b,
                                 None if td is None else torch.tensor(td, dtype=dt))
    if isinstance(sps, SPSTable):
        return sps.lookup(b).to(dt)
    return torch.as_tensor(sps(b), dtype=torch.float64).to(dt)


def _admit(c: torch.Tensor, sps: SPSLike, early_stop: bool, extra_tokens: int = 0) -> torch.Tensor:
    c = torch.as_tensor(c)
    if c.dim() < 2:
        raise ValueError("c must be [R, gamma] (or [..., R, gamma] for independent batches)")
    device = c.device
    # on the host, in the loop dtype (fp64 for the CPU reference: exact ties compare exactly; fp32
    # under the kernels' numerics, as admit_static in the graph, so both admit the same drafts)
    dt = loop_dtype()
    c64 = c.detach().to("cpu", dt).nan_to_num(0.0).clamp(0.0, 1.0)
    *lead, R, G = c64.shape
    M = R * G
    if M == 0:
        return torch.zeros(*lead, R, dtype=torch.int64, device=device)
    a = torch.cumprod(c64, dim=-1)  # survival of each draft prefix, non-increasing in j
    # Flatten entries j-major (e = j * R + r); a stable sort on -a then breaks ties by (j, r), so
    # (r, j) always precedes (r, j + 1) and every admitted set is a per-row prefix.
    a_e = a.transpose(-1, -2).reshape(*lead, M)
    a_sorted, order = torch.sort(-a_e, dim=-1, stable=True)
    a_sorted = -a_sorted
    valid = a_sorted > 0  # Alg. 1 only walks entries with a > 0; those sort first
    B0 = R + int(extra_tokens)  # tokens in the forward before any draft: anchors + other work
    sps_b = _sps_values(sps, torch.arange(B0, B0 + M + 1, dtype=torch.int64), dt)  # B = B0 .. B0 + M
    tau = R + torch.cumsum(a_sorted, dim=-1)
    val = tau * sps_b[1:]  # value after admitting k = 1..M entries
    base = torch.full((*lead, 1), R * float(sps_b[0]), dtype=dt)  # exact product, rounded once: as R * sps in dt
    if early_stop:
        prev = torch.cat([base, val[..., :-1]], dim=-1)
        ok = (val > prev) & valid
        n_adm = torch.cumprod(ok.to(torch.int64), dim=-1).sum(-1)
    else:
        # global argmax over prefix lengths (first maximum = strict improvement semantics)
        all_vals = torch.cat([base, val.masked_fill(~valid, float("-inf"))], dim=-1)
        n_adm = all_vals.argmax(-1)
    rank = torch.arange(M).expand(*lead, M)
    admitted_sorted = rank < n_adm.unsqueeze(-1)
    admitted = torch.zeros(*lead, M, dtype=torch.bool).scatter_(-1, order, admitted_sorted)
    ell = admitted.reshape(*lead, G, R).sum(-2)
    return ell.to(device)


def admit(c: torch.Tensor, sps: SPSLike, extra_tokens: int = 0) -> torch.Tensor:
    """Paper Algorithm 1 with the early stop. c [R, gamma] calibrated confidences in [0, 1]
    (values outside are clamped, NaN counts as 0); sps an SPSTable or a callable
    B (int64 tensor) -> steps/s. Returns ell [R] int64: row r verifies 1 + ell[r] tokens.

    extra_tokens: tokens that share the verify forward but commit nothing this step (e.g. a
    prefill chunk); B then starts at R + extra_tokens while tau starts at R.
    A leading batch shape [..., R, gamma] runs independent admissions (used by tests)."""
    return _admit(c, sps, early_stop=True, extra_tokens=extra_tokens)


def admit_no_early_stop(c: torch.Tensor, sps: SPSLike, extra_tokens: int = 0) -> torch.Tensor:
    """NEGATIVE CONTROL, not lossless: the global argmax of tau * SPS(B) over all prefixes of
    the survival order. A later draft's survival (which depends on the earlier sampled draft)
    then decides whether that earlier draft is verified (paper App. A)."""
    return _admit(c, sps, early_stop=False, extra_tokens=extra_tokens)


def admit_fixed(R: int, n: int, gamma: Optional[int] = None, device=None) -> torch.Tensor:
    """Fixed-length speculation: every row admits n drafts (clamped to gamma when given)."""
    if n < 0:
        raise ValueError("n must be >= 0")
    if gamma is not None:
        n = min(n, gamma)
    return torch.full((R,), n, dtype=torch.int64, device=device)


def sps_tensors(sps: "SPSTable") -> torch.Tensor:
    """The SPS table as one `loop_dtype()` tensor [2, n] (sizes, exact in fp32 below 2^24; smoothed
    steps/s): an input of the static draft graph, so `admit_static` runs inside it (floor lookup: a
    static runner's table is a staircase of its buckets, never interpolated)."""
    dt = loop_dtype()
    return torch.stack([sps._sizes_t.to(dt), sps._sps_t.to(dt)])


def admit_static(c: torch.Tensor, live: torch.Tensor, sps_t: torch.Tensor,
                 t_draft: torch.Tensor | None = None) -> torch.Tensor:
    """`admit` (early stop, extra_tokens 0) over a bucket with no host reads: c [S, gamma]
    confidences, live [S] bool (the rows admit sees; the others get 0 and do not count in R),
    sps_t = sps_tensors(table). Row by row equal to admit(c[live], table): the rows that are not
    live have survival 0, sort behind every live entry and are never admitted, and the j-major
    tie order among live entries is the same. t_draft [>= S + 1] (dspark_adaptive): the draft
    seconds by R; with t_draft[R] > 0 the table is `StepCost.sps_for(R)`'s, 1 / (1 / SPS(B) +
    t_draft[R]) (`staircase_sps`, R, the live rows, is only known inside the graph). All float math
    in `loop_dtype()` (sps_t / t_draft are expected in it: a cast of a matching input is a no-op)."""
    dt = loop_dtype()
    dev = c.device
    c64 = c.detach().to(dt).nan_to_num(0.0).clamp(0.0, 1.0)
    c64 = torch.where(live[:, None], c64, torch.zeros_like(c64))
    S, G = c64.shape
    M = S * G
    R = live.to(torch.int64).sum()
    a = torch.cumprod(c64, dim=-1)
    a_e = a.transpose(0, 1).reshape(M)
    a_sorted, order = torch.sort(-a_e, stable=True)
    a_sorted = -a_sorted
    valid = a_sorted > 0
    B = R + torch.arange(M + 1, device=dev)
    td = None
    if t_draft is not None:
        td = t_draft.to(dt).gather(0, R.reshape(1)).reshape(())  # a gather, not t_draft[R]: no host read of R
    sps_b = staircase_sps(sps_t[0].long(), sps_t[1].to(dt), B, td)
    tau = R.to(dt) + torch.cumsum(a_sorted, dim=-1)
    val = tau * sps_b[1:]
    base = (R.to(dt) * sps_b[0]).reshape(1)
    prev = torch.cat([base, val[:-1]])
    ok = (val > prev) & valid
    n_adm = torch.cumprod(ok.to(torch.int64), dim=-1).sum()
    admitted_sorted = torch.arange(M, device=dev) < n_adm
    admitted = torch.zeros(M, dtype=torch.bool, device=dev).scatter(0, order, admitted_sorted)
    return admitted.reshape(G, S).sum(0)
