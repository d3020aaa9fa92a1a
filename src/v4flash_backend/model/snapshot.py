"""A slot's `ModelState` at a prefix boundary: captured after the rows of positions < p were
written, restored into another slot so that it continues at position p exactly as the original.

Every buffer of the state is addressed by absolute position, so a snapshot is a set of
(first position, rows) per buffer (rows of consecutive positions), holding only what a later row at
a position >= p - 1 reads (the prefix cache runs the last position of a whole-prompt match again,
for its logits; rewriting a row with the value it holds changes nothing):

- window ring per layer: positions max(0, p - window)..p-1 (a row at t >= p - 1 reads t-window+1..t)
- compressor pending rows (ratio > 1): the group of position p - 1, ((p - 1) // r) * r..p-1
- Engram history: the last engram_max_ngram_size positions (the n-grams that end at p - 1 and later)
- DSpark ring per stage: the last min(p, window) positions (a draft reads the filled ring)
- compressed KV / index keys by group: groups q0 // r..p // r - 1, where q0 is the boundary of the
  snapshot this one extends (its parent in the prefix cache's chain, 0 for none): a chain of
  snapshots restored in order writes every complete group < p // r once, so the rows of a long shared
  prefix are stored once, not once per boundary
- the index-key aliasing marker (`ik_last`, read only under reference quirks)

Rows that a later position overwrites before reading (the ring slot of position p and later) are
not stored: the slot that receives the snapshot was reset, like the slot the original started in.
A snapshot's tensors live where the state does (device memory on a NeuronCore).
"""

from __future__ import annotations

import torch

from .state import ModelState


def _rows(t: torch.Tensor, slot: int, positions: torch.Tensor, ring: int) -> torch.Tensor:
    return t[slot, (positions % ring).to(t.device)].clone()


def ring_spans(state: ModelState, p: int) -> dict[str, tuple[int, int]]:
    """The position ranges [lo, p) of each ring a continuation from p reads."""
    cfg = state.cfg
    return {"window": (max(0, p - cfg.window_size), p),
            "engram": (max(0, p - max(cfg.engram_max_ngram_size, 1)), p),
            "dspark": (max(0, p - cfg.window_size), p)}


def capture(state: ModelState, slot: int, p: int, q0: int = 0) -> dict:
    """The snapshot of `slot` at boundary p (its compressed groups from q0's on; see the module doc)."""
    spans = ring_spans(state, p)
    pos = {k: torch.arange(lo, hi) for k, (lo, hi) in spans.items()}
    snap: dict = {"p": p, "q0": q0, "window": {}, "pend": {}, "ckv": {}, "ik": {}, "dspark": {}}
    for layer, t in state.window.items():
        snap["window"][layer] = (spans["window"][0], _rows(t, slot, pos["window"], t.shape[1]))
    for layer, t in state.pend_kv.items():
        r = state.cfg.compress_ratios[layer]
        g0 = (max(p - 1, 0) // r) * r
        pp = torch.arange(g0, p)
        R = state.pend_ring[layer]
        snap["pend"][layer] = (g0, _rows(t, slot, pp, R), _rows(state.pend_score[layer], slot, pp, R))
    for name in ("ckv", "ik"):
        for layer, t in getattr(state, name).items():
            r = state.cfg.compress_ratios[layer]
            g = torch.arange(q0 // r, p // r)
            snap[name][layer] = (q0 // r, t[slot, g.to(t.device)].clone())
    win = state.cfg.window_size
    for k, t in state.dspark.items():
        snap["dspark"][k] = (spans["dspark"][0], _rows(t, slot, pos["dspark"], win))
    snap["engram"] = (spans["engram"][0], _rows(state.engram_hist, slot, pos["engram"], state.eng_ring))
    snap["ik_last"] = int(state.ik_last[slot])
    return snap


def _put(t: torch.Tensor, slot: int, lo: int, rows: torch.Tensor, ring: int | None) -> None:
    if rows.shape[0]:
        positions = torch.arange(lo, lo + rows.shape[0])
        idx = positions % ring if ring else positions
        t[slot, idx.to(t.device)] = rows


def restore(state: ModelState, slot: int, chain: list[dict]) -> None:
    """Write the snapshots of a chain (root first; each extends the previous one's boundary) into
    `slot`, which the caller has reset: the compressed groups of every link, the rings of the last."""
    for snap in chain:
        for name in ("ckv", "ik"):
            for layer, (g0, rows) in snap[name].items():
                _put(getattr(state, name)[layer], slot, g0, rows, None)
    last = chain[-1]
    for layer, (lo, rows) in last["window"].items():
        _put(state.window[layer], slot, lo, rows, state.window[layer].shape[1])
    for layer, (lo, kv, score) in last["pend"].items():
        R = state.pend_ring[layer]
        _put(state.pend_kv[layer], slot, lo, kv, R)
        _put(state.pend_score[layer], slot, lo, score, R)
    for k, (lo, rows) in last["dspark"].items():
        _put(state.dspark[k], slot, lo, rows, state.cfg.window_size)
    lo, rows = last["engram"]
    _put(state.engram_hist, slot, lo, rows, state.eng_ring)
    state.ik_last[slot] = last["ik_last"]


def nbytes(snap: dict) -> int:
    """Bytes of the rows a snapshot holds (positions are kept as first-position ints)."""
    n = 0
    for key in ("window", "pend", "ckv", "ik", "dspark"):
        for parts in snap[key].values():
            n += sum(t.numel() * t.element_size() for t in parts[1:])
    return n + snap["engram"][1].numel() * snap["engram"][1].element_size()


class SnapshotStore:
    """A rank's snapshots by entry id (the ids rank 0's prefix cache hands out; every rank keeps
    its own shard's rows under the same id)."""

    def __init__(self):
        self.entries: dict[int, dict] = {}

    def save(self, state: ModelState, slot: int, entry: int, p: int, q0: int) -> int:
        snap = capture(state, slot, p, q0)
        self.entries[entry] = snap
        return nbytes(snap)

    def load(self, state: ModelState, slot: int, chain: list[int]) -> None:
        restore(state, slot, [self.entries[e] for e in chain])

    def drop(self, entries) -> None:
        for e in entries:
            self.entries.pop(int(e), None)

    @property
    def bytes(self) -> int:
        return sum(nbytes(s) for s in self.entries.values())
