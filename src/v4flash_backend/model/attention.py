"""V4.1 attention: sliding window + shared compressed KV (CSA2) + two-level indexer + sink.

Works on a flattened step input: rows of several sequences (Segments), each extending its own
cache from an arbitrary start. Prefill (start 0), decode (n = 1) and speculative verify (n = 1 +
drafts) are the same code path. The layouts of the attention slots follow the reference exactly
(window slots ascending by position, -1 at the end in a chunk from position 0 and at the front in a
single-token step), because the 64-slot online softmax rounds probabilities per block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from v4flash_backend import ops
from v4flash_backend.config import ModelConfig
from v4flash_backend.formats import quant

from .state import ModelState, Segment
from .weights import linear


# ---- per-op helpers shared by the eager forward (below), the static decode step
# (trn2/static_step.py) and the DSpark stages (dspark.py): one definition of each computation, so
# a change to attention is made once; the callers differ only in how they gather and scatter rows.
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
    if layer == cfg.candidate_source_layer:
        shared["candidates"] = candidate_blocks(score, clens, cfg.candidate_topk_blocks, cfg.candidate_block_size)
    elif 0 <= cfg.candidate_source_layer < layer:
        score = score.masked_fill(~shared["candidates"], -torch.inf)
    idx = topk_idx(score, k).sort(dim=-1).values
    return torch.where(idx < clens, idx, -1)


def window_slots(state: ModelState, layer: int, seg: Segment, kv_new: torch.Tensor, window: int):
    """Window keys a chunk attends to, as (local kv rows, per-query slot indices into them).

    Reads the cached rows of positions max(0, start-W+1)..start-1 from the ring, appends the new
    rows, then writes the new rows into the ring."""
    s, n = seg.start, seg.n
    ring = state.window[layer]
    R = ring.shape[1]
    lo = max(0, s - window + 1)
    dev = kv_new.device  # every index follows the rows (a device-resident state)
    old = ring[seg.slot, torch.arange(lo, s, device=dev) % R]
    local = torch.cat([old, kv_new], dim=0)
    t = torch.arange(s, s + n, device=dev).unsqueeze(1)
    if s > 0 and n == 1:  # a decode step: the whole ring, oldest first, unfilled slots first
        pos = t - window + 1 + torch.arange(window, device=dev)
        idx = torch.where(pos < 0, -1, pos - lo)
    else:
        width = min(s + n, window)
        pos = (t - window + 1).clamp_min(0) + torch.arange(width, device=dev)
        idx = torch.where(pos > t, -1, pos - lo)
    keep = min(n, R)
    ring[seg.slot, torch.arange(s + n - keep, s + n, device=dev) % R] = kv_new[n - keep:]
    return local, idx.int()


def compress(W: dict, cfg: ModelConfig, layer: int, state: ModelState, seg: Segment, x: torch.Tensor):
    """The KV source's compressor on one chunk: RoPE-free latents of the groups the chunk completes
    (bf16 [ng, hd]) and their group ids, or (None, None)."""
    r = cfg.compress_ratios[layer]
    p = f"layers.{layer}.attn.compressor"
    s, n = seg.start, seg.n
    dev = x.device
    if r == 1:
        return compressor_latent_r1(W, cfg, p, x), torch.arange(s, s + n, device=dev)
    kv, score = compressor_rows(W, p, x)
    ring, R = state.pend_kv[layer], state.pend_ring[layer]
    sring = state.pend_score[layer]
    g0 = (s // r) * r
    if s > g0:  # the partial group carried over from earlier steps
        prev = torch.arange(g0, s, device=dev) % R
        kv = torch.cat([ring[seg.slot, prev], kv])
        score = torch.cat([sring[seg.slot, prev], score])
    keep = min(n, R)
    new_rows = torch.arange(s + n - keep, s + n, device=dev) % R
    ring[seg.slot, new_rows] = kv[kv.shape[0] - keep:]
    sring[seg.slot, new_rows] = score[score.shape[0] - keep:]
    ng = (s + n) // r - s // r
    if ng == 0:
        return None, None
    lat = pooled_latent(W, cfg, p, kv[: ng * r].unflatten(0, (ng, r)), score[: ng * r].unflatten(0, (ng, r)))
    return lat, torch.arange(s // r, s // r + ng, device=dev)


def topk_idx(score: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k best scores along the last dim. 'reference' numerics call torch's topk as
    the reference does (tie order implementation-defined); 'exact' numerics break ties by lowest
    index, so the picks do not depend on how wide the masked row is (chunk boundaries)."""
    if ops.get_numerics() == "exact":
        return torch.sort(score, dim=-1, descending=True, stable=True).indices[..., :k]
    return score.topk(k, dim=-1, sorted=False).indices


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


