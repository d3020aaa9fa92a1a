"""Tensors of the simulator: a flat NumPy storage plus a strided view (shape, element strides, offset).

Every storage carries a `written` mask next to its data, so reading memory that no instruction (and no
kernel argument) ever wrote is an error rather than a silent NaN. On-chip tensors (SBUF, PSUM) are
[partition, free...] with at most 128 partitions; a view must stay inside its partitions.
"""

import math

import numpy as np

from . import _dtypes as D
from . import _rules as RU
from ._errors import SimError

PMAX = 128
# Per-allocation limits (the live footprint is checked by _rules.Footprint): usable SBUF and the 8 PSUM banks.
SBUF_PARTITION_BYTES = RU.SBUF_USABLE
PSUM_PARTITION_BYTES = RU.PSUM_BANK_BYTES * RU.PSUM_BANKS


class Buffer:
    __slots__ = ("name", "on_chip")

    def __init__(self, name, on_chip):
        self.name, self.on_chip = name, on_chip

    def __repr__(self):
        return f"nl.{self.name}"


sbuf = Buffer("sbuf", True)
psum = Buffer("psum", True)
private_hbm = Buffer("private_hbm", False)
shared_hbm = Buffer("shared_hbm", False)
hbm = private_hbm


class DynSlice:
    """nl.ds(start, size): `size` elements from `start`."""

    __slots__ = ("start", "size")

    def __init__(self, start, size):
        self.start, self.size = int(start), int(size)

    def __repr__(self):
        return f"ds({self.start}, {self.size})"


# Bound on the per-storage caches below (a kernel slicing one big tensor at many offsets must not grow them
# without limit); past it the cache is emptied and refilled.
_CACHE_MAX = 4096
# (shape, strides, new shape) -> (shape, strides) of the no-copy reshape: NumPy's stride arithmetic, once
_RESHAPED = {}


class Storage:
    __slots__ = ("data", "written", "buffer", "name", "shape", "pstride", "full", "views", "owner", "mm",
                 "vcache", "ok", "__weakref__")

    def __init__(self, data, written, buffer, name, shape, full):
        self.data, self.written, self.buffer, self.name, self.shape = data, written, buffer, name, shape
        self.pstride = math.prod(shape[1:])  # elements per partition (on-chip) / per leading row
        self.full = full  # every element written at least once (then reads need no check)
        self.views = {data.dtype: data}  # same-size reinterpretations of `data`
        self.owner = None  # shared_hbm: program id that wrote each element (race detector, _rules R11)
        # PSUM: element last written by a matmul (True) or by another instruction (False) (_rules R10)
        self.mm = np.zeros(len(data), np.bool_) if buffer is psum else None
        # The simulator's cost on small tiles is per-instruction Python overhead, dominated by building the
        # same NumPy views over and over (kernels re-slice one tile identically in every loop iteration).
        # vcache: (kind, view geometry) -> the NumPy view (kind: a dtype, or "w" / "mm" for the masks);
        # ok: geometries whose elements are all written. `written` only ever turns True, so an entry of
        # `ok` never goes stale, and a write into such a region needs no mask update.
        self.vcache = {}
        self.ok = set()

    def typed(self, dt):
        v = self.views.get(dt)
        if v is None:
            v = self.views[dt] = self.data.view(dt)
        return v


_NAN_OK = {}


def _sentinel(n, dt):
    nan_ok = _NAN_OK.get(dt)
    if nan_ok is None:
        nan_ok = _NAN_OK[dt] = not D.is_int(dt) and bool(np.isnan(np.array([np.nan], np.float32).astype(dt))[0])
    # np.empty + fill: the same bytes as np.full at a fraction of its Python overhead (one per allocation)
    if nan_ok:
        a = np.empty(n, dt)
        a.fill(np.nan)
        return a
    a = np.empty(n * dt.itemsize, np.uint8)
    a.fill(0x5A)
    return a.view(dt)


