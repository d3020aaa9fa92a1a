"""The static decode step: one fixed-shape graph per row bucket, no host syncs inside it.

The graphs run the model's own forward and DSpark stages over fixed-shape state (gpt-fast's way:
fixed-size caches and masks, so one function runs eager and compiled): a bucket of S sequences x Q
rows each (Q = 1 + DSpark block size, or 1 without DSpark) is one `model.geometry.Geometry`, the
same index tensors the eager forward builds per segment:

- a step is `tokens [S, Q]`, `slot [S]`, `start [S]` (position of row 0), `n [S]` (valid rows,
  0 for a padding sequence); row i of sequence s sits at position start[s] + i;
- every cache read is a gather with index tensors, the compressed KV / index keys the first
  ctx // ratio rows (ctx = the bucket's context bound, a Python int baked into the graph);
- every cache write is a `masked_put`: invalid rows (padding rows, padding sequences, groups a
  step does not complete) leave the state as the eager forward leaves it, bit for bit;
- top-k runs with a fixed k = min(index_topk, ctx // ratio), the picks beyond a row's reach masked
  to -1, the attention slots in the eager order with the extra -1 slots at the end;
- the MoE runs form 'all' of `ffn.moe` (every local expert on every row, weight 0 where not routed;
  below one (row, expert) pair per local expert, only the routed experts' gathered weights);
- RoPE tables are `TableRope`s covering every position a bucket can address.

What stays here is what is static-specific: buckets, padding plans, plan checks and the entry
points. `HostSyncCounter` flags any device-to-host read while a step runs; tests run both entry
points under `torch.compile(fullgraph=True)`, which fails on any graph break or host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from v4flash_backend.engine.device_boundary import (  # noqa: F401  (re-exported)
    _SYNC_NAMES,
    BoundarySpy,
    HostSyncCounter,
    graph_host_syncs,
)
from v4flash_backend.model.geometry import masked_put, step_geometry  # noqa: F401  (masked_put re-exported)
from v4flash_backend.model.rope import TableRope


# ---- buckets -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Bucket:
    """One compiled shape: `seqs` sequences of `rows` rows each, every position < `ctx`."""

    seqs: int
    rows: int
    ctx: int

    def __str__(self) -> str:
        return f"S={self.seqs} Q={self.rows} ctx={self.ctx}"


def bucket_sizes(limit: int, start: int = 1) -> list[int]:
    """Powers of two from `start` up to the first one >= limit (the last one is `limit` itself)."""
    out, v = [], max(1, start)
    while v < limit:
        out.append(v)
        v *= 2
    return out + [limit]


def pick_bucket(buckets: list[Bucket], seqs: int, rows: int, ctx_needed: int) -> Bucket:
    """The smallest bucket holding `seqs` sequences of up to `rows` rows whose positions stay < ctx."""
    fits = [b for b in buckets if b.seqs >= seqs and b.rows >= rows and b.ctx >= ctx_needed]
    if not fits:
        raise ValueError(f"no decode bucket holds {seqs} sequences x {rows} rows at context {ctx_needed}")
    return min(fits, key=lambda b: (b.seqs * b.rows, b.ctx))


# the name other modules knew the fixed-table Rope by (it moved to model/rope.py)
_TableRope = TableRope


class StaticDecoder:
    """The static decode step over a model and its `ModelState`.

    `scratch` is a state slot no sequence uses (default: the last one): padding sequences point at it
    (they write nothing: `masked_put`). The state's margin must cover the bucket's rows (rings hold
    window + margin).
    """

    def __init__(self, model, state, scratch: int | None = None, max_rows: int | None = None,
                 prefill: bool = False):
        cfg = model.cfg
        self.m, self.cfg, self.state = model, cfg, state
        self.scratch = state.num_slots - 1 if scratch is None else scratch
        self.B = cfg.dspark_block_size
        self.max_rows = max_rows or (1 + self.B)
        # speculative rows may be rejected: their ring writes must not clobber rows a later step
        # reads. Prefill rows are all committed (prefill=True: any row count).
        if not prefill and self.max_rows > state.margin + 1:
            raise ValueError(f"{self.max_rows} rows per sequence need a state margin >= {self.max_rows - 1} "
                             f"(rings hold window + margin rows), got {state.margin}")
        if state.reference_quirks:
            raise ValueError("the static step does not replay the reference's index-key aliasing quirk")
        # positions a step can address: rows up to max_len - 1 + (Q - 1), drafts up to max_len + B
        n_pos = state.max_len + max(self.max_rows, self.B) + 1
        self.ropes = {i: TableRope(r, n_pos) for i, r in model.ropes.items()}
        self.drafter = None
        if self.B:
            from v4flash_backend.model.dspark import DSparkDrafter

            self.drafter = DSparkDrafter(model)

    @property
    def device(self) -> torch.device:
        """Where the state (hence the weights, `place_resident`) lives: the graphs' inputs go there."""
        return self.state.engram_hist.device

    def padding_plan(self, seqs: int, rows: int):
        """A plan of `seqs` padding sequences (scratch slot, no valid row): running it changes no
        state, so it serves to warm caches and to compile a bucket. Built on the state's device."""
        dev = self.device
        z = torch.zeros(seqs, dtype=torch.long, device=dev)
        return (torch.zeros(seqs, rows, dtype=torch.long, device=dev),
                torch.full((seqs,), self.scratch, dtype=torch.long, device=dev), z, z.clone())

    def prime(self, bucket: Bucket) -> None:
        """Run both graphs of `bucket` once eagerly on a padding plan: fills the host-side caches the
        ops backend keeps (e.g. the torch backend's dequantized weights, expert lists), so that a
        compiled graph traced afterwards does not depend on them being filled later."""
        tokens, slot, start, n = self.padding_plan(bucket.seqs, bucket.rows)
        _, taps = self.verify(tokens, slot, start, n, bucket.ctx)
        if self.drafter is not None and taps is not None:
            self.draft(taps, n, slot, start, tokens[:, 0])

    # ---- plan validation (host side, before the graph) ---------------------------------------------
    def check_plan(self, bucket: Bucket, slot, start, n) -> None:
        """Host-side checks of a plan's Python values (never called inside the graph)."""
        st = self.state
        for s, a, k in zip(slot, start, n):
            if k == 0:
                continue
            if not 0 <= s < st.num_slots or s == self.scratch:
                raise ValueError(f"slot {s} is not a usable slot (scratch is {self.scratch})")
            if a + k > min(bucket.ctx, st.max_len):
                raise ValueError(f"positions up to {a + k} exceed the bucket's ctx {bucket.ctx} "
                                 f"or the state's max_len {st.max_len}")
            if k > bucket.rows:
                raise ValueError(f"{k} rows exceed the bucket's {bucket.rows} rows per sequence")

    # ---- the verify / decode graph --------------------------------------------------------------------
    def verify(self, tokens: torch.Tensor, slot: torch.Tensor, start: torch.Tensor, n: torch.Tensor,
               ctx: int):
        """Target forward of a bucket: tokens [S, Q], slot/start/n [S] int64; ctx a Python int with
        start + n <= ctx for every real sequence. Returns (logits [S*Q, V] f32, taps [S*Q, taps*D]
        bf16, or None without DSpark). Rows i >= n[s] are padding: their outputs are garbage and they
        write nothing."""
        cfg = self.cfg
        geo = step_geometry(slot, start, n, tokens.shape[1], cfg.window_size, ctx)
        out = self.m.run(self.state, tokens.reshape(-1).long(), [geo], self.ropes, slice(None),
                         want_taps=bool(cfg.dspark_target_layer_ids), moe_form="all", split_rows=False)
        return out.logits, out.taps

    # ---- the DSpark graph -----------------------------------------------------------------------------
    def draft(self, taps: torch.Tensor, commit: torch.Tensor, slot: torch.Tensor, start: torch.Tensor,
              anchor: torch.Tensor, greedy: bool = True):
        """Ring writes of the rows the last verify committed, then the draft block.

        taps [S*Q, taps*D] (the verify's, bucket layout); commit [S]: rows 0..commit-1 of each
        sequence are committed context (0: nothing to write, e.g. a padding sequence); the block sits
        at positions start + commit .. + B - 1 with `anchor` [S] (the bonus token) first.
        Returns (U [S, B, V] f32, hidden [S, B, D] bf16, greedy ids [S, B+1], greedy corrected logits
        [S, B, V], confidence logits [S, B]) -- the greedy chain is `DSparkDrafter.greedy_chain`;
        greedy=False returns (U, hidden) only."""
        cfg, d = self.cfg, self.drafter
        S = slot.shape[0]
        Q = taps.shape[0] // S
        dev = slot.device
        ropes = {k: self.ropes[cfg.n_layers + k] for k in range(d.n_stages)}
        pos = start[:, None] + torch.arange(Q, device=dev)
        d.write_ring_rows(self.state, taps, slot, pos, torch.arange(Q, device=dev) < commit[:, None], ropes)
        # the last position whose main-KV is in the ring
        out = d.draft_block(self.state, slot, start + commit - 1, anchor, ropes, moe_form="all")
        if not greedy:  # the served round samples its own chain (static_round.draft_round)
            return out.base_logits, out.hidden
        g_ids, g_logits, conf = d.greedy_chain(out, anchor)
        return out.base_logits, out.hidden, g_ids, g_logits, conf
