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
- Engram tables are row-partitioned (ceil split, as the reference); masked lookup + all-reduce;
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

import os
import re
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch

from . import ops, quant
from .checkpoint import CheckpointReader, shard_range
from .config import ModelConfig
from .weights import Weights, convert, linear

ATTN_GROUP_MAX = 8  # ranks per attention group (one trn2 chip pair's worth of heads: 64 heads / 8)
VOCAB_ALIGN = 128  # rows of the embedding / head shard are padded to a multiple of this
FP8_BLOCK = 32  # fp8 weights carry one scale per 32x32 tile: split boundaries must fall on tiles


@dataclass(frozen=True)
class Layout:
    rank: int
    world: int
    group_max: int = ATTN_GROUP_MAX  # attention group = min(group_max, world) consecutive ranks

    def __post_init__(self):
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ValueError(f"bad rank {self.rank} for world size {self.world}")
        if self.group_max < 1 or (self.world > self.group_max and self.world % self.group_max):
            raise ValueError(f"world size {self.world} > {self.group_max} must be a multiple of {self.group_max} "
                             "(the attention group size)")

    @property
    def group_size(self) -> int:
        return min(self.group_max, self.world)

    @property
    def group_rank(self) -> int:
        return self.rank % self.group_size

    @property
    def n_groups(self) -> int:
        return self.world // self.group_size

    def group_ranks(self, g: int) -> list[int]:
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
        return -(-vocab // (VOCAB_ALIGN * self.world)) * VOCAB_ALIGN

    def vocab_range(self, vocab: int) -> tuple[int, int]:
        c = self.vocab_chunk(vocab)
        return min(vocab, self.rank * c), min(vocab, (self.rank + 1) * c)

    def expert_range(self, n_experts: int) -> tuple[int, int]:
        return shard_range(n_experts, self.rank, self.world)


# ---- placement rule: which slice of each checkpoint tensor a rank holds -------------------------
FULL = ("full",)


def _layer_experts(cfg: ModelConfig, top: str, idx: int) -> int:
    return cfg.moe_shape(idx if top == "layers" else cfg.n_layers + idx)[0]


def shard_spec(name: str, shape: tuple[int, ...], cfg: ModelConfig, lay: Layout):
    """How rank `lay.rank` holds checkpoint tensor `name` of on-disk `shape`:
    None (not on this rank / not used), FULL, or ("slice", dim, start, stop, rows_after_padding)."""
    if name.endswith("bias_vl") or name.startswith(("vision.", "aligner.", "image_")):
        return None
    if name in ("embed.weight", "head.weight"):
        a, b = lay.vocab_range(shape[0])
        return ("slice", 0, a, b, lay.vocab_chunk(shape[0]))
    m = re.match(r"(layers|mtp)\.(\d+)\.(.+)$", name)
    if not m:
        return FULL
    top, idx, rest = m.group(1), int(m.group(2)), m.group(3)
    e = re.match(r"ffn\.experts\.(\d+)\.", rest)
    if e:
        a, b = lay.expert_range(_layer_experts(cfg, top, idx))
        return FULL if a <= int(e.group(1)) < b else None
    if rest.startswith("engram.embed."):
        a, b = shard_range(shape[0], lay.rank, lay.world)
        return ("slice", 0, a, b, b - a)
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
        i: shard_range(reader.shape(f"layers.{i}.engram.embed.weight")[0], lay.rank, lay.world)[0]
        for i in cfg.engram_layer_ids if f"layers.{i}.engram.embed.weight" in reader}
    experts = {}
    for top, n in (("layers", cfg.n_layers), ("mtp", cfg.n_mtp_layers if cfg.dspark_block_size else 0)):
        for i in range(n):
            if f"{top}.{i}.ffn.gate.weight" in reader:
                experts[f"{top}.{i}.ffn"] = list(range(*lay.expert_range(_layer_experts(cfg, top, i))))
    out.meta["experts"] = experts
    out.meta["layout"] = (lay.rank, lay.world)
    return out


