"""What the trn2 projection measures on the CPU: per static decode step, the graph entries, host
syncs and collectives (hook, group, calls, payload bytes) of the release *structure*.

The model has the release's layer structure (40 layers with its window / compressed / indexer /
candidate / Engram layers, 3 DSpark stages, release head_dim, index_head_dim, window, index top-k and
Engram table widths) with the hidden size, vocabulary and expert count shrunk so one step runs on a
CPU with random weights (`structure_config`); `measure_step` runs one static step (`static_step`:
the verify graph, and the DSpark draft graph) with counters: graph entries, host syncs
(`HostSyncCounter`), and every collective a sharded run would issue (`CountingComm`). The counts do
not depend on the widths. `layout_counts` derives the same collectives from the layout alone and
`served_counts` measures them on a served rank group (W = 2, 4), so the three can be compared.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from v4flash_backend.config import ModelConfig  # noqa: E402
from v4flash_backend.model.state import ModelState  # noqa: E402
from v4flash_backend.model.transformer import LocalComm, V41Model  # noqa: E402
from v4flash_backend.trn2.static_step import HostSyncCounter, StaticDecoder  # noqa: E402

SHARED = ROOT.parent / "shared"
RELEASE_JSON = SHARED / "configs" / "deepseek-v4.1-flash.json"
TOKENIZER = SHARED / "golden" / "v41-tiny" / "tokenizer.json"

# Which group each collective hook of the forward reduces over (parallel/layout.py's placement).
HOOK_GROUP = {"embed": "world", "engram_rows": "world", "lookups": "world", "moe_out": "world", "head": "world",
              "attn_out": "attn", "index_scores": "attn"}
HOOK_OP = {"head": "all_gather"}  # the rest are all-reduces


# ---- the model ------------------------------------------------------------------------------------
def release_config() -> ModelConfig:
    return ModelConfig.from_json(RELEASE_JSON) if RELEASE_JSON.exists() else ModelConfig.release()


def structure_config(release: ModelConfig, tokenizer) -> ModelConfig:
    """The release's layer structure and KV geometry with CPU-sized widths (see module docstring)."""
    from v4flash_backend.model.engram_hash import (
        bucket_primes,
        build_compressed_token_map,
        table_rows,
    )

    _, cvocab = build_compressed_token_map(tokenizer)
    d = release.to_dict()
    n_eng = len(release.engram_layer_ids)
    d.update(dim=64, moe_inter_dim=32, q_lora_rank=32, n_heads=8, o_lora_rank=16, index_n_heads=8,
             vocab_size=tokenizer.get_vocab_size(), n_routed_experts=8, dspark_n_routed_experts=4,
             dspark_markov_rank=16, dspark_noise_token_id=tokenizer.get_vocab_size() - 1,
             image_token_id=tokenizer.get_vocab_size() - 2, engram_vocab_size=500,
             engram_compressed_vocab_size=cvocab,
             engram_num_embeddings=table_rows(bucket_primes(n_eng, release.engram_max_ngram_size,
                                                            release.engram_n_heads, 500)))
    return ModelConfig.from_dict(d)


def build_random_model(cfg: ModelConfig, tokenizer_path: Path = TOKENIZER, seed: int = 0, comm=None) -> V41Model:
    """A V41Model with random weights in the checkpoint's storage formats (training.params' init and
    export, then the loader's conversions) and the Engram hasher of `tokenizer_path`."""
    from tokenizers import Tokenizer

    from v4flash_backend.model.engram_hash import EngramHasher
    from v4flash_backend.training.params import (
        export_tensors,
        inference_weights,
        init_masters,
    )

    with torch.no_grad():
        W = inference_weights(cfg, export_tensors(cfg, init_masters(cfg, seed)))
    hasher = EngramHasher.from_config(cfg, Tokenizer.from_file(str(tokenizer_path))) if cfg.engram_layer_ids else None
    return V41Model(cfg, W, hasher, comm)


# ---- counters -------------------------------------------------------------------------------------
class CountingComm(LocalComm):
    """LocalComm (W = 1 values) that records every collective a sharded run would issue: hook,
    group, calls and payload bytes (the size of the reduced / gathered tensor)."""

    def __init__(self):
        self.calls: dict[str, list[int]] = {}

    def _rec(self, hook: str, nbytes: int) -> None:
        c = self.calls.setdefault(hook, [0, 0])
        c[0] += 1
        c[1] += int(nbytes)

    def embed(self, y):
        self._rec("embed", y.numel() * y.element_size())
        return super().embed(y)

    def attn_out(self, W, prefix, x):
        y = super().attn_out(W, prefix, x)
        self._rec("attn_out", y.numel() * 4)  # fp32 partial sums are reduced, then rounded once
        return y

    def index_scores(self, q, k, w):
        s = super().index_scores(q, k, w)
        self._rec("index_scores", s.numel() * 4)
        return s

    def moe_out(self, y):
        self._rec("moe_out", y.numel() * y.element_size())
        return super().moe_out(y)

    def engram_rows(self, v):
        self._rec("engram_rows", v.numel() * v.element_size())
        return super().engram_rows(v)

    def lookups(self, parts):  # one collective for all of them, whatever their number (none for none)
        if parts:
            self._rec("lookups", sum(p.numel() * p.element_size() for p in parts))
        return super().lookups(parts)

    def head(self, logits):
        self._rec("head", logits.numel() * logits.element_size())
        return super().head(logits)

    def reset(self) -> None:
        self.calls = {}


