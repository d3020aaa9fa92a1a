"""The simulator's nki.isa helpers: operand checks, reads and writes of on-chip tiles in fp32, the
engine an instruction runs on, operator application (`isa` imports them; none is an instruction, so
none is charged an engine cost by `_cost.instrument`)."""

import math

import numpy as np

from . import _dtypes as D
from . import _ops as O
from . import _rules as RU
from . import _runtime as R
from ._errors import SimError
from ._tensor import SimTensor, shared_hbm


def _tensor(x, what):
    if not isinstance(x, SimTensor):
        raise SimError(f"{what} must be a tensor, got {type(x).__name__}")
    return x


def _on_chip(x, what):
    if type(x) is not SimTensor:  # the exact-type test is the fast path; isinstance covers the rest
        _tensor(x, what)
    if not x._st.buffer.on_chip:
        raise SimError(f"{what} must be in SBUF or PSUM, not {x.buffer}")
    return x


def _free(t):
    return math.prod(t.shape[1:])


def _read(t):
    if not t._all_written():
        raise SimError(f"read of never-written memory in {t.name!r} {t.shape}")
    if t._st.buffer is shared_hbm:
        RU.check_shared_read(t, R.current().pid)
    return t._data()


def _f32_2d(t):
    return D.to_f32(_read(t)).reshape(t.shape[0], -1)


def _write(t, vals):
    if 0 in t.strides and any(s == 0 and n > 1 for s, n in zip(t.strides, t.shape)):
        raise SimError(f"destination {t.name!r} is a broadcast view")
    if t._st.buffer is shared_hbm:
        RU.check_shared_write(t, R.current().pid)
    t._data()[...] = np.asarray(vals).reshape(t.shape)
    t._mark_written()
    if t._st.mm is not None:
        t._mm()[...] = False  # PSUM now holds a non-matmul value (R10)


def _store(dst, vals_f32):  # an fp32 dst takes the values as they are: from_f32 would only copy them
    v = np.asarray(vals_f32, np.float32)
    _write(dst, v if dst.dtype == D.float32 else D.from_f32(v, dst.dtype))


def _engine(instr, *tensors):
    """Start-partition rule (R5) for every on-chip access of a Vector / Scalar / GpSimd instruction."""
    for t in tensors:
        # an access from partition 0 (offset inside the first partition) passes for any size: no call
        if isinstance(t, SimTensor) and t.offset >= t._st.pstride:
            RU.check_start_partition(t, instr)


def _same_lanes(ref, *others):
    """Engines compute lane by lane: every on-chip operand must cover the same partitions."""
    p, s = ref.shape[0], ref.pstart()
    for o in others:
        if o is None:
            continue
        if o.shape[0] != p or o.pstart() != s:
            raise SimError(f"operands on different partitions: {ref.name!r}[{s}:{s + p}] vs "
                           f"{o.name!r}[{o.pstart()}:{o.pstart() + o.shape[0]}]")


def _same_free(a, b):
    if _free(a) != _free(b):
        raise SimError(f"free sizes differ: {a.name!r}{a.shape} vs {b.name!r}{b.shape}")


def _operand(x, ref, what, fp32=True):
    """A compile-time scalar or a (P, 1) on-chip vector broadcast along the free axis."""
    if isinstance(x, SimTensor):
        _on_chip(x, what)
        if x.ndim != 2 or x.shape[1] != 1:
            raise SimError(f"{what} must be a (P, 1) tile, got {x.shape}")
        _same_lanes(ref, x)
        if fp32 and x.dtype != D.float32:
            raise SimError(f"{what} must be float32, got {x.dtype}")
        return D.to_f32(_read(x)).reshape(-1, 1)
    if isinstance(x, (bool, int, float, np.integer, np.floating)):
        return np.float32(x)
    raise SimError(f"{what}: unsupported operand {x!r}")


def _apply(op, a, b, reverse):
    if op.unary:
        return op.alu(a)
    return op.alu(b, a) if reverse else op.alu(a, b)


def _bits(t, p):
    """Raw bit patterns of an integer tile as non-negative int64, [p, free]."""
    a = _read(t).reshape(p, -1)
    return a.view(np.dtype(f"u{a.dtype.itemsize}")).astype(np.int64)


def _wrap(v, dt):
    """int64 results into an integer dtype, keeping the low bits (two's complement wrap)."""
    return v.astype(np.dtype(f"u{dt.itemsize}") if dt.kind == "u" else np.int64).astype(dt)


def _check_op(op, what):
    if not isinstance(op, O.Op) or op.alu is None:
        raise SimError(f"{what}: {op!r} is not an ALU operator")
    RU.check_alu(op, what)