# ---- collectives ----------------------------------------------------------------------------------
class Collectives:
    """The one place that calls torch.distributed during serving. Groups are named: 'world' and
    'attn' (this rank's attention group; the world itself when W <= 8). Counters are
    {(group, op): [calls, bytes, seconds]} for the whole run (`total`), the step in progress
    (`step`) and the last finished step (`last_step`); bytes are this rank's payload."""

    def __init__(self, groups: dict | None = None, sizes: dict | None = None):
        self.groups = groups or {}
        self.sizes = sizes or {}
        self.total: dict = defaultdict(lambda: [0, 0, 0.0])
        self.step: dict = defaultdict(lambda: [0, 0, 0.0])
        self.last_step: dict = {}
        self.steps = 0

    def _count(self, group: str, op: str, nbytes: int, t0: float) -> None:
        dt = time.perf_counter() - t0
        for d in (self.total, self.step):
            c = d[(group, op)]
            c[0] += 1
            c[1] += nbytes
            c[2] += dt

    def size(self, group: str) -> int:
        return self.sizes.get(group, 1)

    def all_reduce(self, t: torch.Tensor, group: str, label: str = "all_reduce") -> torch.Tensor:
        if self.size(group) == 1:
            return t
        import torch.distributed as dist

        t0 = time.perf_counter()
        dist.all_reduce(t, group=self.groups[group])
        self._count(group, label, t.numel() * t.element_size(), t0)
        return t

    def all_gather(self, t: torch.Tensor, group: str, label: str = "all_gather") -> list[torch.Tensor]:
        if self.size(group) == 1:
            return [t]
        import torch.distributed as dist

        t0 = time.perf_counter()
        parts = [torch.empty_like(t) for _ in range(self.size(group))]
        dist.all_gather(parts, t.contiguous(), group=self.groups[group])
        self._count(group, label, t.numel() * t.element_size(), t0)
        return parts

    def broadcast(self, t: torch.Tensor, src: int, group: str = "world") -> torch.Tensor:
        if self.size(group) == 1:
            return t
        import torch.distributed as dist

        t0 = time.perf_counter()
        dist.broadcast(t, src=src, group=self.groups[group])
        self._count(group, "broadcast", t.numel() * t.element_size(), t0)
        return t

    def begin_step(self) -> None:
        self.step = defaultdict(lambda: [0, 0, 0.0])

    def end_step(self) -> dict:
        self.last_step = {k: list(v) for k, v in self.step.items()}
        self.steps += 1
        return self.last_step

    @staticmethod
    def calls(counts: dict, group: str | None = None, op: str | None = None) -> int:
        return sum(c[0] for (g, o), c in counts.items() if group in (None, g) and op in (None, o))

    @staticmethod
    def as_json(counts: dict) -> dict:
        return {f"{g}.{o}": {"calls": c[0], "bytes": c[1], "seconds": round(c[2], 6)}
                for (g, o), c in sorted(counts.items())}


