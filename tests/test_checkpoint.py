"""Checkpoint reader/writer: round trips, the golden v41-tiny checkpoint, shard-only reads, errors.

All data comparisons are bit-exact (tensors compared as raw bytes), since nothing is converted.
"""

import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import v4flash_backend.formats.checkpoint as ckpt
from v4flash_backend.formats.checkpoint import (
    CheckpointError,
    CheckpointReader,
    shard_range,
    write_checkpoint,
)

GOLDEN = Path("/work/shared/golden/v41-tiny")
SRC = Path(__file__).resolve().parents[1] / "src"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of a tensor (torch.equal does not cover every float8 dtype)."""
    t = t.contiguous()
    return t.view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))


def _sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g)
    return {
        # dense fp8 weight + E8M0 block scale [ceil(96/32), ceil(64/32)]
        "layers.0.attn.wq_a.weight": w.to(torch.float8_e4m3fn),
        "layers.0.attn.wq_a.scale": torch.randint(110, 130, (3, 2), dtype=torch.uint8, generator=g).view(
            torch.float8_e8m0fnu
        ),
        # MXFP4 expert: I8 [out, in/2] + E8M0 [out, in/32]
        "layers.0.ffn.experts.0.w1.weight": torch.randint(-128, 128, (64, 32), dtype=torch.int8, generator=g),
        "layers.0.ffn.experts.0.w1.scale": torch.randint(110, 130, (64, 2), dtype=torch.uint8, generator=g).view(
            torch.float8_e8m0fnu
        ),
        "embed.weight": torch.randn(200, 64, generator=g).to(torch.bfloat16),
        "layers.0.attn.attn_sink": torch.randn(4, generator=g),
        "step": torch.tensor(7, dtype=torch.int64),  # 0-d tensor
        # a view into a larger buffer and two views of one buffer: must still be written
        "view_a": w[:10, :5],
        "view_b": w[10:20],
    }


# ------------------------------------------------------------------ round trips


def test_round_trip_single_file(tmp_path):
    tensors = _sample_tensors()
    written = write_checkpoint(tmp_path, tensors)
    assert [p.name for p in written] == ["model.safetensors"]
    assert not (tmp_path / "model.safetensors.index.json").exists()
    with CheckpointReader(tmp_path) as r:
        assert r.keys() and sorted(r.keys()) == sorted(tensors)
        for name, t in tensors.items():
            assert r.dtype(name) == t.dtype and r.shape(name) == tuple(t.shape)
            assert _same(r.get(name), t), name
    # a file path works as well as its directory
    with CheckpointReader(tmp_path / "model.safetensors") as r:
        assert _same(r.get("embed.weight"), tensors["embed.weight"])


def test_round_trip_sharded(tmp_path):
    tensors = _sample_tensors()
    limit = 16_000  # bytes; embed (25.6 kB) is larger than that and must get a shard of its own
    written = write_checkpoint(tmp_path, tensors, max_shard_bytes=limit)
    shards = sorted(p.name for p in written if p.suffix == ".safetensors")
    n = len(shards)
    assert n >= 3
    assert shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    assert set(index["weight_map"]) == set(tensors)
    per_file: dict[str, int] = {}
    for name, f in index["weight_map"].items():
        per_file[f] = per_file.get(f, 0) + tensors[name].nbytes
        with safe_open(str(tmp_path / f), "pt") as h:  # the index points at the file that holds it
            assert name in h.keys()
    for f, size in per_file.items():
        names = [k for k, v in index["weight_map"].items() if v == f]
        assert size <= limit or len(names) == 1, (f, size, names)
    with CheckpointReader(tmp_path) as r:
        assert len(r) == len(tensors)
        for name, t in tensors.items():
            assert _same(r.get(name), t), name
        assert r.info("embed.weight").file != r.info("layers.0.attn.wq_a.weight").file


def test_write_refuses_to_mix_with_existing_checkpoint(tmp_path):
    tensors = _sample_tensors()
    write_checkpoint(tmp_path, tensors, max_shard_bytes=16_000)
    with pytest.raises(CheckpointError, match="already holds a checkpoint"):
        write_checkpoint(tmp_path, tensors)
    # overwrite replaces the sharded checkpoint by a single file and removes the old shards + index
    (tmp_path / "notes.txt").write_text("kept")
    write_checkpoint(tmp_path, {"x": torch.ones(3)}, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "notes.txt"]
    with CheckpointReader(tmp_path) as r:
        assert r.keys() == ["x"]


# ------------------------------------------------------------------ golden checkpoint


def test_golden_checkpoint_metadata():
    index = json.loads((GOLDEN / "model.safetensors.index.json").read_text())
    with CheckpointReader(GOLDEN) as r:
        assert len(r) == 990
        # header-derived sizes agree with the index's total_size
        assert sum(r.info(k).nbytes for k in r.keys()) == index["metadata"]["total_size"] == 5386200
        # storage formats of README section 4 (tiny dims: dim 128, q_lora 64, moe_inter 64, engram hd 64)
        r.expect("embed.weight", (1024, 128), torch.bfloat16)
        r.expect("layers.0.attn.wq_a.weight", (64, 128), torch.float8_e4m3fn)
        r.expect("layers.0.attn.wq_a.scale", (2, 4), torch.float8_e8m0fnu)
        r.expect("layers.0.ffn.experts.0.w1.weight", (64, 64), torch.int8)  # [out, in/2]
        r.expect("layers.0.ffn.experts.0.w1.scale", (64, 4), "F8_E8M0")  # [out, in/32]
        r.expect("layers.1.engram.embed.weight", (3144, 64), "F8_E4M3")  # rows = engram_num_embeddings[0]
        r.expect("layers.1.engram.embed.scale", (3144, 2), "F8_E8M0")
        r.expect("layers.4.engram.embed.weight", (3424, None), torch.float8_e4m3fn)
        r.expect("layers.0.attn.attn_sink", (4,), torch.float32)
        assert r.info("layers.9.ffn.shared_experts.w2.weight").file == "model-00002-of-00002.safetensors"
        # data from both shards equals a direct read of the file
        for name in ("layers.1.engram.embed.scale", "layers.9.ffn.shared_experts.w2.weight"):
            with safe_open(str(GOLDEN / r.info(name).file), "pt") as h:
                assert _same(r.get(name), h.get_tensor(name))


# ------------------------------------------------------------------ shard-only reads


class _SpySlice:
    def __init__(self, real, name, log):
        self._real, self._name, self._log = real, name, log

    def get_shape(self):
        return self._real.get_shape()

    def get_dtype(self):
        return self._real.get_dtype()

    def __getitem__(self, key):
        out = self._real[key]
        self._log.append(("slice", self._name, key, out.nbytes))
        return out


class _SpyHandle:
    """Wraps a real safe_open handle and records every data access."""

    def __init__(self, real, log):
        self._real, self._log = real, log

    def keys(self):
        return self._real.keys()

    def get_tensor(self, name):
        self._log.append(("get_tensor", name))
        return self._real.get_tensor(name)

    def get_slice(self, name):
        return _SpySlice(self._real.get_slice(name), name, self._log)

    def __exit__(self, *a):
        return self._real.__exit__(*a)


@pytest.fixture
def spy(monkeypatch):
    log, opens = [], []

    def fake_open(path, framework, device="cpu"):
        opens.append(os.path.basename(path))
        return _SpyHandle(ckpt._st_safe_open(path, framework=framework, device=device), log)

    monkeypatch.setattr(ckpt, "_safe_open", fake_open)
    return log, opens


def test_shard_loads_read_only_the_shard(spy):
    log, opens = spy
    name = "layers.1.engram.embed.weight"  # [3144, 64] fp8, rows split with ceil
    with safe_open(str(GOLDEN / "model-00001-of-00002.safetensors"), "pt") as h:
        full = h.get_tensor(name)
        dense = h.get_tensor("layers.1.engram.wkv.weight")  # [640, 384] fp8
    with CheckpointReader(GOLDEN) as r:
        parts = [r.get_shard(name, 0, rank, 4) for rank in range(4)]
        cols = r.get_shard("layers.1.engram.wkv.weight", 1, 2, 3)  # columns 256..383
    # every access went through get_slice with exactly the shard's extent; never get_tensor
    assert [e[0] for e in log] == ["slice"] * 5
    assert [e[2] for e in log[:4]] == [(slice(0, 786),), (slice(786, 1572),), (slice(1572, 2358),),
                                       (slice(2358, 3144),)]
    assert log[4][2] == (slice(None), slice(256, 384))
    # and what came back is only the shard: own compact storage, not a view of the full tensor
    for part in parts + [cols]:
        assert part.is_contiguous()
        assert part.untyped_storage().nbytes() == part.nbytes
    assert [p.shape[0] for p in parts] == [786, 786, 786, 786]
    assert _same(torch.cat(parts), full)
    assert _same(cols, dense[:, 256:384])
    assert opens == ["model-00001-of-00002.safetensors"]  # one handle for all five reads


def test_each_file_opened_once(spy):
    log, opens = spy
    with CheckpointReader(GOLDEN) as r:
        for name in r.keys()[:50] + r.keys()[-50:]:
            r.get(name)
        r.get_rows("layers.9.ffn.shared_experts.w2.weight", 0, 32)
    assert sorted(opens) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def test_results_do_not_alias_the_file_mapping(tmp_path):
    write_checkpoint(tmp_path, {"w": torch.arange(8, dtype=torch.float32)})
    with CheckpointReader(tmp_path) as r:
        a = r.get("w")
        a += 100  # an in-place edit of one result ...
        assert r.get("w").tolist() == list(range(8))  # ... never leaks into later reads
        assert r.get_rows("w", 2, 4).tolist() == [2.0, 3.0]


_RSS_PROBE = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[1])
    from v4flash_backend.formats.checkpoint import CheckpointReader

    def reset_peak():
        # writing 5 to clear_refs resets VmHWM (peak RSS) to the current RSS (Linux >= 4.0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    def peak_growth_mib(before_kib):
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return (int(line.split()[1]) - before_kib) / 1024

    def rss_kib():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1])

    r = CheckpointReader(sys.argv[2])
    try:
        reset_peak()
    except OSError:
        print("no-clear-refs")
        sys.exit(0)
    base = rss_kib()
    part = r.get_shard("big", 0, 5, 16)
    assert part.shape == (512, 8192) and not bool(part[-1].any())
    shard = peak_growth_mib(base)
    del part
    reset_peak()
    base = rss_kib()
    whole = r.get("big")
    assert whole.shape == (8192, 8192) and not bool(whole[-1].any())
    print(shard, peak_growth_mib(base))
    """
)


