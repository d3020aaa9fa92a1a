"""The static decode round's plan and read-back, typed: what the engine hands `decode_round` and
what comes back, owned here with their padding, their rank-group wire form and their column layout.

- `RoundPlan`: one round's per-sequence inputs (lists, one entry a sequence), its spec mode, the SPS
  table, dspark_adaptive's admission inputs (`t_draft`, `cal`, `fixed_ell`: all or none) and the
  processed variant's columns (`n_out`, `min_tokens`, `frequency`, `presence`: all or none).
  `inputs` pads it to a bucket as host tensors (`StaticRunner.round_inputs` moves them in once),
  `padding_inputs` is a round of padding sequences only (the warm-up), `pack` / `unpack` its int64
  wire form for the rank group (`group.worker`'s ROUND plan).
- `RoundResult`: one sequence's row of the round's one int64 read-back, [G+1 committed tokens |
  committed | accepted | stopped | next ell | G confidence logits (+ (G+1) x LOGPROB_COLS log-probs)];
  `pack_result` / `pack_logprobs` build it inside the graphs (trn2.static_round), the engine reads it
  through the properties. No other module knows a column offset (tests/test_layout.py checks it).

Float values of the read-back are `loop_dtype` bits (`precision.pack_bits`: exact, and no float64 op
under the kernels' numerics); on the wire the float columns and the SPS table cross as float64 bits
(a widening that is exact both ways). Imports torch and the engine's dtype policy only: the engine
imports this module, and nothing of the graphs.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from v4flash_backend.engine.precision import loop_dtype, pack_bits, unpack_bits
from v4flash_backend.engine.sampling import GREEDY_TEMPERATURE, LOGPROB_WIDTH

STOP_WIDTH = 8  # stop ids per request a static decode round takes (more: the eager path)
SPS_WIDTH = 16  # SPS table entries a round takes (padded with its last entry: same lookups)
LOGPROB_COLS = 2 + 2 * LOGPROB_WIDTH  # a round's read-back per token: logprob, rank, top ids, top logprobs
RESULT_FIXED = 5  # the read-back's columns besides the 2G + 1 token and confidence ones (see RoundResult)

MODES = ("off", "dspark", "fixed")
_INTS = ("slot", "start", "pending", "ell", "top_k", "seed", "rnd", "budget", "len_left")
_FLOATS = ("temperature", "top_p")
# the processed round's columns (min_tokens, penalties, log-probs in the graphs): wire mode + 4
_PROC_INTS = ("n_out", "min_tokens")
_PROC_FLOATS = ("frequency", "presence")
_ADAPTIVE = ("t_draft", "cal", "fixed_ell")


def _long(x) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.long).reshape(-1)


def _f64_bits(x) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.float64).reshape(-1).view(torch.int64)


@dataclass
class RoundPlan:
    """One static decode round (`Engine._round_plan` builds it, `runner.decode_round` runs it)."""

    slot: list[int]
    start: list[int]  # cached positions before the round
    pending: list[int]  # the token to verify first
    ell: list[int]  # drafts of the resident block to verify (0: none; -1: a padding row of step_profile)
    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    seed: list[int]
    rnd: list[int]  # the request's round counter (the noise streams' index)
    budget: list[int]  # tokens left to generate
    len_left: list[int]  # context rows left
    stop_ids: list[list[int]]  # [S, stop width], -1 padded
    spec_mode: str = "off"  # off | dspark | fixed (off: graph 1 alone)
    fixed_len: int = 0
    sps: torch.Tensor | None = None  # the SPS table [2, n] (dspark admission), None: a dummy
    # dspark_adaptive's admission inputs: draft seconds by live rows [S+1], (T_k, b_k) [S, G, 2], fixed_ell [S]
    t_draft: list[float] | None = None
    cal: list | None = None
    fixed_ell: list[int] | None = None
    # the processed variant (min_tokens, penalties, log-probs inside the graphs)
    n_out: list[int] | None = None
    min_tokens: list[int] | None = None
    frequency: list[float] | None = None
    presence: list[float] | None = None

    @property
    def size(self) -> int:
        return len(self.slot)

    @property
    def processed(self) -> bool:
        return self.n_out is not None

    @property
    def adaptive(self) -> bool:
        return self.cal is not None

    # ---- padded to a bucket -------------------------------------------------------------------------
    def inputs(self, S: int, G: int, scratch: int) -> dict:
        """The round graphs' inputs for a bucket of S sequences as host tensors: the plan's rows, then
        padding sequences (scratch slot, no valid row). A round of spec mode off runs graph 1 alone:
        without the draft graph's inputs (the SPS table, dspark_adaptive's), which it does not read."""
        pad = S - self.size
        fd = loop_dtype()

        def col(name, fill, dtype=torch.long):
            return torch.tensor(list(getattr(self, name)) + [fill] * pad, dtype=dtype)

        x = dict(slot=col("slot", scratch), start=col("start", 0),
                 n=torch.tensor([1 + e for e in self.ell] + [0] * pad, dtype=torch.long),
                 pending=col("pending", 0), temperature=col("temperature", 0.0, fd),
                 top_k=col("top_k", 0), top_p=col("top_p", 1.0, fd), seed=col("seed", 0),
                 rnd=col("rnd", 0), budget=col("budget", 0), len_left=col("len_left", 0),
                 stop_ids=torch.tensor([list(r) for r in self.stop_ids] + [[-1] * len(self.stop_ids[0])] * pad,
                                       dtype=torch.long))
        if self.spec_mode != "off":
            x.update(sps_t=pad_sps(self.sps), **adaptive_inputs(S, G, self))
        if self.processed:
            x.update(n_out=col("n_out", 0), min_tokens=col("min_tokens", 0),
                     frequency=col("frequency", 0.0, fd), presence=col("presence", 0.0, fd))
        return x

    @staticmethod
    def padding_inputs(S: int, G: int, scratch: int, stop_width: int, processed: bool = False) -> dict:
        """Inputs of a round of padding sequences only (scratch slot, no valid row): it changes no
        real slot's state, so it compiles the round graphs at start."""
        z, fd = torch.zeros(S, dtype=torch.long), loop_dtype()
        proc = dict(n_out=z.clone(), min_tokens=z.clone(), frequency=torch.zeros(S, dtype=fd),
                    presence=torch.zeros(S, dtype=fd)) if processed else {}
        return proc | dict(slot=torch.full((S,), scratch, dtype=torch.long), start=z, n=z.clone(),
                           pending=z.clone(), temperature=torch.zeros(S, dtype=fd), top_k=z.clone(),
                           top_p=torch.ones(S, dtype=fd), seed=z.clone(), rnd=z.clone(), budget=z.clone(),
                           len_left=z.clone(), stop_ids=torch.full((S, stop_width), -1, dtype=torch.long),
                           sps_t=pad_sps(None), **adaptive_inputs(S, G))

    # ---- the rank group's wire form -----------------------------------------------------------------
    def pack(self) -> tuple[tuple[int, int, int, int], torch.Tensor]:
        """a = (S, stop width, spec mode (+ 4: processed), fixed_len); body = the int64 columns, the
        float columns as float64 bits, the stop ids, the padded SPS table (float64 bits), then
        dspark_adaptive's inputs when the plan has them: t_draft [S+1] (float64 bits), fixed_ell [S],
        cal [S, G, 2] (float64 bits)."""
        S, W = self.size, len(self.stop_ids[0])
        proc = self.processed
        ints = _long([getattr(self, k) for k in _INTS + (_PROC_INTS if proc else ())])
        floats = _f64_bits([getattr(self, k) for k in _FLOATS + (_PROC_FLOATS if proc else ())])
        # the table in the loop's dtype (fp32 under the kernels' numerics) crosses as float64 bits: the
        # widening is exact, and the receiving side's pad_sps narrows it back to the same values
        sps = pad_sps(self.sps).to(torch.float64).reshape(-1).view(torch.int64)
        parts = [ints, floats, _long(self.stop_ids), sps]
        if self.adaptive:
            td = _f64_bits(self.t_draft)
            if td.numel() != S + 1:
                raise ValueError(f"a round plan of {S} sequences needs {S + 1} draft seconds, got {td.numel()}")
            parts += [td, _long(self.fixed_ell), _f64_bits(self.cal)]
        mode = MODES.index(self.spec_mode) + (4 if proc else 0)
        return (S, W, mode, int(self.fixed_len)), torch.cat(parts)

    @classmethod
    def unpack(cls, a, body: torch.Tensor) -> "RoundPlan":
        S, W, mode, fixed = a
        names_i = _INTS + (_PROC_INTS if mode >= 4 else ())
        names_f = _FLOATS + (_PROC_FLOATS if mode >= 4 else ())
        ni, nf = len(names_i) * S, len(names_f) * S
        kw = dict(zip(names_i, body[:ni].view(len(names_i), S).tolist()))
        kw.update(zip(names_f, body[ni:ni + nf].clone().view(torch.float64).view(len(names_f), S).tolist()))
        kw["stop_ids"] = body[ni + nf:ni + nf + S * W].view(S, W).tolist()
        o = ni + nf + S * W
        kw["sps"] = pad_sps(body[o:o + 2 * SPS_WIDTH].clone().view(torch.float64).view(2, -1))
        rest = body[o + 2 * SPS_WIDTH:]
        if rest.numel():
            G = (rest.numel() - 2 * S - 1) // (2 * S)
            kw["t_draft"] = rest[:S + 1].clone().view(torch.float64).tolist()
            kw["fixed_ell"] = rest[S + 1:2 * S + 1].tolist()
            kw["cal"] = rest[2 * S + 1:].clone().view(torch.float64).view(S, G, 2).tolist()
        return cls(spec_mode=MODES[mode % 4], fixed_len=fixed, **kw)

    def diff(self, other: "RoundPlan") -> list[str]:
        """The names of the fields (the SPS table aside: a tensor) where two plans differ."""
        return [f.name for f in fields(self) if f.name != "sps" and getattr(self, f.name) != getattr(other, f.name)]


