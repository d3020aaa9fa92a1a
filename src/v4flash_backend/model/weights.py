"""Model weights as a flat {checkpoint name: tensor} dict, converted the way the reference loads them.

The official loader path (golden README section 4) keeps these conversions, all exact:
`attn.wo_a` fp8 -> bf16 (it is used by a grouped einsum, not a quantized GEMM); bf16 ->
fp32 for the ratio>1 compressor `wkv`/`wgate`, `head.weight`, the Markov head's `head.weight` and
the confidence head's `proj.weight`; `ffn.gate.bias_vl` is dropped (vision is off).
"""

from __future__ import annotations

import re

import torch

from v4flash_backend.config import ModelConfig
from v4flash_backend.formats import quant

_FP32_SUFFIXES = ("markov_head.head.weight", "confidence_head.proj.weight")


class Weights(dict):
    """{checkpoint name: tensor}, plus `meta` for facts derived from the names or the shard layout
    (which experts this rank holds, the first Engram row of its shard, ...).

    What a rank's shard starts at (its first vocabulary row, first local expert id, first Engram row)
    is a rank offset: a 0-dim int64 tensor in `meta["rank_offsets"]` (`parallel.layout.load_shard`
    makes them; `trn2.static_runner.place_resident` puts them beside the weights), never a Python int
    the forward computes with. A static graph then reads the offset as an input, so every rank of a
    world traces the same graph per bucket (one compile for all ranks: `trn2.graph_key`); a traced
    int would be a constant of rank r's graph alone. Without a shard (W = 1) an offset is 0."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.meta: dict = {}

    def rank_offset(self, name: str):
        """Rank offset `name` (a 0-dim int64 tensor), or 0 where the weights are not a shard."""
        return self.meta.get("rank_offsets", {}).get(name, 0)


def convert(name: str, t: torch.Tensor, cfg: ModelConfig, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The in-memory form of one checkpoint tensor."""
    if name.endswith("attn.wo_a.weight") and t.dtype == torch.float8_e4m3fn:
        return quant.dequant_fp8_weight(t, scale).to(torch.bfloat16)
    if name == "head.weight" or name.endswith(_FP32_SUFFIXES):
        return t.float()
    m = re.match(r"layers\.(\d+)\.attn\.compressor\.(wkv|wgate)\.weight$", name)
    if m and cfg.compress_ratios[int(m.group(1))] > 1:
        return t.float()
    return t


def load_weights(reader, cfg: ModelConfig) -> Weights:
    """Read every tensor the text model needs from a checkpoint reader (full tensors, W = 1)."""
    names = set(reader.keys())
    out = Weights()
    for name in sorted(names):
        if name.endswith("bias_vl") or name.startswith(("vision.", "aligner.", "image_")):
            continue
        if name.endswith("attn.wo_a.scale"):
            continue
        t = reader.get(name)
        scale = None
        if name.endswith("attn.wo_a.weight") and t.dtype == torch.float8_e4m3fn:
            scale = reader.get(name[: -len("weight")] + "scale")
        out[name] = convert(name, t, cfg, scale)
    return out


def linear(W: dict, prefix: str, x: torch.Tensor) -> torch.Tensor:
    """Apply the linear layer stored under `prefix` picking the GEMM from its weight dtype, as the
    reference's `linear()` does: fp8 and fp4 weights take a per-32 fp8 activation."""
    from v4flash_backend import ops

    w = W[prefix + ".weight"]
    if W.meta.get("train"):
        return _train_linear(W, prefix, w, x)
    if w.dtype == torch.float8_e4m3fn:
        return ops.linear_fp8(x, w, W[prefix + ".scale"])
    if w.dtype == torch.int8:
        return ops.linear_fp4(x, w, W[prefix + ".scale"])
    if w.dtype == torch.float32:
        return ops.linear_f32(x, w)
    return ops.linear_bf16(x, w)


def _train_linear(W: dict, prefix: str, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Training mode: W holds fp32 master weights; `W.meta["qtype"][prefix]` names the storage the
    export will use ('fp8', 'fp4', 'bf16', 'f32'), and the forward sees exactly those values
    (fake quantization with straight-through gradients, fp8 activations for fp8/fp4 weights)."""
    import torch.nn.functional as F

    qtype = W.meta.get("qtype", {}).get(prefix, "f32")
    if qtype == "fp8":
        return F.linear(quant.fp8_act_dequant_f32(x), quant.fake_quant_fp8_weight(w)).to(x.dtype)
    if qtype == "fp4":
        return F.linear(quant.fp8_act_dequant_f32(x), quant.fake_quant_fp4_weight(w)).to(x.dtype)
    if qtype == "bf16":
        wb = quant._ste(w, w.detach().to(torch.bfloat16).float())
        return F.linear(x.float(), wb).to(x.dtype)
    return F.linear(x.float(), w.float())
