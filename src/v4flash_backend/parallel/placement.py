"""`python -m v4flash_backend placement`: bytes per rank and collectives per step of the parallel
layout, computed from a config alone (no tensor is allocated).

- `tensor_specs(cfg)`: every tensor of a checkpoint in the official layout (name, shape,
  safetensors dtype), derived from the config (tests check it against the golden checkpoint's
  headers);
- each tensor goes through `parallel.layout.shard_spec` (the rule the loader uses) and the in-memory
  conversion of `weights.convert` (wo_a -> bf16, head / Markov / confidence / ratio-2 compressor ->
  fp32), giving bytes per rank and component;
- `cache_bytes`: the per-slot state of `model_state.ModelState` (replicated on every rank: the
  single KV head is shared by all query heads) for max_num_seqs + 1 slots (the engine's scratch
  slot) of max_model_len positions;
- `collectives_per_forward` / `collectives_per_draft`: what `parallel.comm.DistComm` calls, by group.
  The eager forward's indexer reduces its head sum once per segment (sequence) of a step, so its
  attention-group count grows with the sequences in the step; `static_step` batches them.
"""

from __future__ import annotations

import math
from collections import defaultdict

from v4flash_backend.config import ModelConfig

from .layout import Layout, shard_spec

_ITEM = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "BF16": 2, "F32": 4, "I64": 8}
GIB = 1024 ** 3
COMPONENTS = ("experts", "attention", "engram_rows", "embed_head", "shared_ffn", "other")
PORT_GIB_PER_RANK, PORT_WORLD_ALLREDUCE = 13.9, 43  # the trn2 port's README (PR #71)


def _dense(name: str, out_dim: int, in_dim: int, fp8: bool):
    if not fp8:
        return [(name + ".weight", (out_dim, in_dim), "BF16")]
    return [(name + ".weight", (out_dim, in_dim), "F8_E4M3"),
            (name + ".scale", (math.ceil(out_dim / 32), math.ceil(in_dim / 32)), "F8_E8M0")]


