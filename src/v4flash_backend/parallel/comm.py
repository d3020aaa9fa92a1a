"""The collective hooks of the forward on a sharded rank (`DistComm`, the sharded counterpart of
`model.transformer.LocalComm`) and building the sharded model of this rank. Numerics: see
`layout`'s docstring (partials reduced before the one rounding W = 1 does)."""

from __future__ import annotations

import os
from itertools import pairwise
from pathlib import Path

import torch

from v4flash_backend import ops
from v4flash_backend.config import ModelConfig
from v4flash_backend.formats import quant
from v4flash_backend.formats.checkpoint import CheckpointReader
from v4flash_backend.model.weights import linear
from v4flash_backend.settings import env_setting

from .collectives import Collectives, init_distributed
from .layout import SP_MIN_ROWS_PER_RANK, Layout, load_shard
from .placement import check_shapes


class DistComm:
    """`model.transformer.LocalComm`'s methods for a sharded rank (see the module docstring for numerics)."""

    def __init__(self, lay: Layout, coll: Collectives, vocab_size: int, cfg: ModelConfig | None = None,
                 sequence_parallel: bool = False):
        self.lay = lay
        self.sequence_parallel = sequence_parallel
        self._sp = None
        self.coll = coll
        self.vocab_size = vocab_size
        self.cfg = cfg
        # the model's 'world' collectives run over the rank's stage (the world when pipeline is 1;
        # named 'stage' otherwise, so the counters tell the two apart)
        self.sg = "stage" if lay.pipeline > 1 else "world"
        self._wcache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    # ---- sequence parallelism ----------------------------------------------------------------------
    # A forward of T >= G rows (G = attention group size > 1) with sequence_parallel set splits its
    # rows over the attention group: rank g of the group keeps rows [g*T//G, (g+1)*T//G) for the
    # per-token work (mHC mixes and Sinkhorn, norms, hc_post, Engram projection and gate, the
    # shared expert); attention and the routed experts, which need every row, get them from an
    # all-gather, and their row-parallel reductions become reduce-scatters (wo_b over the group;
    # the MoE carry too when the stage is one attention group, else a stage all-reduce and a
    # slice). Before the head or a stage send the streams are all-gathered again: full rows cross
    # a boundary, never this shard. Under exact numerics the partials are the same fp64 / fp32
    # sums as without SP, so the result is bit-identical.
    def sp_begin(self, T: int):
        G = self.lay.group_size
        if not self.sequence_parallel or G == 1 or T < SP_MIN_ROWS_PER_RANK * G:
            self._sp = None
            return None
        bounds = [g * T // G for g in range(G + 1)]
        g = self.lay.group_rank
        self._sp = (bounds, g)
        self.coll.sp_forwards = getattr(self.coll, "sp_forwards", 0) + 1
        return bounds[g], bounds[g + 1]

    def sp_end(self) -> None:
        self._sp = None

    def _sp_pad(self) -> int:
        bounds = self._sp[0]
        return max(b - a for a, b in pairwise(bounds))

    def sp_full(self, x):
        if getattr(self, "_sp", None) is None:
            return x
        bounds = self._sp[0]
        c = self._sp_pad()
        pad = x.new_zeros((c,) + tuple(x.shape[1:]))
        pad[: x.shape[0]] = x
        parts = self.coll.all_gather(pad, "attn", "sp_all_gather")
        return torch.cat([p[: b - a] for p, (a, b) in zip(parts, pairwise(bounds))])

    def sp_local(self, x):
        if getattr(self, "_sp", None) is None:
            return x
        bounds, g = self._sp
        return x[bounds[g]:bounds[g + 1]]

    def _reduce_scatter_rows(self, part, group: str):
        """Sum `part` [T, ...] over `group` (the attention group) and keep this rank's rows."""
        bounds, g = self._sp
        c = self._sp_pad()
        G = len(bounds) - 1
        blocks = part.new_zeros((G, c) + tuple(part.shape[1:]))
        for r in range(G):
            blocks[r, : bounds[r + 1] - bounds[r]] = part[bounds[r]:bounds[r + 1]]
        out = self.coll.reduce_scatter(blocks.flatten(0, 1), group)
        return out[: bounds[g + 1] - bounds[g]]

    # ---- pipeline boundary (see parallel.pipeline) ------------------------------------------------
    def stage_recv(self, T: int, n_taps: int):
        """(h [T, hc, D] bf16, pre_mix [T, hc] f32, taps [T, n_taps * D] bf16 or None) from this
        rank's peer in the previous stage."""
        from .pipeline import recv_boundary

        return recv_boundary(self.coll, self.lay, self.cfg, T, n_taps)

    def stage_send(self, h, pre_mix, taps) -> None:
        """Hand the full streams, the pre-mix and the taps so far to the peer in the next stage."""
        from .pipeline import send_boundary

        send_boundary(self.coll, self.lay, h, pre_mix, taps)

    def embed(self, y):
        return self.coll.all_reduce(y.contiguous(), self.sg)

    def attn_out(self, W, prefix, x):
        if self.coll.size("attn") == 1:
            return linear(W, prefix, x)
        part = self._partial_linear(W, prefix, x)
        if getattr(self, "_sp", None) is not None:  # x [1, T, .]: reduce-scatter the rows
            return self._reduce_scatter_rows(part[0], "attn").to(torch.bfloat16).unsqueeze(0)
        return self.coll.all_reduce(part, "attn").to(torch.bfloat16)

    def index_scores(self, q, k, w):
        if self.coll.size("attn") == 1:
            return ops.indexer_scores(q, k, w)
        part = _partial_indexer_scores(q, k, w)
        return self.coll.all_reduce(part, "attn").to(torch.bfloat16)

    def moe_out(self, y):
        if getattr(self, "_sp", None) is not None:
            if self.lay.n_groups == 1:  # the stage is one attention group: reduce-scatter over it
                return self._reduce_scatter_rows(y, "attn")
            return self.sp_local(self.coll.all_reduce(y.contiguous(), self.sg))
        return self.coll.all_reduce(y.contiguous(), self.sg)

    def engram_rows(self, v):
        # every rank of the stage looks up every row (the table is split by row over the stage), so
        # the reduction covers all rows; sequence parallel keeps this rank's afterwards
        return self.sp_local(self.coll.all_reduce(v.contiguous(), self.sg))

    def lookups(self, parts):
        # One all-reduce of the parts laid end to end. Exact as the separate ones were: each element
        # is reduced on its own, and in each at most one rank's term is nonzero (a vocab or Engram
        # row lives on one rank, the others add zeros), so no summation order can round it; the
        # buffer keeps the parts' dtype (concatenating two dtypes would promote one: refused).
        if len(parts) < 2:
            return [self.coll.all_reduce(p.contiguous(), self.sg) for p in parts]
        if len({p.dtype for p in parts}) != 1:
            raise TypeError(f"lookups of one collective share a dtype, got {[p.dtype for p in parts]}")
        flat = self.coll.all_reduce(torch.cat([p.reshape(-1) for p in parts]), self.sg)
        return [f.view(p.shape) for f, p in zip(flat.split([p.numel() for p in parts]), parts)]

    def head(self, logits):
        parts = self.coll.all_gather(logits.contiguous(), self.sg)
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




def load_sharded_model(ckpt_dir: str | Path, lay: Layout, coll: Collectives, sequence_parallel: bool = False):
    """A V41Model holding rank `lay.rank`'s shard, with DistComm as its collective hooks."""
    from v4flash_backend.model.loading import load_hasher
    from v4flash_backend.model.transformer import V41Model

    ckpt_dir = Path(ckpt_dir)
    cfg = ModelConfig.from_json(ckpt_dir / "config.json")
    with CheckpointReader(ckpt_dir) as reader:
        check_shapes(reader, cfg)
        weights = load_shard(reader, cfg, lay)
    return V41Model(cfg, weights, load_hasher(cfg, ckpt_dir), DistComm(lay, coll, cfg.vocab_size, cfg,
                                                                        sequence_parallel))


def model_for_env(ckpt_dir: str | Path, pipeline: int | None = None, sequence_parallel: bool = False):
    """The model for a process that may have been started by torchrun: the sharded model of this
    rank when WORLD_SIZE > 1 (joining the process group; `pipeline` stages, default
    the pipeline_parallel setting: $V4FLASH_PIPELINE or 1), else the plain W = 1 model. Every rank
    must then make the same forward calls (as golden-check does)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        from v4flash_backend.model.loading import load_model as load_local

        return load_local(ckpt_dir)
    torch.set_num_threads(env_setting("threads"))  # $V4FLASH_THREADS, else the threads default
    lay, coll = init_distributed(pipeline=pipeline)
    return load_sharded_model(ckpt_dir, lay, coll, sequence_parallel)