def allocate(shape, dtype, buffer, name=""):
    shape = tuple(map(int, shape))
    dt = D.normalize(dtype)
    RU.check_dtype(dt, f"tensor {name!r}")
    if not isinstance(buffer, Buffer):
        raise SimError(f"unknown buffer {buffer!r}")
    if not shape or min(shape) <= 0:
        raise SimError(f"tensor {name!r}: shape {shape} must be non-empty with positive sizes")
    if buffer.on_chip:
        if shape[0] > PMAX:
            raise SimError(f"tensor {name!r}: partition dim {shape[0]} > {PMAX} in {buffer}")
        per_part = math.prod(shape[1:]) * dt.itemsize
        limit = SBUF_PARTITION_BYTES if buffer is sbuf else PSUM_PARTITION_BYTES
        if per_part > limit:
            raise SimError(f"tensor {name!r}: {per_part} bytes per partition exceed {buffer} ({limit})")
    n = math.prod(shape)
    # Fresh memory is garbage on the device: it is filled with a sentinel (NaN / 0x5A bytes, as the official
    # simulator does) and, stricter, every read is checked against the `written` mask.
    st = Storage(_sentinel(n, dt), np.zeros(n, np.bool_), buffer, name, shape, False)
    # the whole contiguous storage, its shape checked above: a valid view, no _validate needed
    t = SimTensor._sub(st, dt, shape, _contig_strides(shape), 0)
    t._base = True
    return t


def wrap_array(arr, buffer, name=""):
    """A kernel argument: a copy of `arr` in HBM, fully written."""
    arr = np.ascontiguousarray(arr)
    dt = D.normalize(arr.dtype)
    RU.check_dtype(dt, f"kernel argument {name!r}")
    shape = tuple(arr.shape)
    st = Storage(arr.reshape(-1).copy(), np.ones(arr.size, np.bool_), buffer, name, shape, True)
    return SimTensor(st, dt, shape, _contig_strides(shape), 0, True)


def _contig_strides(shape):
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


