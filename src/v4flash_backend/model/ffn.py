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
    """Expert ids whose weights this rank holds (all of them at W = 1): a contiguous range
    [start, start + E) (`parallel.layout`'s experts by id), which `local_slots` relies on."""
    meta = W.meta.setdefault("experts", {})
    if p not in meta:
        pre = p + ".experts."
        meta[p] = sorted({int(k[len(pre):].split(".")[0]) for k in W if k.startswith(pre)})
    return meta[p]


def local_slots(W: dict, p: str, ids: torch.Tensor) -> torch.Tensor:
    """Routed expert ids [T, k] -> this rank's local expert slots [T, k] (-1: another rank's expert).

    The representation a graph sees: this rank holds experts [start, start + E) (contiguous, by id),
    `start` is the rank offset `expert_start.<p>` (a 0-dim int64 tensor on a shard, see `Weights`)
    and E the number of local experts (a shape, the same on every rank): slot = id - start where it
    falls in [0, E). No expert id of a rank is a traced constant, so every rank's MoE graph is the
    same; a capacity-bounded routed form can gather its rows and weights by these slots."""
    E = len(local_experts(W, p))
    local = ids - W.rank_offset(f"expert_start.{p}")
    return torch.where((local >= 0) & (local < E), local, -1)


# rows x local experts up to which the eager exact forward runs the dense form (every local expert
# on every row, routing weight 0 where not routed); above it, the grouped form (each expert on its
# own routed rows, padded to the busiest expert's count). Both are a few batched GEMMs instead of a
# per-expert Python loop; the dense one needs no index building, which pays up to about 64 (1 CPU
# thread, the embedded model: a plain decode row of 8 experts, a batch-1 or -2 draft block of the
# stages' 4). The static decode graph runs form 'all' of `moe` (the routed or the dense form)
DENSE_MOE_MIN = 64
# and up to which either batched form runs; the loop beyond (measured on the embedded model: at 128
# rows x 8 experts the loop is as fast as the grouped form, whose padding grows with the rows)
BATCHED_MOE_MAX = 1024


def _experts_ffn(xg, rw, stacks, limit, experts=None):
    """The stacked experts on xg [E, M, D] with routing weights rw [E, M, 1] -> [E, M, D] bf16;
    experts [E]: entry i of xg meets stack entry experts[i] (the routed form)."""
    w1, s1, w3, s3, w2, s2 = stacks

    def lin(v, w, s):
        return ops.linear_fp4(v, w, s, experts) if w.dtype == torch.int8 else ops.linear_fp8(v, w, s, experts)

    return lin(ops.swiglu(lin(xg, w1, s1), lin(xg, w3, s3), rw, limit), w2, s2)


def _dense_experts(x, local, weights, n_exp: int, stacks, limit) -> torch.Tensor:
    """Every local expert on every row: [E, T, D], rows not routed to an expert exactly zero."""
    route_w = torch.zeros(x.shape[0], n_exp + 1, dtype=torch.float32, device=x.device)
    route_w.scatter_(1, torch.where(local >= 0, local, n_exp), weights)  # column n_exp: other ranks' experts
    xe = x.unsqueeze(0).expand(n_exp, -1, -1)
    return _experts_ffn(xe, route_w[:, :n_exp].T.unsqueeze(-1), stacks, limit)


# the routed form's slots per rank and MoE layer: twice a rank's expected (row, expert) pairs under
# uniform routing, at least this many (release, 6-row verify: 4 slots for 0.56 expected pairs, overflow
# ~2e-4 per layer), at most every pair a rank can hold (then no overflow pass)
MOE_CAPACITY_MIN = 4