def init_distributed(backend: str | None = None, timeout_s: float = 60.0) -> tuple[Layout, Collectives]:
    """Join the process group torchrun describes (RANK / WORLD_SIZE / MASTER_ADDR in the
    environment) and create the attention groups. A collective that waits longer than `timeout_s`
    raises, so a hung or dead peer ends the rank instead of blocking it forever."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    # V4FLASH_ATTN_GROUP overrides the group size (tests use 2 to get several groups at W = 4)
    lay = Layout(rank, world, int(os.environ.get("V4FLASH_ATTN_GROUP", ATTN_GROUP_MAX)))
    if world == 1:
        return lay, Collectives()
    backend = backend or os.environ.get("V4FLASH_DIST_BACKEND", "gloo")
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timeout)
    world_pg = dist.group.WORLD
    attn_pg = world_pg
    if lay.n_groups > 1:  # every rank creates every group, in the same order
        for g in range(lay.n_groups):
            pg = dist.new_group(lay.group_ranks(g), timeout=timeout)
            if g == rank // lay.group_size:
                attn_pg = pg
    coll = Collectives({"world": world_pg, "attn": attn_pg}, {"world": world, "attn": lay.group_size})
    return lay, coll


# ---- the collective hooks of the forward ------------------------------------------------------------
class DistComm:
    """`model.LocalComm`'s methods for a sharded rank (see the module docstring for numerics)."""

    def __init__(self, lay: Layout, coll: Collectives, vocab_size: int):
        self.lay = lay
        self.coll = coll
        self.vocab_size = vocab_size
        self._wcache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def embed(self, y):
        return self.coll.all_reduce(y.contiguous(), "world")

    def attn_out(self, W, prefix, x):
        if self.coll.size("attn") == 1:
            return linear(W, prefix, x)
        part = self._partial_linear(W, prefix, x)
        return self.coll.all_reduce(part, "attn").to(torch.bfloat16)

    def index_scores(self, q, k, w):
        if self.coll.size("attn") == 1:
            return ops.indexer_scores(q, k, w)
        part = _partial_indexer_scores(q, k, w)
        return self.coll.all_reduce(part, "attn").to(torch.bfloat16)

    def moe_out(self, y):
        return self.coll.all_reduce(y.contiguous(), "world")

    def engram_rows(self, v):
        return self.coll.all_reduce(v.contiguous(), "world")

    def head(self, logits):
        parts = self.coll.all_gather(logits.contiguous(), "world")
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]

    # unrounded partial products of a row-parallel linear
    def _weight_f32(self, W, prefix: str) -> torch.Tensor:
        w = W[prefix + ".weight"]
        hit = self._wcache.get(prefix)
        if hit is not None and hit[0] is w:
            return hit[1]
        if w.dtype == torch.float8_e4m3fn:
            wf = quant.dequant_fp8_weight(w, W[prefix + ".scale"])
        elif w.dtype == torch.int8:
            wf = quant.dequant_fp4_weight(w, W[prefix + ".scale"])
        else:
            wf = w.float()
        self._wcache[prefix] = (w, wf)
        return wf

    def _partial_linear(self, W, prefix: str, x: torch.Tensor) -> torch.Tensor:
        """x @ w.T with the activation quantization `weights.linear` applies, before its final
        rounding: fp64 under 'exact' numerics (as torch_ops accumulates), else fp32 through
        `ops.linear_f32` on the dequantized weight. (On a Neuron device this wants a kernel variant
        of the fp8 linear that returns its fp32 accumulator instead of rounding to bf16.)"""
        w = W[prefix + ".weight"]
        xa = quant.fp8_act_dequant_f32(x) if w.dtype in (torch.float8_e4m3fn, torch.int8) else x
        wf = self._weight_f32(W, prefix)
        if ops.get_numerics() == "exact":
            return xa.double() @ wf.double().T
        return ops.linear_f32(xa.float(), wf)


def _partial_indexer_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum over this rank's heads of w * relu(q . k) with torch_ops.indexer_scores' roundings of
    the per-head terms but not of the sum (fp64 for 'exact', fp32 for 'reference' numerics).
    The nki backends round inside the kernel: there the rounded partials are reduced in fp32,
    which is the reference's own tensor-parallel behaviour."""
    if ops.get_backend() != "torch":
        return ops.indexer_scores(q, k, w).float()
    if ops.get_numerics() == "exact":
        dots = torch.einsum("bshd,btd->bsht", q.double(), k.double()).to(torch.bfloat16)
        return (dots.relu_() * w.unsqueeze(-1)).double().sum(dim=2)
    dots = torch.einsum("bshd,btd->bsht", q, k)
    return (dots.relu_() * w.unsqueeze(-1)).float().sum(dim=2)


# ---- building a sharded model ------------------------------------------------------------------------
def load_model(ckpt_dir: str | Path, lay: Layout, coll: Collectives):
    """A V41Model holding rank `lay.rank`'s shard, with DistComm as its collective hooks."""
    from .loading import load_hasher
    from .model import V41Model

    ckpt_dir = Path(ckpt_dir)
    cfg = ModelConfig.from_json(ckpt_dir / "config.json")
    with CheckpointReader(ckpt_dir) as reader:
        weights = load_shard(reader, cfg, lay)
    return V41Model(cfg, weights, load_hasher(cfg, ckpt_dir), DistComm(lay, coll, cfg.vocab_size))


def is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def model_for_env(ckpt_dir: str | Path):
    """The model for a process that may have been started by torchrun: the sharded model of this
    rank when WORLD_SIZE > 1 (joining the process group), else the plain W = 1 model. Every rank
    must then make the same forward calls (as golden-check does)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        from .loading import load_model as load_local

        return load_local(ckpt_dir)
    torch.set_num_threads(int(os.environ.get("V4FLASH_THREADS", "1")))
    lay, coll = init_distributed()
    return load_model(ckpt_dir, lay, coll)