@pytest.mark.slow  # ~4 s, nearly all of it the child process importing torch
def test_shard_load_peak_memory(tmp_path):
    """Physical check in a fresh process: a 128 MiB tensor in a sparse file; loading 1/16 of its
    rows (8 MiB) must raise peak RSS far less than loading the whole tensor does (the control).
    Complements the spy test above: this one would also catch a full read hidden inside a library
    call, the spy one catches a full read that safetensors' lazy memory map would hide from RSS."""
    rows, cols = 8192, 8192  # bf16 -> 128 MiB of data, a hole on disk
    header = json.dumps({"big": {"dtype": "BF16", "shape": [rows, cols], "data_offsets": [0, rows * cols * 2]}})
    header = header.encode() + b" " * (-len(header) % 8)
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + rows * cols * 2)
    res = subprocess.run(
        [sys.executable, "-c", _RSS_PROBE, str(SRC), str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    if res.stdout.strip() == "no-clear-refs":
        pytest.skip("cannot reset the peak-RSS counter (/proc/self/clear_refs) here")
    shard_mib, full_mib = map(float, res.stdout.split())
    # shard: its 8 MiB copy (a sparse file is read with positioned reads, no mapped pages); the bound
    # leaves room for allocator noise and for 8 MiB of mapped pages on a reader that maps it
    assert shard_mib < 40, shard_mib
    # control: the whole tensor (its 128 MiB copy) is plainly visible to this measurement
    assert full_mib > 100, full_mib


def test_shard_range():
    assert [shard_range(3144, r, 4) for r in range(4)] == [(0, 786), (786, 1572), (1572, 2358), (2358, 3144)]
    assert [shard_range(10, r, 4) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert [shard_range(2, r, 4) for r in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]
    with pytest.raises(ValueError):
        shard_range(8, 4, 4)


# ------------------------------------------------------------------ errors


def test_expect_errors_are_clear():
    with CheckpointReader(GOLDEN) as r:
        with pytest.raises(CheckpointError) as e:
            r.expect("layers.0.attn.wq_c.weight", (64, 128), torch.float8_e4m3fn)
        assert "'layers.0.attn.wq_c.weight'" in str(e.value) and "missing" in str(e.value)
        with pytest.raises(CheckpointError) as e:
            r.expect("layers.0.attn.wq_a.weight", (128, 64), torch.float8_e4m3fn)
        msg = str(e.value)
        assert "'layers.0.attn.wq_a.weight'" in msg and "expected shape [128, 64], got [64, 128]" in msg
        with pytest.raises(CheckpointError) as e:
            r.expect("embed.weight", (1024, 128), torch.float8_e4m3fn)
        assert "'embed.weight'" in str(e.value) and "expected dtype F8_E4M3, got BF16" in str(e.value)
        with pytest.raises(CheckpointError, match="expected dtype BF16 or F32, got F8_E8M0"):
            r.expect("layers.0.attn.wq_a.scale", None, (torch.bfloat16, torch.float32))
        with pytest.raises(CheckpointError, match="expected shape"):
            r.expect("layers.0.attn.attn_sink", (4, 1))  # rank mismatch
        with pytest.raises(CheckpointError, match="missing"):
            r.get("nope")
        with pytest.raises(CheckpointError, match=r"slice \[0:65\] out of range"):
            r.get_rows("layers.0.attn.wq_a.weight", 0, 65)
        # get() checks the expectation before reading
        with pytest.raises(CheckpointError, match="expected dtype F32"):
            r.get("embed.weight", dtype=torch.float32)


def test_broken_checkpoints_are_reported(tmp_path):
    write_checkpoint(tmp_path / "a", {"x": torch.ones(2), "y": torch.zeros(3)}, max_shard_bytes=8)
    index_path = tmp_path / "a" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["z"] = index["weight_map"]["x"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="'z'"):
        CheckpointReader(tmp_path / "a")
    index["weight_map"]["z"] = "model-00009-of-00009.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model-00009-of-00009.safetensors.*missing"):
        CheckpointReader(tmp_path / "a")
    with pytest.raises(CheckpointError, match="does not exist"):
        CheckpointReader(tmp_path / "nothing")
    (tmp_path / "b").mkdir()
    with pytest.raises(CheckpointError, match="exactly one .safetensors"):
        CheckpointReader(tmp_path / "b")


def test_sparse_files_read_their_data_and_zero_their_holes(tmp_path):
    """A sparse file (a release-shaped test checkpoint) is read with positioned reads that skip its
    holes (SEEK_DATA / SEEK_HOLE) and zero the destination there: the tensors must equal the file's
    bytes, with data written across hole boundaries, in whole tensors, row ranges and column slices."""
    from v4flash_backend.formats.release_shape import write_sparse_checkpoint

    sc = write_sparse_checkpoint(tmp_path, [("a", (1024, 2048), "F32"), ("b", (4, 3), "I64")])
    (path,) = [p for p in sc.files if p.suffix == ".safetensors"]
    with CheckpointReader(tmp_path) as r:
        base = r._handle(path.name)._base
        off = r._handle(path.name)._meta["a"]["data_offsets"][0]
    gen = torch.Generator().manual_seed(0)
    with open(path, "r+b") as f:  # data islands: inside a block, across a block edge, a run of blocks
        for at, n in ((5, 100), (4096 * 37 - 9, 30), (2048 * 4 * 300 + 4, 3 * 4096 + 17)):
            f.seek(base + off + at)
            f.write(torch.randint(1, 255, (n,), dtype=torch.uint8, generator=gen).numpy().tobytes())
    assert path.stat().st_blocks * 512 < path.stat().st_size // 8  # still sparse
    raw = path.read_bytes()
    want = torch.frombuffer(bytearray(raw[base + off: base + off + 1024 * 2048 * 4]), dtype=torch.float32)
    want = want.view(1024, 2048)
    assert int((want.view(torch.int32) != 0).sum()) > 3000
    with CheckpointReader(tmp_path) as r:
        assert isinstance(r._handle(path.name), ckpt._PreadHandle)  # the hole-skipping reader
        assert _same(r.get("a"), want)
        assert _same(r.get_rows("a", 290, 310), want[290:310])
        assert _same(r.get_cols("a", 1000, 1100), want[:, 1000:1100])
        assert torch.equal(r.get("b"), torch.zeros(4, 3, dtype=torch.int64))
