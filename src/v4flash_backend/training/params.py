"""Trainable fp32 master weights of a V4.1 model, and their export to the official checkpoint layout.

Every checkpoint tensor has a storage class (golden README section 4):

- 'fp8'      dense projection used through `weights.linear` (F8_E4M3 + 32x32 E8M0 scales)
- 'fp8_deq'  `attn.wo_a`: stored fp8, used as the dequantized bf16 matrix by the grouped einsum
- 'fp4'      routed expert (I8-packed MXFP4 + E8M0 scale per 32 along K)
- 'bf16_lin' BF16 projection used through `weights.linear` (compressor, indexer wk / weights_proj)
- 'bf16'     BF16 tensor read directly (norms, embed, head, router, Markov and confidence heads)
- 'f32'      F32 tensor (mHC fn/base/scale, attention sinks, router biases)
- 'engram'   Engram table (F8_E4M3 rows + one E8M0 scale per 32 columns)

`forward_weights` turns the masters into the dict the inference forward reads, with every value
exactly what the exported checkpoint will hold (fake quantization, straight-through gradients), so
the training forward *is* the exported model's forward up to activation precision.
"""

from __future__ import annotations

import math

import torch

from v4flash_backend.config import ModelConfig
from v4flash_backend.formats import quant
from v4flash_backend.model.weights import Weights, convert


