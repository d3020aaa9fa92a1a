"""The placement report: tensor inventory from a config, bytes per rank against shards actually
loaded, cache bytes against a real ModelState, and the release numbers against independent
arithmetic from the layout's definition."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from v4flash_backend.config import ModelConfig
from v4flash_backend.formats.checkpoint import CheckpointReader
from v4flash_backend.parallel import placement
from v4flash_backend.parallel.layout import Layout, load_shard

SRC = Path(__file__).resolve().parents[1] / "src"
LAST = re.compile(r"^placement: world=(\d+) max_gib_per_rank=([\d.]+) world_allreduce_per_step=(\d+) "
                  r"group_allreduce_per_step=(\d+)$")


def test_tensor_specs_match_the_golden_checkpoint(golden_dir):
    cfg = ModelConfig.from_json(golden_dir)
    with CheckpointReader(golden_dir) as r:
        disk = {n: (r.info(n).shape, r.info(n).st_dtype) for n in r.keys()}
    mine = {n: (s, d) for n, s, d in placement.tensor_specs(cfg)}
    assert mine == disk


@pytest.mark.parametrize("world", [1, 2, 4])
def test_rank_bytes_equal_the_loaded_shards(golden_dir, world):
    cfg = ModelConfig.from_json(golden_dir)
    predicted = placement.all_rank_bytes(cfg, world)
    with CheckpointReader(golden_dir) as r:
        for rank in range(world):
            got = dict.fromkeys(placement.COMPONENTS, 0)
            for name, t in load_shard(r, cfg, Layout(rank, world)).items():
                got[placement.component(name)] += t.numel() * t.element_size()
            assert got == predicted[rank], (world, rank)


def _state_bytes(st) -> int:
    total = 0
    for v in vars(st).values():
        for t in (v.values() if isinstance(v, dict) else [v]):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


@pytest.mark.parametrize("slots,max_len", [(3, 100), (1, 257)])
def test_cache_bytes_equal_a_real_model_state(golden_dir, slots, max_len):
    from v4flash_backend.model.state import ModelState

    cfg = ModelConfig.from_json(golden_dir)
    assert placement.cache_bytes(cfg, slots, max_len) == _state_bytes(ModelState(cfg, slots, max_len))


@pytest.fixture(scope="module")
def release():
    cfg = ModelConfig.release()
    return cfg, placement.all_rank_bytes(cfg, 64)


def test_release_bytes_follow_the_layout(release):
    cfg, per_rank = release
    D, inter = cfg.dim, cfg.moe_inter_dim
    # MXFP4 expert: 3 matrices of inter x D at half a byte per value + one e8m0 scale per 32
    expert = 3 * inter * D * (1 / 2 + 1 / 32)
    local = 384 // 64 * cfg.n_layers + 128 // 64 * cfg.n_mtp_layers
    assert all(b["experts"] == local * expert for b in per_rank)
    row = cfg.engram_head_dim + cfg.engram_head_dim // 32  # fp8 row + its e8m0 scales
    # ceil-sized row chunks, the last one padded to the same size: one table shape on every rank (a
    # graph input of the rank-agnostic graphs), at most 63 zero rows per table over the exact split
    chunk = sum(-(-n // 64) for n in cfg.engram_num_embeddings) * row
    assert all(b["engram_rows"] == chunk for b in per_rank)
    assert 0 <= 64 * chunk - sum(cfg.engram_num_embeddings) * row <= 63 * len(cfg.engram_num_embeddings) * row
    # vocab shard padded to 2048 rows (129280 / 64 = 2020): bf16 embedding + fp32 head
    assert all(b["embed_head"] == 2048 * D * (2 + 4) for b in per_rank)
    assert len({b["attention"] for b in per_rank}) == 1  # every attention group holds the same split


def test_release_report_last_line(release):
    cfg, per_rank = release
    lines = placement.report(cfg, 64, 65536, 8, "release")
    m = LAST.match(lines[-1])
    assert m, lines[-1]
    caches = placement.cache_bytes(cfg, 9, 65536)
    assert float(m.group(2)) == pytest.approx(max(sum(b.values()) for b in per_rank) / 2 ** 30 + caches / 2 ** 30,
                                              abs=0.006)
    # per decode step: embed with the 2 Engram layers' lookups (one all-reduce) + one MoE per layer,
    # and the draft's embed + one MoE per stage (47 before the fold); the group: wo_b per layer and
    # per stage + the indexer per index layer and sequence
    assert int(m.group(3)) == 1 + 40 + 1 + 3
    assert int(m.group(4)) == 40 + 8 * 8 + 3
    assert any("13.9 GiB/rank" in line for line in lines)


def test_cli_module_on_the_golden_config(golden_dir):
    r = subprocess.run([sys.executable, "-m", "v4flash_backend", "placement", "--config", str(golden_dir),
                        "--world-size", "4", "--max-model-len", "256", "--max-num-seqs", "2"],
                       capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(SRC)})
    assert r.returncode == 0, r.stderr
    m = LAST.match(r.stdout.strip().splitlines()[-1])
    cfg = ModelConfig.from_json(golden_dir)
    assert m and int(m.group(1)) == 4
    # embed + Engram lookups (one collective), a MoE per layer; the draft: embed, a MoE per stage
    assert int(m.group(3)) == 1 + cfg.n_layers + 1 + cfg.n_mtp_layers
    r = subprocess.run([sys.executable, "-m", "v4flash_backend", "placement", "--world-size", "12"],
                       capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(SRC)})
    assert r.returncode != 0 and "multiple of 8" in r.stderr


def test_unsplittable_config_is_refused():
    cfg = ModelConfig.release()
    with pytest.raises(ValueError, match="cannot be split"):
        placement.rank_bytes(ModelConfig.from_dict({**cfg.to_dict(), "n_heads": 60, "o_groups": 6}), Layout(0, 8))