def _expert(name: str, out_dim: int, in_dim: int, cfg: ModelConfig):
    if cfg.expert_dtype == "fp4":  # MXFP4: two e2m1 per byte, one e8m0 scale per 32 along K
        return [(name + ".weight", (out_dim, in_dim // 2), "I8"), (name + ".scale", (out_dim, in_dim // 32), "F8_E8M0")]
    return _dense(name, out_dim, in_dim, cfg.dtype == "fp8")


def tensor_specs(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, safetensors dtype) of every text-model tensor of an official checkpoint."""
    fp8 = cfg.dtype == "fp8"
    D, V, hd, hc = cfg.dim, cfg.vocab_size, cfg.head_dim, cfg.hc_mult
    out = [("embed.weight", (V, D), "BF16"), ("head.weight", (V, D), "BF16"), ("norm.weight", (D,), "BF16")]
    n_mtp = cfg.n_mtp_layers if cfg.dspark_block_size else 0
    blocks = [(f"layers.{i}", i) for i in range(cfg.n_layers)] + [(f"mtp.{k}", cfg.n_layers + k) for k in range(n_mtp)]
    for p, i in blocks:
        a = p + ".attn"
        out += [(a + ".attn_sink", (cfg.n_heads,), "F32"), (a + ".kv_norm.weight", (hd,), "BF16"),
                (a + ".q_norm.weight", (cfg.q_lora_rank,), "BF16")]
        out += _dense(a + ".wkv", hd, D, fp8) + _dense(a + ".wq_a", cfg.q_lora_rank, D, fp8)
        out += _dense(a + ".wq_b", cfg.n_heads * hd, cfg.q_lora_rank, fp8)
        out += _dense(a + ".wo_a", cfg.o_groups * cfg.o_lora_rank, cfg.n_heads * hd // cfg.o_groups, fp8)
        out += _dense(a + ".wo_b", D, cfg.o_groups * cfg.o_lora_rank, fp8)
        if i < cfg.n_layers and i in cfg.kv_source_layers:
            c = a + ".compressor"
            out += [(c + ".norm.weight", (hd,), "BF16"), (c + ".wkv.weight", (hd, D), "BF16")]
            if cfg.compress_ratios[i] > 1:
                out.append((c + ".wgate.weight", (hd, D), "BF16"))
        if i < cfg.n_layers and i in cfg.index_source_layers:
            x = a + ".indexer"
            out += _dense(x + ".wq_b", cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank, fp8)
            out.append((x + ".weights_proj.weight", (cfg.index_n_heads, D), "BF16"))
            if i in cfg.kv_source_layers:
                out += [(x + ".wk.weight", (cfg.index_head_dim, hd), "BF16"),
                        (x + ".k_norm.weight", (cfg.index_head_dim,), "BF16")]
        out += [(p + ".attn_norm.weight", (D,), "BF16"), (p + ".ffn_norm.weight", (D,), "BF16")]
        if i < cfg.n_layers and i in cfg.engram_layer_ids:
            e, rows = p + ".engram", cfg.engram_num_embeddings[cfg.engram_layer_ids.index(i)]
            out += [(e + ".embed.weight", (rows, cfg.engram_head_dim), "F8_E4M3"),
                    (e + ".embed.scale", (rows, cfg.engram_head_dim // 32), "F8_E8M0"),
                    (e + ".k_weight", (hc, D), "BF16"), (e + ".q_weight", (hc, D), "BF16")]
            out += _dense(e + ".wkv", (hc + 1) * D, cfg.n_hash_cols * cfg.engram_head_dim, fp8)
        E = cfg.moe_shape(i)[0]
        f, inter = p + ".ffn", cfg.moe_inter_dim
        for j in range(E):
            x = f"{f}.experts.{j}"
            out += _expert(x + ".w1", inter, D, cfg) + _expert(x + ".w2", D, inter, cfg)
            out += _expert(x + ".w3", inter, D, cfg)
        out += [(f + ".gate.bias", (E,), "F32"), (f + ".gate.bias_vl", (E,), "F32"),
                (f + ".gate.weight", (E, D), "BF16")]
        si = cfg.n_shared_experts * inter
        s = f + ".shared_experts"
        out += _dense(s + ".w1", si, D, fp8) + _dense(s + ".w2", D, si, fp8) + _dense(s + ".w3", si, D, fp8)
        for sub in ("attn", "ffn"):
            out += [(f"{p}.hc_{sub}_base", ((2 + hc) * hc,), "F32"),
                    (f"{p}.hc_{sub}_fn", ((2 + hc) * hc, hc * D), "F32"), (f"{p}.hc_{sub}_scale", (3,), "F32")]
    if n_mtp:
        out += [("mtp.0.main_norm.weight", (D,), "BF16")]
        out += _dense("mtp.0.main_proj", D, len(cfg.dspark_target_layer_ids) * D, fp8)
        last, R = f"mtp.{n_mtp - 1}", cfg.dspark_markov_rank
        out += [(last + ".confidence_head.proj.weight", (1, D + R), "BF16"),
                (last + ".markov_head.embed.weight", (V, R), "BF16"),
                (last + ".markov_head.head.weight", (V, R), "BF16"), (last + ".norm.weight", (D,), "BF16")]
    return sorted(out)


def check_shapes(reader, cfg: ModelConfig) -> None:
    """Refuse a checkpoint whose tensors do not have the shapes `cfg` implies: every tensor of the
    reader that `tensor_specs` names must have that shape (CheckpointError naming the first few).
    Dtypes are not checked (a checkpoint may hold `wo_a` dequantized to bf16, which the loader
    accepts), nor tensors the specs do not name (vision, ...); a missing tensor fails where it is used.
    The sharded loader slices by the config's head / expert / vocab counts, so a tensor of another
    shape would otherwise load as a silently wrong shard."""
    from v4flash_backend.formats.checkpoint import CheckpointError

    bad = [f"{name}: checkpoint {list(reader.shape(name))}, config {list(shape)}"
           for name, shape, _ in tensor_specs(cfg) if name in reader and tuple(reader.shape(name)) != tuple(shape)]
    if bad:
        raise CheckpointError(f"{len(bad)} tensor(s) do not match the config's shapes, e.g. " + "; ".join(bad[:3]))


def _memory_dtype(name: str, st_dtype: str, cfg: ModelConfig) -> str | None:
    """The dtype `weights.convert` keeps in memory (None: consumed at load, not kept)."""
    if name.endswith("attn.wo_a.scale"):
        return None
    if name.endswith("attn.wo_a.weight") and st_dtype == "F8_E4M3":
        return "BF16"
    if name == "head.weight" or name.endswith(("markov_head.head.weight", "confidence_head.proj.weight")):
        return "F32"
    if ".attn.compressor.w" in name:
        layer = int(name.split(".")[1])
        if cfg.compress_ratios[layer] > 1:
            return "F32"
    return st_dtype


def component(name: str) -> str:
    if ".ffn.experts." in name:
        return "experts"
    if ".attn." in name:
        return "attention"
    if ".engram.embed." in name:
        return "engram_rows"
    if name in ("embed.weight", "head.weight"):
        return "embed_head"
    if ".shared_experts." in name or ".ffn.gate." in name:
        return "shared_ffn"
    return "other"


def rank_bytes(cfg: ModelConfig, lay: Layout, specs=None) -> dict[str, int]:
    """Bytes of weights rank `lay.rank` keeps, by component."""
    out = dict.fromkeys(COMPONENTS, 0)
    for name, shape, st in specs or tensor_specs(cfg):
        rule = shard_spec(name, shape, cfg, lay)
        dt = _memory_dtype(name, st, cfg)
        if rule is None or dt is None:
            continue
        if rule[0] == "slice":
            shape = tuple(rule[4] if d == rule[1] else s for d, s in enumerate(shape))
        out[component(name)] += math.prod(shape) * _ITEM[dt]
    return out


def _expert_id(name: str) -> tuple[str, int] | None:
    i = name.find(".ffn.experts.")
    if i < 0:
        return None
    j = i + len(".ffn.experts.")
    return name[: i + 4], int(name[j: name.index(".", j)])


def all_rank_bytes(cfg: ModelConfig, world: int, specs=None, pipeline: int = 1) -> list[dict[str, int]]:
    """`rank_bytes` of every rank. Routed experts (most of the ~10^5 tensors of the release) are
    whole on one rank and partitioned by `Layout.expert_range` (the rule `shard_spec` applies), so
    they are summed per expert once; everything else goes through `rank_bytes`."""
    specs = specs or tensor_specs(cfg)
    per_expert: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))  # ffn prefix -> id -> bytes
    rest = []
    for name, shape, st in specs:
        key = _expert_id(name)
        if key is None:
            rest.append((name, shape, st))
            continue
        per_expert[key[0]][key[1]] += math.prod(shape) * _ITEM[st]
    # the rule of a tensor depends on the rank only through its stage and attention-group rank,
    # except the vocab-parallel and Engram-row tensors: sum the rest once per (stage, group rank)
    per_rank = [t for t in rest if t[0] in ("embed.weight", "head.weight") or ".engram.embed." in t[0]]
    per_group = [t for t in rest if not (t[0] in ("embed.weight", "head.weight") or ".engram.embed." in t[0])]
    groups: dict = {}
    out = []
    for r in range(world):
        lay = Layout(r, world, pipeline=pipeline)
        key = (lay.stage, lay.group_rank)
        if key not in groups:
            groups[key] = rank_bytes(cfg, lay, per_group)
        b = {c: groups[key][c] + v for c, v in rank_bytes(cfg, lay, per_rank).items()}
        for prefix, sizes in per_expert.items():
            top, idx = prefix.split(".")[:2]
            if lay.holds_layer(cfg, top, int(idx)):
                b["experts"] += sum(sizes[j] for j in range(*lay.expert_range(len(sizes))))
        out.append(b)
    return out


def cache_bytes(cfg: ModelConfig, num_slots: int, max_len: int, margin: int = 8, layers=None,
                dspark: bool = True) -> int:
    """Bytes of `ModelState(cfg, num_slots, max_len, margin)` (every rank holds all of it), or of
    the part a pipeline stage keeps (`pipeline.trim_state`): backbone `layers` [lo, hi), the
    DSpark rings if `dspark`."""
    lo, hi = layers or (0, cfg.n_layers)
    hd, per_slot = cfg.head_dim, 0
    per_slot += (hi - lo) * (cfg.window_size + margin) * hd * 2
    for src in [s for s in cfg.kv_source_layers if lo <= s < hi]:
        r = cfg.compress_ratios[src]
        rows = (max_len + margin) // r + 1
        per_slot += rows * hd * 2
        if src in cfg.index_source_layers:
            per_slot += rows * cfg.index_head_dim * 2
        if r > 1:
            per_slot += 2 * (r + margin) * hd * 4
    per_slot += (max(cfg.engram_max_ngram_size, 1) + margin) * 8 + 8  # Engram history + ik_last
    per_slot += (cfg.n_mtp_layers if cfg.dspark_block_size and dspark else 0) * cfg.window_size * hd * 2
    return num_slots * per_slot


# HBM of one LNC=2 rank on trn2: a chip's 96 GiB over its 4 logical cores (each a pair of physical
# cores sharing a 24 GB bank: shared/notes/nki.md, LNC topology)
RANK_HBM_GIB = 24.0


def prefix_cache_bytes(cfg: ModelConfig, tokens: int, entries: int) -> int:
    """Bytes a rank's prefix cache holds for `tokens` prefix tokens cached in `entries` entries
    (model.snapshot, every rank holds its whole state): each compressed group once (KV and index
    keys, bf16), plus per entry the rings a continuation reads: `window` rows of every layer's
    window KV and of every DSpark ring (bf16), the compressor's unfinished group (fp32 kv + score, at
    most r rows) and the last Engram n-gram's ids."""
    hd, per_token = cfg.head_dim, 0.0
    per_entry = cfg.n_layers * cfg.window_size * hd * 2
    per_entry += (cfg.n_mtp_layers if cfg.dspark_block_size else 0) * cfg.window_size * hd * 2
    per_entry += max(cfg.engram_max_ngram_size, 1) * 8
    for src in cfg.kv_source_layers:
        r = cfg.compress_ratios[src]
        per_token += hd * 2 / r + (cfg.index_head_dim * 2 / r if src in cfg.index_source_layers else 0)
        if r > 1:
            per_entry += 2 * r * hd * 4
    return int(tokens * per_token) + entries * per_entry


def prefix_cache_lines(cfg: ModelConfig, world: int, used_gib: float, prefill_chunk: int,
                       budget_bytes: int = 512 << 20) -> list[str]:
    """What a rank's leftover HBM holds of cached prefixes (an entry every prefill_chunk tokens, as
    the engine keeps them); the leftover is an upper bound: activations, graph scratch and the
    runtime's own buffers are not in the placement total."""
    marginal = prefix_cache_bytes(cfg, 1 << 20, 0) / (1 << 20)
    entry = prefix_cache_bytes(cfg, 0, 1)
    per_token = prefix_cache_bytes(cfg, prefill_chunk, 1) / prefill_chunk
    left = max(0.0, RANK_HBM_GIB - used_gib) * GIB
    return [f"prefix cache per rank (world={world}): {marginal:.0f} B per cached token (compressed KV + index "
            f"keys) + {entry / 2**20:.2f} MiB per entry (rings); an entry every prefill_chunk={prefill_chunk} "
            f"tokens: {per_token:.0f} B per token",
            f"prefix-cache-trn2: world={world} bytes_per_token={per_token:.0f} leftover_gib="
            f"{left / GIB:.2f} (of {RANK_HBM_GIB:g}) tokens_in_leftover={int(left // per_token)} "
            f"tokens_in_default_budget={int(budget_bytes // per_token)}"]


def collectives_per_forward(cfg: ModelConfig, world: int, segments, logits: bool = True,
                            pipeline: int = 1, stage: int = 0) -> dict:
    """{(group, op): calls} of one `V41Model.forward` over `segments` [(start, n)] at world size
    `world`: the row lookups by token id (embedding and the stage's Engram layers: one collective,
    `DistComm.lookups`) + one MoE per layer on the world; wo_b per layer plus the
    indexer once per segment that reaches a compressed group, on the attention group. With
    `pipeline` stages: stage `stage`'s layers, its in-stage collectives on group 'stage', and the
    boundary messages on 'pp' (a receive unless first, a send unless last)."""
    from .layout import stage_cuts

    cuts = stage_cuts(cfg, pipeline)
    lo, hi = cuts[stage], cuts[stage + 1]
    first, last = stage == 0, stage == pipeline - 1
    out = {}
    if pipeline > 1:
        if not first:
            out[("pp", "boundary_recv")] = 1
        if not last:
            out[("pp", "boundary_send")] = 1
    if world // pipeline == 1:
        return out
    wg = "stage" if pipeline > 1 else "world"
    index_calls = sum(1 for i in cfg.index_source_layers if lo <= i < hi for start, n in segments
                      if (start + n) // cfg.compress_ratios[i] > 0)
    lookups = first or any(lo <= i < hi for i in cfg.engram_layer_ids)
    out[(wg, "all_reduce")] = int(lookups) + (hi - lo)
    out[("attn", "all_reduce")] = (hi - lo) + index_calls
    if logits and last:
        out[(wg, "all_gather")] = 1
    return out


def collectives_per_draft(cfg: ModelConfig, world: int, pipeline: int = 1) -> dict:
    """One `DSparkDrafter.draft` (on the last stage): embed, one MoE per stage, the head; wo_b per stage."""
    if world // pipeline == 1 or not cfg.dspark_block_size:
        return {}
    wg = "stage" if pipeline > 1 else "world"
    return {(wg, "all_reduce"): 1 + cfg.n_mtp_layers, ("attn", "all_reduce"): cfg.n_mtp_layers,
            (wg, "all_gather"): 1}


def _add(a: dict, b: dict) -> dict:
    out = defaultdict(int, a)
    for k, v in b.items():
        out[k] += v
    return dict(out)


def sp_lines(cfg: ModelConfig, world: int, pipeline: int, sequence_parallel: bool, prefill_chunk: int) -> list[str]:
    """Per layer, whether sequence parallelism is active for a prefill chunk of `prefill_chunk`
    rows (`parallel.comm.DistComm.sp_begin`: on when set, the attention group has G > 1 ranks and
    the chunk at least SP_MIN_ROWS_PER_RANK * G rows; decode steps have fewer and stay off)."""
    from .layout import SP_MIN_ROWS_PER_RANK, stage_cuts

    cuts = stage_cuts(cfg, pipeline)
    G = Layout(0, world, pipeline=pipeline).group_size
    m = SP_MIN_ROWS_PER_RANK * G
    on = sequence_parallel and G > 1 and prefill_chunk >= m
    parts = [f"layers {cuts[s]}..{cuts[s + 1] - 1} {'on' if on else 'off'} (stage {s})" for s in range(pipeline)]
    why = "" if on else (" (not set)" if not sequence_parallel else f" (attention group of {G})" if G == 1
                         else f" (chunk < {m} rows)")
    return [f"sequence parallel for prefill chunks of {prefill_chunk} rows over the attention group of {G}: "
            + "; ".join(parts) + f"{why}; steps of fewer than {m} rows (decode) off; "
            f"sp_layers={cfg.n_layers if on else 0}/{cfg.n_layers}"]


def report(cfg: ModelConfig, world: int, max_model_len: int, max_num_seqs: int, label: str = "",
           pipeline: int = 1, sequence_parallel: bool = False, prefill_chunk: int = 256) -> list[str]:
    if pipeline > 1:
        return _pipeline_report(cfg, world, max_model_len, max_num_seqs, label, pipeline, sequence_parallel,
                                prefill_chunk)
    specs = tensor_specs(cfg)
    caches = cache_bytes(cfg, max_num_seqs + 1, max_model_len)
    per_rank = all_rank_bytes(cfg, world, specs)
    for b in per_rank:
        b["caches"] = caches
    lay0 = Layout(0, world)
    cols = list(COMPONENTS) + ["caches"]
    lines = [f"placement of {label or 'config'}: world={world} attn_group={lay0.group_size} "
             f"vocab_rows/rank={lay0.vocab_chunk(cfg.vocab_size)} experts/rank={cfg.n_routed_experts / world:g} "
             f"(DSpark {cfg.moe_shape(cfg.n_layers)[0] / world:g}) caches for max_model_len={max_model_len} "
             f"max_num_seqs={max_num_seqs} (+1 scratch slot)",
             "GiB per rank   " + " ".join(f"{c:>11}" for c in cols) + f" {'total':>8}"]
    lines += _rank_rows(per_rank, cols)
    max_gib = max(sum(b.values()) for b in per_rank) / GIB
    R = max_num_seqs
    long_ctx = [(max_model_len - 1, 1)] * R  # decode rows of R sequences with compressed context
    fwd = collectives_per_forward(cfg, world, long_ctx)
    drf = collectives_per_draft(cfg, world)
    step = _add(fwd, drf)
    w_ar, g_ar = step.get(("world", "all_reduce"), 0), step.get(("attn", "all_reduce"), 0)
    n_idx = len(cfg.index_source_layers)
    lines += [
        f"collectives per decode step ({R} sequences, forward + DSpark draft): "
        f"world all_reduce {w_ar} (lookups 1: embed + {len(cfg.engram_layer_ids)} Engram layers; MoE {cfg.n_layers}; "
        f"draft {drf.get(('world', 'all_reduce'), 0)}); attention-group all_reduce {g_ar} (wo_b {cfg.n_layers}, "
        f"indexer {n_idx}x{R}, draft {drf.get(('attn', 'all_reduce'), 0)}); world all_gather "
        f"{step.get(('world', 'all_gather'), 0)} (logits) ; plus one step-plan broadcast per runner call",
        f"with the static decode step (`static_step`: the indexer reduces all sequences at once) the "
        f"attention-group count is {cfg.n_layers + n_idx + drf.get(('attn', 'all_reduce'), 0)}",
        f"compare: the port's README: {PORT_GIB_PER_RANK} GiB/rank, ~{PORT_WORLD_ALLREDUCE} world all-reduces "
        f"per step; here {max_gib:.2f} GiB/rank max, {fwd.get(('world', 'all_reduce'), 0)} world all-reduces per "
        f"target forward ({w_ar} with the draft)",
        f"placement: world={world} max_gib_per_rank={max_gib:.2f} world_allreduce_per_step={w_ar} "
        f"group_allreduce_per_step={g_ar}",
    ]
    if sequence_parallel:
        lines[-1:-1] = sp_lines(cfg, world, 1, True, prefill_chunk)
    lines[-1:-1] = prefix_cache_lines(cfg, world, max_gib, prefill_chunk)
    return lines


def _rank_rows(per_rank: list[dict], cols) -> list[str]:
    seen, out = {}, []
    for r, b in enumerate(per_rank):  # ranks with identical shards print once
        seen.setdefault(tuple(b[c] for c in cols), []).append(r)
    for key, ranks in seen.items():
        name = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}..{ranks[-1]}" \
            if ranks == list(range(ranks[0], ranks[-1] + 1)) else f"{len(ranks)} ranks"
        out.append(f"{name:<14} " + " ".join(f"{v / GIB:>11.4f}" for v in key) + f" {sum(key) / GIB:>8.4f}")
    return out


def _pipeline_report(cfg, world, max_model_len, max_num_seqs, label, P, sequence_parallel, prefill_chunk):
    """The report of `pipeline` P > 1 stages: each rank's weights and caches of its stage alone, the
    in-stage collectives of each stage, and the point-to-point bytes of the boundaries."""
    from .layout import stage_cuts
    from .pipeline import HEADER, boundary_bytes, payload_bytes, taps_before

    specs = tensor_specs(cfg)
    cuts = stage_cuts(cfg, P)
    per_rank = all_rank_bytes(cfg, world, specs, pipeline=P)
    S = world // P
    for r, b in enumerate(per_rank):
        s = r // S
        b["caches"] = cache_bytes(cfg, max_num_seqs + 1, max_model_len, layers=(cuts[s], cuts[s + 1]),
                                  dspark=s == P - 1)
    lay0 = Layout(0, world, pipeline=P)
    cols = list(COMPONENTS) + ["caches"]
    lines = [f"placement of {label or 'config'}: world={world} pipeline_parallel={P} stage_world={S} "
             f"attn_group={lay0.group_size} vocab_rows/rank={lay0.vocab_chunk(cfg.vocab_size)} "
             f"experts/rank={cfg.n_routed_experts / S:g} (DSpark {cfg.moe_shape(cfg.n_layers)[0] / S:g}, last stage) "
             f"caches for max_model_len={max_model_len} max_num_seqs={max_num_seqs} (+1 scratch slot)",
             "stages: " + "; ".join(f"{s}: layers {cuts[s]}..{cuts[s + 1] - 1} (ranks {s * S}..{(s + 1) * S - 1}"
                                    + (", embedding" if s == 0 else "")
                                    + (", head + DSpark + sampling, driver" if s == P - 1 else "") + ")"
                                    for s in range(P))
             + " (balanced by layer count at cuts no KV source / indexer dependency crosses)",
             "GiB per rank   " + " ".join(f"{c:>11}" for c in cols) + f" {'total':>8}"]
    lines += _rank_rows(per_rank, cols)
    max_gib = max(sum(b.values()) for b in per_rank) / GIB
    R = max_num_seqs
    long_ctx = [(max_model_len - 1, 1)] * R
    w_ar = g_ar = 0
    for s in range(P):
        step = collectives_per_forward(cfg, world, long_ctx, pipeline=P, stage=s)
        if s == P - 1:
            step = _add(step, collectives_per_draft(cfg, world, P))
        sa, ga = step.get(("stage", "all_reduce"), 0), step.get(("attn", "all_reduce"), 0)
        w_ar, g_ar = max(w_ar, sa), max(g_ar, ga)
        lines.append(f"stage {s} collectives per decode step "
                     f"({R} sequences{', + DSpark draft' if s == P - 1 else ''}): "
                     f"stage all_reduce {sa}, attention-group all_reduce {ga}, stage all_gather "
                     f"{step.get(('stage', 'all_gather'), 0)}, boundary recv {step.get(('pp', 'boundary_recv'), 0)} "
                     f"send {step.get(('pp', 'boundary_send'), 0)}")
    dec = boundary_bytes(cfg, world, P, R)
    pre = boundary_bytes(cfg, world, P, prefill_chunk)
    one = payload_bytes(cfg, 1, taps_before(cfg, cuts[1])) - HEADER
    lines += [
        f"point-to-point per boundary message: full mHC streams {cfg.hc_mult}x{cfg.dim} bf16 + pre-mix "
        f"{cfg.hc_mult} f32 + DSpark taps so far ({', '.join(str(taps_before(cfg, c)) for c in cuts[1:-1])} at the "
        f"boundaries) = {one} bytes per row plus a {HEADER}-byte header per message, from each of the {S} ranks "
        f"of a stage to its peer",
        f"pipeline: stages={P} p2p_bytes_per_step={sum(dec)} (decode, {R} rows: "
        f"{' + '.join(str(b) for b in dec)} over {P - 1} boundar{'y' if P == 2 else 'ies'}) "
        f"p2p_bytes_per_prefill_chunk={sum(pre)} ({prefill_chunk} rows)",
    ]
    lines += sp_lines(cfg, world, P, sequence_parallel, prefill_chunk)
    lines.append(f"placement: world={world} max_gib_per_rank={max_gib:.2f} world_allreduce_per_step={w_ar} "
                 f"group_allreduce_per_step={g_ar}")
    return lines


def add_arguments(parser) -> None:
    parser.add_argument("--config", default="release",
                        help="config.json (or a checkpoint directory), or 'release' for the V4.1-Flash values")
    parser.add_argument("--world-size", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=65536)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--pipeline-parallel", type=int, default=1,
                        help="pipeline stages (world-size / P ranks each); with P > 1 the two per-step "
                             "all-reduce counts of the last line are those of the busiest stage")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="report sequence-parallel prefill per layer")
    parser.add_argument("--prefill-chunk", type=int, default=256, help="rows of a prefill chunk")


def main(args) -> int:
    cfg = ModelConfig.release() if args.config == "release" else ModelConfig.from_json(args.config)
    Layout(0, args.world_size, pipeline=args.pipeline_parallel)  # validates the world size
    for line in report(cfg, args.world_size, args.max_model_len, args.max_num_seqs, str(args.config),
                       args.pipeline_parallel, args.sequence_parallel, args.prefill_chunk):
        print(line)
    return 0


if __name__ == "__main__":
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m v4flash_backend placement")
    add_arguments(ap)
    sys.exit(main(ap.parse_args()))
