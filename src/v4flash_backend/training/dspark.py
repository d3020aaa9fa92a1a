"""Training of the three DSpark stages (checkpoint `mtp.0-2`) on the target's own outputs.

Data (`make_data`): greedy continuations of training-corpus prompts by the exported target, then one
prefill over each whole sequence for the taps (stream means of the attention inputs of the
configured target layers) and the target's top-k next-token distribution at every row. In the
generated part, the tokens after an anchor ARE the target's greedy chain, which is exactly what a
temperature-0 verify accepts.

Forward (`draft_forward`): the inference drafter's computation (model_dspark.DSparkDrafter) for many
anchors at once. Anchor (sequence n, position p): the ring holds main-KV of rows max(0, p-W+1)..p,
the block is [token p+1, noise x (B-1)] at positions p+1..p+B, all block queries see the ring and
the whole block; stage k+1 continues stage k's streams; the last stage's collapse -> norm -> the
target's (frozen) head gives U. Slot i predicts the token at p+2+i.

Loss per slot k (weight exp(-k/4), as DeepSpec): cross-entropy of the Markov-corrected logits
z_k = U_k + W2 W1[x_{p+1+k}] (teacher forcing) against the target's greedy token, plus the soft
cross-entropy against the target's top-k distribution; the confidence head (on detached inputs) is
fit with binary cross-entropy to c*_k = 1 - 0.5 |p_draft,k - p_target,k|_1 (paper section 3.2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from v4flash_backend import ops
from v4flash_backend.formats import quant
from v4flash_backend.model.attention import grouped_out
from v4flash_backend.model.state import ModelState, make_segments
from v4flash_backend.model.transformer import V41Model
from v4flash_backend.model.weights import linear

from .params import forward_weights, qtypes

TOPK = 32  # target distribution kept per row: enough mass for the L1 distance of a tiny model


@dataclass
class DraftData:
    tokens: torch.Tensor  # [N, L] int64 (right-padded with PAD)
    lengths: torch.Tensor  # [N]
    prompt_lens: torch.Tensor  # [N]
    taps: torch.Tensor  # [N, L, n_taps * D] bf16
    top_ids: torch.Tensor  # [N, L, TOPK] int64: the target's most likely next tokens at each row
    top_p: torch.Tensor  # [N, L, TOPK] f32: their probabilities


@torch.no_grad()
def greedy_batch(model: V41Model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Plain greedy continuation of several prompts at once (one slot each, decode steps batched)."""
    n = len(prompts)
    st = ModelState(model.cfg, n, max(len(p) for p in prompts) + new_tokens + 1)
    flat = torch.tensor([t for p in prompts for t in p])
    out = model.forward(st, flat, make_segments([(i, 0, len(p)) for i, p in enumerate(prompts)]))
    seqs = [list(p) for p in prompts]
    for step in range(new_tokens):
        nxt = out.logits.argmax(-1)
        for i in range(n):
            seqs[i].append(int(nxt[i]))
        if step == new_tokens - 1:
            break
        out = model.forward(st, nxt, make_segments([(i, len(seqs[i]) - 1, 1) for i in range(n)]))
    return seqs