def filters_sampling(temperature, top_k, top_p, vocab: int) -> bool:
    """Whether any row's sampling filters (top-k below the vocabulary or top-p below 1, not greedy):
    `SamplingParams.stages`'s rule on the values rounded to the plan's dtype, as the graphs compare
    them, in plain Python (no tensor op outside a round). Only the processed round variant has the
    filters (`static_round.stages_of`), so such a round must be processed."""
    cast = float if loop_dtype() == torch.float64 else (lambda v: float(np.float32(v)))
    cut = cast(GREEDY_TEMPERATURE)
    return any(cast(t) >= cut and (0 < k < vocab or cast(p) < 1) for t, k, p in zip(temperature, top_k, top_p))


def adaptive_inputs(S: int, G: int, plan: RoundPlan | None = None) -> dict:
    """The draft graph's dspark_adaptive inputs for a bucket of S rows (static_round.draft_round):
    t_draft [S+1] `loop_dtype()` (draft seconds by live rows; zeros: the forward's table alone), cal
    [S, G, 2] `loop_dtype()` ((T_k, b_k) per row; T = 0: the raw head), fixed_ell [S] (-1: admission;
    -1 - f: admission with at least f drafts, the fixed-length guard's floor; a probe: 1). From a round
    plan's `t_draft` / `cal` / `fixed_ell` (padding rows: the last value, the raw head, -1). Host tensors:
    `round_inputs` / `round_padding` move the plan to the device."""
    fd = loop_dtype()
    td = list((plan.t_draft if plan is not None else None) or [0.0])
    td = td[:S + 1] + [td[-1]] * (S + 1 - len(td))
    cal = torch.zeros(S, G, 2, dtype=fd)
    if plan is not None and plan.cal is not None and len(plan.cal):
        c = torch.as_tensor(plan.cal, dtype=fd).reshape(-1, G, 2)
        cal[:c.shape[0]] = c
    fe = list((plan.fixed_ell if plan is not None else None) or [])
    return dict(t_draft=torch.tensor(td, dtype=fd), cal=cal,
                fixed_ell=torch.tensor(fe + [-1] * (S - len(fe)), dtype=torch.long))


