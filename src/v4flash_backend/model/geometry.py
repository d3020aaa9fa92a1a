"""The index tensors of one forward step over fixed-shape state, shared by every layer.

A step is S sequences of Q rows each: sequence s extends cache slot slot[s] from position start[s]
with n[s] valid rows (row i at position start[s] + i; rows i >= n[s] are padding, n[s] = 0 a padding
sequence). The eager forward builds one geometry per Segment (S = 1, Q = seg.n, every row valid);
the static decode step (`trn2.static_step`) one for its whole bucket. Both then run the same
attention, compressor, indexer and Engram code (`attention.attend`, `V41Model.engram_hashes`): every
cache read is a gather with these tensors, every cache write a `masked_put`, and the only Python
values are the shapes and `ctx`, the context bound that sizes the compressed reads (the eager
step's own end, so it reads exactly the rows it did; a bucket's bound in the static step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .state import Segment


@dataclass
class Geometry:
    S: int
    Q: int
    ctx: int  # every valid position is < ctx; compressed reads cover the first ctx // ratio rows
    slot: torch.Tensor  # [S]
    start: torch.Tensor  # [S]
    n: torch.Tensor  # [S]
    pos: torch.Tensor  # [S, Q]
    valid: torch.Tensor  # [S, Q]
    flat_pos: torch.Tensor  # [S*Q]
    span_pos: torch.Tensor  # [S, window-1+Q]: the window positions any row of the step can see
    widx: torch.Tensor  # [S, Q, window] window slots (indices into the span, -1 = none)
    width: torch.Tensor  # [S] the eager layout's window width (slots after it are padding)
    off: int = 0  # first row of this geometry in the step's flattened rows (eager segments)
    # (start, n) as Python values when the step knows them (an eager segment: S = 1, every row
    # valid): writes that are all valid skip the mask, the compressor pools only the groups the
    # segment completes, and the slot list has no padding columns -- the same values, less work
    host: tuple[int, int] | None = None


def step_geometry(slot: torch.Tensor, start: torch.Tensor, n: torch.Tensor, Q: int, window: int, ctx: int,
                  off: int = 0, host: tuple[int, int] | None = None) -> Geometry:
    """The geometry of S sequences (slot/start/n [S] int64, on the state's device) of Q rows."""
    S, dev = slot.shape[0], slot.device
    ar = torch.arange(Q, device=dev)
    pos = start[:, None] + ar
    valid = ar < n[:, None]
    span0 = start - (window - 1)  # first position of the span
    span_pos = span0[:, None] + torch.arange(window - 1 + Q, device=dev)
    t = pos[:, :, None]
    cols = torch.arange(window, device=dev)
    # the reference's layouts: a single-token step past position 0 takes the whole window oldest
    # first with the empty slots in front; a chunk takes `width` slots from max(0, t - W + 1) with
    # the not-yet-visible ones (-1) at the end (the 64-slot softmax blocks round per block)
    single = (n == 1) & (start > 0)
    dec = t - window + 1 + cols
    dec_idx = torch.where(dec < 0, -1, dec - span0[:, None, None])
    chk = (t - window + 1).clamp_min(0) + cols
    chk_idx = torch.where(chk > t, -1, chk - span0[:, None, None])
    widx = torch.where(single[:, None, None], dec_idx, chk_idx)
    width = torch.where(single, window, (start + n).clamp_max(window))
    return Geometry(S, Q, ctx, slot, start, n, pos, valid, pos.reshape(-1), span_pos, widx, width, off, host)


def segment_geometry(seg: Segment, window: int, device) -> Geometry:
    """One eager segment as a geometry of one sequence whose rows are all valid (ctx = its end)."""
    t = torch.tensor([seg.slot, seg.start, seg.n], dtype=torch.long, device=device)
    return step_geometry(t[0:1], t[1:2], t[2:3], seg.n, window, seg.end, seg.off, (seg.start, seg.n))


def masked_put(buf: torch.Tensor, slot: torch.Tensor, idx: torch.Tensor, val: torch.Tensor,
               valid: torch.Tensor | None) -> None:
    """buf[slot, idx] = val where valid, with no host read and no spare slot.

    Valid entries never share a target (the callers' invariant). Every invalid entry is redirected
    to the first valid entry's target and writes that entry's value, so duplicate targets all carry
    the same value and the result does not depend on the scatter's order; when no entry is valid
    each writes back the value read at its own target. slot broadcasts against idx; val is idx's
    shape plus buf's trailing dims. valid None: every entry is valid."""
    if valid is None:
        buf[slot, idx] = val.to(buf.dtype)
        return
    slot, idx = torch.broadcast_tensors(slot, idx)
    trail = val.shape[idx.dim():]
    s, i, ok = slot.reshape(-1), idx.reshape(-1), valid.expand(idx.shape).reshape(-1)
    v = val.reshape((-1,) + trail).to(buf.dtype)
    # the first valid entry, as a [1] index (0 when none is valid; then unused: `any_ok` is False)
    first = ok.to(torch.int8).argmax().view(1)
    any_ok = ok.any()
    s_t = torch.where(ok, s, torch.where(any_ok, s.index_select(0, first), s))
    i_t = torch.where(ok, i, torch.where(any_ok, i.index_select(0, first), i))
    mask = ok.reshape((-1,) + (1,) * len(trail))
    fill = torch.where(any_ok, v.index_select(0, first), buf[s, i])
    buf[s_t, i_t] = torch.where(mask, v, fill)


def last_rows(geo: Geometry, R: int) -> torch.Tensor:
    """The valid rows a ring of R rows keeps: the last R of each sequence's step (all of them in a
    decode step; a long prefill chunk would otherwise write several rows into one ring slot).
    None when that is every row (an eager segment of at most R rows)."""
    if geo.host is not None and geo.Q <= R:
        return None
    return geo.valid & (geo.pos >= (geo.start + geo.n)[:, None] - R)


def join_slots(widx: torch.Tensor, cidx: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
    """Window slots [S, Q, Wn] then compressed slots [S, Q, K], with the window's padding columns
    (>= width, all -1) moved behind the compressed ones: the reference's order plus trailing -1
    (an all-empty 64-slot block changes no softmax sum)."""
    Wn, K = widx.shape[-1], cidx.shape[-1]
    full = torch.cat([widx, cidx], dim=-1)
    c = torch.arange(Wn + K, device=widx.device)
    w = width[:, None, None]
    src = torch.where(c < w, c, c + (Wn - w))
    picked = full.gather(-1, src.clamp_max(Wn + K - 1).expand(full.shape))
    return torch.where(src < Wn + K, picked, -1)
