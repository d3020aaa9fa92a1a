"""Model configuration in the official `inference/config.json` key format.

Field names are exactly the keys of the released DeepSeek-V4.1-Flash `inference/config.json`
(plus `gate_temp` / `norm_topk_prob`, which the reference defaults when absent), so any such file
loads field by field. `release()` holds the V4.1-Flash release values.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ModelConfig:
    vocab_size: int = 129280
    dim: int = 5120
    moe_inter_dim: int = 2304
    n_layers: int = 40
    n_mtp_layers: int = 3
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] = (37, 38, 39)
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_n_activated_experts: int = 3
    n_heads: int = 64
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    n_activated_experts: int = 6
    score_func: str = "sqrtsoftplus"
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    q_lora_rank: int = 1280
    head_dim: int = 512
    rope_head_dim: int = 64
    norm_eps: float = 1e-20
    o_groups: int = 8
    o_lora_rank: int = 1024
    window_size: int = 128
    kv_source_layers: tuple[int, ...] = (2, 8, 14, 20)
    index_source_layers: tuple[int, ...] = (2, 8, 14, 20, 24, 28, 32, 36)
    original_seq_len: int = 65536
    rope_theta: float = 10000.0
    rope_factor: float = 16.0
    beta_fast: int = 32
    beta_slow: int = 1
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    candidate_source_layer: int = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    engram_layer_ids: tuple[int, ...] = (1, 14)
    engram_vocab_size: int = 16_000_000
    engram_num_embeddings: tuple[int, ...] = (384006168, 384016682)
    engram_max_ngram_size: int = 4
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 99092
    dtype: str = "fp8"
    expert_dtype: str | None = "fp4"
    compress_rope_theta: float = 160000.0
    compress_ratios: tuple[int, ...] = (0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0)
    vision_n_layers: int = 32
    vision_dim: int = 1024
    vision_n_heads: int = 16
    vision_inter_dim: int = 2816
    vision_patch_size: int = 14
    vision_downsample_ratio: int = 3
    vision_max_n_token: int = 1024
    vision_min_pixels: int = 295936
    vision_max_wh_ratio: int | None = None
    image_token_id: int = 129264
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    vision_rope_theta: float = 10000.0
    # not in the released file; the reference's defaults
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    # special ids of the DeepSeek tokenizer convention (not in inference/config.json)
    bos_token_id: int = 0
    eos_token_id: int = 1
    # keys of a loaded file that this dataclass does not know (kept, never silently dropped)
    extra: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, list):
                setattr(self, f.name, tuple(v))
        self.validate()

    # ---- loading / saving -------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in d.items() if k in names}
        extra = {k: v for k, v in d.items() if k not in names}
        return cls(**known, extra=extra)

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def to_dict(self) -> dict:
        d = {}
        for f in dataclasses.fields(self):
            if f.name == "extra":
                continue
            v = getattr(self, f.name)
            d[f.name] = list(v) if isinstance(v, tuple) else v
        d.update(self.extra)
        return d

    def to_json(self, path: str | Path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=4)

    @classmethod
    def release(cls) -> "ModelConfig":
        """DeepSeek-V4.1-Flash as released (the dataclass defaults are those values)."""
        return cls()

    # ---- derived facts ----------------------------------------------------------------
    def validate(self) -> None:
        total = self.n_layers + (self.n_mtp_layers if self.dspark_block_size else 0)
        if len(self.compress_ratios) < total:
            raise ValueError(
                f"compress_ratios has {len(self.compress_ratios)} entries, need one per layer "
                f"including DSpark stages ({total})"
            )
        if self.head_dim % 32 or self.dim % 32:
            raise ValueError("dim and head_dim must be multiples of 32 (fp8 activation blocks)")
        if self.n_heads % self.o_groups:
            raise ValueError("n_heads must be a multiple of o_groups")
        for i in self.kv_source_layers:
            if not self.compress_ratios[i]:
                raise ValueError(f"kv source layer {i} has compress ratio 0")

    @property
    def n_total_layers(self) -> int:
        return self.n_layers + (self.n_mtp_layers if self.dspark_block_size else 0)

    def kv_source_of(self, layer: int) -> int | None:
        """The KV-source layer whose compressed cache `layer` reads (the last source at or before it
        with the same ratio), or None for a window-only layer."""
        if layer >= self.n_layers or not self.compress_ratios[layer]:
            return None
        srcs = [s for s in self.kv_source_layers if s <= layer]
        if not srcs:
            raise ValueError(f"layer {layer} compresses but no kv source precedes it")
        return srcs[-1]

    def moe_shape(self, layer: int) -> tuple[int, int]:
        """(routed experts, activated experts) for a backbone layer or a DSpark stage."""
        if layer < self.n_layers:
            return self.n_routed_experts, self.n_activated_experts
        return (self.dspark_n_routed_experts or self.n_routed_experts,
                self.dspark_n_activated_experts or self.n_activated_experts)

    @property
    def n_hash_cols(self) -> int:
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads
