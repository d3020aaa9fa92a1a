"""Reading and writing DeepSeek-V4.1 safetensors checkpoints.

Layout (golden README section 4, notes section 4): official names without a `model.` prefix, a
single `*.safetensors` file or shards listed by `model.safetensors.index.json` (`weight_map`:
tensor name -> file, `metadata.total_size`). Storage dtypes: F8_E4M3 weights with F8_E8M0 block
scales, I8-packed MXFP4 experts, BF16 and F32; this module moves them as they are (no conversion).

Tensor-parallel ranks load only their shard: `get_slice` indexes the safetensors slice object
(never `get_tensor`), so only the requested byte ranges are read, and returns them as a compact
tensor of its own, so a full tensor is never materialised.

Every returned tensor owns its memory. safetensors 0.8 (observed) hands out views of a copy-on-write
memory map of the file that are shared within the process: an in-place edit of one result would
show up in every later read of the same bytes, and a small shard would keep the whole tensor's
mapping alive. Copying once on read rules both out.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import torch
from safetensors import safe_open as _st_safe_open
from safetensors.torch import save_file

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")

# safetensors dtype strings <-> torch dtypes (those a V4.1 checkpoint or a test may hold)
ST_TO_TORCH: dict[str, torch.dtype] = {
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E8M0": torch.float8_e8m0fnu,
    "F8_E5M2": torch.float8_e5m2,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "BOOL": torch.bool,
}
TORCH_TO_ST = {v: k for k, v in ST_TO_TORCH.items()}

# Indirection so tests can wrap the file handles and observe every read.
_safe_open = _st_safe_open


class CheckpointError(Exception):
    """A checkpoint does not match what the caller expects (missing, misshaped, wrong dtype...)."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: str  # file name inside the checkpoint directory
    st_dtype: str  # safetensors dtype string, e.g. "F8_E4M3"
    shape: tuple[int, ...]

    @property
    def dtype(self) -> torch.dtype | None:
        return ST_TO_TORCH.get(self.st_dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize if self.dtype is not None else 0


def read_header(path: str | os.PathLike) -> dict:
    """The JSON header of a safetensors file (8-byte little-endian length, then JSON).
    Reads only the header bytes, never tensor data."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw)
        size = os.fstat(f.fileno()).st_size
        if n > size - 8:
            raise CheckpointError(f"{path}: header length {n} exceeds file size {size}")
        try:
            return json.loads(f.read(n))
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path}: unreadable safetensors header ({e})") from None


def shard_range(size: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, stop) of `rank`'s part of a dimension of `size`, split in ceil-sized chunks (the
    reference splits Engram rows this way; for divisible sizes it is the even split). The last
    ranks may get a shorter or empty part."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"bad rank {rank} for world size {world_size}")
    chunk = -(-size // world_size)
    start = min(size, rank * chunk)
    return start, min(size, start + chunk)


def _dtype_str(dtype) -> str:
    if isinstance(dtype, str):
        return dtype
    if dtype in TORCH_TO_ST:
        return TORCH_TO_ST[dtype]
    raise TypeError(f"unsupported dtype {dtype!r}")


class CheckpointReader:
    """Lazy access to a checkpoint directory (or a single .safetensors file).

    Metadata (names, dtypes, shapes) comes from the file headers; data is read on request through
    one `safe_open` handle per file, opened on first use and kept until `close()`.
    """

    def __init__(self, path: str | os.PathLike):
        path = Path(path)
        self.path = path
        if path.is_file():
            self.dir, files = path.parent, {path.name: None}
            weight_map = None
        elif path.is_dir():
            self.dir = path
            index = path / INDEX_NAME
            if index.exists():
                try:
                    weight_map = json.loads(index.read_text())["weight_map"]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise CheckpointError(f"{index}: no readable weight_map ({e!r})") from None
                files = {f: None for f in sorted(set(weight_map.values()))}
            else:
                found = sorted(p.name for p in path.glob("*.safetensors"))
                if len(found) != 1:
                    raise CheckpointError(
                        f"{path}: expected {INDEX_NAME} or exactly one .safetensors file, found {found}"
                    )
                files, weight_map = {found[0]: None}, None
        else:
            raise CheckpointError(f"checkpoint path {path} does not exist")

        self._infos: dict[str, TensorInfo] = {}
        for fname in files:
            fpath = self.dir / fname
            if not fpath.is_file():
                raise CheckpointError(f"{fpath}: listed in {INDEX_NAME} but missing")
            for name, meta in read_header(fpath).items():
                if name == "__metadata__":
                    continue
                if weight_map is not None and weight_map.get(name) != fname:
                    continue  # the index is authoritative; stray tensors are not part of the model
                if name in self._infos:
                    raise CheckpointError(f"tensor {name!r} in both {self._infos[name].file} and {fname}")
                self._infos[name] = TensorInfo(name, fname, meta["dtype"], tuple(meta["shape"]))
        if weight_map is not None:
            missing = [n for n in weight_map if n not in self._infos]
            if missing:
                raise CheckpointError(
                    f"{len(missing)} tensors of {INDEX_NAME} are absent from their files, e.g. "
                    f"{missing[0]!r} (expected in {weight_map[missing[0]]})"
                )
        self._handles: dict[str, object] = {}

    # -- metadata ---------------------------------------------------------------------------------

    def keys(self) -> list[str]:
        return list(self._infos)

    def __contains__(self, name: str) -> bool:
        return name in self._infos

    def __len__(self) -> int:
        return len(self._infos)

    def __iter__(self):
        return iter(self._infos)

    def info(self, name: str) -> TensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise CheckpointError(f"tensor {name!r} is missing from checkpoint {self.path}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self.info(name).shape

    def dtype(self, name: str) -> torch.dtype:
        info = self.info(name)
        if info.dtype is None:
            raise CheckpointError(f"tensor {name!r} has unsupported dtype {info.st_dtype}")
        return info.dtype

    def expect(
        self,
        name: str,
        shape: Sequence[int | None] | None = None,
        dtype: torch.dtype | str | Iterable[torch.dtype | str] | None = None,
    ) -> TensorInfo:
        """Check `name` exists with `shape` (None entries match any size) and `dtype` (one dtype or
        a collection of accepted ones). Raises CheckpointError naming the tensor, the expectation
        and what the checkpoint holds."""
        info = self.info(name)
        if shape is not None:
            shape = tuple(shape)
            ok = len(shape) == len(info.shape) and all(e is None or e == g for e, g in zip(shape, info.shape))
            if not ok:
                raise CheckpointError(
                    f"tensor {name!r}: expected shape {list(shape)}, got {list(info.shape)} (in {info.file})"
                )
        if dtype is not None:
            accepted = [dtype] if isinstance(dtype, (str, torch.dtype)) else list(dtype)
            accepted_st = [_dtype_str(d) for d in accepted]
            if info.st_dtype not in accepted_st:
                want = accepted_st[0] if len(accepted_st) == 1 else " or ".join(accepted_st)
                raise CheckpointError(f"tensor {name!r}: expected dtype {want}, got {info.st_dtype} (in {info.file})")
        return info

    # -- data -------------------------------------------------------------------------------------

    def _handle(self, fname: str):
        h = self._handles.get(fname)
        if h is None and _is_sparse(self.dir / fname):
            # Copying out of a map of a file's holes makes the kernel allocate and zero a page-cache
            # page per 4 KiB (~0.5 GB/s on the release-shaped test checkpoint, 474 GiB apparent);
            # positioned reads skip the holes and zero the destination instead.
            h = self._handles[fname] = _PreadHandle(self.dir / fname, sparse=True)
        if h is None:
            try:
                h = _safe_open(str(self.dir / fname), framework="pt", device="cpu")
            except (OSError, RuntimeError) as e:
                # safetensors maps the whole file copy-on-write; a file larger than RAM + swap (a
                # V4.1 Engram table is one 98 GB tensor) is refused under the kernel's default
                # heuristic overcommit. Fall back to positioned reads of the requested bytes only.
                if "mmap" not in str(e):
                    raise
                h = _PreadHandle(self.dir / fname)
            self._handles[fname] = h
        return h

    def get(self, name: str, shape=None, dtype=None) -> torch.Tensor:
        """The whole tensor (optionally checked with `expect` first)."""
        info = self.expect(name, shape, dtype)
        h = self._handle(info.file)
        t = h.get_tensor(name)
        return t if isinstance(h, _PreadHandle) else t.clone(memory_format=torch.contiguous_format)

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """tensor[..., start:stop, ...] along `dim`, reading only those bytes; the result is
        contiguous and its storage holds exactly the slice."""
        info = self.info(name)
        ndim = len(info.shape)
        if not -ndim <= dim < ndim:
            raise CheckpointError(f"tensor {name!r}: dim {dim} out of range for shape {list(info.shape)}")
        dim %= ndim
        size = info.shape[dim]
        if not 0 <= start <= stop <= size:
            raise CheckpointError(
                f"tensor {name!r}: slice [{start}:{stop}] out of range for dim {dim} of shape {list(info.shape)}"
            )
        key = (slice(None),) * dim + (slice(start, stop),)
        h = self._handle(info.file)
        view = h.get_slice(name)[key]
        # compact owned copy: touches only the shard's bytes and drops any reference to the mapping
        # (a positioned read already returns one)
        out = view if isinstance(h, _PreadHandle) else view.clone(memory_format=torch.contiguous_format)
        if tuple(out.shape) != info.shape[:dim] + (stop - start,) + info.shape[dim + 1 :]:
            raise CheckpointError(f"tensor {name!r}: slice read returned shape {list(out.shape)}")
        return out

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.get_slice(name, 0, start, stop)

    def get_cols(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.get_slice(name, 1, start, stop)

    def get_shard(self, name: str, dim: int, rank: int, world_size: int) -> torch.Tensor:
        """`rank`'s ceil-split part of `name` along `dim` (see shard_range)."""
        start, stop = shard_range(self.shape(name)[dim], rank, world_size)
        return self.get_slice(name, dim, start, stop)

    # -- lifetime ---------------------------------------------------------------------------------

    def close(self) -> None:
        for h in self._handles.values():
            exit_ = getattr(h, "__exit__", None)
            if exit_ is not None:
                exit_(None, None, None)
        self._handles.clear()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _is_sparse(path: Path) -> bool:
    """A file with under half its size allocated on disk (holes: a release-shaped test checkpoint)."""
    st = os.stat(path)
    return st.st_size > (1 << 20) and st.st_blocks * 512 < st.st_size // 2


class _PreadHandle:
    """The subset of a safetensors handle the reader uses (`get_tensor`, `get_slice(name)[key]`),
    reading with os.pread instead of a memory map: only the requested byte ranges, into a tensor
    that owns its memory. Used for files too large to map and for sparse files, whose holes it
    fills with zeros without reading them (see `CheckpointReader._handle`)."""

    def __init__(self, path: Path, sparse: bool = False):
        self.path = path
        header = read_header(path)
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
        self._base = 8 + n
        self._meta = {k: v for k, v in header.items() if k != "__metadata__"}
        self._fd = os.open(path, os.O_RDONLY)
        self._size = os.fstat(self._fd).st_size
        self._sparse = sparse  # ask where its data is (SEEK_DATA / SEEK_HOLE) before reading

    def _read_into(self, out: torch.Tensor, offset: int) -> None:
        arr = out.view(torch.uint8).numpy() if out.numel() else None
        buf = memoryview(arr).cast("B") if arr is not None else memoryview(b"")
        start = self._base + offset
        done = 0
        while done < len(buf):
            pos = start + done
            data, hole = self._extent(pos)
            if data > pos:  # a hole: zeros, without reading them through the page cache
                end = min(data - start, len(buf))
                arr[done:end] = 0
                done = end
                continue
            got = os.preadv(self._fd, [buf[done:min(hole - start, len(buf))]], pos)
            if got <= 0:
                raise CheckpointError(f"{self.path}: file ends inside tensor data")
            done += got

    def _extent(self, pos: int) -> tuple[int, int]:
        """(where data next starts at or after pos, where that data ends); the whole rest of the
        file is data for a file that is not sparse. Past the last data, (the file's size, ...)."""
        if not self._sparse:
            return pos, pos + (1 << 62)
        try:
            data = os.lseek(self._fd, pos, os.SEEK_DATA)
        except OSError:  # ENXIO: only a hole (or the end) follows
            return max(self._size, pos), pos + (1 << 62)
        return data, os.lseek(self._fd, data, os.SEEK_HOLE)

    def _region(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        meta = self._meta[name]
        dtype, shape = ST_TO_TORCH[meta["dtype"]], tuple(meta["shape"])
        a = meta["data_offsets"][0]
        outer, inner = math.prod(shape[:dim]), math.prod(shape[dim + 1:])
        item = dtype.itemsize
        out = torch.empty(shape[:dim] + (stop - start,) + shape[dim + 1:], dtype=dtype)
        flat = out.view(outer, (stop - start) * inner) if out.numel() else out
        for o in range(outer if out.numel() else 0):  # one contiguous run per outer index
            self._read_into(flat[o], a + (o * shape[dim] + start) * inner * item)
        return out

    def get_tensor(self, name: str) -> torch.Tensor:
        meta = self._meta[name]
        if meta["shape"]:
            return self._region(name, 0, 0, meta["shape"][0])
        out = torch.empty((), dtype=ST_TO_TORCH[meta["dtype"]])  # a 0-d tensor
        self._read_into(out.reshape(1), meta["data_offsets"][0])
        return out

    def get_slice(self, name: str):
        handle = self

        class _Slice:
            def __getitem__(self, key):
                key = key if isinstance(key, tuple) else (key,)
                dim = len(key) - 1
                assert all(k == slice(None) for k in key[:-1]) and key[-1].step in (None, 1)
                return handle._region(name, dim, key[-1].start, key[-1].stop)

        return _Slice()

    def __exit__(self, *exc) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def _checkpoint_files(d: Path) -> list[Path]:
    return [p for p in d.iterdir() if p.name in (SINGLE_NAME, INDEX_NAME) or _SHARD_RE.match(p.name)]


def write_checkpoint(
    path: str | os.PathLike,
    tensors: Mapping[str, torch.Tensor],
    max_shard_bytes: int | None = None,
    overwrite: bool = False,
) -> list[Path]:
    """Write `tensors` as a checkpoint directory in the official layout, dtypes unchanged.

    Without `max_shard_bytes`, or when everything fits in one shard, one `model.safetensors`;
    otherwise `model-XXXXX-of-YYYYY.safetensors` shards (filled greedily in the mapping's order; a
    tensor larger than the limit gets a shard of its own) plus `model.safetensors.index.json`.
    An existing checkpoint in the directory is an error unless `overwrite`, which deletes its
    files first (only the names this function writes). Returns the files written.
    """
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    stale = _checkpoint_files(d)
    if stale and not overwrite:
        raise CheckpointError(f"{d} already holds a checkpoint ({sorted(p.name for p in stale)}); pass overwrite=True")

    prepared: dict[str, torch.Tensor] = {}
    seen_storage: set[int] = set()
    for name, t in tensors.items():
        if not isinstance(name, str) or not name:
            raise CheckpointError(f"bad tensor name {name!r}")
        if t.dtype not in TORCH_TO_ST:
            raise CheckpointError(f"tensor {name!r}: dtype {t.dtype} cannot be stored")
        t = t.detach().to("cpu").contiguous()
        # safetensors refuses tensors sharing memory (views of one buffer); give those their own copy
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen_storage or t.untyped_storage().nbytes() != t.nbytes:
            t = t.clone()
        seen_storage.add(t.untyped_storage().data_ptr())
        prepared[name] = t

    groups: list[list[str]] = [[]]
    group_bytes = 0
    for name, t in prepared.items():
        if max_shard_bytes is not None and groups[-1] and group_bytes + t.nbytes > max_shard_bytes:
            groups.append([])
            group_bytes = 0
        groups[-1].append(name)
        group_bytes += t.nbytes

    for p in stale:
        p.unlink()

    def _save(names: list[str], fname: str) -> Path:
        target = d / fname
        tmp = d / (fname + ".tmp")
        save_file({n: prepared[n] for n in names}, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, target)  # never leave a half-written file under the real name
        return target

    if len(groups) == 1:
        return [_save(groups[0], SINGLE_NAME)]

    written, weight_map = [], {}
    for i, names in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        written.append(_save(names, fname))
        weight_map.update({n: fname for n in names})
    index = {
        "metadata": {"total_size": sum(t.nbytes for t in prepared.values())},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (d / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    written.append(d / INDEX_NAME)
    return written
