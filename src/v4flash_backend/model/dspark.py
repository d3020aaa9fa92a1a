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

from collections import OrderedDict
from dataclasses import dataclass

import torch

from v4flash_backend import ops

from .attention import grouped_out, query, window_kv
from .geometry import masked_put
from .rope import TableRope
from .transformer import first_pre_mix
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
        self._bias_rows: OrderedDict[int, torch.Tensor] = OrderedDict()  # markov_bias's memo
        self._bias_key = None  # the head weights the memo was filled from

    def stage_layer(self, k: int) -> int:
        return self.cfg.n_layers + k

    def main_x(self, taps: torch.Tensor) -> torch.Tensor:
        """taps [m, n_taps*D] bf16 -> main_x [m, D] bf16."""
        W, eps = self.m.W, self.cfg.norm_eps
        return ops.rms_norm(linear(W, "mtp.0.main_proj", taps), W["mtp.0.main_norm.weight"], eps)

    def stage_kv(self, k: int, x: torch.Tensor, positions: torch.Tensor, rope=None) -> torch.Tensor:
        """Stage k's main-KV of rows x (the ring rows, and a draft block's own keys)."""
        rope = rope or self.m.ropes[self.stage_layer(k)]
        return window_kv(self.m.W, self.cfg, f"mtp.{k}.attn", x, rope, positions)

    def write_ring(self, state, slot: int, main_x: torch.Tensor, positions: torch.Tensor) -> None:
        """Store every stage's main-KV of committed rows at ring slot position % window."""
        win = self.cfg.window_size
        keep = min(main_x.shape[0], win)
        main_x, positions = main_x[-keep:], positions[-keep:]
        for k in range(self.n_stages):
            state.dspark[k][slot, positions % win] = self.stage_kv(k, main_x, positions)

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
            kv = self.stage_kv(k, mx, pos)
            for (slot, _, p), part in zip(keep, kv.split(n)):
                state.dspark[k][slot, p % win] = part

    def write_ring_rows(self, state, taps: torch.Tensor, slot: torch.Tensor, pos: torch.Tensor,
                        valid: torch.Tensor, ropes=None) -> None:
        """The ring writes of a fixed-shape step: taps [S*Q, n_taps*D] of rows at positions pos [S, Q]
        of slots slot [S], written where valid [S, Q] (committed rows; at most `window` of them)."""
        win = self.cfg.window_size
        S, Q = pos.shape
        mx = self.main_x(taps)
        for k in range(self.n_stages):
            kv = self.stage_kv(k, mx, pos.reshape(-1), ropes[k] if ropes else None)
            masked_put(state.dspark[k], slot[:, None], pos % win, kv.view(S, Q, -1), valid)

    def _attention(self, k: int, x: torch.Tensor, state, slot, last, positions, rope) -> torch.Tensor:
        W, cfg = self.m.W, self.cfg
        p, hd, win, B = f"mtp.{k}.attn", cfg.head_dim, cfg.window_size, self.B
        _, q = query(W, cfg, p, x, rope, positions)
        kv = self.stage_kv(k, x, positions, rope)
        R = slot.shape[0]
        # one attention call over every block (it was one per block: about a fifth of a batch-8
        # draft's time went to their per-call cost); the slot lists keep each block's own order
        bank = torch.cat([state.dspark[k][slot], kv.view(R, B, -1)], dim=1)  # [R, win + B, hd]
        o = ops.sparse_attn(q.view(R, B, -1, hd), bank, W[p + ".attn_sink"],
                            block_slots(last, win, B)[:, None, :].expand(R, B, -1), hd ** -0.5)
        o = rope.apply(o.flatten(0, 1), positions, inverse=True)
        return grouped_out(W, p, cfg, o, self.m.comm)

    def draft_block(self, state, slot: torch.Tensor, last: torch.Tensor, anchor: torch.Tensor, ropes: dict,
                    moe_form: str | None = None, captures: dict | None = None) -> DraftOutput:
        """Draft blocks over tensors (no host read): slot, last, anchor [R] on the state's device,
        `last` the last position whose main-KV is in the ring (the anchor is the token at last + 1);
        ropes {stage: Rope covering positions <= last + B}; moe_form as in `ffn.moe`."""
        cfg, m, B = self.cfg, self.m, self.B
        R = slot.shape[0]
        dev = slot.device
        ids = torch.full((R, B), cfg.dspark_noise_token_id, dtype=torch.long, device=dev)
        ids[:, 0] = anchor
        positions = (last[:, None] + 1 + torch.arange(B, device=dev)).reshape(-1)
        h = ops.hc_expand(m.embed(ids.flatten()), cfg.hc_mult)
        pre_mix = first_pre_mix(h)
        n_act = cfg.moe_shape(cfg.n_layers)[1]
        for k in range(self.n_stages):
            cap = captures.setdefault(k, {}) if captures is not None else None
            h, pre_mix = m.hc_block(f"mtp.{k}", n_act, h, pre_mix,
                                    lambda x, k=k: self._attention(k, x, state, slot, last, positions, ropes[k]),
                                    cap, moe_form)
        x = ops.hc_collapse(h, pre_mix)
        W = m.W
        u = m.comm.head(ops.linear_f32(ops.rms_norm(x, W[self.last + ".norm.weight"], cfg.norm_eps),
                                       W["head.weight"]))
        return DraftOutput(u.view(R, B, -1), x.view(R, B, -1))

    def draft(self, state, items, captures: dict | None = None) -> DraftOutput:
        """items: [(slot, p, anchor_id)] where p is the last position whose main-KV is in the ring
        (the anchor is the token at p + 1). Returns U and the hidden rows for R = len(items)."""
        dev = state.dspark[0].device
        slot, last, anchor = torch.tensor([list(it) for it in items], dtype=torch.long, device=dev).T
        end = max(p for _, p, _ in items) + 1 + self.B
        ropes = {k: TableRope(self.m.ropes[self.stage_layer(k)], end) for k in range(self.n_stages)}
        return self.draft_block(state, slot, last, anchor, ropes, captures=captures)

    def markov(self, prev_ids: torch.Tensor):
        """(bias [.., V] f32, embedding [.., rank] bf16) for previous tokens."""
        e = self.markov_embed(prev_ids)
        # replicated on every rank (no vocab gather): the engine samples drafts on rank 0 alone
        return ops.linear_f32(e, self.m.W[self.last + ".markov_head.head.weight"]), e

    # the memo's budget: the whole vocabulary of the embedded model (4096 rows of 16 KiB), a few hundred
    # of the most recent tokens of a 129k vocabulary
    BIAS_MEMO_BYTES = 64 << 20

    def markov_bias(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """B(prev) [R, V] f32 of prev_ids [R] on the eager host path: the bias rows from a memo by
        token id (least recently used out past BIAS_MEMO_BYTES), the missing ones in one call.

        Why: a draft block calls the Markov head once per draft position, each a [R, rank] x
        [rank, V] product; in 'exact' numerics (fp64, order-free sums) a row depends on its token
        alone, so a memo returns the same bits. On the embedded model at batch 1 the five calls were
        ~1 ms of a ~45 ms DSpark step (timed per function over held-out prompts). Other numerics
        compute every call, as do the static rounds (`markov`, traced: no host reads there)."""
        if (ops.get_numerics() != "exact" or ops.get_backend() != "torch" or prev_ids.dim() != 1
                or not prev_ids.numel()):
            return self.markov(prev_ids)[0]
        W, memo = self.m.W, self._bias_rows
        key = (W[self.last + ".markov_head.embed.weight"], W[self.last + ".markov_head.head.weight"])
        if self._bias_key is None or any(a is not b for a, b in zip(key, self._bias_key)):
            memo.clear()  # weights replaced (a reload, training): the rows are another model's
            self._bias_key = key
        ids = prev_ids.tolist()
        got = {t: memo[t] for t in set(ids) if t in memo}
        miss = sorted(set(ids) - got.keys())
        if miss:
            rows = self.markov(torch.tensor(miss, dtype=torch.long, device=prev_ids.device))[0]
            got.update((t, row.clone()) for t, row in zip(miss, rows))  # own storage: evictable one by one
        for t in ids:  # most recent last
            memo[t] = got[t]
            memo.move_to_end(t)
        cap = max(1, self.BIAS_MEMO_BYTES // (got[ids[0]].numel() * 4))
        while len(memo) > cap:
            memo.popitem(last=False)
        return torch.stack([got[t] for t in ids])

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
        ids = torch.empty(R, B + 1, dtype=torch.long, device=anchors.device)
        ids[:, 0] = anchors
        logits = out.base_logits.clone()
        embeds = []
        for i in range(B):
            bias, e = self.markov(ids[:, i])
            logits[:, i] += bias
            embeds.append(e)
            ids[:, i + 1] = logits[:, i].argmax(-1)
        return ids, logits, self.confidence(out.hidden, torch.stack(embeds, 1))
