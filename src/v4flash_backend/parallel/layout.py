"""Process groups, the weight placement of a W-rank group, and the collectives of the forward.

Layout (the same code at W = 1, 2, 4 with gloo on CPU and W = 64 on trn2.48xlarge):
- attention is tensor-parallel over groups of G = min(8, W) consecutive ranks (replicated W/G
  times): query heads, o-groups and indexer heads are split G ways (`wq_b` and indexer `wq_b` /
  `weights_proj` by output rows, `wo_a` by o-group, `wo_b` by input columns, `attn_sink` by head);
  `wq_a`, `wkv`, the compressor, indexer `wk` and the norms are replicated. One all-reduce over
  the group per attention sublayer (wo_b) and one per indexer call (its head sum);
- routed experts are partitioned by id (contiguous, E/W per rank); tokens and router are
  replicated, every rank runs only its experts into an fp32 carry, then one world all-reduce per
  MoE layer (no dispatch collective);
- embedding and LM head are vocab-parallel: rank r holds rows [r*C, (r+1)*C) with C = V/W
  rounded up to a multiple of 128 (zero rows pad the last shard); masked embedding + world
  all-reduce, logits all-gather;
- Engram tables are row-partitioned (ceil split, as the reference; the last shard padded with zero
  rows to the common size, as the vocabulary's); masked lookup + all-reduce;
- shared expert, router, mHC, norms, DSpark main_proj, Markov and confidence heads replicated.

Numerics are W-invariant: row-parallel partial products (wo_b, the indexer's head sum) are
reduced before the one rounding W = 1 does -- in fp64 under 'exact' numerics, where fp8/bf16
product sums are exact so the result is bit-identical to W = 1, and in fp32 under 'reference'
numerics (README 6.4: "reduce fp32 partials and round once"). The masked embedding / Engram sums
have one non-zero term per element and the logits gather is a concatenation, so those are exact.
The MoE carry is reduced in fp32 as the issue asks; per-token sums of <= 6 bf16 expert outputs
are exact in fp32 except in far-apart magnitudes, which the tests would show as a W = 1 mismatch.

Every collective goes through `Collectives`, which counts calls, bytes and seconds per group and
per step (the forward's formula is `placement.collectives_per_forward`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from v4flash_backend.config import ModelConfig
from v4flash_backend.formats.checkpoint import CheckpointReader, shard_range
from v4flash_backend.model.weights import Weights, convert

ATTN_GROUP_MAX = 8  # ranks per attention group (one trn2 chip pair's worth of heads: 64 heads / 8)
VOCAB_ALIGN = 128  # rows of the embedding / head shard are padded to a multiple of this
FP8_BLOCK = 32  # fp8 weights carry one scale per 32x32 tile: split boundaries must fall on tiles
# sequence parallelism starts at this many rows per rank of the attention group: a decode step's few
# rows are not worth its two extra all-gathers per layer (a choice, see docs/architecture.md's pipeline section)
SP_MIN_ROWS_PER_RANK = 4


@dataclass(frozen=True)
class Layout:
    """Rank `rank` of `world` ranks in `pipeline` stages of world // pipeline consecutive ranks each
    (stage s = ranks [s*S, (s+1)*S)); inside a stage, the in-node layout below (attention groups,
    experts, vocab and Engram rows over the stage's S ranks). pipeline 1: one stage, the world."""

    rank: int
    world: int
    group_max: int = ATTN_GROUP_MAX  # attention group = min(group_max, stage world) consecutive ranks
    pipeline: int = 1

    def __post_init__(self):
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ValueError(f"bad rank {self.rank} for world size {self.world}")
        if self.pipeline < 1 or self.world % self.pipeline:
            raise ValueError(f"world size {self.world} is not a multiple of pipeline_parallel {self.pipeline}")
        S = self.stage_world
        if self.group_max < 1 or (S > self.group_max and S % self.group_max):
            raise ValueError(f"stage world size {S} > {self.group_max} must be a multiple of {self.group_max} "
                             "(the attention group size)")

    # ---- pipeline stages ------------------------------------------------------------------------
    @property
    def stage_world(self) -> int:
        return self.world // self.pipeline

    @property
    def stage(self) -> int:
        return self.rank // self.stage_world

    @property
    def srank(self) -> int:
        """This rank's index inside its stage."""
        return self.rank % self.stage_world

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pipeline - 1

    def stage_ranks(self, s: int) -> list[int]:
        return list(range(s * self.stage_world, (s + 1) * self.stage_world))

    def peer(self, s: int) -> int:
        """The rank of stage `s` with this rank's in-stage index (the point-to-point partner)."""
        return s * self.stage_world + self.srank

    @property
    def driver(self) -> int:
        """The group's driver: the last stage's first rank (engine, sampling, socket server)."""
        return (self.pipeline - 1) * self.stage_world

    def stage_layers(self, cfg: ModelConfig, s: int | None = None) -> tuple[int, int]:
        """[lo, hi) of the backbone layers stage `s` (default: this rank's) runs."""
        cuts = stage_cuts(cfg, self.pipeline)
        s = self.stage if s is None else s
        return cuts[s], cuts[s + 1]

    # ---- the in-stage layout ----------------------------------------------------------------------
    @property
    def group_size(self) -> int:
        return min(self.group_max, self.stage_world)

    @property
    def group_rank(self) -> int:
        return self.srank % self.group_size

    @property
    def n_groups(self) -> int:
        """Attention groups per stage."""
        return self.stage_world // self.group_size

    @property
    def group_index(self) -> int:
        """This rank's attention group among all stages' groups (the order `group_ranks` numbers them)."""
        return self.rank // self.group_size

    def group_ranks(self, g: int) -> list[int]:
        """Global ranks of attention group g (groups numbered across stages: stage s holds groups
        s*n_groups .. (s+1)*n_groups - 1)."""
        return list(range(g * self.group_size, (g + 1) * self.group_size))

    def split(self, n: int, what: str, align: int = 1) -> tuple[int, int]:
        """This rank's part of `n` things split evenly over its attention group."""
        G = self.group_size
        if n % G or (n // G) % align:
            raise ValueError(f"{what}: {n} cannot be split {G} ways in blocks of {align} "
                             f"(attention group of {G} ranks)")
        part = n // G
        return self.group_rank * part, (self.group_rank + 1) * part

    def vocab_chunk(self, vocab: int) -> int:
        return -(-vocab // (VOCAB_ALIGN * self.stage_world)) * VOCAB_ALIGN

    def vocab_range(self, vocab: int) -> tuple[int, int]:
        c = self.vocab_chunk(vocab)
        return min(vocab, self.srank * c), min(vocab, (self.srank + 1) * c)

    def expert_range(self, n_experts: int) -> tuple[int, int]:
        return shard_range(n_experts, self.srank, self.stage_world)

    def holds_layer(self, cfg: ModelConfig, top: str, idx: int) -> bool:
        """Whether this rank's stage holds backbone layer `idx` (top 'layers') or DSpark stage `idx`
        (top 'mtp': the last stage)."""
        if top == "mtp":
            return self.is_last_stage
        lo, hi = self.stage_layers(cfg)
        return lo <= idx < hi


def layer_deps(cfg: ModelConfig, i: int) -> set[int]:
    """Earlier backbone layers whose state layer i reads in the same or a later step: its KV source
    (compressed KV and index keys live in the source's cache), the indexer layer whose top-k it
    reuses, the candidate source whose block mask it applies."""
    deps = set()
    src = cfg.kv_source_of(i)
    if src is not None and src != i:
        deps.add(src)
    if cfg.compress_ratios[i] and i not in cfg.index_source_layers:
        prev = [j for j in cfg.index_source_layers if j < i]
        if prev:
            deps.add(prev[-1])
    if i in cfg.index_source_layers and 0 <= cfg.candidate_source_layer < i:
        deps.add(cfg.candidate_source_layer)
    return deps


def valid_cuts(cfg: ModelConfig) -> list[int]:
    """Layers c (0 < c < n_layers) where a stage may begin: no layer >= c reads the state of a
    layer < c (`layer_deps`), so nothing but the mHC streams and the DSpark taps crosses."""
    L = cfg.n_layers
    return [c for c in range(1, L) if all(d >= c for i in range(c, L) for d in layer_deps(cfg, i))]


def stage_cuts(cfg: ModelConfig, pipeline: int) -> list[int]:
    """[0, c_1, ..., n_layers]: P contiguous stages balanced by layer count, each cut the valid cut
    (`valid_cuts`) nearest to s * n_layers / P (ties go to the later cut: the last stage also runs
    the head and the DSpark stages). Raises if there are not enough valid cuts."""
    L = cfg.n_layers
    if pipeline == 1:
        return [0, L]
    cuts, prev = [0], 0
    cand = valid_cuts(cfg)
    for s in range(1, pipeline):
        left = [c for c in cand if c > prev]
        need = pipeline - s - 1  # cuts still to place after this one
        left = left[: len(left) - need] if need else left
        if not left:
            raise ValueError(f"{cfg.n_layers} layers cannot be split into {pipeline} pipeline stages: the valid "
                             f"stage boundaries (no KV source / indexer dependency across) are {cand}")
        target = s * L / pipeline
        prev = min(left, key=lambda c: (abs(c - target), -c))
        cuts.append(prev)
    return cuts + [L]


def attention_group_max(cfg: ModelConfig, world: int, group_max: int = ATTN_GROUP_MAX) -> int:
    """The largest attention group size <= min(group_max, world) that the checkpoint can be split
    by: whole o-groups, query heads and indexer heads per rank, fp8 tiles whole, and W a multiple
    of it (e.g. the tiny model's 2 o-groups at W = 4: groups of 2 ranks, replicated twice; the
    release's 8 o-groups at W = 64: groups of 8)."""
    g = min(group_max, world)
    while g > 1:
        rows = (cfg.n_heads * cfg.head_dim, cfg.o_groups * cfg.o_lora_rank, cfg.index_n_heads * cfg.index_head_dim)
        if (world % g == 0 and cfg.o_groups % g == 0 and cfg.n_heads % g == 0 and cfg.index_n_heads % g == 0
                and all((r // g) % FP8_BLOCK == 0 for r in rows)):
            return g
        g -= 1
    return 1


# ---- placement rule: which slice of each checkpoint tensor a rank holds -------------------------
FULL = ("full",)


def _layer_experts(cfg: ModelConfig, top: str, idx: int) -> int:
    return cfg.moe_shape(idx if top == "layers" else cfg.n_layers + idx)[0]


def shard_spec(name: str, shape: tuple[int, ...], cfg: ModelConfig, lay: Layout):
    """How rank `lay.rank` holds checkpoint tensor `name` of on-disk `shape`:
    None (not on this rank / not used), FULL, or ("slice", dim, start, stop, rows_after_padding)."""
    if name.endswith("bias_vl") or name.startswith(("vision.", "aligner.", "image_")):
        return None
    if name in ("embed.weight", "head.weight", "norm.weight"):
        # embedding on the first stage (and the last, for the DSpark draft); head + final norm on the last
        if not (lay.is_last_stage or (name == "embed.weight" and lay.is_first_stage)):
            return None
        if name == "norm.weight":
            return FULL
        a, b = lay.vocab_range(shape[0])
        return ("slice", 0, a, b, lay.vocab_chunk(shape[0]))
    m = re.match(r"(layers|mtp)\.(\d+)\.(.+)$", name)
    if not m:
        return FULL
    top, idx, rest = m.group(1), int(m.group(2)), m.group(3)
    if lay.pipeline > 1 and not lay.holds_layer(cfg, top, idx):
        return None
    e = re.match(r"ffn\.experts\.(\d+)\.", rest)
    if e:
        a, b = lay.expert_range(_layer_experts(cfg, top, idx))
        return FULL if a <= int(e.group(1)) < b else None
    if rest.startswith("engram.embed."):
        # ceil-sized row chunks; the last rank's shorter one padded with zero rows to the same size (no
        # hash id reaches them), so every rank's Engram table -- a graph input -- has one shape
        a, b = shard_range(shape[0], lay.srank, lay.stage_world)
        return ("slice", 0, a, b, -(-shape[0] // lay.stage_world))
    is_scale = rest.endswith(".scale")
    unit = FP8_BLOCK if is_scale else 1  # a scale row/column covers 32 weight rows/columns
    base = rest[: -len(".scale")] if is_scale else rest[: -len(".weight")] if rest.endswith(".weight") else rest
    rows = {"attn.wq_b": cfg.n_heads * cfg.head_dim, "attn.wo_a": cfg.o_groups * cfg.o_lora_rank,
            "attn.indexer.wq_b": cfg.index_n_heads * cfg.index_head_dim,
            "attn.indexer.weights_proj": cfg.index_n_heads, "attn.attn_sink": cfg.n_heads}
    if base in rows:
        align = 1 if base in ("attn.attn_sink", "attn.indexer.weights_proj") else FP8_BLOCK
        a, b = lay.split(rows[base], f"{name} rows", align)
        return ("slice", 0, a // unit, b // unit, (b - a) // unit)
    if base == "attn.wo_b":
        a, b = lay.split(cfg.o_groups * cfg.o_lora_rank, f"{name} columns", FP8_BLOCK)
        return ("slice", 1, a // unit, b // unit, (b - a) // unit)
    return FULL


def _read(reader: CheckpointReader, name: str, spec) -> torch.Tensor:
    if spec == FULL:
        return reader.get(name)
    _, dim, a, b, padded = spec
    t = reader.get_slice(name, dim, a, b)
    if padded > b - a:  # vocab shard of the last rank(s): zero rows up to the common chunk
        pad = torch.zeros((padded,) + tuple(t.shape[1:]), dtype=t.dtype)
        pad[: b - a] = t
        t = pad
    return t


def load_shard(reader: CheckpointReader, cfg: ModelConfig, lay: Layout) -> Weights:
    """The weights rank `lay.rank` holds, read slice by slice (never a whole sharded tensor), in the
    in-memory form `weights.convert` gives W = 1 loading, plus the shard facts in `meta`."""
    out = Weights()
    for name in sorted(reader.keys()):
        spec = shard_spec(name, reader.shape(name), cfg, lay)
        if spec is None or name.endswith("attn.wo_a.scale"):
            continue
        t = _read(reader, name, spec)
        scale = None
        if name.endswith("attn.wo_a.weight") and t.dtype == torch.float8_e4m3fn:
            sname = name[: -len("weight")] + "scale"
            scale = _read(reader, sname, shard_spec(sname, reader.shape(sname), cfg, lay))
        out[name] = convert(name, t, cfg, scale)
    V = cfg.vocab_size
    out.meta["vocab_start"] = lay.vocab_range(V)[0]
    out.meta["vocab_size"] = V
    out.meta["engram_row_start"] = {
        i: shard_range(reader.shape(f"layers.{i}.engram.embed.weight")[0], lay.srank, lay.stage_world)[0]
        for i in cfg.engram_layer_ids if f"layers.{i}.engram.embed.weight" in reader}
    experts = {}
    for top, n in (("layers", cfg.n_layers), ("mtp", cfg.n_mtp_layers if cfg.dspark_block_size else 0)):
        for i in range(n):
            if f"{top}.{i}.ffn.gate.weight" in reader and lay.holds_layer(cfg, top, i):
                experts[f"{top}.{i}.ffn"] = list(range(*lay.expert_range(_layer_experts(cfg, top, i))))
    out.meta["experts"] = experts
    # the same starts as tensors, which the forward computes with (model.weights.Weights.rank_offset)
    offsets = {"vocab_start": out.meta["vocab_start"]}
    offsets |= {f"engram_row_start.{i}": v for i, v in out.meta["engram_row_start"].items()}
    offsets |= {f"expert_start.{p}": ids[0] for p, ids in experts.items() if ids}
    out.meta["rank_offsets"] = {k: torch.tensor(v, dtype=torch.long) for k, v in offsets.items()}
    out.meta["layout"] = (lay.rank, lay.world)
    out.meta["stage_layers"] = lay.stage_layers(cfg)
    out.meta["pipeline"] = (lay.stage, lay.pipeline)
    return out
