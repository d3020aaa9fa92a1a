"""nki.isa for the simulator: the instructions our kernels use, with the hardware's checks.

Conventions (Trainium2, NeuronCore-v3): `dst` first; engines read their inputs as float32, compute in
float32 and round once into `dst` (bitvec operators and same-dtype copies are bit-exact); on-chip operands
of one instruction occupy the same partitions; compute operands live in SBUF or PSUM, DMA operands in HBM
or SBUF (never PSUM); nc_matmul reads SBUF and accumulates float32 into PSUM.
"""

import enum
import math

import numpy as np

from . import _dtypes as D
from . import _ops as O
from . import _rules as RU
from . import _runtime as R
from ._errors import NkiValidationError, SimError  # noqa: F401  (re-exported like the real package)
from . import _devicelike as _DL
from ._tensor import PMAX, IndirectAP, SimTensor, psum, sbuf, shared_hbm
from ._isa_helpers import (  # noqa: F401  (the instructions' helpers, nki_sim._isa_helpers)
    _tensor, _on_chip, _free, _read, _f32_2d, _write, _store, _engine,
    _same_lanes, _same_free, _operand, _apply, _bits, _wrap, _check_op,
)


class engine(enum.Enum):
    tensor = "tensor"
    vector = "vector"
    scalar = "scalar"
    gpsimd = "gpsimd"
    dma = "dma"
    sync = "sync"
    unknown = "unknown"


tensor_engine, vector_engine = engine.tensor, engine.vector
scalar_engine, gpsimd_engine, unknown_engine = engine.scalar, engine.gpsimd, engine.unknown


class reduce_cmd(enum.Enum):
    idle = "idle"
    reset = "reset"
    reduce = "reduce"
    reset_reduce = "reset_reduce"
    load_reduce = "load_reduce"


class dge_mode(enum.Enum):
    unknown = "unknown"
    swdge = "swdge"
    hwdge = "hwdge"
    none = "none"


class oob_mode(enum.Enum):
    error = "error"
    skip = "skip"


class matmul_perf_mode(enum.Enum):
    none = "none"
    double_row = "double_row"


class nc_version(enum.Enum):
    gen2 = "gen2"
    gen3 = "gen3"
    gen4 = "gen4"


def get_nc_version():
    return nc_version.gen3 if RU.target() == "trn2" else nc_version.gen4


# aliases: several instructions take parameters that shadow these enum names
_ENGINE, _RCMD = engine, reduce_cmd


# ---- data movement -----------------------------------------------------------------------------------------
def dma_copy(dst, src, priority=None, oob_mode=oob_mode.error, dge_mode=dge_mode.unknown,
             engine=engine.unknown, name=None):
    for x, what in ((dst, "dst"), (src, "src")):
        if isinstance(x, SimTensor) and x.buffer is psum:
            raise SimError(f"dma_copy {what} in PSUM: DMA cannot access PSUM (tensor_copy to SBUF first)")
        if not isinstance(x, (SimTensor, IndirectAP)):
            raise SimError(f"dma_copy {what} must be a tensor")
    if isinstance(src, IndirectAP) and isinstance(dst, IndirectAP):
        raise SimError("dma_copy with indirection on both sides")
    if src.size != dst.size:
        raise SimError(f"dma_copy element counts differ: dst {dst.shape} vs src {src.shape}")
    if isinstance(src, IndirectAP) or isinstance(dst, IndirectAP):
        return _indirect_dma(dst, src, oob_mode)
    _write(dst, D.convert(_read(src), dst.dtype).copy())


def _indirect_dma(dst, src, mode):
    ind = src if isinstance(src, IndirectAP) else dst
    other = dst if ind is src else src
    starts, inner, valid = ind.rows()
    if not valid.all() and mode is not oob_mode.skip:
        bad = np.flatnonzero(~valid)[:4].tolist()
        raise SimError(f"indirect DMA out of bounds on {ind.name!r} (partitions {bad}); use oob_mode=skip")
    p, f = len(starts), len(inner)
    if other.shape[0] != p:
        raise SimError(f"indirect DMA: the other side must have {p} partitions/rows, got {other.shape}")
    addr = starts[valid][:, None] + inner[None, :]
    base = ind.base
    data = base._st.data if base._st.data.dtype == ind.dtype else base._st.data.view(ind.dtype)
    pid = R.current().pid
    if ind is src:
        if not base._st.written[addr].all():
            raise SimError(f"indirect DMA reads never-written rows of {base.name!r}")
        if base.buffer is shared_hbm:
            RU.check_shared_read(base, pid, addr)
        vals = D.convert(data[addr], dst.dtype)
        dv, dm = dst._data(), dst._mask()
        dv[valid] = vals.reshape((-1,) + dst.shape[1:])
        dm[valid] = True
    else:
        vals = D.convert(_read(src).reshape(p, f), ind.dtype)
        if base.buffer is shared_hbm:
            RU.check_shared_write(base, pid, addr)
        data[addr] = vals[valid]
        base._st.written[addr] = True


