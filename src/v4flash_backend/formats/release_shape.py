"""A checkpoint with the release's layout but none of its bytes.

`write_sparse_checkpoint(dir, specs)` lays out the official safetensors files -- tensor names,
safetensors dtypes, shapes, `model-XXXXX-of-YYYYY.safetensors` shards and the
`model.safetensors.index.json` weight map -- for any list of (name, shape, dtype) (e.g.
`parallel.placement.tensor_specs(cfg)` of the V4.1-Flash config), and writes only each file's
header: the data region is made by extending the file with `truncate`, so the file system stores a
hole. The files' apparent size is the release's (~500 GB for V4.1-Flash), their disk use a few MB
of headers, and every tensor reads as zeros through `CheckpointReader` -- the same code path, file
format and slicing as the real checkpoint.

All-zero data is a valid checkpoint in every dtype the layout uses: e4m3fn, bf16, f32 and the
packed MXFP4 int8 zero bytes are 0.0, and the zero byte of F8_E8M0 is the scale 2^-127 (finite;
only 0xFF is NaN), so dequantizing a zero weight with a zero scale gives exact zeros. That is
meaningless numerically and fine for what this is for: shapes, dtypes, per-rank slicing and
resident bytes at release scale.

Reading such a file costs memory like the real one (the loader copies each slice it reads), but
never disk: reads of a hole are served from zero pages.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from .checkpoint import INDEX_NAME, SINGLE_NAME, ST_TO_TORCH, CheckpointError, _checkpoint_files

DEFAULT_SHARD_BYTES = 5 * 1024 ** 3  # the official shards are a few GB each; 5 GiB gives ~100 files


@dataclass(frozen=True)
class SparseCheckpoint:
    path: Path
    files: list[Path]  # safetensors files, then the index (when sharded)
    tensors: int
    data_bytes: int  # sum of tensor sizes (what the release's bytes would be)

    def apparent_bytes(self) -> int:
        """Sum of the files' sizes as `ls -l` shows them."""
        return sum(p.stat().st_size for p in self.files)

    def disk_bytes(self) -> int:
        """Blocks the files actually occupy (`du`): st_blocks is in 512-byte units on Linux."""
        return sum(p.stat().st_blocks * 512 for p in self.files)


def _itemsize(name: str, st_dtype: str) -> int:
    dt = ST_TO_TORCH.get(st_dtype)
    if dt is None:
        raise CheckpointError(f"tensor {name!r}: unsupported safetensors dtype {st_dtype!r}")
    return dt.itemsize


def _header_bytes(entries: list[tuple[str, tuple[int, ...], str, int, int]]) -> bytes:
    """The JSON header of one file, padded with spaces to a multiple of 8 bytes (as safetensors
    writes it, so the data region starts aligned)."""
    header = {"__metadata__": {"format": "pt"}}
    for name, shape, st, a, b in entries:
        header[name] = {"dtype": st, "shape": list(shape), "data_offsets": [a, b]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * ((-len(raw)) % 8)


def _write_file(target: Path, entries) -> None:
    head = _header_bytes(entries)
    size = entries[-1][4] if entries else 0
    tmp = target.with_name(target.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        # extend to the full data size without writing it: the data region is a hole of zeros
        f.truncate(8 + len(head) + size)
    os.replace(tmp, target)  # never leave a half-written file under the real name


def write_sparse_checkpoint(
    path: str | os.PathLike,
    specs: Iterable[tuple[str, Iterable[int], str]],
    max_shard_bytes: int | None = DEFAULT_SHARD_BYTES,
    overwrite: bool = False,
) -> SparseCheckpoint:
    """Write a zero-filled sparse checkpoint of `specs` [(name, shape, safetensors dtype)].

    Sharding follows `checkpoint.write_checkpoint`: tensors in name order fill shards greedily up to
    `max_shard_bytes` of data (a larger tensor gets a shard of its own); one shard is a single
    `model.safetensors` without an index. `overwrite` deletes an existing checkpoint's files first."""
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    stale = _checkpoint_files(d)
    if stale and not overwrite:
        raise CheckpointError(f"{d} already holds a checkpoint ({sorted(p.name for p in stale)}); pass overwrite=True")
    items = []
    seen = set()
    for name, shape, st in specs:
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise CheckpointError(f"bad tensor name {name!r}")
        if name in seen:
            raise CheckpointError(f"tensor {name!r} listed twice")
        seen.add(name)
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise CheckpointError(f"tensor {name!r}: negative size in shape {list(shape)}")
        items.append((name, shape, st, math.prod(shape) * _itemsize(name, st)))
    items.sort()

    groups: list[list] = [[]]
    group_bytes = 0
    for it in items:
        if max_shard_bytes is not None and groups[-1] and group_bytes + it[3] > max_shard_bytes:
            groups.append([])
            group_bytes = 0
        groups[-1].append(it)
        group_bytes += it[3]

    for p in stale:
        p.unlink()

    def layout(group):
        out, off = [], 0
        for name, shape, st, n in group:
            out.append((name, shape, st, off, off + n))
            off += n
        return out

    files: list[Path] = []
    if len(groups) == 1:
        _write_file(d / SINGLE_NAME, layout(groups[0]))
        files.append(d / SINGLE_NAME)
    else:
        weight_map = {}
        for i, group in enumerate(groups):
            fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            _write_file(d / fname, layout(group))
            files.append(d / fname)
            weight_map.update({it[0]: fname for it in group})
        index = {"metadata": {"total_size": sum(it[3] for it in items)},
                 "weight_map": dict(sorted(weight_map.items()))}
        (d / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        files.append(d / INDEX_NAME)
    return SparseCheckpoint(d, files, len(items), sum(it[3] for it in items))


def drop_page_cache(files: Iterable[os.PathLike]) -> None:
    """Ask the kernel to drop the (clean, zero) page-cache pages reading the holes created, so a
    release-size read leaves nothing behind for the other processes of a shared machine."""
    for p in files:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except (OSError, AttributeError):
            pass
        finally:
            os.close(fd)
