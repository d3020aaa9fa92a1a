"""The collective hooks of the forward on a sharded rank (`DistComm`, the sharded counterpart of
`model.transformer.LocalComm`) and building the sharded model of this rank. Numerics: see
`layout`'s docstring (partials reduced before the one rounding W = 1 does)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from v4flash_backend import ops
from v4flash_backend.config import ModelConfig
from v4flash_backend.formats import quant
from v4flash_backend.formats.checkpoint import CheckpointReader
from v4flash_backend.model.weights import linear

from .collectives import Collectives, init_distributed
from .layout import Layout, load_shard
from .placement import check_shapes


class DistComm:
    """`model.transformer.LocalComm`'s methods for a sharded rank (see the module docstring for numerics)."""

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




def load_sharded_model(ckpt_dir: str | Path, lay: Layout, coll: Collectives):
    """A V41Model holding rank `lay.rank`'s shard, with DistComm as its collective hooks."""
    from v4flash_backend.model.loading import load_hasher
    from v4flash_backend.model.transformer import V41Model

    ckpt_dir = Path(ckpt_dir)
    cfg = ModelConfig.from_json(ckpt_dir / "config.json")
    with CheckpointReader(ckpt_dir) as reader:
        check_shapes(reader, cfg)
        weights = load_shard(reader, cfg, lay)
    return V41Model(cfg, weights, load_hasher(cfg, ckpt_dir), DistComm(lay, coll, cfg.vocab_size))


def model_for_env(ckpt_dir: str | Path):
    """The model for a process that may have been started by torchrun: the sharded model of this
    rank when WORLD_SIZE > 1 (joining the process group), else the plain W = 1 model. Every rank
    must then make the same forward calls (as golden-check does)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        from v4flash_backend.model.loading import load_model as load_local

        return load_local(ckpt_dir)
    torch.set_num_threads(int(os.environ.get("V4FLASH_THREADS", "1")))
    lay, coll = init_distributed()
    return load_sharded_model(ckpt_dir, lay, coll)