def pad_sps(sps_t: torch.Tensor | None) -> torch.Tensor:
    """An SPS table [2, n] padded to [2, SPS_WIDTH] (a fixed graph input shape); None: a dummy."""
    fd = loop_dtype()
    if sps_t is None:
        return torch.ones(2, SPS_WIDTH, dtype=fd)
    if sps_t.shape[1] > SPS_WIDTH:
        raise ValueError(f"an SPS table of {sps_t.shape[1]} sizes (at most {SPS_WIDTH})")
    sps_t = sps_t.to(fd)
    pad = sps_t[:, -1:].expand(2, SPS_WIDTH - sps_t.shape[1])
    return torch.cat([sps_t, pad], 1)


# ---- the read-back ----------------------------------------------------------------------------------
def pack_result(tokens_out, committed, accepted, stopped, ell, conf) -> torch.Tensor:
    """The round's read-back (inside the graphs): [S, G+1 committed tokens | committed | accepted |
    stopped | next ell | G confidence logits of the new block (f32 in the loop dtype, bit-cast by
    `precision.pack_bits`; `RoundResult.confidence` reads them)]."""
    return torch.cat([tokens_out, committed[:, None], accepted[:, None], stopped.long()[:, None],
                      ell.long()[:, None], pack_bits(conf)], 1)