# ---- Tensor Engine --------------------------------------------------------------------------------------
_MATMUL_DTYPES = {D.bfloat16, D.float16, D.float32, D.float8_e4m3, D.float8_e5m2}


def _matmul_dtypes():
    return _MATMUL_DTYPES | ({D.float8_e4m3fn} if RU.target() == "trn3" else set())


def nc_matmul(dst, stationary, moving, is_stationary_onezero=False, is_moving_onezero=False,
              is_transpose=False, accumulate=None, tile_position=(), tile_size=(),
              perf_mode=matmul_perf_mode.none, name=None):
    """dst[M, N] (+)= stationary[K, M].T @ moving[K, N]; K on the partitions of both operands."""
    for x, what in ((stationary, "stationary"), (moving, "moving")):
        _tensor(x, what)
        if x.buffer is not sbuf:
            raise SimError(f"nc_matmul {what} must be in SBUF, not {x.buffer}")
    _tensor(dst, "dst")
    if dst.buffer is not psum:
        raise SimError(f"nc_matmul dst must be in PSUM, not {dst.buffer}")
    if perf_mode is not matmul_perf_mode.none:
        raise SimError("matmul perf modes are not simulated")
    if is_transpose:
        return _pe_transpose(dst, stationary, tile_position, tile_size)
    if dst.dtype != D.float32:
        raise SimError(f"nc_matmul dst must be float32 on NeuronCore-v3, got {dst.dtype}")
    if stationary.ndim != 2:
        raise SimError(f"nc_matmul stationary must have exactly one free dim, got {stationary.shape}")
    k, m = stationary.shape
    n = _free(moving)
    if moving.shape[0] != k:
        raise SimError(f"nc_matmul contraction sizes differ: stationary {k} vs moving {moving.shape[0]}")
    if k > PMAX or m > 128 or n > 512:
        raise SimError(f"nc_matmul tile too large: K={k} (<=128), M={m} (<=128), N={n} (<=512)")
    if stationary.pstart() != moving.pstart():
        raise SimError("nc_matmul stationary and moving must occupy the same partitions")
    for x in (stationary, moving):
        if x.dtype not in _matmul_dtypes():
            raise SimError(f"nc_matmul operand dtype {x.dtype} is not supported on NeuronCore-v3")
    if (stationary.dtype == D.float32) != (moving.dtype == D.float32):
        raise SimError("nc_matmul: a float32 operand requires the other operand to be float32 too")
    if dst.shape[0] != m or _free(dst) != n:
        raise SimError(f"nc_matmul dst {dst.shape} does not match [{m}, {n}]")
    RU.check_pe_placement(k, stationary.pstart(), m, dst.pstart(), tile_position, tile_size)
    RU.check_psum_bank(dst, "nc_matmul")
    # Each PE column sums its K products independently of the tile shape. Modelled as the exactly rounded
    # fp32 value of that sum: products of bf16 / fp32 operands are exact in fp64 and the fp64 sum of at most
    # 128 of them is (all but) exact, so the result does not depend on BLAS blocking or on how a GEMM was
    # tiled. Successive matmuls into one PSUM tile add in fp32. The device-like mode (see _devicelike)
    # replaces the exact sum by fp32 accumulation in a random order.
    a = D.to_f32(_read(stationary))
    b = D.to_f32(_read(moving)).reshape(k, n)
    res = _DL.matmul(a, b) if _DL.active() else (a.astype(np.float64).T @ b.astype(np.float64)).astype(np.float32)
    res = res.reshape(dst.shape)
    mask = dst._mask()
    mm = dst._mm()
    RU.check_accumulate(accumulate, mask, mm, dst.name)
    if accumulate is True:
        res = dst._data() + res
    elif accumulate is None and mask.any():
        res = np.where(mask, dst._data(), np.float32(0)) + res
    _write(dst, res.astype(np.float32))
    mm[...] = True