@torch.no_grad()
def make_data(target: V41Model, stream: torch.Tensor, n_prompts: int, new_tokens: int, seed: int,
              chunk: int = 64) -> DraftData:
    from .loop import Progress

    g = torch.Generator().manual_seed(seed + 1)
    lens = torch.randint(8, 48, (n_prompts,), generator=g)
    starts = torch.randint(0, len(stream) - 64, (n_prompts,), generator=g)
    prompts = [[target.cfg.bos_token_id] + stream[s:s + n].tolist() for s, n in zip(starts.tolist(), lens.tolist())]
    seqs = []
    bar = Progress((n_prompts + chunk - 1) // chunk, "dspark data")
    for j in range(0, n_prompts, chunk):
        seqs += greedy_batch(target, prompts[j:j + chunk], new_tokens)
        bar.update(j // chunk)
    L = max(len(s) for s in seqs)
    cfg = target.cfg
    pad = cfg.engram_pad_id
    tokens = torch.full((len(seqs), L), pad, dtype=torch.long)
    for i, s in enumerate(seqs):
        tokens[i, :len(s)] = torch.tensor(s)
    lengths = torch.tensor([len(s) for s in seqs])
    taps = torch.zeros(len(seqs), L, len(cfg.dspark_target_layer_ids) * cfg.dim, dtype=torch.bfloat16)
    top_ids = torch.zeros(len(seqs), L, TOPK, dtype=torch.long)
    top_p = torch.zeros(len(seqs), L, TOPK)
    for i, s in enumerate(seqs):
        st = ModelState(cfg, 1, len(s))
        o = target.forward(st, torch.tensor(s), make_segments([(0, 0, len(s))]), "all", want_taps=True)
        taps[i, :len(s)] = o.taps
        p, ids = o.logits.softmax(-1).topk(TOPK, dim=-1)
        top_ids[i, :len(s)], top_p[i, :len(s)] = ids, p
    return DraftData(tokens, lengths, lens + 1, taps, top_ids, top_p)


def draft_forward(model: V41Model, W, taps: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor,
                  captures: dict | None = None):
    """U [A, B, V] f32 and the collapsed last-stage hidden [A, B, D] for anchors [A, 2] = (row of
    taps/tokens, p). taps [N, L, n_taps*D], tokens [N, L]."""
    cfg = model.cfg
    model.W = W
    B, win, hd, H = cfg.dspark_block_size, cfg.window_size, cfg.head_dim, cfg.n_heads
    N, L, _ = taps.shape
    A = anchors.shape[0]
    eps = cfg.norm_eps
    main_x = ops.rms_norm(linear(W, "mtp.0.main_proj", taps.flatten(0, 1)), W["mtp.0.main_norm.weight"], eps)
    row_pos = torch.arange(L).repeat(N)
    n_idx, p = anchors[:, 0], anchors[:, 1]
    ring_pos = p.unsqueeze(1) - win + 1 + torch.arange(win)  # [A, win]
    ring_ok = ring_pos >= 0
    ring_rows = n_idx.unsqueeze(1) * L + ring_pos.clamp_min(0)
    ids = torch.full((A, B), cfg.dspark_noise_token_id, dtype=torch.long)
    ids[:, 0] = tokens[n_idx, p + 1]
    pos_b = (p.unsqueeze(1) + 1 + torch.arange(B)).flatten()
    mask = torch.cat([ring_ok, torch.ones(A, B, dtype=torch.bool)], dim=1)  # [A, win + B]

    def attn(k: int, x: torch.Tensor) -> torch.Tensor:
        a = f"mtp.{k}.attn"
        rope = model.ropes[cfg.n_layers + k]
        kv_ring = ops.rms_norm(linear(W, a + ".wkv", main_x), W[a + ".kv_norm.weight"], eps)
        kv_ring = quant.fp8_act_qdq(rope.apply(kv_ring, row_pos))[ring_rows]  # [A, win, hd]
        qr = ops.rms_norm(linear(W, a + ".wq_a", x), W[a + ".q_norm.weight"], eps)
        q = rope.apply(linear(W, a + ".wq_b", qr).unflatten(-1, (-1, hd)), pos_b).view(A, B, H, hd)
        kv = ops.rms_norm(linear(W, a + ".wkv", x), W[a + ".kv_norm.weight"], eps)
        kv = quant.fp8_act_qdq(rope.apply(kv, pos_b)).view(A, B, hd)
        bank = torch.cat([kv_ring, kv], dim=1).float()
        s = torch.einsum("abhd,akd->abhk", q.float(), bank) * hd ** -0.5
        s = s.masked_fill(~mask[:, None, None, :], -torch.inf)
        sink = W[a + ".attn_sink"].float().view(1, 1, H, 1).expand(A, B, H, 1)
        pr = torch.cat([s, sink], dim=-1).softmax(-1)[..., :-1]  # the sink only joins the denominator
        o = torch.einsum("abhk,akd->abhd", pr, bank).to(torch.bfloat16).flatten(0, 1)
        return grouped_out(W, a, cfg, rope.apply(o, pos_b, inverse=True), model.comm)

    h = ops.hc_expand(model.embed(ids.flatten()), cfg.hc_mult)
    pre_mix = torch.zeros(h.shape[0], cfg.hc_mult)
    pre_mix[:, 0] = 1.0
    n_act = cfg.moe_shape(cfg.n_layers)[1]
    for k in range(cfg.n_mtp_layers):
        cap = captures.setdefault(k, {}) if captures is not None else None
        h, pre_mix = model.hc_block(f"mtp.{k}", n_act, h, pre_mix, lambda x, k=k: attn(k, x), cap)
    x = ops.hc_collapse(h, pre_mix)
    last = f"mtp.{cfg.n_mtp_layers - 1}"
    u = ops.linear_f32(ops.rms_norm(x, W[last + ".norm.weight"], eps), W["head.weight"])
    return u.view(A, B, -1), x.view(A, B, -1)


def sample_anchors(data: DraftData, n_seqs: int, n_anchors: int, g: torch.Generator):
    """(sequence rows, anchors [A, 2] = (index into those rows, p)) for one step."""
    rows = torch.randperm(len(data.tokens), generator=g)[:n_seqs]
    cand = []
    for j, r in enumerate(rows.tolist()):
        hi = int(data.lengths[r]) - 2  # slot 0 needs a target row (and the anchor) at p + 1
        lo = max(0, min(int(data.prompt_lens[r]) - 1, hi))  # on-policy: the anchor is generated
        cand += [(j, p) for p in range(lo, hi + 1)]
    pick = torch.randperm(len(cand), generator=g)[:n_anchors]
    return rows, torch.tensor([cand[i] for i in pick.tolist()])


def dspark_loss(model: V41Model, W, data: DraftData, rows, anchors, captures=None):
    cfg = model.cfg
    B = cfg.dspark_block_size
    last = f"mtp.{cfg.n_mtp_layers - 1}"
    taps, tokens = data.taps[rows], data.tokens[rows]
    u, hidden = draft_forward(model, W, taps, tokens, anchors, captures)
    n_idx, p = anchors[:, 0], anchors[:, 1]
    tgt_row = p.unsqueeze(1) + 1 + torch.arange(B)  # target row whose next-token dist slot k matches
    valid = tgt_row < data.lengths[rows][n_idx].unsqueeze(1)
    tgt_row = tgt_row.clamp_max(tokens.shape[1] - 1)
    prev = tokens[n_idx.unsqueeze(1), tgt_row]  # teacher forcing: the token before slot k's target
    emb = W[last + ".markov_head.embed.weight"][prev]
    z = u + ops.linear_f32(emb, W[last + ".markov_head.head.weight"])
    tid = data.top_ids[rows][n_idx.unsqueeze(1), tgt_row]  # [A, B, K]
    tp = data.top_p[rows][n_idx.unsqueeze(1), tgt_row]
    logp = z.log_softmax(-1)
    hard = -logp.gather(-1, tid[..., :1]).squeeze(-1)  # the target's greedy token
    soft = -(logp.gather(-1, tid) * tp).sum(-1)
    with torch.no_grad():
        pd = logp.exp()
        pd_top = pd.gather(-1, tid)
        l1 = (pd_top - tp).abs().sum(-1) + (1 - pd_top.sum(-1)).clamp_min(0) + (1 - tp.sum(-1)).clamp_min(0)
        c_star = (1 - 0.5 * l1).clamp(0, 1)
        greedy_hit = (z.argmax(-1) == tid[..., 0]).float()
    conf_in = torch.cat([hidden.detach().float(), emb.detach().float()], dim=-1)
    c_logit = ops.linear_f32(conf_in, W[last + ".confidence_head.proj.weight"]).squeeze(-1)
    bce = F.binary_cross_entropy_with_logits(c_logit, c_star, reduction="none")
    wk = torch.exp(-torch.arange(B) / 4.0).unsqueeze(0) * valid
    denom = wk.sum().clamp_min(1.0)
    loss = ((hard + 0.5 * soft + bce) * wk).sum() / denom
    stats = {"ce": ((hard * valid).sum() / valid.sum().clamp_min(1)).item(),
             "acc_k": [round(v, 3) for v in ((greedy_hit * valid).sum(0) / valid.sum(0).clamp_min(1)).tolist()]}
    return loss, stats


def train(model: V41Model, masters: dict, data: DraftData, steps: int, lr: float, seed: int, log: list,
          n_seqs: int = 16, n_anchors: int = 384) -> None:
    """Train the mtp.* masters (the target's, including embed and head, stay frozen)."""
    from .loop import Progress, balance_router, lr_at, param_groups

    cfg = model.cfg
    names = [n for n in masters if n.startswith("mtp.") and not n.endswith(("gate.bias", "gate.bias_vl"))]
    opt = torch.optim.AdamW(param_groups(masters, names, 0.01), lr=lr, betas=(0.9, 0.95))
    meta = {"train": True, "qtype": qtypes(cfg)}
    frozen = {n: masters[n].detach() for n in ("embed.weight", "head.weight")}  # all the draft reads
    g = torch.Generator().manual_seed(seed + 2)
    bar = Progress(steps, "dspark")
    n_exp = cfg.moe_shape(cfg.n_layers)[0]
    for step in range(steps):
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step, steps, lr, max(1, steps // 20))
        rows, anchors = sample_anchors(data, n_seqs, n_anchors, g)
        W = forward_weights(cfg, {**frozen, **{n: masters[n] for n in masters if n.startswith("mtp.")}}, meta)
        caps: dict = {}
        loss, stats = dspark_loss(model, W, data, rows, anchors, caps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([masters[n] for n in names], 1.0)
        opt.step()
        balance_router(masters, caps, "mtp.", n_exp, 1e-3)
        log.append({"step": step, "loss": round(loss.item(), 4), **stats})
        bar.update(step, f"loss {loss.item():.3f} ce {stats['ce']:.3f} acc {stats['acc_k']}")
