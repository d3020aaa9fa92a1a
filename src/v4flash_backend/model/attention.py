"""V4.1 attention: sliding window + shared compressed KV (CSA2) + two-level indexer + sink.

Works on a flattened step input: rows of several sequences, each extending its own cache from an
arbitrary start, described by `geometry.Geometry`s (one per eager Segment, or one static bucket).
Prefill (start 0), decode (n = 1) and speculative verify (n = 1 + drafts) are the same code path,
eager and in the static graphs (`attend`). The layouts of the attention slots follow the reference
exactly (window slots ascending by position, -1 at the end in a chunk from position 0 and at the
front in a single-token step; any extra -1 slots after everything), because the 64-slot online
softmax rounds probabilities per block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from v4flash_backend import ops
from v4flash_backend.config import ModelConfig
from v4flash_backend.formats import quant

from .geometry import Geometry, join_slots, last_rows, masked_put
from .state import ModelState
from .weights import linear


# ---- per-op helpers shared by `attend` (the eager forward's and the static decode step's) and the
# DSpark stages (dspark.py): one definition of each computation, so a change is made once.
def query(W: dict, cfg: ModelConfig, p: str, x: torch.Tensor, rope, positions: torch.Tensor):
    """(qr [T, q_lora] (the indexer's input too), q [T, H, hd] with RoPE) of attention prefix p."""
    qr = ops.rms_norm(linear(W, p + ".wq_a", x), W[p + ".q_norm.weight"], cfg.norm_eps)
    return qr, rope.apply(linear(W, p + ".wq_b", qr).unflatten(-1, (-1, cfg.head_dim)), positions)


def window_kv(W: dict, cfg: ModelConfig, p: str, x: torch.Tensor, rope, positions: torch.Tensor) -> torch.Tensor:
    """The rows' window KV (also a DSpark stage's main-KV): kv_norm(wkv x), RoPE, fp8 QDQ."""
    kv = ops.rms_norm(linear(W, p + ".wkv", x), W[p + ".kv_norm.weight"], cfg.norm_eps)
    return quant.fp8_act_qdq(rope.apply(kv, positions))


def compressor_rows(W: dict, p: str, x: torch.Tensor):
    """(kv, score) fp32 rows of a ratio > 1 compressor (they wait in the pending ring)."""
    return linear(W, p + ".wkv", x.float()), linear(W, p + ".wgate", x.float())


def compressor_latent_r1(W: dict, cfg: ModelConfig, p: str, x: torch.Tensor) -> torch.Tensor:
    """Latents of a ratio-1 compressor (one token per group: no gate, bf16)."""
    return ops.rms_norm(linear(W, p + ".wkv", x), W[p + ".norm.weight"], cfg.norm_eps)


def pooled_latent(W: dict, cfg: ModelConfig, p: str, kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """Latents of complete groups [..., r, d] -> [..., d] bf16 (softmax pool, then the norm)."""
    return ops.rms_norm(ops.softmax_pool(kv, score).to(torch.bfloat16), W[p + ".norm.weight"], cfg.norm_eps)


def compressed_kv(latent: torch.Tensor, rope, group_pos: torch.Tensor) -> torch.Tensor:
    """A latent as stored compressed KV: RoPE at the group's first position, fp4 (16, e4m3 scales)."""
    return quant.fp4_qdq(rope.apply(latent, group_pos), 16, "e4m3")


def index_keys(W: dict, cfg: ModelConfig, p: str, latent: torch.Tensor, rope, group_pos: torch.Tensor):
    """Index keys of new groups, from the RoPE-free latent (fp4, ue8m0 scales per 32)."""
    k = ops.rms_norm(linear(W, p + ".wk", latent), W[p + ".k_norm.weight"], cfg.norm_eps)
    return quant.fp4_qdq(rope.apply(k, group_pos), 32, "ue8m0")


def index_query(W: dict, cfg: ModelConfig, p: str, x, qr, rope, positions):
    """(indexer queries [T, Hi, ihd] fp4, head weights [T, Hi]) of the rows."""
    ihd = cfg.index_head_dim
    q = linear(W, p + ".wq_b", qr).unflatten(-1, (-1, ihd))
    q = quant.fp4_qdq(rope.apply(q, positions), 32, "ue8m0")
    w = linear(W, p + ".weights_proj", x) * (ihd ** -0.5 * cfg.index_n_heads ** -0.5)
    return q, w


def pick_compressed(cfg: ModelConfig, layer: int, score: torch.Tensor, clens: torch.Tensor, shared: dict,
                    k: int) -> torch.Tensor:
    """Top-k compressed slots per query from indexer scores [..., C] (reachable: < clens [..., 1]):
    the candidate-block mask (computed at the candidate source layer, applied after it), then top-k,
    ascending, picks beyond reach -> -1 (int64)."""
    score = score.masked_fill(torch.arange(score.shape[-1], device=score.device) >= clens, -torch.inf)
    if layer == cfg.candidate_source_layer:  # kept as [rows, width], the reference's layout
        shared["candidates"] = candidate_blocks(score, clens, cfg.candidate_topk_blocks,
                                                cfg.candidate_block_size).flatten(0, -2)
    elif 0 <= cfg.candidate_source_layer < layer:
        score = score.masked_fill(~shared["candidates"].view(score.shape), -torch.inf)
    idx = topk_idx(score, k).sort(dim=-1).values
    return torch.where(idx < clens, idx, -1)


def window_span(state: ModelState, layer: int, geo: Geometry, kv: torch.Tensor) -> torch.Tensor:
    """The window keys the step's rows can see, [S, window-1+Q, hd]: the window - 1 cached positions
    before the step (read before the write), then the step's rows kv [S*Q, hd]; then writes the
    rows into the ring (only the last R rows of a long prefill chunk)."""
    ring = state.window[layer]
    R = ring.shape[1]
    new = kv.view(geo.S, geo.Q, -1)
    old = ring[geo.slot[:, None], geo.span_pos[:, :geo.span_pos.shape[1] - geo.Q] % R]
    masked_put(ring, geo.slot[:, None], geo.pos % R, new, last_rows(geo, R))
    return torch.cat([old, new], dim=1)


def compress(W: dict, cfg: ModelConfig, layer: int, state: ModelState, geo: Geometry, x: torch.Tensor):
    """The KV source's compressor on the step's rows: RoPE-free latents of the groups the step can
    complete ([S, G, hd] bf16), their group ids [S, G] and which of them it completes [S, G]
    (latents of the others pool garbage rows and are never written)."""
    r = cfg.compress_ratios[layer]
    p = f"layers.{layer}.attn.compressor"
    S, Q = geo.S, geo.Q
    if r == 1:
        return compressor_latent_r1(W, cfg, p, x).view(S, Q, -1), geo.pos, None if geo.host else geo.valid
    kv, score = compressor_rows(W, p, x)
    ring, sring, R = state.pend_kv[layer], state.pend_score[layer], state.pend_ring[layer]
    # the rows of the open group before the step (positions g0 .. start-1, from the pending ring,
    # read before the write), then the step's rows
    g0 = (geo.start // r) * r
    dev = geo.start.device
    prev = (g0[:, None] + torch.arange(r - 1, device=dev)) % R
    span_kv = torch.cat([ring[geo.slot[:, None], prev], kv.view(S, Q, -1)], dim=1)
    span_sc = torch.cat([sring[geo.slot[:, None], prev], score.view(S, Q, -1)], dim=1)
    keep = last_rows(geo, R)
    masked_put(ring, geo.slot[:, None], geo.pos % R, kv.view(S, Q, -1), keep)
    masked_put(sring, geo.slot[:, None], geo.pos % R, score.view(S, Q, -1), keep)
    if geo.host is not None:  # the groups this segment completes (maybe none)
        s, n = geo.host
        G, gvalid = (s + n) // r - s // r, None
        if G == 0:
            return None, None, None
        j = torch.arange(G, device=dev)
    else:
        G = -(-Q // r)  # Q rows complete at most ceil(Q / r) groups
        j = torch.arange(G, device=dev)
        gvalid = j < ((geo.start + geo.n) // r - geo.start // r)[:, None]
    gids = (geo.start // r)[:, None] + j
    gp = gids[:, :, None] * r + torch.arange(r, device=dev)  # [S, G, r] positions of each group's rows
    st0 = geo.start[:, None, None]
    idx = torch.where(gp < st0, gp - g0[:, None, None], (r - 1) + gp - st0).clamp(0, r - 2 + Q)
    flat = idx.flatten(1)
    d = span_kv.shape[-1]
    gk = span_kv.gather(1, flat[:, :, None].expand(-1, -1, d)).view(S, G, r, d)
    gs = span_sc.gather(1, flat[:, :, None].expand(-1, -1, span_sc.shape[-1])).view(S, G, r, -1)
    return pooled_latent(W, cfg, p, gk, gs), gids, gvalid


def topk_idx(score: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k best scores along the last dim. 'reference' numerics call torch's topk as
    the reference does (tie order implementation-defined); 'exact' numerics break ties by lowest
    index, so the picks do not depend on how wide the masked row is (chunk boundaries)."""
    if ops.get_numerics() == "exact":
        return _first_k_of_stable_sort(score, k)
    return score.topk(k, dim=-1, sorted=False).indices


def _first_k_of_stable_sort(score: torch.Tensor, k: int) -> torch.Tensor:
    """`torch.sort(score, descending=True, stable=True).indices[..., :k]` as one top-k over unique
    int64 keys (a full sort of the row was ~47 us a call in a compiled decode round, this ~5): the
    score's order-preserving integer (fp32 bits, negatives flipped; +0.0 added first so that -0 ties
    +0 as in the float comparison) times 2^32, plus 2^32 - 1 - index, so equal scores rank by
    lowest index."""
    bits = (score.float() + 0.0).view(torch.int32).long()
    key = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    idx = torch.arange(score.shape[-1], device=score.device)
    return (key * (1 << 32) + ((1 << 32) - 1 - idx)).topk(k, dim=-1).indices


def candidate_blocks(score: torch.Tensor, clens: torch.Tensor, topk_blocks: int, block: int) -> torch.Tensor:
    """Level one of the two-level top-k: a bool mask over positions keeping the best `topk_blocks`
    blocks (block score = max inside), the block of the newest reachable position pinned in, and
    blocks with nothing reachable dropped."""
    width = score.shape[-1]
    padded = F.pad(score, (0, -width % block), value=-torch.inf)
    blk = padded.unflatten(-1, (-1, block)).amax(-1)
    nb = blk.shape[-1]
    last = torch.div(clens - 1, block, rounding_mode="floor")
    blk = blk.masked_fill(torch.arange(nb, device=blk.device) == last, torch.inf)
    top = topk_idx(blk, min(topk_blocks, nb))
    keep = torch.zeros_like(blk, dtype=torch.bool).scatter_(-1, top, blk.gather(-1, top) > -torch.inf)
    return keep.repeat_interleave(block, dim=-1)[..., :width]


def indexer(W: dict, cfg: ModelConfig, layer: int, state: ModelState, geo: Geometry, x, qr, latent, gids,
            gvalid, rope, shared: dict, comm) -> torch.Tensor:
    """Compressed-slot picks [S, Q, k] (int64, -1 = none) over the first ctx // ratio compressed rows,
    before the window offset; publishes the index keys of the step's complete groups first."""
    r = cfg.compress_ratios[layer]
    p = f"layers.{layer}.attn.indexer"
    src = cfg.kv_source_of(layer)
    S, Q = geo.S, geo.Q
    C = geo.ctx // r
    if latent is not None:  # publish index keys of the new groups (from the RoPE-free latent)
        k = index_keys(W, cfg, p, latent.flatten(0, 1), rope, (gids * r).flatten())
        masked_put(state.ik[layer], geo.slot[:, None], gids, k.view(gids.shape + (-1,)), gvalid)
        state.ik_last[geo.slot] = layer if gvalid is None else torch.where(gvalid.any(-1), layer,
                                                                           state.ik_last[geo.slot])
    if state.reference_quirks:
        # The reference reads whichever index-key cache was published LAST: in a decode step where a
        # ratio > 1 source completes no group, that is another source's cache (usually the ratio-1
        # one, from the previous step). Reproduced only for bit-exact replay of reference decoding
        # (an eager host read; the static step refuses quirks); the default reads this layer's own
        # source, which keeps decode equal to a prefill recompute.
        if S != 1:
            raise ValueError("the reference's index-key aliasing is replayed one sequence at a time")
        src = int(state.ik_last[geo.slot[0]])
    if C == 0:
        return torch.empty(S, Q, 0, dtype=torch.long, device=x.device)
    ihd = cfg.index_head_dim
    q, w = index_query(W, cfg, p, x, qr, rope, geo.flat_pos)
    keys = state.ik[src][:, :C][geo.slot]  # [S, C, ihd]
    score = comm.index_scores(q.view(S, Q, -1, ihd), keys, w.view(S, Q, -1))
    clens = ((geo.pos + 1) // r).unsqueeze(-1)
    return pick_compressed(cfg, layer, score, clens, shared, min(cfg.index_topk, C))


def attend(W: dict, cfg: ModelConfig, layer: int, state: ModelState, geo: Geometry, x, qr, q, kv, rope,
           shared: dict, comm) -> torch.Tensor:
    """Attention of the geometry's rows (x, qr, q, kv: its [S*Q, ...] rows of `query`/`window_kv`)
    over the window and the compressed KV, reading and writing the caches -> o [S*Q, H, hd]."""
    p = f"layers.{layer}.attn"
    hd = cfg.head_dim
    kv_all = window_span(state, layer, geo, kv)
    idx = geo.widx
    ratio = cfg.compress_ratios[layer]
    if ratio:
        src = cfg.kv_source_of(layer)
        latent = gids = gvalid = None
        if layer == src:
            latent, gids, gvalid = compress(W, cfg, layer, state, geo, x)
        if layer in cfg.index_source_layers:
            cidx = indexer(W, cfg, layer, state, geo, x, qr, latent, gids, gvalid, rope, shared, comm)
            shared["topk"] = cidx.flatten(0, 1)  # [rows, k]: the picks per row, as the reference's
        else:
            cidx = shared["topk"].view(geo.S, geo.Q, -1)
        if latent is not None:
            lat = compressed_kv(latent.flatten(0, 1), rope, (gids * ratio).flatten())
            masked_put(state.ckv[layer], geo.slot[:, None], gids, lat.view(gids.shape + (hd,)), gvalid)
        comp = state.ckv[src][:, :geo.ctx // ratio][geo.slot]  # [S, C, hd]
        span = kv_all.shape[1]
        kv_all = torch.cat([kv_all, comp], dim=1)
        cidx = torch.where(cidx >= 0, cidx + span, -1)
        if geo.host is not None:  # the width is a Python value: the reference's slot list as it is
            s, n = geo.host
            w = cfg.window_size if (n == 1 and s > 0) else min(s + n, cfg.window_size)
            idx = torch.cat([geo.widx[..., :w], cidx], dim=-1)
        else:
            idx = join_slots(geo.widx, cidx, geo.width)
    o = ops.sparse_attn(q.view(geo.S, geo.Q, -1, hd), kv_all, W[p + ".attn_sink"], idx.int(), hd ** -0.5)
    return o.flatten(0, 1)


def attention(W: dict, cfg: ModelConfig, layer: int, x: torch.Tensor, geos: list[Geometry],
              state: ModelState, rope, shared: list[dict], comm, positions: torch.Tensor) -> torch.Tensor:
    """Attention sublayer of backbone layer `layer` on flattened rows x [T, D] (bf16): the
    projections over every row at once, `attend` per geometry (an eager step's segments, or the
    static step's one bucket), the output projection over every row."""
    p = f"layers.{layer}.attn"
    qr, q = query(W, cfg, p, x, rope, positions)
    kv = window_kv(W, cfg, p, x, rope, positions)
    if len(geos) == 1 and geos[0].S * geos[0].Q == x.shape[0]:
        o = attend(W, cfg, layer, state, geos[0], x, qr, q, kv, rope, shared[0], comm)
    else:
        outs = []
        for geo, sh in zip(geos, shared):
            rows = slice(geo.off, geo.off + geo.S * geo.Q)
            outs.append(attend(W, cfg, layer, state, geo, x[rows], qr[rows], q[rows], kv[rows], rope, sh, comm))
        o = torch.cat(outs)
    o = rope.apply(o, positions, inverse=True)
    return grouped_out(W, p, cfg, o, comm)


def grouped_out(W: dict, p: str, cfg: ModelConfig, o: torch.Tensor, comm) -> torch.Tensor:
    """o [T, H, hd] -> block-diagonal wo_a per o-group (bf16 einsum) -> wo_b -> [T, D]; wo_b goes
    through `comm` because it is row-parallel over the attention group (see `parallel`)."""
    T = o.shape[0]
    wo_a = W[p + ".wo_a.weight"]
    groups = wo_a.shape[0] // cfg.o_lora_rank
    o = ops.linear_bf16(o.reshape(1, T, groups, -1), wo_a.view(groups, cfg.o_lora_rank, -1))
    return comm.attn_out(W, p + ".wo_b", o.flatten(2))[0]