def _pe_transpose(dst, data, tile_position=(), tile_size=()):
    _on_chip(data, "data")
    p, f = data.shape[0], _free(data)
    if dst.shape[0] != f or _free(dst) != p:
        raise SimError(f"nc_transpose dst {dst.shape} does not match [{f}, {p}]")
    if dst.dtype != data.dtype:
        raise SimError("nc_transpose dst must have the dtype of data")
    if data.buffer is not sbuf or dst.buffer is not psum:
        raise SimError("Tensor Engine transpose reads SBUF and writes PSUM")
    if p > 128 or f > 128:
        raise SimError(f"Tensor Engine transpose is limited to 128x128, got {p}x{f}")
    RU.check_pe_placement(p, data.pstart(), f, dst.pstart(), tile_position, tile_size, "Tensor Engine transpose")
    RU.check_psum_bank(dst, "Tensor Engine transpose")
    _write(dst, _read(data).reshape(p, f).T.copy())
    dst._mm()[...] = True  # a matmul-class write (bit-exact transpose through the PE array)


def nc_transpose(dst, data, engine=engine.unknown, name=None):
    """2-D transpose between the partition axis and the (flattened) free axis, bit-exact."""
    _on_chip(data, "data")
    _on_chip(dst, "dst")
    p, f = data.shape[0], _free(data)
    use_pe = engine is _ENGINE.tensor or (engine is _ENGINE.unknown and dst.buffer is psum)
    if use_pe:
        return _pe_transpose(dst, data)
    if dst.shape[0] != f or _free(dst) != p:
        raise SimError(f"nc_transpose dst {dst.shape} does not match [{f}, {p}]")
    if dst.dtype != data.dtype:
        raise SimError("nc_transpose dst must have the dtype of data")
    if p > 32 or f > 32:
        raise SimError(f"Vector Engine transpose is limited to 32x32, got {p}x{f}")
    _engine("nc_transpose", dst, data)
    _write(dst, _read(data).reshape(p, f).T.copy())


# ---- Vector / Scalar / GpSimd engines -------------------------------------------------------------------
def tensor_copy(dst, src, engine=engine.unknown, name=None):
    _on_chip(src, "src")
    _on_chip(dst, "dst")
    _engine("tensor_copy", dst, src)
    _same_lanes(dst, src)
    _same_free(dst, src)
    _write(dst, D.convert(_read(src), dst.dtype).reshape(dst.shape[0], -1).copy())


def tensor_tensor(dst, data1, data2, op, engine=engine.unknown, name=None):
    for x, w in ((dst, "dst"), (data1, "data1"), (data2, "data2")):
        _on_chip(x, w)
    if data1.buffer is psum and data2.buffer is psum:
        raise SimError("tensor_tensor inputs cannot both be in PSUM")
    _engine("tensor_tensor", dst, data1, data2)
    _same_lanes(dst, data1, data2)
    _same_free(dst, data1)
    _same_free(dst, data2)
    _check_op(op, "tensor_tensor")
    if op.kind == "bitvec":  # bit patterns, exact
        if not all(D.is_int(x.dtype) for x in (dst, data1, data2)):
            raise SimError(f"{op!r} needs integer tiles")
        p = dst.shape[0]
        _write(dst, _wrap(op.alu(_bits(data1, p), _bits(data2, p)), dst.dtype))
        return
    # arithmetic operators convert every input to fp32 first, integers included (_rules R3)
    _store(dst, op.alu(_f32_2d(data1), _f32_2d(data2)))


def tensor_scalar(dst, data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False,
                  engine=engine.unknown, name=None):
    _on_chip(data, "data")
    _on_chip(dst, "dst")
    _engine("tensor_scalar", dst, data, operand0, operand1)
    _same_lanes(dst, data)
    _same_free(dst, data)
    _check_op(op0, "tensor_scalar op0")
    ops = [(op0, operand0, reverse0)]
    if op1 is not None:
        _check_op(op1, "tensor_scalar op1")
        ops.append((op1, operand1, reverse1))
    elif operand1 is not None:
        raise SimError("tensor_scalar: operand1 without op1")
    kinds = {o.kind for o, _, _ in ops}
    if len(kinds) != 1:
        raise SimError("tensor_scalar: op0 and op1 must both be bitvec or both arithmetic")
    if kinds == {"bitvec"}:
        if not (D.is_int(data.dtype) and D.is_int(dst.dtype)):
            raise SimError("bitvec tensor_scalar needs integer data and dst")
        v = _bits(data, dst.shape[0])
        for o, x, rev in ops:
            if not isinstance(x, (int, np.integer)) or rev:
                raise SimError("bitvec tensor_scalar takes a non-reversed integer immediate")
            v = o.alu(v, int(x))
        _write(dst, _wrap(v, dst.dtype))
        return
    v = _f32_2d(data)
    for o, x, rev in ops:
        v = _apply(o, v, None if o.unary else _operand(x, data, "tensor_scalar operand"), rev)
    _store(dst, v)