# ---- one measured step --------------------------------------------------------------------------------
def measure_step(model: V41Model, seqs: int, ctx: int, dspark: bool) -> dict:
    """One static decode step of `seqs` sequences at positions just below `ctx`: graph entries, host
    syncs (by op) and collectives (hook -> [calls, payload bytes])."""
    cfg, comm = model.cfg, model.comm
    B = cfg.dspark_block_size if dspark else 0
    Q = 1 + B
    st = ModelState(cfg, seqs + 1, ctx, margin=max(8, Q))
    dec = StaticDecoder(model, st, max_rows=Q)
    start = torch.full((seqs,), ctx - Q, dtype=torch.long)
    slot = torch.arange(seqs)
    tokens = torch.randint(3, cfg.vocab_size - 3, (seqs, Q), generator=torch.Generator().manual_seed(1))
    n = torch.full((seqs,), Q, dtype=torch.long)
    _, taps0 = dec.verify(tokens, slot, start, n, ctx)  # warm the caches (rope tables, dequantized weights)
    if dspark:
        dec.draft(taps0, n, slot, start, tokens[:, 0])
    comm.reset()
    graphs = 0
    with HostSyncCounter() as syncs:
        _, taps = dec.verify(tokens, slot, start, n, ctx)
        graphs += 1
        if dspark:
            dec.draft(taps, n, slot, start, tokens[:, 0])
            graphs += 1
    return {"graphs": graphs, "host_syncs": syncs.total, "host_sync_ops": dict(syncs.calls),
            "collectives": {k: list(v) for k, v in comm.calls.items()}, "rows": seqs * Q}


# ---- counts of a served run (the rank group on the static path) ------------------------------------
def layout_counts(cfg: ModelConfig, world: int, attn_group: int) -> dict:
    """Collectives of one static decode round (verify graph + DSpark draft graph + the step plan),
    derived from the layout (parallel/layout.py's placement) and the config alone -- not from a run:
    world all-reduces: the vocab-parallel embedding (verify and draft; the verify's carries the
    Engram layers' row lookups too: rows partitioned by rank, one collective for all), one per MoE
    layer and per DSpark stage (experts partitioned, tokens replicated); world all-gathers: the
    vocab-parallel head (verify and draft); attention-group all-reduces (heads split, only when the
    group has > 1 rank): one o-projection per layer and per stage, one indexer score per
    index-source layer; one broadcast of the plan over the control plane (gloo:
    parallel.collectives.make_groups)."""
    if world == 1:
        return {}
    st = cfg.n_mtp_layers if cfg.dspark_block_size else 0
    out = {"world.all_reduce": 1 + cfg.n_layers + (1 + st if st else 0),
           "world.all_gather": 1 + (1 if st else 0), "control.broadcast": 1}
    if attn_group > 1:
        out["attn.all_reduce"] = cfg.n_layers + len(cfg.index_source_layers) + st
    return out


def served_counts(world: int, checkpoint: Path, max_tokens: int = 6) -> dict:
    """Launch the rank group (torchrun, gloo) at `world` ranks on the static decode path, serve one
    greedy request, and return its engine's per-decode-step figures and the collectives of its last
    decode round (calls per group.op)."""
    from v4flash_backend.group.rank_group import RankGroup
    from v4flash_backend.settings import Settings

    settings = Settings(checkpoint_dir=str(checkpoint), world_size=world, max_num_seqs=1, max_model_len=64,
                        decode_graph="static", spec_mode="fixed", startup_timeout_s=600.0)
    # the boundary spy on every rank's rounds: a round that moves a weight or cache shows up in the stats
    g = RankGroup.launch(settings, env={"V4FLASH_BOUNDARY_SPY": "1"})
    try:
        for _ in g.submit([0, 17, 250, 33, 901, 12], {"max_tokens": max_tokens, "ignore_eos": True}):
            pass
        st = g.stats()
    finally:
        g.shutdown(timeout=60)
    e = st["engine"]
    return {"world": world, "attn_group": st.get("attn_group_size") or g.info.get("attn_group_size"),
            "decode_steps": e["decode_steps"], "graphs_per_step": e["graphs_per_step"],
            "host_syncs_per_step": e["host_syncs_per_step"],
            "host_to_device_bytes_per_step": e["host_to_device_bytes_per_step"],
            "collectives": {k: v["calls"] for k, v in st["collectives_last_step"].items()},
            "boundary_resident_moves": e.get("boundary_resident_moves"), "boundary_reads": e.get("boundary_reads")}