def moe_capacity(rows: int, n_act: int, n_local: int, n_total: int) -> int:
    """(row, expert) slots of the routed form: a function of shapes and the config only (the same graph
    on every rank)."""
    worst = rows * min(n_act, n_local)
    return min(worst, max(MOE_CAPACITY_MIN, -(-2 * rows * n_act * n_local // n_total)))


def _routed_experts(x, local, weights, n_exp: int, stacks, limit, capacity: int) -> torch.Tensor:
    """Only the routed experts, packed into `capacity` (row, expert) slots: the static graph's form
    while the slots are fewer than the local experts. Returns [A, T, D] bf16 (A = min(top-k, local
    experts)): entry a holds each row's a-th local expert in expert-id order (zeros past its last), so
    adding the entries in turn is the dense form's carry bit for bit (its other experts add exact zeros).

    The pairs of this rank (local >= 0), row by row, take slots 0, 1, ...; slot s's row, expert and
    routing weight are tensors (`experts` = -1 for an empty slot, whose kernel reads no weight). The pairs
    past the capacity are never dropped: an overflow pass runs each local expert that has one on every
    row, weighted by the overflowing pairs only, and the carry picks their outputs (a static shape; its
    kernel runs only the experts with an overflowing pair, none in the common case). With capacity =
    every pair a rank can hold there is no overflow pass."""
    T = local.shape[0]
    dev = x.device
    A = min(local.shape[1], n_exp)
    key, order = torch.where(local >= 0, local, n_exp).sort(dim=1)  # local experts first, by id
    e, w = key[:, :A], weights.gather(1, order)[:, :A]
    valid = (e < n_exp).reshape(-1)
    pos = torch.cumsum(valid.long(), 0) - 1  # the pair's slot if it fits
    routed = valid & (pos < capacity)
    slot = torch.where(routed, pos, capacity)  # slot `capacity`: scratch for pairs not routed here
    rows = torch.arange(T, device=dev).repeat_interleave(A)
    ef, wf = e.reshape(-1), w.reshape(-1)
    slot_row = torch.zeros(capacity + 1, dtype=torch.long, device=dev).scatter(0, slot, rows)[:capacity]
    slot_exp = torch.full((capacity + 1,), -1, dtype=torch.long, device=dev).scatter(
        0, slot, torch.where(routed, ef, -1))[:capacity]
    slot_w = torch.zeros(capacity + 1, dtype=torch.float32, device=dev).scatter(
        0, slot, torch.where(routed, wf, 0.0))[:capacity]
    out = _experts_ffn(x[slot_row].unsqueeze(1), slot_w.view(-1, 1, 1), stacks, limit, experts=slot_exp)
    D = x.shape[-1]
    pool = [out.view(capacity, D)]
    pick = torch.where(routed, pos, -1)
    if capacity < T * A:  # the exact overflow pass
        over = valid & ~routed
        ow = torch.zeros(T, n_exp + 1, dtype=torch.float32, device=dev).scatter(
            1, torch.where(over.view(T, A), e, n_exp), torch.where(over.view(T, A), w, 0.0))[:, :n_exp]
        hit = torch.zeros(n_exp + 1, dtype=torch.bool, device=dev).scatter(
            0, torch.where(over, ef, n_exp), True)[:n_exp]
        ex = torch.where(hit, torch.arange(n_exp, device=dev), -1)
        oo = _experts_ffn(x.unsqueeze(0).expand(n_exp, -1, -1), ow.T.unsqueeze(-1), stacks, limit, experts=ex)
        pool.append(oo.reshape(n_exp * T, D))
        pick = torch.where(over, capacity + ef.clamp(max=n_exp - 1) * T + rows, pick)
    pool.append(out.new_zeros(1, D))
    pool = torch.cat(pool)
    pick = torch.where(pick >= 0, pick, pool.shape[0] - 1)
    return pool[pick.view(T, A).T]


def _grouped_experts(x, local, weights, n_exp: int, stacks, limit) -> torch.Tensor:
    """Each local expert on its own routed rows, one batched call padded to the busiest expert's
    count M (padding rows carry weight 0): E x M rows instead of the dense form's E x T (top-k of E:
    about k / E of them), scattered back to [E, T, D] with zeros where a row was not routed."""
    T, A = local.shape
    e = local.flatten()
    dev = x.device
    t = torch.arange(T, device=dev).repeat_interleave(A)
    w = weights.flatten()
    keep = e >= 0
    e, t, w = e[keep], t[keep], w[keep]
    order = torch.argsort(e * T + t)  # by expert, then row
    e, t, w = e[order], t[order], w[order]
    counts = torch.bincount(e, minlength=n_exp)
    M = max(1, int(counts.max()))
    slot = torch.arange(len(e), device=dev) - (torch.cumsum(counts, 0) - counts)[e]
    idx = torch.zeros(n_exp, M, dtype=torch.long, device=dev)
    rw = torch.zeros(n_exp, M, 1, dtype=torch.float32, device=dev)
    idx[e, slot] = t
    rw[e, slot, 0] = w
    out = _experts_ffn(x[idx], rw, stacks, limit)
    full = torch.zeros(n_exp, T, x.shape[-1], dtype=out.dtype, device=dev)
    full[e, t] = out[e, slot]
    return full


def _n_total(cfg: ModelConfig, p: str) -> int:
    """Routed experts of the whole model at MoE prefix p (the DSpark stages have their own)."""
    return cfg.moe_shape(cfg.n_layers if p.startswith("mtp.") else 0)[0]


def _fp4_experts(W: dict, p: str, experts: list[int]) -> bool:
    """MXFP4 experts (the routed kernel's format; fp8 ones keep the dense loop on the NKI backends)."""
    return bool(experts) and W[f"{p}.experts.{experts[0]}.w1.weight"].dtype == torch.int8


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
        capture: dict | None = None, form: str | None = None) -> torch.Tensor:
    """Routed experts summed in fp32 in expert-id order (each output rounded to bf16), then the
    world reduction, then the shared expert; one final rounding.

    form: None picks by numerics and size (the batched forms, else a loop over the routed experts:
    host reads of the routing); 'all' is the static graph's (no host read, static shapes): while
    `moe_capacity` gives fewer slots than local experts (decode rows), only the routed experts, packed
    into that many (row, expert) slots with an exact overflow pass (`_routed_experts`; MXFP4 experts,
    or the batched torch stacks), else every local expert on every row, weighted by a dense [rows,
    experts] routing matrix that is 0 where a row is not routed. A zero weight makes swiglu's output,
    hence the expert's, +-0 (activations are clamped, so never 0 * inf), which leaves the fp32 carry
    unchanged."""
    p = layer_prefix + ".ffn"
    weights, ids = route(W, cfg, p, x, n_act)
    if capture is not None:
        capture["gate_indices"], capture["gate_weights"] = ids, weights
    experts = local_experts(W, p)
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    if form not in (None, "all"):
        raise ValueError(f"moe form must be None or 'all', got {form!r}")
    # exact numerics make each (row, expert) result independent of which rows share the call, so the
    # batched forms equal the per-expert loop bit for bit (the carry is still added in expert-id
    # order); a zero routing weight gives an exact zero output
    batched = (ops.get_numerics() == "exact" and ops.get_backend() == "torch" and not W.meta.get("train")
               and len(experts) > 1 and W[f"{p}.experts.{experts[0]}.w1.weight"].dim() == 2)
    stacks = routed = None
    if form == "all":
        routed = moe_capacity(x.shape[0], n_act, len(experts), _n_total(cfg, p))
        if routed < len(experts) and (batched or _fp4_experts(W, p, experts)):
            stacks = stacked_experts(W, p)
        else:
            routed = None
    if stacks is not None:  # the static graph's routed form: fewer slots than local experts
        out = _routed_experts(x, local_slots(W, p, ids), weights, len(experts), stacks, cfg.swiglu_limit, routed)
        for a in range(out.shape[0]):  # each row's experts in id order, each output rounded to bf16 already
            y += out[a]
    elif form == "all" and not batched:
        # [rows, local experts + 1] routing weights by local slot (column E: other ranks' experts)
        E = len(experts)
        local = local_slots(W, p, ids)
        dense = torch.zeros(x.shape[0], E + 1, dtype=weights.dtype, device=x.device).scatter(
            1, torch.where(local >= 0, local, E), weights)
        for i, e in enumerate(experts):  # e names the weights (inputs of a graph), i is a column
            y = y + expert(W, f"{p}.experts.{e}", x, dense[:, i:i + 1], cfg.swiglu_limit)
    elif batched and (form == "all" or x.shape[0] * len(experts) <= BATCHED_MOE_MAX):
        # form 'all' (a static graph): the routed or the dense form at any size, three batched GEMMs
        # and no host read
        stacks = stacked_experts(W, p)
        local = local_slots(W, p, ids)
        dense_form = form == "all" or x.shape[0] * len(experts) <= DENSE_MOE_MIN
        out = (_dense_experts if dense_form else _grouped_experts)(x, local, weights, len(experts), stacks,
                                                                    cfg.swiglu_limit)
        for e in range(out.shape[0]):  # the carry in expert-id order, each output rounded to bf16 already
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


def engram_lookup(W: dict, layer: int, hash_ids: torch.Tensor) -> torch.Tensor:
    """This rank's Engram rows [T, n_cols, C] bf16 of hash_ids [T, n_cols] (table rows of `layer`):
    dequantized (fp8 x per-32 scale), zero where another rank holds the row, so the sum over the
    ranks that split the table is the lookup. Depends on the token ids only: the forward reduces
    it together with the embedding's rows (`comm.lookups`)."""
    p = f"layers.{layer}.engram"
    table, scale = W[p + ".embed.weight"], W[p + ".embed.scale"]
    local = hash_ids - W.rank_offset(f"engram_row_start.{layer}")  # a tensor on a shard: see Weights
    miss = (local < 0) | (local >= table.shape[0])
    local = local.masked_fill(miss, 0)
    rows = quant.dequant_fp8_rows(table[local], scale[local]).to(torch.bfloat16)
    return rows.masked_fill(miss.unsqueeze(-1), 0)


def engram_mix(W: dict, cfg: ModelConfig, layer: int, h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """h [T, hc, D] bf16; rows [T, n_cols, C] the layer's looked-up rows (reduced over ranks),
    flattened in column order and projected to hc keys + one value that gate the streams."""
    p = f"layers.{layer}.engram"
    kv = linear(W, p + ".wkv", rows.flatten(-2))
    hc, D = cfg.hc_mult, cfg.dim
    key = kv[..., : hc * D].unflatten(-1, (hc, D))
    value = kv[..., hc * D:]
    qk = W[p + ".q_weight"].float() * W[p + ".k_weight"].float()
    return ops.engram_gate(h, key, value, qk, cfg.norm_eps)


def engram(W: dict, cfg: ModelConfig, layer: int, h: torch.Tensor, hash_ids: torch.Tensor, comm) -> torch.Tensor:
    """One Engram layer with its own reduction (the golden per-layer replay; the forward folds the
    lookups into one collective instead)."""
    return engram_mix(W, cfg, layer, h, comm.engram_rows(engram_lookup(W, layer, hash_ids)))
