"""DSpark draft stages of V4.1 (checkpoint `mtp.0..2`) as pure functions over per-slot rings.

- taps: the attention inputs (after Engram) of `dspark_target_layer_ids`, averaged over the hc
  streams, concatenated -> main_x = main_norm(main_proj(taps)) (stage 0's weights, shared by all);
- each stage keeps a ring of `window` rows of its own main-KV (kv_norm(wkv(main_x)), RoPE at the
  row's position, fp8 QDQ), written for committed positions only;
- a draft block is [anchor, noise x (B-1)] at positions p+1..p+B; every stage is a window-only mHC
  block whose queries all see the filled ring slots and all B block rows (no causal mask);
- the last stage collapses the streams, applies its norm and the shared LM head (U, fp32); the
  Markov head adds W2 . W1[prev] to row i's logits and the confidence head reads
  [collapsed hidden ; W1[prev]].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from v4flash_backend import ops

from .attention import grouped_out, query, window_kv
from .weights import linear


def block_slots(last: torch.Tensor, win: int, B: int) -> torch.Tensor:
    """The attention slots of draft blocks over banks [ring (win rows) ; block (B rows)], for blocks
    whose last ring position is last [R]: the filled ring slots 0..min(win, last + 1) - 1 in slot
    order, then the whole block (no causal mask inside it), then -1 padding -> int32 [R, win + B]."""
    filled = (last + 1).clamp(0, win)[:, None]
    j = torch.arange(win + B, device=last.device)
    return torch.where(j < filled, j, torch.where(j < filled + B, win + j - filled, -1)).int()


@dataclass
class DraftOutput:
    base_logits: torch.Tensor  # U [R, B, V] f32, before the Markov bias
    hidden: torch.Tensor  # [R, B, D] bf16: collapsed last-stage stream (confidence head input)


class DSparkDrafter:
    def __init__(self, model):
        self.m = model
        self.cfg = model.cfg
        if not self.cfg.dspark_block_size:
            raise ValueError("this config has no DSpark stages (dspark_block_size 0)")
        self.n_stages = self.cfg.n_mtp_layers
        self.B = self.cfg.dspark_block_size
        self.last = f"mtp.{self.n_stages - 1}"

    def stage_layer(self, k: int) -> int:
        return self.cfg.n_layers + k

    def main_x(self, taps: torch.Tensor) -> torch.Tensor:
        """taps [m, n_taps*D] bf16 -> main_x [m, D] bf16."""
        W, eps = self.m.W, self.cfg.norm_eps
        return ops.rms_norm(linear(W, "mtp.0.main_proj", taps), W["mtp.0.main_norm.weight"], eps)

    def write_ring(self, state, slot: int, main_x: torch.Tensor, positions: torch.Tensor) -> None:
        """Store every stage's main-KV of committed rows at ring slot position % window."""
        W, cfg = self.m.W, self.cfg
        win = cfg.window_size
        keep = min(main_x.shape[0], win)
        main_x, positions = main_x[-keep:], positions[-keep:]
        for k in range(self.n_stages):
            kv = window_kv(W, cfg, f"mtp.{k}.attn", main_x, self.m.ropes[self.stage_layer(k)], positions)
            state.dspark[k][slot, positions % win] = kv

    def write_rings(self, state, taps: torch.Tensor, writes) -> None:
        """write_ring for several slots at once: writes [(slot, rows of taps, positions)]. One
        main_x and one main-KV projection per stage over every slot's kept rows (the last `window`
        of each), then each slot's ring rows (per-row ops: the same values as slot by slot; one
        call instead of R per stage: 4 % of a batch-8 DSpark step on the embedded model)."""
        win = self.cfg.window_size
        keep = [(slot, rows[-win:], pos[-win:]) for slot, rows, pos in writes if len(rows)]
        if not keep:
            return
        mx = self.main_x(taps[torch.cat([r for _, r, _ in keep])])
        pos = torch.cat([p for _, _, p in keep])
        n = [len(r) for _, r, _ in keep]
        for k in range(self.n_stages):
            kv = window_kv(self.m.W, self.cfg, f"mtp.{k}.attn", mx, self.m.ropes[self.stage_layer(k)], pos)
            for (slot, _, p), part in zip(keep, kv.split(n)):
                state.dspark[k][slot, p % win] = part

    def _attention(self, k: int, x: torch.Tensor, items, state, positions) -> torch.Tensor:
        W, cfg = self.m.W, self.cfg
        p, hd, win, B = f"mtp.{k}.attn", cfg.head_dim, cfg.window_size, self.B
        rope = self.m.ropes[self.stage_layer(k)]
        _, q = query(W, cfg, p, x, rope, positions)
        kv = window_kv(W, cfg, p, x, rope, positions)
        R = len(items)
        dev = x.device
        slots = torch.tensor([slot for slot, _, _ in items], device=dev)
        last = torch.tensor([pos for _, pos, _ in items], device=dev)
        # one attention call over every block (it was one per block: about a fifth of a batch-8
        # draft's time went to their per-call cost); the slot lists keep each block's own order
        bank = torch.cat([state.dspark[k][slots], kv.view(R, B, -1)], dim=1)  # [R, win + B, hd]
        o = ops.sparse_attn(q.view(R, B, -1, hd), bank, W[p + ".attn_sink"],
                            block_slots(last, win, B)[:, None, :].expand(R, B, -1), hd ** -0.5)
        o = rope.apply(o.flatten(0, 1), positions, inverse=True)
        return grouped_out(W, p, cfg, o, self.m.comm)

    def draft(self, state, items, captures: dict | None = None) -> DraftOutput:
        """items: [(slot, p, anchor_id)] where p is the last position whose main-KV is in the ring
        (the anchor is the token at p + 1). Returns U and the hidden rows for R = len(items)."""
        cfg, m, B = self.cfg, self.m, self.B
        dev = state.dspark[0].device  # every tensor made here follows the state (a device-resident runner)
        ids = torch.full((len(items), B), cfg.dspark_noise_token_id, dtype=torch.long, device=dev)
        ids[:, 0] = torch.tensor([a for _, _, a in items], device=dev)
        positions = torch.cat([torch.arange(p + 1, p + 1 + B, device=dev) for _, p, _ in items])
        h = ops.hc_expand(m.embed(ids.flatten()), cfg.hc_mult)
        pre_mix = torch.zeros(h.shape[0], cfg.hc_mult, dtype=torch.float32, device=dev)
        pre_mix[:, 0] = 1.0
        n_act = cfg.moe_shape(cfg.n_layers)[1]
        for k in range(self.n_stages):
            cap = captures.setdefault(k, {}) if captures is not None else None
            h, pre_mix = m.hc_block(f"mtp.{k}", n_act, h, pre_mix,
                                    lambda x, k=k: self._attention(k, x, items, state, positions), cap)
        x = ops.hc_collapse(h, pre_mix)
        W = m.W
        u = m.comm.head(ops.linear_f32(ops.rms_norm(x, W[self.last + ".norm.weight"], cfg.norm_eps),
                                       W["head.weight"]))
        return DraftOutput(u.view(len(items), B, -1), x.view(len(items), B, -1))

    def markov(self, prev_ids: torch.Tensor):
        """(bias [.., V] f32, embedding [.., rank] bf16) for previous tokens."""
        e = self.markov_embed(prev_ids)
        # replicated on every rank (no vocab gather): the engine samples drafts on rank 0 alone
        return ops.linear_f32(e, self.m.W[self.last + ".markov_head.head.weight"]), e

    def markov_embed(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """W1[prev] [.., rank] bf16 alone: what the confidence head reads. The bias's [.., V]
        projection is not needed there (it had been computed and dropped on every drafted step)."""
        return self.m.W[self.last + ".markov_head.embed.weight"][prev_ids.long()]

    def confidence(self, hidden: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        """Confidence logits (sigmoid -> c_k) from [hidden ; W1[prev]] (fp32 projection)."""
        x = torch.cat([hidden, markov_embed], dim=-1)
        return ops.linear_f32(x, self.m.W[self.last + ".confidence_head.proj.weight"]).squeeze(-1)

    def greedy_chain(self, out: DraftOutput, anchors: torch.Tensor):
        """Left-to-right argmax with the Markov bias of each predecessor (temperature 0):
        (ids [R, B+1] starting with the anchor, corrected logits [R, B, V], confidence logits [R, B])."""
        R, B = out.base_logits.shape[:2]
        ids = torch.empty(R, B + 1, dtype=torch.long, device=out.base_logits.device)
        ids[:, 0] = anchors
        logits = out.base_logits.clone()
        embeds = []
        for i in range(B):
            bias, e = self.markov(ids[:, i])
            logits[:, i] += bias
            embeds.append(e)
            ids[:, i + 1] = logits[:, i].argmax(-1)
        return ids, logits, self.confidence(out.hidden, torch.stack(embeds, 1))
