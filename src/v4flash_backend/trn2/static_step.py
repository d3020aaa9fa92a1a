"""The static decode step: one fixed-shape graph per row bucket, no host syncs inside it.

`V41Model.forward` is shaped by Python values (segment lists, `int(start)`, per-expert `.tolist()`,
ragged window widths), so on a Neuron device every step re-enters the host many times. Here the same
forward is written over tensors only, for a bucket of S sequences x Q rows each (Q = 1 + DSpark block
size, or 1 without DSpark):

- a step is `tokens [S, Q]`, `slot [S]`, `start [S]` (position of row 0), `n [S]` (valid rows,
  0 for a padding sequence); row i of sequence s sits at position start[s] + i;
- every cache read is a gather with index tensors: the window is read as the span of positions
  start - window + 1 .. start + Q - 1 from the ring, the compressed KV / index keys as the first
  ctx // ratio rows (ctx = the bucket's context bound, a Python int baked into the graph);
- every cache write is masked: invalid rows (padding rows, padding sequences, groups a step does not
  complete) are redirected to a scratch slot and write back the value they read, so the state after
  a step equals the eager forward's bit for bit;
- top-k runs with a fixed k = min(index_topk, ctx // ratio), the picks beyond a row's reach masked
  to -1; the attention slot order reproduces the eager layouts (so 'reference' numerics keep the
  reference's 64-slot softmax blocks), with the extra -1 slots at the end;
- the MoE runs every local expert on every row of the bucket, weighted by a dense [rows, experts]
  routing matrix that is 0 where a row is not routed (the same PE work as a 128-row floor, and a
  static graph). A zero-weight expert adds exactly +-0 to the fp32 carry, so the sum is unchanged.

The building blocks are the model's own (`ops`, `hc_block`, `route`/`expert`, `engram`,
`candidate_blocks`, `topk_idx`, `grouped_out`, the DSpark heads); only the per-segment loops are
replaced. `HostSyncCounter` flags any device-to-host read while a step runs; tests run both entry
points under `torch.compile(fullgraph=True)`, which fails on any graph break or host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from v4flash_backend import ops
from v4flash_backend.engine.device_boundary import (  # noqa: F401  (re-exported)
    _SYNC_NAMES,
    BoundarySpy,
    HostSyncCounter,
    graph_host_syncs,
)
from v4flash_backend.model import attention as A
from v4flash_backend.model.attention import grouped_out
from v4flash_backend.model.dspark import block_slots
from v4flash_backend.model.ffn import engram, expert, local_experts, route
from v4flash_backend.model.rope import Rope
from v4flash_backend.model.transformer import stream_mean


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


# ---- pieces --------------------------------------------------------------------------------------
class _TableRope(Rope):
    """A Rope whose table already covers every position a bucket can address, so `at` is a plain
    gather (the eager Rope grows its table with `int(positions.max())`, a host sync). The table
    rows are the eager ones: row p is p * freqs, whatever the table length."""

    def __init__(self, rope: Rope, n_positions: int):
        super().__init__(rope.freqs)
        if rope._table.shape[0] < n_positions:  # grow the shared table once, on the host
            rope.at(torch.tensor([n_positions - 1], device=rope._table.device))
        self._table = rope._table

    def at(self, positions: torch.Tensor) -> torch.Tensor:
        return self._table[positions.long()]


def masked_put(buf: torch.Tensor, slot: torch.Tensor, idx: torch.Tensor, val: torch.Tensor,
               valid: torch.Tensor, scratch: int) -> None:
    """buf[slot, idx] = val where valid. Invalid entries are redirected to (scratch, 0) and write
    back the value already there, so duplicates among them are harmless and real slots untouched.
    slot broadcasts against idx; val is idx's shape plus buf's trailing dims."""
    slot, idx = torch.broadcast_tensors(slot, idx)
    s = torch.where(valid, slot, scratch)
    i = torch.where(valid, idx, 0)
    old = buf[s, i]
    mask = valid.reshape(valid.shape + (1,) * (old.dim() - valid.dim()))
    buf[s, i] = torch.where(mask, val.to(buf.dtype), old)


def moe_dense(W, cfg, layer_prefix: str, n_act: int, x: torch.Tensor, comm) -> torch.Tensor:
    """`model_ffn.moe` with every local expert applied to every row, weighted by the dense routing
    matrix (0 where not routed): the same fp32 carry, added in expert-id order, then the world
    reduction and the shared expert. A zero weight makes swiglu's output, hence the expert's
    output, +-0 (activations are clamped, so never 0 * inf), which leaves the carry unchanged."""
    p = layer_prefix + ".ffn"
    weights, ids = route(W, cfg, p, x, n_act)
    n_experts = W[p + ".gate.weight"].shape[0]
    dense = torch.zeros(x.shape[0], n_experts, dtype=weights.dtype, device=x.device).scatter(1, ids, weights)
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in local_experts(W, p):
        y = y + expert(W, f"{p}.experts.{e}", x, dense[:, e:e + 1], cfg.swiglu_limit)
    y = comm.moe_out(y)
    y += expert(W, p + ".shared_experts", x, None, cfg.swiglu_limit)
    return y.to(x.dtype)


@dataclass
class _Geometry:
    """Index tensors of one verify step, shared by every layer."""

    S: int
    Q: int
    slot: torch.Tensor  # [S]
    start: torch.Tensor  # [S]
    n: torch.Tensor  # [S]
    pos: torch.Tensor  # [S, Q]
    valid: torch.Tensor  # [S, Q]
    flat_pos: torch.Tensor  # [S*Q]
    span_pos: torch.Tensor  # [S, window-1+Q]: the window positions any row of the step can see
    widx: torch.Tensor  # [S, Q, window] window slots (indices into the span, -1 = none)
    width: torch.Tensor  # [S] the eager layout's window width (slots after it are padding)


class StaticDecoder:
    """The static decode step over a model and its `ModelState`.

    `scratch` is a state slot no sequence uses (default: the last one): padding sequences and masked
    writes go there. The state's margin must cover the bucket's rows (rings hold window + margin).
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
        self.ropes = {i: _TableRope(r, n_pos) for i, r in model.ropes.items()}
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
        cfg, m = self.cfg, self.m
        geo = self._geometry(slot, start, n, tokens.shape[1])
        tok = tokens.reshape(-1).long()
        hashes = self._engram_hashes(tok, geo) if cfg.engram_layer_ids else None
        h = ops.hc_expand(m.embed(tok), cfg.hc_mult)
        pre_mix = torch.zeros(h.shape[0], cfg.hc_mult, dtype=torch.float32, device=h.device)
        pre_mix[:, 0] = 1.0
        shared: dict = {}
        taps = []
        for i in range(cfg.n_layers):
            if i in cfg.engram_layer_ids:
                h = engram(m.W, cfg, i, h, hashes[:, cfg.engram_layer_ids.index(i)], m.comm)
            if i in cfg.dspark_target_layer_ids:
                taps.append(stream_mean(h))
            p = f"layers.{i}"
            h, pre_mix = m.hc_block(
                p, cfg.n_activated_experts, h, pre_mix,
                lambda x, i=i: self._attention(i, x, geo, shared, ctx),
                ffn=lambda x2, p=p: moe_dense(m.W, cfg, p, cfg.n_activated_experts, x2, m.comm))
        logits, _ = m.head_logits(h, pre_mix)
        return logits, (torch.cat(taps, dim=-1) if taps else None)

    def _geometry(self, slot, start, n, Q: int) -> _Geometry:
        Wn = self.cfg.window_size
        S, dev = slot.shape[0], slot.device
        ar = torch.arange(Q, device=dev)
        pos = start[:, None] + ar
        valid = ar < n[:, None]
        span0 = start - (Wn - 1)  # first position of the span
        span_pos = span0[:, None] + torch.arange(Wn - 1 + Q, device=dev)
        t = pos[:, :, None]
        cols = torch.arange(Wn, device=dev)
        # eager layouts (model_attention.window_slots): a single-token step past position 0 takes the
        # whole window oldest first with the empty slots in front; a chunk takes `width` slots from
        # max(0, t - W + 1) with the not-yet-visible ones (-1) at the end
        single = (n == 1) & (start > 0)
        dec = t - Wn + 1 + cols
        dec_idx = torch.where(dec < 0, -1, dec - span0[:, None, None])
        chk = (t - Wn + 1).clamp_min(0) + cols
        chk_idx = torch.where(chk > t, -1, chk - span0[:, None, None])
        widx = torch.where(single[:, None, None], dec_idx, chk_idx)
        width = torch.where(single, Wn, (start + n).clamp_max(Wn))
        return _Geometry(S, Q, slot, start, n, pos, valid, pos.reshape(-1), span_pos, widx, width)

    def _engram_hashes(self, tok: torch.Tensor, geo: _Geometry) -> torch.Tensor:
        """Table rows [S*Q, n_engram_layers, C], updating the history ring (valid rows only)."""
        st, hs = self.state, self.m.hasher
        N, R = self.cfg.engram_max_ngram_size, st.eng_ring
        comp = hs.token_map[tok].view(geo.S, geo.Q)  # ids are validated by the engine, not here
        # the N - 1 positions before the step from the ring (read before it is written), then the
        # step's own rows: any row count, and the ring keeps only the last R rows of a long chunk
        dev = tok.device
        old = st.engram_hist[geo.slot[:, None], (geo.start[:, None] - (N - 1) + torch.arange(N - 1, device=dev)) % R]
        span = torch.cat([old, comp], dim=1)  # [S, N-1+Q]: positions start-N+1 ..
        t = geo.pos[:, :, None] - torch.arange(N, device=dev)
        j = (t - (geo.start[:, None, None] - (N - 1))).clamp_min(0)
        win = torch.where(t >= 0, span.gather(1, j.flatten(1)).view(t.shape), -1)
        masked_put(st.engram_hist, geo.slot[:, None], geo.pos % R, comp, _last_rows(geo, R), self.scratch)
        return hs.hash_windows(win).flatten(0, 1)

    def _attention(self, layer: int, x: torch.Tensor, geo: _Geometry, shared: dict, ctx: int) -> torch.Tensor:
        W, cfg, st = self.m.W, self.cfg, self.state
        p = f"layers.{layer}.attn"
        hd = cfg.head_dim
        S, Q = geo.S, geo.Q
        rope = self.ropes[layer]
        qr, q = A.query(W, cfg, p, x, rope, geo.flat_pos)
        kv = A.window_kv(W, cfg, p, x, rope, geo.flat_pos)
        ring = st.window[layer]
        R = ring.shape[1]
        # the span: the window - 1 cached positions before the step (read before the write), then
        # the step's rows; only the last R rows of a long (prefill) chunk go into the ring
        old = ring[geo.slot[:, None], geo.span_pos[:, :cfg.window_size - 1] % R]
        kv_all = torch.cat([old, kv.view(S, Q, hd)], dim=1)  # [S, Wn-1+Q, hd]
        masked_put(ring, geo.slot[:, None], geo.pos % R, kv.view(S, Q, hd), _last_rows(geo, R), self.scratch)
        idx = geo.widx
        ratio = cfg.compress_ratios[layer]
        if ratio:
            src = cfg.kv_source_of(layer)
            C = ctx // ratio
            latent = gids = gvalid = None
            if layer == src:
                latent, gids, gvalid = self._compress(layer, x, geo)
            if layer in cfg.index_source_layers:
                cidx = self._indexer(layer, x, qr, geo, latent, gids, gvalid, shared, C)
                shared["topk"] = cidx
            else:
                cidx = shared["topk"]
            if latent is not None:
                lat = A.compressed_kv(latent.flatten(0, 1), rope, (gids * ratio).flatten())
                masked_put(st.ckv[layer], geo.slot[:, None], gids, lat.view(gids.shape + (hd,)), gvalid,
                           self.scratch)
            comp = st.ckv[src][:, :C][geo.slot]  # [S, C, hd]
            span = kv_all.shape[1]
            kv_all = torch.cat([kv_all, comp], dim=1)
            idx = _join_slots(geo.widx, torch.where(cidx >= 0, cidx + span, -1), geo.width)
        o = ops.sparse_attn(q.view(S, Q, -1, hd), kv_all, W[p + ".attn_sink"], idx.int(), hd ** -0.5)
        o = rope.apply(o.flatten(0, 1), geo.flat_pos, inverse=True)
        return grouped_out(W, p, cfg, o, self.m.comm)

    def _compress(self, layer: int, x: torch.Tensor, geo: _Geometry):
        """Latents of the groups this step can complete: ([S, G, hd] bf16, group ids [S, G], valid)."""
        W, cfg, st = self.m.W, self.cfg, self.state
        r = cfg.compress_ratios[layer]
        p = f"layers.{layer}.attn.compressor"
        S, Q = geo.S, geo.Q
        if r == 1:
            return A.compressor_latent_r1(W, cfg, p, x).view(S, Q, -1), geo.pos, geo.valid
        kv, score = A.compressor_rows(W, p, x)
        ring, sring, R = st.pend_kv[layer], st.pend_score[layer], st.pend_ring[layer]
        # the rows of the open group before the step (positions g0 .. start-1, from the pending ring,
        # read before the write), then the step's rows
        g0 = (geo.start // r) * r
        dev = geo.start.device
        prev = (g0[:, None] + torch.arange(r - 1, device=dev)) % R
        span_kv = torch.cat([ring[geo.slot[:, None], prev], kv.view(S, Q, -1)], dim=1)
        span_sc = torch.cat([sring[geo.slot[:, None], prev], score.view(S, Q, -1)], dim=1)
        keep = _last_rows(geo, R)
        masked_put(ring, geo.slot[:, None], geo.pos % R, kv.view(S, Q, -1), keep, self.scratch)
        masked_put(sring, geo.slot[:, None], geo.pos % R, score.view(S, Q, -1), keep, self.scratch)
        G = -(-Q // r)  # a step of Q rows completes at most ceil(Q / r) groups
        j = torch.arange(G, device=dev)
        gids = (geo.start // r)[:, None] + j
        gvalid = j < ((geo.start + geo.n) // r - geo.start // r)[:, None]
        gp = gids[:, :, None] * r + torch.arange(r, device=dev)  # [S, G, r] positions of each group's rows
        st0 = geo.start[:, None, None]
        idx = torch.where(gp < st0, gp - g0[:, None, None], (r - 1) + gp - st0).clamp(0, r - 2 + Q)
        flat = idx.flatten(1)
        d = span_kv.shape[-1]
        gk = span_kv.gather(1, flat[:, :, None].expand(-1, -1, d)).view(S, G, r, d)
        gs = span_sc.gather(1, flat[:, :, None].expand(-1, -1, span_sc.shape[-1])).view(S, G, r, -1)
        # invalid groups pool garbage rows; they are never written
        return A.pooled_latent(W, cfg, p, gk, gs), gids, gvalid

    def _indexer(self, layer, x, qr, geo: _Geometry, latent, gids, gvalid, shared: dict, C: int):
        """Compressed-slot picks [S, Q, k] (-1 = none) over the first C compressed rows."""
        W, cfg, st = self.m.W, self.cfg, self.state
        r = cfg.compress_ratios[layer]
        p = f"layers.{layer}.attn.indexer"
        src = cfg.kv_source_of(layer)
        S, Q = geo.S, geo.Q
        rope = self.ropes[layer]
        if latent is not None:  # publish index keys of the new groups
            k = A.index_keys(W, cfg, p, latent.flatten(0, 1), rope, (gids * r).flatten())
            masked_put(st.ik[layer], geo.slot[:, None], gids, k.view(gids.shape + (-1,)), gvalid, self.scratch)
        ihd = cfg.index_head_dim
        q, w = A.index_query(W, cfg, p, x, qr, rope, geo.flat_pos)
        keys = st.ik[src][:, :C][geo.slot]  # [S, C, ihd]
        score = self.m.comm.index_scores(q.view(S, Q, -1, ihd), keys, w.view(S, Q, -1))
        clens = ((geo.pos + 1) // r).unsqueeze(-1)
        return A.pick_compressed(cfg, layer, score, clens, shared, min(cfg.index_topk, C))

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
        cfg, m, st, d = self.cfg, self.m, self.state, self.drafter
        S = slot.shape[0]
        Q = taps.shape[0] // S
        B, win = self.B, cfg.window_size
        dev = slot.device
        pos = start[:, None] + torch.arange(Q, device=dev)
        valid = torch.arange(Q, device=dev) < commit[:, None]
        main_x = d.main_x(taps)
        for k in range(d.n_stages):
            kv = self._stage_kv(k, main_x, pos.reshape(-1))
            masked_put(st.dspark[k], slot[:, None], pos % win, kv.view(S, Q, -1), valid, self.scratch)
        last = start + commit - 1  # the last position whose main-KV is in the ring
        ids = torch.full((S, B), cfg.dspark_noise_token_id, dtype=torch.long, device=dev)
        ids[:, 0] = anchor
        dpos = last[:, None] + 1 + torch.arange(B, device=dev)
        h = ops.hc_expand(m.embed(ids.flatten()), cfg.hc_mult)
        pre_mix = torch.zeros(h.shape[0], cfg.hc_mult, dtype=torch.float32, device=h.device)
        pre_mix[:, 0] = 1.0
        n_act = cfg.moe_shape(cfg.n_layers)[1]
        for k in range(d.n_stages):
            p = f"mtp.{k}"
            h, pre_mix = m.hc_block(p, n_act, h, pre_mix,
                                    lambda x, k=k: self._stage_attention(k, x, slot, last, dpos),
                                    ffn=lambda x2, p=p: moe_dense(m.W, cfg, p, n_act, x2, m.comm))
        x = ops.hc_collapse(h, pre_mix)
        W = m.W
        u = m.comm.head(ops.linear_f32(ops.rms_norm(x, W[d.last + ".norm.weight"], cfg.norm_eps),
                                       W["head.weight"]))
        from v4flash_backend.model.dspark import DraftOutput

        out = DraftOutput(u.view(S, B, -1), x.view(S, B, -1))
        if not greedy:  # the served round samples its own chain (static_round.draft_round)
            return out.base_logits, out.hidden
        g_ids, g_logits, conf = d.greedy_chain(out, anchor)
        return out.base_logits, out.hidden, g_ids, g_logits, conf

    def _stage_kv(self, k: int, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """A DSpark stage's main-KV of rows x (as DSparkDrafter.write_ring / _attention compute it)."""
        return A.window_kv(self.m.W, self.cfg, f"mtp.{k}.attn", x, self.ropes[self.cfg.n_layers + k], positions)

    def _stage_attention(self, k: int, x: torch.Tensor, slot, last, dpos) -> torch.Tensor:
        W, cfg, st = self.m.W, self.cfg, self.state
        p, hd, win, B = f"mtp.{k}.attn", cfg.head_dim, cfg.window_size, self.B
        S = slot.shape[0]
        rope = self.ropes[cfg.n_layers + k]
        flat = dpos.reshape(-1)
        _, q = A.query(W, cfg, p, x, rope, flat)
        kv = self._stage_kv(k, x, flat)
        bank = torch.cat([st.dspark[k][slot], kv.view(S, B, hd)], dim=1)  # [S, win + B, hd]
        o = ops.sparse_attn(q.view(S, B, -1, hd), bank, W[p + ".attn_sink"],
                            block_slots(last, win, B)[:, None, :].expand(S, B, -1), hd ** -0.5)
        o = rope.apply(o.flatten(0, 1), flat, inverse=True)
        return grouped_out(W, p, cfg, o, self.m.comm)


def _last_rows(geo: _Geometry, R: int) -> torch.Tensor:
    """The valid rows a ring of R rows keeps: the last R of each sequence's step (all of them in a
    decode step; a long prefill chunk would otherwise write several rows into one ring slot)."""
    return geo.valid & (geo.pos >= (geo.start + geo.n)[:, None] - R)


def _join_slots(widx: torch.Tensor, cidx: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
    """Window slots [S, Q, Wn] then compressed slots [S, Q, K], with the window's padding columns
    (>= width, all -1) moved behind the compressed ones: the eager order plus trailing -1."""
    Wn, K = widx.shape[-1], cidx.shape[-1]
    full = torch.cat([widx, cidx], dim=-1)
    c = torch.arange(Wn + K, device=widx.device)
    w = width[:, None, None]
    src = torch.where(c < w, c, c + (Wn - w))
    picked = full.gather(-1, src.clamp_max(Wn + K - 1).expand(full.shape))
    return torch.where(src < Wn + K, picked, -1)
