import json

import pytest

from v4flash_backend.config import ModelConfig


def test_release_values_match_shared_release_file(golden_dir):
    path = golden_dir.parents[1] / "configs" / "deepseek-v4.1-flash.json"
    cfg = ModelConfig.from_json(path)
    assert cfg == ModelConfig.release()
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.head_dim) == (5120, 40, 64, 512)
    assert cfg.n_routed_experts == 384 and cfg.n_activated_experts == 6
    assert len(cfg.compress_ratios) == 43 and cfg.n_total_layers == 43
    assert cfg.kv_source_of(21) == 20 and cfg.kv_source_of(3) == 2 and cfg.kv_source_of(1) is None


def test_golden_config_loads_field_by_field(golden_dir):
    raw = json.loads((golden_dir / "config.json").read_text())
    cfg = ModelConfig.from_json(golden_dir)
    for k, v in raw.items():
        got = getattr(cfg, k)
        assert (list(got) if isinstance(got, tuple) else got) == v, k
    assert cfg.gate_temp == 1.0 and cfg.norm_topk_prob is True  # reference defaults for absent keys
    assert cfg.moe_shape(10) == (4, 2) and cfg.moe_shape(3) == (8, 3)


def test_roundtrip_and_unknown_keys(tmp_path):
    d = ModelConfig.release().to_dict()
    d["some_future_key"] = 7
    cfg = ModelConfig.from_dict(d)
    assert cfg.extra == {"some_future_key": 7}
    cfg.to_json(tmp_path / "c.json")
    assert ModelConfig.from_json(tmp_path / "c.json") == cfg


def test_invalid_config_is_rejected():
    with pytest.raises(ValueError, match="compress_ratios"):
        ModelConfig(compress_ratios=(0, 0))
