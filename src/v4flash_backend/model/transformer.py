"""The DeepSeek-V4.1-Flash forward: embed -> hc streams -> blocks (Engram, attention, MoE, single-
pass mHC) -> collapse -> norm -> head, over a flattened batch of Segments extending per-slot state.

The same function serves prefill (start 0, any length), chunked prefill, decode (n = 1) and
speculative verification (n = 1 + drafts) for any mix of sequences. Collectives of a sharded run
go through `comm` (LocalComm: W = 1, nothing to reduce).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from v4flash_backend import ops
from v4flash_backend.config import ModelConfig

from .attention import attention
from .ffn import engram_lookup, engram_mix, moe
from .geometry import Geometry, last_rows, masked_put, segment_geometry
from .rope import TableRope, layer_rope
from .state import ModelState, Segment
from .weights import linear


class LocalComm:
    """Collective hooks of the forward, identity at world size 1. A sharded run substitutes an
    object with the same methods (see `parallel`)."""

    def embed(self, y):  # vocab-parallel embedding: masked rows summed over ranks
        return y

    def attn_out(self, W, prefix, x):  # row-parallel wo_b: partial sums reduced within the attention group
        return linear(W, prefix, x)

    def index_scores(self, q, k, w):  # indexer heads split across the attention group
        return ops.indexer_scores(q, k, w)

    def moe_out(self, y):  # experts partitioned by id: fp32 carry summed over the world
        return y

    def engram_rows(self, v):  # Engram table rows partitioned by rank
        return v

    def lookups(self, parts):  # embedding and Engram rows (each held by one rank): summed in one collective
        return parts

    def head(self, logits):  # vocab-parallel head: gather the vocab shards
        return logits

    # sequence parallelism (`parallel.comm.DistComm`): a forward's rows split over the attention group
    def sp_begin(self, T: int):  # -> this rank's rows (a, b) of a T-row forward, or None (off)
        return None

    def sp_end(self) -> None:
        pass

    def sp_full(self, x):  # this rank's rows -> all rows (all-gather); identity when off
        return x

    def sp_local(self, x):  # all rows -> this rank's rows; identity when off
        return x

    # pipeline boundary (a model of one stage of several: `parallel.pipeline`); never called at one stage
    def stage_recv(self, T: int, n_taps: int):  # -> (h [T, hc, D], pre_mix [T, hc], taps or None)
        raise RuntimeError("a single-stage model has no previous stage")

    def stage_send(self, h, pre_mix, taps) -> None:
        raise RuntimeError("a single-stage model has no next stage")


@dataclass
class StepOutput:
    logits: torch.Tensor | None  # [L, V] f32 for the requested rows
    taps: torch.Tensor | None  # [T, n_taps * D] bf16: DSpark main_hidden of every row
    final_hidden: torch.Tensor | None  # [L, D] bf16: normed input of the head for the requested rows


class V41Model:
    def __init__(self, cfg: ModelConfig, weights, hasher=None, comm=None):
        self.cfg = cfg
        self.W = weights
        self.hasher = hasher
        self.comm = comm or LocalComm()
        self.ropes = {i: layer_rope(cfg, i) for i in range(cfg.n_total_layers)}
        # the backbone layers this model runs: all of them, or one pipeline stage's [lo, hi)
        self.stage = tuple(getattr(weights, "meta", {}).get("stage_layers", (0, cfg.n_layers)))
        if cfg.engram_layer_ids and hasher is None:
            raise ValueError("this config has Engram layers: pass an EngramHasher built from the tokenizer")

    @property
    def is_first_stage(self) -> bool:
        return self.stage[0] == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage[1] == self.cfg.n_layers

    def holds_layer(self, i: int) -> bool:
        return self.stage[0] <= i < self.stage[1]

    # ---- pieces, also used by the golden per-layer replay -------------------------------------
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.comm.embed(self.embed_rows(tokens))

    def embed_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's embedding rows [T, D] (zero where another rank holds the vocab row)."""
        table = self.W["embed.weight"]
        local = tokens - self.W.rank_offset("vocab_start")  # a tensor on a shard: see Weights
        miss = (local < 0) | (local >= table.shape[0])
        return table[local.masked_fill(miss, 0)].masked_fill(miss.unsqueeze(-1), 0)

    def engram_hashes(self, state: ModelState, tokens: torch.Tensor, segs: list[Segment],
                      geos: list[Geometry] | None = None) -> torch.Tensor:
        """Table rows [T, n_engram_layers, C] of every new row, updating the per-slot history ring."""
        if tokens.device.type == "cpu":  # ids are host values here: refuse out-of-range ones (the engine
            self.hasher.compress(tokens)  # validates a device step's ids before they go there)
        geos = geos or step_geometries(segs, self.cfg.window_size, tokens.device)
        return torch.cat([self.geometry_hashes(state, tokens[g.off:g.off + g.S * g.Q], g) for g in geos])

    def geometry_hashes(self, state: ModelState, tok: torch.Tensor, geo: Geometry) -> torch.Tensor:
        """Table rows [S*Q, n_engram_layers, C] of a geometry's rows, updating the history ring
        (valid rows only)."""
        hs = self.hasher
        N, R = self.cfg.engram_max_ngram_size, state.eng_ring
        comp = hs.token_map[tok.long()].view(geo.S, geo.Q)
        # the N - 1 positions before the step from the ring (read before it is written), then the
        # step's own rows: any row count, and the ring keeps only the last R rows of a long chunk
        dev = tok.device
        before = (geo.start[:, None] - (N - 1) + torch.arange(N - 1, device=dev)) % R
        span = torch.cat([state.engram_hist[geo.slot[:, None], before], comp], dim=1)  # positions start-N+1 ..
        t = geo.pos[:, :, None] - torch.arange(N, device=dev)
        j = (t - (geo.start[:, None, None] - (N - 1))).clamp_min(0)
        win = torch.where(t >= 0, span.gather(1, j.flatten(1)).view(t.shape), -1)
        masked_put(state.engram_hist, geo.slot[:, None], geo.pos % R, comp, last_rows(geo, R))
        return hs.hash_windows(win).flatten(0, 1)

    def block(self, layer: int, h: torch.Tensor, pre_mix: torch.Tensor, segs, state, shared, positions,
              capture: dict | None = None, geos: list[Geometry] | None = None, rope=None, moe_form=None):
        """One backbone block on streams h [T, hc, D]; returns (h, the FFN pre-mix for the next block).
        geos: the step's geometries (built from segs when not given); rope: the layer's Rope (a
        `TableRope` in a step that must not read positions on the host)."""
        geos = geos or step_geometries(segs, self.cfg.window_size, h.device)
        rope = rope or self.ropes[layer]

        def attn(x):
            return attention(self.W, self.cfg, layer, x, geos, state, rope, shared, self.comm, positions)

        return self.hc_block(f"layers.{layer}", self.cfg.n_activated_experts, h, pre_mix, attn, capture, moe_form)

    def hc_block(self, p: str, n_act: int, h: torch.Tensor, pre_mix: torch.Tensor, attn, capture=None,
                 moe_form=None):
        """Single-pass mHC block: the attention collapses with the previous block's FFN pre-mix, the
        FFN with the pre-mix this block's attention mixes produced; returns (h, FFN pre-mix).
        `moe_form`: the form of `ffn.moe` (None: its own choice; 'all' in the static step)."""
        cfg, W = self.cfg, self.W
        mix = (cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps)
        a_pre, a_post, a_comb = ops.hc_mixes(h, W[p + ".hc_attn_fn"], W[p + ".hc_attn_scale"],
                                             W[p + ".hc_attn_base"], *mix)
        x = ops.rms_norm(ops.hc_collapse(h, pre_mix), W[p + ".attn_norm.weight"], cfg.norm_eps)
        a = attn(self.comm.sp_full(x))  # sequence parallel: attention sees every row, returns ours
        h2 = ops.hc_post(a, h, a_post, a_comb)
        f_pre, f_post, f_comb = ops.hc_mixes(h2, W[p + ".hc_ffn_fn"], W[p + ".hc_ffn_scale"],
                                             W[p + ".hc_ffn_base"], *mix)
        x2 = ops.rms_norm(ops.hc_collapse(h2, a_pre), W[p + ".ffn_norm.weight"], cfg.norm_eps)
        f = moe(W, cfg, p, n_act, self.comm.sp_full(x2), self.comm, capture, form=moe_form)
        out = ops.hc_post(f, h2, f_post, f_comb)
        if capture is not None:
            capture.update(attn_in=x, attn_out=a, ffn_in=x2, ffn_out=f, x_out=out, pre_mix_out=f_pre)
        return out, f_pre

    def head_logits(self, h: torch.Tensor, pre_mix: torch.Tensor):
        """Collapse with the last pre-mix, final norm, fp32 head: (logits f32, normed hidden bf16)."""
        x = ops.rms_norm(ops.hc_collapse(h, pre_mix), self.W["norm.weight"], self.cfg.norm_eps)
        return self.comm.head(ops.linear_f32(x, self.W["head.weight"])), x

    # ---- the step -----------------------------------------------------------------------------
    def forward(self, state: ModelState, tokens: torch.Tensor, segs: list[Segment], logits_rows="last",
                want_taps: bool = False, captures: dict | None = None) -> StepOutput:
        """Run new tokens [T] (the segments' rows, concatenated) through the backbone.

        logits_rows: 'last' (the last row of each segment), 'all', 'none', or a LongTensor of rows.
        captures: optional {layer: dict} filled with that layer's intermediate tensors.
        """
        cfg = self.cfg
        tokens = tokens.long()
        for seg in segs:
            state.check_fits(seg)
        lo, hi = self.stage
        if tokens.device.type == "cpu" and any(lo <= i < hi for i in cfg.engram_layer_ids):
            self.hasher.compress(tokens)  # host ids: refuse out-of-range ones (the engine checks a device step's)
        dev = state.engram_hist.device  # every tensor made here follows the state (a device-resident runner)
        tokens = tokens.to(dev)
        # the step's index tensors on its device, one geometry per segment, and RoPE tables covering
        # its positions (no host read of positions)
        geos = step_geometries(segs, cfg.window_size, dev)
        end = max(s.end for s in segs)
        ropes = {i: TableRope(self.ropes[i], end) for i in range(lo, hi)}
        return self.run(state, tokens, geos, ropes, _rows(logits_rows, segs, dev), want_taps, captures)

    def run(self, state: ModelState, tokens: torch.Tensor, geos: list[Geometry], ropes: dict, rows,
            want_taps: bool = False, captures: dict | None = None, moe_form: str | None = None,
            split_rows: bool = True) -> StepOutput:
        """The step over geometries: tokens [T] (the geometries' rows, in order); ropes {layer: Rope}
        (`TableRope`s: no host read of positions); rows: the rows to compute logits of (a LongTensor,
        a slice, or None). The static decode step calls it with one bucket geometry, moe_form 'all'
        and split_rows False (no sequence-parallel row split inside a graph)."""
        cfg = self.cfg
        lo, hi = self.stage
        positions = torch.cat([g.flat_pos for g in geos]) if len(geos) > 1 else geos[0].flat_pos
        eng = [i for i in cfg.engram_layer_ids if lo <= i < hi]
        looked = []  # rows looked up by token id: the stage's Engram layers' (and the embedding's)
        if eng:
            hashes = torch.cat([self.geometry_hashes(state, tokens[g.off:g.off + g.S * g.Q], g) for g in geos])
            looked = [engram_lookup(self.W, i, hashes[:, cfg.engram_layer_ids.index(i)]) for i in eng]
        if lo == 0:
            looked.insert(0, self.embed_rows(tokens))
        # none depends on the streams, so one collective reduces them all (Engram's would otherwise
        # cost one world all-reduce per Engram layer on top of the embedding's)
        looked = self.comm.lookups(looked)
        eng_rows = dict(zip(eng, looked[1:] if lo == 0 else looked))
        taps = []
        if lo == 0:
            h = ops.hc_expand(looked[0], cfg.hc_mult)
            pre_mix = first_pre_mix(h)
        else:  # a later pipeline stage: the previous stage's full streams, pre-mix and taps so far
            n_in = sum(1 for t in cfg.dspark_target_layer_ids if t < lo) if want_taps else 0
            h, pre_mix, t_in = self.comm.stage_recv(len(tokens), n_in)
            if t_in is not None:
                taps.append(t_in)
        shared = [dict() for _ in geos]
        # sequence parallel: per-token work on rows [a, b) only
        sp = self.comm.sp_begin(len(tokens)) if split_rows else None
        try:
            if sp is not None:
                h, pre_mix = h[sp[0]:sp[1]], pre_mix[sp[0]:sp[1]]
            new_taps = []
            for i in range(lo, hi):
                if i in eng_rows:  # all rows were reduced: sequence parallel keeps this rank's
                    h = engram_mix(self.W, cfg, i, h, eng_rows[i] if sp is None else eng_rows[i][sp[0]:sp[1]])
                if want_taps and i in cfg.dspark_target_layer_ids:
                    new_taps.append(stream_mean(h))  # the attention input of a target layer, averaged over streams
                cap = captures.setdefault(i, {}) if captures is not None else None
                if cap is not None:
                    cap.update(x_in=h, pre_mix_in=pre_mix)
                h, pre_mix = self.block(i, h, pre_mix, None, state, shared, positions, cap, geos, ropes[i], moe_form)
                if cap is not None:
                    cap["shared"] = [dict(s) for s in shared]
            if sp is not None:  # full rows again before the head or a stage boundary (never send a shard)
                h, pre_mix = self.comm.sp_full(h), self.comm.sp_full(pre_mix)
                new_taps = [self.comm.sp_full(torch.cat(new_taps, dim=-1))] if new_taps else []
        finally:
            if split_rows:
                self.comm.sp_end()
        taps += new_taps
        if hi < cfg.n_layers:  # not the last stage: hand over, nothing to return
            self.comm.stage_send(h, pre_mix, torch.cat(taps, dim=-1) if taps else None)
            return StepOutput(None, None, None)
        logits = hidden = None
        if rows is not None:
            logits, hidden = self.head_logits(h[rows], pre_mix[rows])
        return StepOutput(logits, torch.cat(taps, dim=-1) if want_taps else None, hidden)


def stream_mean(h: torch.Tensor) -> torch.Tensor:
    """Mean over the hc streams of [T, hc, D] (bf16 out, as the reference's h.mean)."""
    if ops.get_numerics() == "exact":
        return h.double().mean(dim=1).to(h.dtype)
    return h.mean(dim=1)


def first_pre_mix(h: torch.Tensor) -> torch.Tensor:
    """The pre-mix of the embedded streams h [T, hc, D]: all of stream 0 -> [T, hc] f32."""
    pre_mix = torch.zeros(h.shape[0], h.shape[1], dtype=torch.float32, device=h.device)
    pre_mix[:, 0] = 1.0
    return pre_mix


def step_geometries(segs: list[Segment], window: int, device) -> list[Geometry]:
    return [segment_geometry(s, window, device) for s in segs]


def _rows(spec, segs, device):
    if isinstance(spec, str):
        if spec == "none":
            return None
        if spec == "all":
            return torch.arange(segs[-1].off + segs[-1].n, device=device)
        if spec == "last":
            return torch.tensor([s.off + s.n - 1 for s in segs], device=device)
        raise ValueError(f"logits_rows must be 'last', 'all', 'none' or a tensor, got {spec!r}")
    return torch.as_tensor(spec, dtype=torch.long, device=device)