def scalar_tensor_tensor(dst, data, op0, operand0, op1, operand1, reverse0=False, reverse1=False, name=None):
    """(data op0 operand0) op1 operand1, with operand0 a scalar/(P,1) vector and operand1 a full tile."""
    for x, w in ((dst, "dst"), (data, "data"), (operand1, "operand1")):
        _on_chip(x, w)
    if data.buffer is psum and operand1.buffer is psum:
        raise SimError("scalar_tensor_tensor: data and operand1 cannot both be in PSUM")
    _engine("scalar_tensor_tensor", dst, data, operand0, operand1)
    _same_lanes(dst, data, operand1)
    _same_free(dst, data)
    _same_free(dst, operand1)
    _check_op(op0, "op0")
    _check_op(op1, "op1")
    if op0.kind != "arith" or op1.kind != "arith":
        raise SimError("scalar_tensor_tensor takes arithmetic operators only")
    v = _apply(op0, _f32_2d(data), _operand(x=operand0, ref=data, what="operand0", fp32=False), reverse0)
    _store(dst, _apply(op1, v, _f32_2d(operand1), reverse1))


def _sum_rows(v):
    """fp32 sum over the last axis (torch's CPU reduction when available; see _ops)."""
    if _DL.active():
        return _DL.sum_rows(v)
    t = O.torch_module()
    if t is not None:
        return t.from_numpy(np.ascontiguousarray(v, np.float32)).sum(-1).numpy()
    return v.sum(-1, dtype=np.float32)  # pragma: no cover


def tensor_reduce(dst, op, data, axis, negate=False, keepdims=False, name=None):
    _on_chip(data, "data")
    _on_chip(dst, "dst")
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    axes = tuple(sorted(a % data.ndim for a in axes))
    if 0 in axes or axes != tuple(range(data.ndim - len(axes), data.ndim)):
        raise SimError(f"tensor_reduce axes {axis} must be the trailing free axes of {data.shape}")
    _engine("tensor_reduce", dst, data)
    _same_lanes(dst, data)
    _check_op(op, "tensor_reduce")
    keep = data.shape[: data.ndim - len(axes)]
    if _free(dst) != math.prod(keep[1:]):
        raise SimError(f"tensor_reduce dst {dst.shape} does not match the kept shape {keep}")
    v = D.to_f32(_read(data)).reshape(math.prod(keep), -1)
    if op is O.add:
        r = _sum_rows(v)
    elif op is O.maximum:
        r = v.max(-1)
    elif op is O.minimum:
        r = v.min(-1)
    elif op is O.multiply:
        r = v.prod(-1, dtype=np.float32)
    else:
        raise SimError(f"tensor_reduce op {op!r} is not simulated")
    if negate:
        r = -r
    _store(dst, r.reshape(dst.shape[0], -1))


def activation(dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None,
               reduce_cmd=reduce_cmd.idle, name=None):
    """dst = op(data * scale + bias) in fp32; optional add-reduction of the result along the free axis
    into the engine's per-lane registers (reduce_cmd), read out into reduce_res."""
    _on_chip(data, "data")
    _on_chip(dst, "dst")
    _engine("activation", dst, data, bias, scale, reduce_res)
    _same_lanes(dst, data)
    _same_free(dst, data)
    if not isinstance(op, O.Op) or op.act is None:
        raise SimError(f"activation: {op!r} is not an activation function")
    x = _f32_2d(data) * _operand(scale, data, "scale")
    if bias is not None:
        if isinstance(bias, SimTensor) and bias.dtype == D.float32:
            x = x + _operand(bias, data, "bias")
        else:
            x = x + _operand(bias, data, "bias", fp32=False)
    y = np.asarray(op.act(x.astype(np.float32)), np.float32)
    _store(dst, y)
    state = R.current()
    p0, p = data.pstart(), data.shape[0]
    cmd = _RCMD
    if reduce_cmd in (cmd.reset, cmd.reset_reduce):
        state.act_regs = np.zeros(PMAX, np.float32)
    if reduce_cmd in (cmd.reduce, cmd.reset_reduce):
        if reduce_op is not O.add:
            raise SimError("activation reduce_op must be nl.add")
        if state.act_regs is None:
            raise SimError("activation: reduce_cmd=reduce before any reset of the reduce registers")
        state.act_regs[p0:p0 + p] += _sum_rows(y)
    if reduce_res is not None:
        _on_chip(reduce_res, "reduce_res")
        _same_lanes(data, reduce_res)
        if _free(reduce_res) != 1:
            raise SimError("reduce_res must be a (P, 1) tile")
        if state.act_regs is None:
            raise SimError("activation: reduce_res read from never-reset reduce registers")
        _store(reduce_res, state.act_regs[p0:p0 + p].reshape(p, 1).copy())