def pack_logprobs(tok_lp, rank, top_ids, top_lp, S: int) -> torch.Tensor:
    """The processed round's log-probs pack (inside the graphs): per verify row the committed
    token's log-prob, its rank, the top LOGPROB_WIDTH ids and log-probs, as int64 [S, (G+1) *
    LOGPROB_COLS] (`loop_dtype` values bit-cast; `RoundResult.logprobs` reads them)."""
    cols = torch.cat([pack_bits(tok_lp)[:, None], rank[:, None], top_ids, pack_bits(top_lp)], 1)
    return cols.view(S, -1)


@dataclass(frozen=True)
class RoundResult:
    """One sequence's row of a round's read-back; G is the block size of the graph that ran it (0
    for the plain-decode graph, whatever the runner's)."""

    row: list[int]
    G: int

    @classmethod
    def rows(cls, out: list[list[int]], processed: bool) -> list["RoundResult"]:
        """The read-back's rows (`decode_round`'s list of int lists) with their block size, which
        the row width gives: 2G + 5 columns (+ (G+1) x LOGPROB_COLS when processed)."""
        if not out:
            return []
        n = len(out[0])
        G = (n - RESULT_FIXED - LOGPROB_COLS) // (2 + LOGPROB_COLS) if processed else (n - RESULT_FIXED) // 2
        return [cls(r, G) for r in out]

    @property
    def committed(self) -> int:
        return self.row[self.G + 1]

    @property
    def tokens(self) -> list[int]:
        return self.row[:self.committed]

    @property
    def accepted(self) -> int:
        return self.row[self.G + 2]

    @property
    def stopped(self) -> bool:
        return bool(self.row[self.G + 3])

    @property
    def next_ell(self) -> int:
        return self.row[self.G + 4]

    def confidence(self) -> torch.Tensor:
        """The new block's [G] f32 confidence logits."""
        return unpack_bits(self.row[self.G + RESULT_FIXED:2 * self.G + RESULT_FIXED]).float()

    def logprobs(self, top_n: int) -> list:
        """The processed round's log-probs of the committed tokens, as the engine reports them:
        [logprob, rank, [[id, logprob], ...the first top_n alternatives in the support]] each."""
        pack = self.row[2 * self.G + RESULT_FIXED:]
        out = []
        for j in range(self.committed):
            c = pack[j * LOGPROB_COLS:(j + 1) * LOGPROB_COLS]
            ids = c[2:2 + LOGPROB_WIDTH]
            vals = unpack_bits([c[0]] + c[2 + LOGPROB_WIDTH:]).tolist()
            alts = [[int(t), v] for t, v in zip(ids[:top_n], vals[1:1 + top_n]) if v > float("-inf")]
            out.append([vals[0], int(c[1]), alts])
        return out