def inventory(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """{checkpoint name (weights without '.weight'/'.scale' pairs split): (shape, storage class)}.

    Names of projections are given with their '.weight' suffix; the exporter adds '.scale'."""
    D, hd, H = cfg.dim, cfg.head_dim, cfg.n_heads
    hc = cfg.hc_mult
    inv: dict[str, tuple[tuple[int, ...], str]] = {
        "embed.weight": ((cfg.vocab_size, D), "bf16"),
        "head.weight": ((cfg.vocab_size, D), "bf16"),
        "norm.weight": ((D,), "bf16"),
    }

    def block(p: str, layer: int):
        a = p + ".attn"
        inv[a + ".wq_a.weight"] = ((cfg.q_lora_rank, D), "fp8")
        inv[a + ".q_norm.weight"] = ((cfg.q_lora_rank,), "bf16")
        inv[a + ".wq_b.weight"] = ((H * hd, cfg.q_lora_rank), "fp8")
        inv[a + ".wkv.weight"] = ((hd, D), "fp8")
        inv[a + ".kv_norm.weight"] = ((hd,), "bf16")
        inv[a + ".wo_a.weight"] = ((cfg.o_groups * cfg.o_lora_rank, H * hd // cfg.o_groups), "fp8_deq")
        inv[a + ".wo_b.weight"] = ((D, cfg.o_groups * cfg.o_lora_rank), "fp8")
        inv[a + ".attn_sink"] = ((H,), "f32")
        if layer < cfg.n_layers and layer in cfg.kv_source_layers:
            c = a + ".compressor"
            inv[c + ".wkv.weight"] = ((hd, D), "bf16_lin")
            if cfg.compress_ratios[layer] > 1:
                inv[c + ".wgate.weight"] = ((hd, D), "bf16_lin")
            inv[c + ".norm.weight"] = ((hd,), "bf16")
        if layer < cfg.n_layers and layer in cfg.index_source_layers:
            ix = a + ".indexer"
            inv[ix + ".wq_b.weight"] = ((cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank), "fp8")
            inv[ix + ".weights_proj.weight"] = ((cfg.index_n_heads, D), "bf16_lin")
            if layer in cfg.kv_source_layers:
                inv[ix + ".wk.weight"] = ((cfg.index_head_dim, hd), "bf16_lin")
                inv[ix + ".k_norm.weight"] = ((cfg.index_head_dim,), "bf16")
        for s in ("attn", "ffn"):
            inv[f"{p}.{s}_norm.weight"] = ((D,), "bf16")
            inv[f"{p}.hc_{s}_fn"] = (((2 + hc) * hc, hc * D), "f32")
            inv[f"{p}.hc_{s}_base"] = (((2 + hc) * hc,), "f32")
            inv[f"{p}.hc_{s}_scale"] = ((3,), "f32")
        n_exp, _ = cfg.moe_shape(layer)
        f = p + ".ffn"
        inv[f + ".gate.weight"] = ((n_exp, D), "bf16")
        inv[f + ".gate.bias"] = ((n_exp,), "f32")
        inv[f + ".gate.bias_vl"] = ((n_exp,), "f32")
        inter = cfg.moe_inter_dim
        for e in range(n_exp):
            inv[f"{f}.experts.{e}.w1.weight"] = ((inter, D), "fp4")
            inv[f"{f}.experts.{e}.w2.weight"] = ((D, inter), "fp4")
            inv[f"{f}.experts.{e}.w3.weight"] = ((inter, D), "fp4")
        si = inter * cfg.n_shared_experts
        inv[f + ".shared_experts.w1.weight"] = ((si, D), "fp8")
        inv[f + ".shared_experts.w2.weight"] = ((D, si), "fp8")
        inv[f + ".shared_experts.w3.weight"] = ((si, D), "fp8")
        if layer < cfg.n_layers and layer in cfg.engram_layer_ids:
            e = p + ".engram"
            rows = cfg.engram_num_embeddings[cfg.engram_layer_ids.index(layer)]
            inv[e + ".embed.weight"] = ((rows, cfg.engram_head_dim), "engram")
            inv[e + ".wkv.weight"] = (((hc + 1) * D, cfg.n_hash_cols * cfg.engram_head_dim), "fp8")
            inv[e + ".q_weight"] = ((hc, D), "bf16")
            inv[e + ".k_weight"] = ((hc, D), "bf16")

    for i in range(cfg.n_layers):
        block(f"layers.{i}", i)
    if cfg.dspark_block_size:
        n_taps = len(cfg.dspark_target_layer_ids)
        inv["mtp.0.main_proj.weight"] = ((D, n_taps * D), "fp8")
        inv["mtp.0.main_norm.weight"] = ((D,), "bf16")
        for k in range(cfg.n_mtp_layers):
            block(f"mtp.{k}", cfg.n_layers + k)
        last = f"mtp.{cfg.n_mtp_layers - 1}"
        r = cfg.dspark_markov_rank
        inv[last + ".norm.weight"] = ((D,), "bf16")
        inv[last + ".markov_head.embed.weight"] = ((cfg.vocab_size, r), "bf16")
        inv[last + ".markov_head.head.weight"] = ((cfg.vocab_size, r), "bf16")
        inv[last + ".confidence_head.proj.weight"] = ((1, D + r), "bf16")
    return inv


def _gain(name: str, cfg: ModelConfig) -> float:
    """Init std multiplier of a projection: residual-branch outputs start small (depth-scaled)."""
    if name.endswith(("wo_b.weight", "w2.weight")):
        return 1.0 / math.sqrt(2 * (cfg.n_layers + cfg.n_mtp_layers))
    if name.endswith("engram.wkv.weight"):
        return 0.5
    return 1.0


def init_masters(cfg: ModelConfig, seed: int, names=None) -> dict[str, torch.Tensor]:
    """fp32 master tensors (requires_grad) for `names` (default: the whole inventory), each from its
    own generator seeded by (seed, name), so adding a tensor never changes the others' init."""
    import zlib

    inv = inventory(cfg)
    out = {}
    hc = cfg.hc_mult
    for name in names if names is not None else inv:
        shape, cls = inv[name]
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        if name.endswith(("norm.weight", "q_weight", "k_weight")):
            t = torch.ones(shape)
        elif name.endswith(("attn_sink", "gate.bias", "gate.bias_vl", "markov_head.head.weight",
                            "confidence_head.proj.weight")):
            t = torch.zeros(shape)  # Markov bias and confidence logit start neutral
        elif name.endswith(("_fn",)):
            t = torch.randn(shape, generator=g) / math.sqrt(shape[1])
        elif name.endswith("_scale"):
            t = torch.full(shape, 0.1)
        elif name.endswith("_base"):
            # pre = 1/hc each (collapse = stream mean), post = 1, comb close to the identity
            t = torch.zeros(shape)
            t[:hc] = -math.log(hc - 1)
            t[2 * hc:] = 2.0 * torch.eye(hc).flatten()
        elif name == "embed.weight" or cls == "engram" or name.endswith("markov_head.embed.weight"):
            t = torch.randn(shape, generator=g)
        else:
            t = torch.randn(shape, generator=g) * (_gain(name, cfg) / math.sqrt(shape[-1]))
        out[name] = t.float().requires_grad_(True)
    return out


def qtypes(cfg: ModelConfig) -> dict[str, str]:
    """`Weights.meta['qtype']` for training: prefix -> storage the linear() sees."""
    m = {"fp8": "fp8", "fp4": "fp4", "bf16_lin": "bf16"}
    return {n[: -len(".weight")]: m[c] for n, (_, c) in inventory(cfg).items() if c in m}


def forward_weights(cfg: ModelConfig, masters: dict[str, torch.Tensor], meta: dict | None = None,
                    quantize: bool = True) -> Weights:
    """The dict the inference forward reads, built from fp32 masters with fake quantization.

    Linear weights stay masters (`linear` fake-quantizes them per `meta['qtype']`); tensors the model
    reads directly are replaced by their exported values with straight-through gradients. Pass the
    `meta` of an earlier call to reuse derived facts (expert lists). quantize=False gives the float
    model: the linears multiply bf16-rounded master weights by unquantized activations (bf16, the
    serving activation dtype) and every other tensor is its fp32 master; the model's own activation
    quantization points (window KV fp8, compressed KV fp4, ...) stay, being part of the architecture."""
    inv = inventory(cfg)
    W = Weights()
    if meta is None:
        q = qtypes(cfg)
        meta = {"train": True, "qtype": q if quantize else {k: "bf16" for k in q}}
    W.meta = meta
    for name, t in masters.items():
        cls = inv[name][1]
        if cls in ("fp8", "fp4", "bf16_lin", "f32"):
            W[name] = t
        elif not quantize:
            W[name] = t.to(torch.bfloat16) if name == "embed.weight" else t  # bf16 activations, as served
            if cls == "engram":
                W[name[: -len("weight")] + "scale"] = _unit_scales(t)
        elif cls == "fp8_deq":
            W[name] = quant.fake_quant_fp8_weight(t)
        elif cls == "bf16":
            # bf16 as stored, then the loader's conversion (fp32 for the head-like tensors); the
            # casts pass gradients through, and a bf16 embedding makes the activations bf16
            W[name] = convert(name, t.to(torch.bfloat16), cfg)
        elif cls == "engram":
            q, s = quant.quantize_fp8_rows(t.detach())
            W[name] = quant._ste(t, quant.dequant_fp8_rows(q, s))
            W[name[: -len("weight")] + "scale"] = _unit_scales(t)
        else:
            raise ValueError(f"{name}: unknown storage class {cls}")
    return W


def _unit_scales(table: torch.Tensor) -> torch.Tensor:
    """E8M0 scales of 1.0 for an Engram table whose rows already hold their final values."""
    return torch.full((table.shape[0], table.shape[1] // 32), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)


def export_tensors(cfg: ModelConfig, masters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors in the official storage dtypes (sorted by name)."""
    inv = inventory(cfg)
    out: dict[str, torch.Tensor] = {}
    for name in sorted(masters):
        t = masters[name].detach().float()
        cls = inv[name][1]
        base = name[: -len("weight")] if name.endswith("weight") else None
        if cls in ("fp8", "fp8_deq"):
            out[name], out[base + "scale"] = quant.quantize_fp8_weight(t)
        elif cls == "fp4":
            out[name], out[base + "scale"] = quant.quantize_fp4_weight(t)
        elif cls == "engram":
            q, s = quant.quantize_fp8_rows(t)
            out[name], out[base + "scale"] = q.to(torch.float8_e4m3fn), s
        elif cls in ("bf16", "bf16_lin"):
            out[name] = t.to(torch.bfloat16)
        else:
            out[name] = t.clone()
    return dict(sorted(out.items()))


def inference_weights(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> Weights:
    """What `weights.load_weights` would build from `tensors` (no file round trip)."""
    W = Weights()
    for name, t in tensors.items():
        if name.endswith("bias_vl") or name.endswith("attn.wo_a.scale"):
            continue
        scale = tensors.get(name[: -len("weight")] + "scale") if name.endswith("attn.wo_a.weight") else None
        W[name] = convert(name, t, cfg, scale)
    return W