def activation_reduce(dst, op, data, reduce_op, reduce_res, bias=None, scale=1.0, name=None):
    activation(dst, op, data, bias=bias, scale=scale, reduce_op=reduce_op, reduce_res=reduce_res,
               reduce_cmd=reduce_cmd.reset_reduce)


def reciprocal(dst, data, name=None):
    _on_chip(data, "data")
    _on_chip(dst, "dst")
    _engine("reciprocal", dst, data)
    _same_lanes(dst, data)
    _same_free(dst, data)
    v = _f32_2d(data)
    _store(dst, _DL.transcendental("reciprocal", np.float32(1) / v) if _DL.active() else np.float32(1) / v)


def iota(dst, pattern, offset=0, channel_multiplier=0, name=None):
    """dst[p, i...] = offset + p * channel_multiplier + sum(step_k * i_k), computed in int32."""
    _on_chip(dst, "dst")
    _engine("iota", dst)
    if dst.buffer is not sbuf:
        raise SimError("iota writes SBUF")
    pattern = [(int(s), int(n)) for s, n in pattern]
    if math.prod(n for _, n in pattern) != _free(dst):
        raise SimError(f"iota pattern covers {math.prod(n for _, n in pattern)} elements, dst has {_free(dst)}")
    v = np.zeros(1, np.int64)
    for s, n in pattern:
        v = (v[:, None] + np.arange(n, dtype=np.int64)[None, :] * s).reshape(-1)
    p = np.arange(dst.shape[0], dtype=np.int64)[:, None] * int(channel_multiplier)
    vals = (int(offset) + p + v[None, :]).astype(np.int32)
    _write(dst, vals.astype(dst.dtype) if D.is_int(dst.dtype) else D.from_f32(vals.astype(np.float32),
                                                                                    dst.dtype))


def memset(dst, value, engine=engine.unknown, name=None):
    _on_chip(dst, "dst")
    _engine("memset", dst)
    if D.is_int(dst.dtype):
        if not float(value).is_integer():
            raise SimError(f"memset of an integer tile with non-integer {value!r}")
        info = np.iinfo(dst.dtype)
        if not info.min <= int(value) <= info.max:
            raise SimError(f"memset value {value} does not fit {dst.dtype}")
        _write(dst, np.full(dst.shape, int(value), dst.dtype))
    else:
        _store(dst, np.full(dst.shape, np.float32(value)))


# ---- registers (runtime values: the bounds of compiled loops) ------------------------------------------
class VirtualRegister:
    """A register on an engine (`register_alloc`): one 32-bit integer known only at run time. The tracer
    never sees its value, so Python control flow on it is refused (as NKI's tracer refuses `if reg:`); it
    bounds `nl.fori_loop` (docs: nki.isa.VirtualRegister, nki.language.fori_loop)."""

    def __init__(self, value=0, frozen=False):
        self._value, self.frozen = int(value), frozen

    def __bool__(self):
        raise SimError("a VirtualRegister's value is not known while the kernel is built: use nl.fori_loop")

    __int__ = __index__ = __bool__


def register_alloc(value=None):
    return VirtualRegister(0 if value is None else int(value))


def register_load(dst, src):
    """dst <- the (1, 1) int32 SBUF tile src (a register load reads one element of SBUF)."""
    if not isinstance(dst, VirtualRegister) or dst.frozen:
        raise SimError("register_load needs a register from register_alloc")
    _on_chip(src, "src")
    if src.buffer is not sbuf or tuple(src.shape) != (1, 1) or src.dtype not in (D.int32, D.uint32):
        raise SimError(f"register_load reads a (1, 1) int32 SBUF tile, got {src.shape} {src.dtype}")
    dst._value = int(_read(src).reshape(-1)[0])


def register_value(reg):
    """The run-time value of a register or a Python int (the simulator's side of a compiled loop)."""
    return reg._value if isinstance(reg, VirtualRegister) else int(reg)


from . import _cost as _C  # noqa: E402  (after the definitions it wraps)

_C.instrument(globals())  # every instruction charges its engine time (see _cost)
