"""V4.1 feed-forward parts: the MoE (sqrt-softplus router, top-k, shared expert, clamped SwiGLU)
and the Engram n-gram memory added to the stream before its layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from v4flash_backend import ops
from v4flash_backend.config import ModelConfig
from v4flash_backend.formats import quant

from .weights import linear


def route(W: dict, cfg: ModelConfig, p: str, x: torch.Tensor, topk: int):
    """(weights [T, k] f32, expert ids [T, k]); the bias only steers selection."""
    # scores are fp32 as in the reference; 'exact' numerics evaluate the transcendentals in fp64
    scores = ops.linear_f32(x, W[p + ".gate.weight"]).to(_score_dtype()) / cfg.gate_temp
    if cfg.score_func == "softmax":
        scores = scores.softmax(dim=-1)
    elif cfg.score_func == "sigmoid":
        scores = scores.sigmoid()
    else:
        scores = F.softplus(scores).sqrt()
    ids = (scores.float() + W[p + ".gate.bias"]).topk(topk, dim=-1)[1]
    w = scores.gather(1, ids)
    if cfg.norm_topk_prob and topk > 1:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)  # 1e-20, not norm_eps: matches training
    return (w * cfg.route_scale).float(), ids


def _score_dtype():
    return torch.float64 if ops.get_numerics() == "exact" else torch.float32


def expert(W: dict, p: str, x: torch.Tensor, w: torch.Tensor | None, limit: float) -> torch.Tensor:
    """One SwiGLU expert; the routing weight multiplies before w2, as in training."""
    g = linear(W, p + ".w1", x)
    u = linear(W, p + ".w3", x)
    return linear(W, p + ".w2", ops.swiglu(g, u, w, limit))


def local_experts(W: dict, p: str) -> list[int]:
    """Expert ids whose weights this rank holds (all of them at W = 1)."""
    meta = W.meta.setdefault("experts", {})
    if p not in meta:
        pre = p + ".experts."
        meta[p] = sorted({int(k[len(pre):].split(".")[0]) for k in W if k.startswith(pre)})
    return meta[p]


# rows x local experts up to which the dense form (every local expert on every row, routing
# weight 0 where not routed) replaces the per-expert loop: a few batched GEMMs instead of a Python
# loop, and a cost independent of the routing (what a static decode graph needs as well)
DENSE_MOE_MAX = 1024


def stacked_experts(W: dict, p: str) -> list:
    """[w1, s1, w3, s3, w2, s2] of the local experts stacked along a new leading dim (cached);
    the per-expert entries of W become views into the stacks, so nothing is stored twice."""
    meta = W.meta.setdefault("stacked", {})
    if p not in meta:
        ids = local_experts(W, p)
        out = []
        for w in ("w1", "w3", "w2"):
            for part in ("weight", "scale"):
                names = [f"{p}.experts.{e}.{w}.{part}" for e in ids]
                st = torch.stack([W[n] for n in names])
                for i, n in enumerate(names):
                    W[n] = st[i]
                out.append(st)
        meta[p] = out
    return meta[p]


def moe(W: dict, cfg: ModelConfig, layer_prefix: str, n_act: int, x: torch.Tensor, comm,
        capture: dict | None = None) -> torch.Tensor:
    """Routed experts summed in fp32 in expert-id order (each output rounded to bf16), then the
    world reduction, then the shared expert; one final rounding."""
    p = layer_prefix + ".ffn"
    weights, ids = route(W, cfg, p, x, n_act)
    if capture is not None:
        capture["gate_indices"], capture["gate_weights"] = ids, weights
    experts = local_experts(W, p)
    y = torch.zeros(x.shape, dtype=torch.float32)
    if (ops.get_numerics() == "exact" and ops.get_backend() == "torch" and not W.meta.get("train") and len(experts) > 1
            and x.shape[0] * len(experts) <= DENSE_MOE_MAX and W[f"{p}.experts.{experts[0]}.w1.weight"].dim() == 2):
        # exact numerics make each (row, expert) result independent of the batch, so the dense
        # form equals the loop bit for bit; a zero routing weight gives an exact zero output
        w1, s1, w3, s3, w2, s2 = stacked_experts(W, p)
        col = torch.full((cfg.moe_shape(0)[0] if layer_prefix.startswith("layers") else
                          cfg.moe_shape(cfg.n_layers)[0],), -1, dtype=torch.long)
        col[torch.tensor(experts)] = torch.arange(len(experts))
        route_w = torch.zeros(x.shape[0], len(experts), dtype=torch.float32)
        local = col[ids]
        hit = local >= 0
        route_w[torch.nonzero(hit)[:, 0], local[hit]] = weights[hit]
        xe = x.unsqueeze(0).expand(len(experts), -1, -1)
        h = ops.swiglu(ops.linear_fp4(xe, w1, s1) if w1.dtype == torch.int8 else ops.linear_fp8(xe, w1, s1),
                       ops.linear_fp4(xe, w3, s3) if w3.dtype == torch.int8 else ops.linear_fp8(xe, w3, s3),
                       route_w.T.unsqueeze(-1), cfg.swiglu_limit)
        out = ops.linear_fp4(h, w2, s2) if w2.dtype == torch.int8 else ops.linear_fp8(h, w2, s2)
        for e in range(len(experts)):
            y += out[e]
    else:
        present = set(torch.unique(ids).tolist())
        for e in experts:
            if e not in present:
                continue
            rows, slot = torch.where(ids == e)
            y[rows] += expert(W, f"{p}.experts.{e}", x[rows], weights[rows, slot, None], cfg.swiglu_limit)
    y = comm.moe_out(y)  # sequence parallel: reduced and split to this rank's rows
    y += expert(W, p + ".shared_experts", comm.sp_local(x), None, cfg.swiglu_limit)
    return y.to(x.dtype)


def engram(W: dict, cfg: ModelConfig, layer: int, h: torch.Tensor, hash_ids: torch.Tensor, comm) -> torch.Tensor:
    """h [T, hc, D] bf16; hash_ids [T, n_cols] table rows of this layer. Rows are dequantized
    (fp8 x per-32 scale) to bf16, flattened in column order, projected to hc keys + one value."""
    p = f"layers.{layer}.engram"
    table, scale = W[p + ".embed.weight"], W[p + ".embed.scale"]
    start = W.meta.get("engram_row_start", {}).get(layer, 0)
    local = hash_ids - start
    miss = (local < 0) | (local >= table.shape[0])
    local = local.masked_fill(miss, 0)
    rows = quant.dequant_fp8_rows(table[local], scale[local]).to(torch.bfloat16)
    rows = comm.engram_rows(rows.masked_fill(miss.unsqueeze(-1), 0))
    kv = linear(W, p + ".wkv", rows.flatten(-2))
    hc, D = cfg.hc_mult, cfg.dim
    key = kv[..., : hc * D].unflatten(-1, (hc, D))
    value = kv[..., hc * D:]
    qk = W[p + ".q_weight"].float() * W[p + ".k_weight"].float()
    return ops.engram_gate(h, key, value, qk, cfg.norm_eps)
