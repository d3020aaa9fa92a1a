"""nki.language for the simulator: dtypes, buffers, allocation, slicing helpers, launch queries and the
operator tokens passed to nki.isa instructions."""

import numpy as np

from . import _cost as C
from . import _dtypes as D
from . import _runtime as R
from ._errors import SimError
from ._ops import ALL as _ALL_OPS
from ._ops import *  # noqa: F401,F403  (nl.add, nl.exp, ...)
from ._tensor import DynSlice, SimTensor, hbm, private_hbm, psum, sbuf, shared_hbm  # noqa: F401

bool_, int8, int16, int32 = D.bool_, D.int8, D.int16, D.int32
uint8, uint16, uint32 = D.uint8, D.uint16, D.uint32
float16, float32, tfloat32, bfloat16 = D.float16, D.float32, D.tfloat32, D.bfloat16
float8_e4m3, float8_e4m3fn, float8_e5m2 = D.float8_e4m3, D.float8_e4m3fn, D.float8_e5m2
float8_e8m0fnu, float4_e2m1fn = D.float8_e8m0fnu, D.float4_e2m1fn

ndarray_type = SimTensor


class NKIObject:
    """Base class the NKI tracer requires for user classes used inside kernels."""


class tile_size:
    pmax = 128
    psum_fmax = 2048
    psum_bank_fmax = 512
    gemm_stationary_fmax = 128
    gemm_moving_fmax = 512
    bn_stats_fmax = 512
    total_available_sbuf_size = 192 * 1024


def ndarray(shape, dtype, buffer=None, name="", address=None):
    return R.alloc(shape, dtype, sbuf if buffer is None else buffer, name)


def _filled(shape, dtype, buffer, name, value):
    t = ndarray(shape, dtype, buffer, name)
    dt = t.dtype
    t._data()[...] = D.from_f32(np.full(t.shape, np.float32(value)), dt)
    t._mask()[...] = True
    C.fill(t, value)
    return t


def zeros(shape, dtype, buffer=None, name=""):
    return _filled(shape, dtype, buffer, name, 0.0)


def ones(shape, dtype, buffer=None, name=""):
    return _filled(shape, dtype, buffer, name, 1.0)


def full(shape, fill_value, dtype, buffer=None, name=""):
    return _filled(shape, dtype, buffer, name, fill_value)


def zeros_like(a, dtype=None, buffer=None, name=""):
    return zeros(a.shape, a.dtype if dtype is None else dtype, a.buffer if buffer is None else buffer, name)


def ds(start, size):
    return DynSlice(start, size)


program_id = R.program_id
num_programs = R.num_programs
program_ndim = R.program_ndim


# All NKI loop iterators unroll at trace time in nki >= 0.6 (deprecated aliases of range).
def affine_range(start, stop=None, step=1):
    return range(start, stop, step) if stop is not None else range(start)


sequential_range = static_range = affine_range


def fori_loop(lower, upper, body_fun, step=1):
    """A compiled loop (nki.language.fori_loop): body_fun(i) for i in [lower, upper) by step, where the
    bounds may be registers known only at run time; i reaches the body as a frozen register. Only the
    iterations that run execute (and are charged): a trip count of 0 costs nothing."""
    from . import isa

    if not isinstance(step, int) or step <= 0:
        raise SimError("fori_loop step must be a compile-time positive int")
    for i in range(isa.register_value(lower), isa.register_value(upper), step):
        body_fun(isa.VirtualRegister(i, frozen=True))


def device_print(*args, **kwargs):
    raise SimError("device_print is not simulated")


__all__ = [n for n in dir() if not n.startswith("_")] + list(_ALL_OPS)