def indexer(W: dict, cfg: ModelConfig, layer: int, state: ModelState, seg: Segment, x, qr, latent, groups,
            rope, shared: dict, comm) -> torch.Tensor:
    """Compressed-slot indices per query ([n, k] int32, -1 = none), before the window offset."""
    r = cfg.compress_ratios[layer]
    p = f"layers.{layer}.attn.indexer"
    src = cfg.kv_source_of(layer)
    s, n = seg.start, seg.n
    clen = (s + n) // r
    if layer == src and latent is not None:  # publish index keys of the new groups (from the RoPE-free latent)
        state.ik[layer][seg.slot, groups] = index_keys(W, cfg, p, latent, rope, groups * r)
        state.ik_last[seg.slot] = layer
    if state.reference_quirks:
        # The reference reads whichever index-key cache was published LAST: in a decode step where a
        # ratio > 1 source completes no group, that is another source's cache (usually the ratio-1
        # one, from the previous step). Reproduced only for bit-exact replay of reference decoding;
        # the default reads this layer's own source, which keeps decode equal to a prefill recompute.
        src = int(state.ik_last[seg.slot])
    if clen == 0:
        return torch.empty(n, 0, dtype=torch.int32, device=x.device)
    q, w = index_query(W, cfg, p, x, qr, rope, torch.arange(s, s + n, device=x.device))
    keys = state.ik[src][seg.slot, :clen]
    score = comm.index_scores(q.unsqueeze(0), keys.unsqueeze(0), w.unsqueeze(0))[0]
    clens = (torch.arange(s + 1, s + n + 1, device=x.device) // r).unsqueeze(-1)
    return pick_compressed(cfg, layer, score, clens, shared, min(cfg.index_topk, clen)).int()


def attention(W: dict, cfg: ModelConfig, layer: int, x: torch.Tensor, segs: list[Segment],
              state: ModelState, rope, shared: list[dict], comm, positions: torch.Tensor) -> torch.Tensor:
    """Attention sublayer of backbone layer `layer` on flattened rows x [T, D] (bf16)."""
    p = f"layers.{layer}.attn"
    hd = cfg.head_dim
    qr, q = query(W, cfg, p, x, rope, positions)
    kv = window_kv(W, cfg, p, x, rope, positions)
    ratio = cfg.compress_ratios[layer]
    src = cfg.kv_source_of(layer)
    outs = []
    for seg, sh in zip(segs, shared):
        rows = slice(seg.off, seg.off + seg.n)
        kv_all, idx = window_slots(state, layer, seg, kv[rows], cfg.window_size)
        if ratio:
            latent, groups = compress(W, cfg, layer, state, seg, x[rows]) if layer == src else (None, None)
            if layer in cfg.index_source_layers:
                cidx = indexer(W, cfg, layer, state, seg, x[rows], qr[rows], latent, groups, rope, sh, comm)
                sh["topk"] = cidx
            else:
                cidx = sh["topk"]
            if latent is not None:
                state.ckv[layer][seg.slot, groups] = compressed_kv(latent, rope, groups * ratio)
            comp = state.ckv[src][seg.slot, : seg.end // ratio]
            cidx = torch.where(cidx >= 0, cidx + kv_all.shape[0], -1).int()
            kv_all = torch.cat([kv_all, comp])
            idx = torch.cat([idx, cidx], dim=-1)
        o = ops.sparse_attn(q[rows].unsqueeze(0), kv_all.unsqueeze(0), W[p + ".attn_sink"],
                            idx.unsqueeze(0), hd ** -0.5)
        outs.append(o[0])
    o = rope.apply(torch.cat(outs), positions, inverse=True)
    return grouped_out(W, p, cfg, o, comm)


def grouped_out(W: dict, p: str, cfg: ModelConfig, o: torch.Tensor, comm) -> torch.Tensor:
    """o [T, H, hd] -> block-diagonal wo_a per o-group (bf16 einsum) -> wo_b -> [T, D]; wo_b goes
    through `comm` because it is row-parallel over the attention group (see `parallel`)."""
    T = o.shape[0]
    wo_a = W[p + ".wo_a.weight"]
    groups = wo_a.shape[0] // cfg.o_lora_rank
    o = ops.linear_bf16(o.reshape(1, T, groups, -1), wo_a.view(groups, cfg.o_lora_rank, -1))
    return comm.attn_out(W, p + ".wo_b", o.flatten(2))[0]
