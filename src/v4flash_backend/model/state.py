"""Per-sequence decoding state of the V4.1 forward, indexed by absolute position.

Every buffer is addressed by a sequence's absolute positions (ring slot = position % ring size),
so a speculative rollback costs nothing: rejected draft rows are simply overwritten later, and the
rings are sized window + max draft so that no row a later query still needs is ever overwritten.

- window KV per layer: ring of `window + margin` rows (bf16, post-RoPE, fp8 QDQ)
- compressed KV / index K per KV-source layer: one row per compressed group j (absolute)
- compressor pending rows (ratio > 1): fp32 kv and gate scores of recent positions
- Engram history: compressed token ids of recent positions
- DSpark ring per stage: exactly `window` rows, slot = position % window, committed rows only
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from v4flash_backend.config import ModelConfig


@dataclass
class Segment:
    """`n` new tokens of cache slot `slot` at absolute positions start..start+n-1; rows off..off+n-1
    of the flattened step input."""

    slot: int
    start: int
    n: int
    off: int = 0

    @property
    def end(self) -> int:
        return self.start + self.n


def make_segments(spec) -> list[Segment]:
    """[(slot, start, n), ...] -> Segments with row offsets into the flattened input."""
    segs, off = [], 0
    for slot, start, n in spec:
        segs.append(Segment(int(slot), int(start), int(n), off))
        off += int(n)
    return segs


class ModelState:
    def __init__(self, cfg: ModelConfig, num_slots: int, max_len: int, margin: int = 8):
        self.cfg = cfg
        self.num_slots = num_slots
        self.max_len = max_len
        self.margin = margin
        hd = cfg.head_dim
        self.win_ring = cfg.window_size + margin
        self.window = {i: torch.zeros(num_slots, self.win_ring, hd, dtype=torch.bfloat16)
                       for i in range(cfg.n_layers)}
        self.ckv: dict[int, torch.Tensor] = {}
        self.ik: dict[int, torch.Tensor] = {}
        self.pend_kv: dict[int, torch.Tensor] = {}
        self.pend_score: dict[int, torch.Tensor] = {}
        self.pend_ring = {}
        for src in cfg.kv_source_layers:
            r = cfg.compress_ratios[src]
            rows = (max_len + margin) // r + 1
            self.ckv[src] = torch.zeros(num_slots, rows, hd, dtype=torch.bfloat16)
            if src in cfg.index_source_layers:
                self.ik[src] = torch.zeros(num_slots, rows, cfg.index_head_dim, dtype=torch.bfloat16)
            if r > 1:
                ring = r + margin
                self.pend_ring[src] = ring
                self.pend_kv[src] = torch.zeros(num_slots, ring, hd, dtype=torch.float32)
                self.pend_score[src] = torch.full((num_slots, ring, hd), -torch.inf, dtype=torch.float32)
        # replay the reference's decode-time index-key aliasing (see model_attention.indexer)
        self.reference_quirks = False
        self.ik_last = torch.full((num_slots,), -1, dtype=torch.int64)
        self.eng_ring = max(cfg.engram_max_ngram_size, 1) + margin
        self.engram_hist = torch.zeros(num_slots, self.eng_ring, dtype=torch.int64)
        self.dspark = {k: torch.zeros(num_slots, cfg.window_size, hd, dtype=torch.bfloat16)
                       for k in range(cfg.n_mtp_layers if cfg.dspark_block_size else 0)}

    def reset_slot(self, slot: int) -> None:
        """Forget a sequence (positions restart at 0); stale rows are never read before rewritten,
        but zeroing keeps a released slot's data from lingering."""
        for t in self.window.values():
            t[slot].zero_()
        for d in (self.ckv, self.ik, self.pend_kv):
            for t in d.values():
                t[slot].zero_()
        for t in self.pend_score.values():
            t[slot].fill_(-torch.inf)
        self.engram_hist[slot].zero_()
        self.ik_last[slot] = -1
        for t in self.dspark.values():
            t[slot].zero_()

    def check_fits(self, seg: Segment) -> None:
        if seg.end > self.max_len:
            raise ValueError(f"positions up to {seg.end} exceed the state's max_len {self.max_len}")
        if not 0 <= seg.slot < self.num_slots:
            raise ValueError(f"slot {seg.slot} outside 0..{self.num_slots - 1}")