class SimTensor:
    """An nl.ndarray (or a view of one). Only zero-copy view operations are defined; all data movement and
    math goes through nki.isa instructions."""

    # _geo: (shape, strides, offset), the key of the view in its storage's caches; _dv / _wv: this tensor's
    # data / written-mask views once asked for (a tile object is often an operand of several instructions)
    __slots__ = ("_st", "dtype", "shape", "strides", "offset", "_base", "_geo", "_dv", "_wv")

    def __init__(self, st, dtype, shape, strides, offset, base=False):
        self._st, self.dtype, self.shape, self.strides, self.offset, self._base = (
            st, dtype, tuple(shape), tuple(strides), int(offset), base)
        self._geo = (self.shape, self.strides, self.offset)
        self._dv = self._wv = None
        self._validate()

    @classmethod
    def _sub(cls, st, dtype, shape, strides, offset):
        """A view derived by in-range slicing of a valid view: valid by construction, no re-check."""
        t = object.__new__(cls)
        shape, strides = tuple(shape), tuple(strides)
        t._st, t.dtype, t.shape, t.strides, t.offset, t._base = st, dtype, shape, strides, offset, False
        t._geo = (shape, strides, offset)
        t._dv = t._wv = None
        return t

    # ---- properties -------------------------------------------------------------------------------
    @property
    def buffer(self):
        return self._st.buffer

    @property
    def name(self):
        return self._st.name

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def size(self):
        return math.prod(self.shape)

    def __repr__(self):
        return f"SimTensor({self.name!r}, {self.shape}, {self.dtype}, {self.buffer})"

    def __bool__(self):
        raise SimError("a tensor has no truth value inside a kernel (control flow is resolved at trace time)")

    def __setitem__(self, key, value):
        raise SimError("tensor item assignment is not an NKI instruction; use nisa.tensor_copy / dma_copy")

    def __array__(self, *a, **k):
        raise SimError("kernel tensors cannot be converted to NumPy inside a kernel")

    # ---- validation -------------------------------------------------------------------------------
    def _pstride(self):
        return self._st.pstride

    def _validate(self):
        shape, strides = self.shape, self.strides
        span = 0
        for d, s in zip(shape, strides):
            if d <= 0 or s < 0:
                raise SimError(f"{self.name!r}: empty view {shape} or negative stride {strides}")
            span += (d - 1) * s
        if self.offset < 0 or self.offset + span >= len(self._st.data):
            raise SimError(f"{self.name!r}: view {shape} at offset {self.offset} is out of bounds")
        if self._st.buffer.on_chip:
            if not shape:
                raise SimError(f"{self.name!r}: on-chip views need a partition dim")
            if shape[0] > PMAX:
                raise SimError(f"{self.name!r}: partition dim {shape[0]} > {PMAX}")
            ps = self._st.pstride
            if shape[0] > 1 and strides[0] != ps:
                raise SimError(f"{self.name!r}: partition access must be contiguous (stride {strides[0]}"
                               f" != {ps})")
            if self.offset % ps + span - (shape[0] - 1) * strides[0] >= ps:
                raise SimError(f"{self.name!r}: free-axis access crosses a partition boundary")

    def pstart(self):
        """First partition of an on-chip view."""
        return self.offset // self._st.pstride

    # ---- NumPy views (simulator internals) -------------------------------------------------------
    def _view(self, base):
        isz = base.itemsize
        return np.ndarray(self.shape, base.dtype, base, self.offset * isz, [s * isz for s in self.strides])

    # _data / _mask / _mm: the view of an array the storage owns for this geometry, built once per storage
    # (Storage.vcache). The callers only index-assign into it or derive new arrays from it, so sharing it
    # is safe.
    def _cache_view(self, kind, base):
        cache = self._st.vcache
        if len(cache) >= _CACHE_MAX:
            cache.clear()
        v = cache[(kind, self._geo)] = self._view(base)
        return v

    def _data(self):
        v = self._dv
        if v is None:
            v = self._st.vcache.get((self.dtype, self._geo))
            if v is None:
                v = self._cache_view(self.dtype, self._st.typed(self.dtype))
            self._dv = v
        return v

    def _mask(self):
        v = self._wv
        if v is None:
            v = self._st.vcache.get(("w", self._geo))
            if v is None:
                v = self._cache_view("w", self._st.written)
            self._wv = v
        return v

    def _mm(self):
        """PSUM: the view of the written-by-a-matmul mask (_rules R10)."""
        v = self._st.vcache.get(("mm", self._geo))
        return self._cache_view("mm", self._st.mm) if v is None else v

    def _mark_written(self):
        st = self._st
        if st.full or self._geo in st.ok:
            return  # every element is already marked
        self._mask()[...] = True
        self._note_ok()

    def _note_ok(self):
        ok = self._st.ok
        if len(ok) >= _CACHE_MAX:
            ok.clear()
        ok.add(self._geo)

    def _all_written(self):
        st = self._st
        if st.full or self._geo in st.ok:
            return True
        if self._mask().all():
            if st.written.all():
                st.full = True
            else:
                self._note_ok()
            return True
        return False

    # ---- view operations ---------------------------------------------------------------------------
    def _derive(self, shape, strides, offset, dtype=None, base=False):
        return SimTensor(self._st, self.dtype if dtype is None else dtype, shape, strides, offset, base)

    def __getitem__(self, key):
        if type(key) is slice and key.step is None:  # t[a:b] on the leading dim, the most common index
            start, stop = key.start, key.stop
            if type(start) is int and type(stop) is int and 0 <= start < stop <= self.shape[0]:
                return SimTensor._sub(self._st, self.dtype, (stop - start,) + self.shape[1:], self.strides,
                                      self.offset + start * self.strides[0])
        if not isinstance(key, tuple):
            key = (key,)
        ndim = len(self.shape)
        if len(key) != ndim:
            if any(k is Ellipsis for k in key):
                i = key.index(Ellipsis)
                key = key[:i] + (slice(None),) * (ndim - (len(key) - 1)) + key[i + 1:]
            if len(key) > ndim:
                raise SimError(f"{self.name!r}: too many indices for shape {self.shape}")
            key = key + (slice(None),) * (ndim - len(key))
        shape, strides, off = [], [], self.offset
        on_chip = self._st.buffer.on_chip
        dim = 0
        for k, n, s in zip(key, self.shape, self.strides):
            tk = type(k)
            if tk is slice:
                # kernels slice with plain ints (a[0:m], a[:, i:i + 1]): skip int() for those
                start, stop, step = k.start, k.stop, k.step
                if type(start) is not int:
                    start = 0 if start is None else int(start)
                if type(stop) is not int:
                    stop = n if stop is None else int(stop)
                if step is None:
                    if 0 <= start < stop <= n:  # the common case: a unit-step slice in range
                        shape.append(stop - start)
                        off += start * s
                        strides.append(s)
                        dim += 1
                        continue
                    step = 1
                else:
                    step = int(step)
            elif tk is DynSlice:
                start, stop, step = k.start, k.start + k.size, 1
            elif isinstance(k, (int, np.integer)):
                k = int(k)
                if not 0 <= k < n:
                    raise SimError(f"{self.name!r}: index {k} out of range for dim {dim} of size {n}")
                if on_chip and dim == 0:
                    raise SimError(f"{self.name!r}: integer-indexing the partition dim; slice it (i:i+1)")
                off += k * s
                dim += 1
                continue
            else:
                raise SimError(f"{self.name!r}: unsupported index {k!r}")
            if not (0 <= start < stop <= n) or step <= 0:
                raise SimError(f"{self.name!r}: slice {start}:{stop}:{step} out of range for dim {dim} "
                               f"of size {n}")
            if step == 1:
                shape.append(stop - start)
            else:
                if on_chip and dim == 0:
                    raise SimError(f"{self.name!r}: strided partition access")
                shape.append(len(range(start, stop, step)))
            off += start * s
            strides.append(s * step)
            dim += 1
        return SimTensor._sub(self._st, self.dtype, shape, strides, off)

    def reshape(self, new_shape=None, shape=None):
        new_shape = tuple(int(s) for s in (new_shape if new_shape is not None else shape))
        if self.buffer.on_chip and new_shape[0] != self.shape[0]:
            raise SimError(f"{self.name!r}: reshape {self.shape}->{new_shape} would move the partition dim")
        key = (self.shape, self.strides, new_shape)
        geo = _RESHAPED.get(key)
        if geo is None:
            v = self._mask().view()
            try:
                v.shape = new_shape
            except (AttributeError, ValueError) as e:
                raise SimError(f"{self.name!r}: reshape {self.shape}->{new_shape} needs a copy") from e
            if len(_RESHAPED) >= _CACHE_MAX:
                _RESHAPED.clear()
            geo = _RESHAPED[key] = (v.shape, tuple(s // v.itemsize for s in v.strides))
        # a no-copy reshape keeping the partition dim covers the same elements, row by row, as this valid
        # view, so the result is valid too (no _validate)
        t = SimTensor._sub(self._st, self.dtype, geo[0], geo[1], self.offset)
        t._base = self._base
        return t

    def view(self, dtype):
        dt = D.normalize(dtype)
        RU.check_dtype(dt, f"{self.name!r}.view")
        if dt.itemsize != self.dtype.itemsize:
            raise SimError(f"{self.name!r}: view({dt}) changes the element size; not supported")
        return self._derive(self.shape, self.strides, self.offset, dtype=dt, base=self._base)

    def permute(self, dims):
        dims = tuple(int(d) for d in dims)
        if sorted(dims) != list(range(self.ndim)):
            raise SimError(f"{self.name!r}: bad permutation {dims}")
        if self.buffer.on_chip and dims[0] != 0:
            raise SimError(f"{self.name!r}: permute cannot move the partition dim")
        return self._derive([self.shape[d] for d in dims], [self.strides[d] for d in dims], self.offset)

    def broadcast(self, dim, size):
        if self.shape[dim] != 1:
            raise SimError(f"{self.name!r}: broadcast needs dim {dim} of size 1, got {self.shape[dim]}")
        if self.buffer.on_chip and dim == 0:
            raise SimError(f"{self.name!r}: on-chip partition broadcast is not a view (use DMA or a matmul)")
        shape, strides = list(self.shape), list(self.strides)
        shape[dim], strides[dim] = int(size), 0
        if shape[dim] < 1:
            return self._derive(shape, strides, self.offset)  # _validate names the empty view
        # stride 0 on a size-1 free dim adds no element to this valid view: valid without _validate
        return SimTensor._sub(self._st, self.dtype, shape, strides, self.offset)

    def ap(self, pattern, offset=0, scalar_offset=None, vector_offset=None, indirect_dim=0, dtype=None):
        """Explicit access pattern [[step, num], ...] over the flattened tensor (outermost first)."""
        if not self._base:
            raise SimError(f"{self.name!r}: .ap() is only allowed on an nl.ndarray, not on a view of one")
        dt = self.dtype if dtype is None else D.normalize(dtype)
        RU.check_dtype(dt, f"{self.name!r}.ap")
        if dt.itemsize != self.dtype.itemsize:
            raise SimError("ap(dtype=...) with a different element size is not supported")
        pattern = [(int(st), int(nm)) for st, nm in pattern]
        if scalar_offset is not None:
            raise SimError("scalar_offset is not supported by the simulator")
        if self.buffer.on_chip:
            ps = self._pstride()
            if pattern[0][1] > 1 and pattern[0][0] != ps:
                raise SimError(f"{self.name!r}: on-chip ap must step whole partitions ({pattern[0][0]} != {ps})")
        if vector_offset is not None:
            return IndirectAP(self, pattern, int(offset), vector_offset, int(indirect_dim), dt)
        return self._derive([n for _, n in pattern], [s for s, _ in pattern], self.offset + int(offset), dt)


class IndirectAP:
    """`.ap(..., vector_offset=idx, indirect_dim=0)` on an HBM tensor: partition p of the access starts at
    row idx[p] (times the step of the indirect dim). Usable only as a dma_copy source or destination."""

    def __init__(self, base, pattern, offset, idx, indirect_dim, dtype):
        if base.buffer.on_chip:
            raise SimError("vector_offset indirection needs the indexed tensor in HBM")
        if indirect_dim != 0:
            raise SimError("the simulator supports vector_offset on indirect_dim=0 only")
        if not isinstance(idx, SimTensor) or idx.buffer is not sbuf:
            raise SimError("vector_offset must be an SBUF tensor")
        if idx.ndim != 2 or idx.shape[1] != 1 or not D.is_int(idx.dtype) or idx.dtype.itemsize != 4:
            raise SimError(f"vector_offset must be an (P, 1) int32/uint32 tile, got {idx.shape} {idx.dtype}")
        if pattern[0][1] != idx.shape[0]:
            raise SimError(f"indirect pattern covers {pattern[0][1]} partitions, offsets give {idx.shape[0]}")
        if idx.shape[0] < 2:
            raise SimError("a vector_offset DMA needs at least 2 partitions")
        RU.indirect_stride(base, pattern)  # R4: the device ignores the pattern's leading stride
        self.base, self.pattern, self.offset, self.idx, self.dtype = base, pattern, offset, idx, dtype
        self.shape = tuple(n for _, n in pattern)
        self.buffer = base.buffer
        self.name = base.name

    @property
    def size(self):
        return math.prod(self.shape)

    def rows(self):
        """(row start addresses [P], inner element offsets [F], row-valid mask [P]) for the current
        offsets; a row is valid when every element it touches lies inside the indexed tensor."""
        idx_t = self.idx
        if not idx_t._all_written():
            raise SimError(f"vector_offset tile {idx_t.name!r} read before it was written")
        idx = idx_t._data().reshape(-1).astype(np.int64)
        step0 = RU.indirect_stride(self.base, self.pattern)  # the device's step, not the pattern's (R4)
        inner = np.zeros(1, np.int64)
        for st, nm in self.pattern[1:]:
            inner = (inner[:, None] + np.arange(nm, dtype=np.int64)[None, :] * st).reshape(-1)
        starts = self.base.offset + self.offset + idx * step0
        n = len(self.base._st.data)
        valid = (starts + inner.min() >= 0) & (starts + inner.max() < n)
        return starts, inner, valid
