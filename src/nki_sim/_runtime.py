"""Kernel launch: `@nki.jit`, `kernel[grid](...)`, `nki.simulate(kernel)`.

A launch with grid G runs the kernel body once per program id 0..G-1, one after the other (the kernels we
simulate use no barriers or collectives). Arguments become fully written `shared_hbm` tensors. Every
program allocates its own SBUF/PSUM/private HBM; the i-th `shared_hbm` allocation of each program is the
same tensor, as on a logical NeuronCore pair. Outputs must be `shared_hbm` tensors returned by the kernel
and must be completely written.
"""

import ast
import inspect
import math
import textwrap

import numpy as np

from . import _cost as C
from . import _dtypes as D
from . import _rules as RU
from . import _tensor as T
from ._blas import single_thread
from ._errors import SimError

_current = None  # the active _Launch
last_peaks = []  # [(peak live SBUF bytes per partition, peak live PSUM banks)] per program of the last launch
last_cost = None  # _cost.CallCost of the last launch (its programs' ledgers)


class _Launch:
    def __init__(self, grid):
        self.grid = grid
        self.pid = 0
        self.shared = []  # shared_hbm allocations of program 0, by allocation order
        self.n_shared = 0  # allocation counter of the running program
        self.act_regs = None  # Scalar Engine reduce registers (None = never reset)
        self.footprint = RU.Footprint()  # live SBUF / PSUM of the running program (_rules R8)
        self.peaks = []  # (peak SBUF bytes per partition, peak PSUM banks) of every finished program
        self.ledger = None  # _cost.Ledger of the running program (engine time, DMA bytes)
        self.ledgers = []


def current():
    if _current is None:
        raise SimError("this nki call is only valid inside a running kernel")
    return _current


def program_id(axis=0):
    if axis != 0:
        raise SimError("only a 1-D launch grid is simulated")
    return current().pid


def num_programs(axes=0):
    if axes not in (0, None):
        raise SimError("only a 1-D launch grid is simulated")
    return current().grid


def program_ndim():
    current()
    return 1


def alloc(shape, dtype, buffer, name=""):
    launch = current()
    if buffer is T.shared_hbm:
        i = launch.n_shared
        launch.n_shared += 1
        if launch.pid == 0:
            t = T.allocate(shape, dtype, buffer, name)
            launch.shared.append(t)
            return t
        if i >= len(launch.shared):
            raise SimError("programs of one launch allocated different shared_hbm tensors")
        t0 = launch.shared[i]
        if tuple(shape) != t0.shape or D.normalize(dtype) != t0.dtype:
            raise SimError("programs of one launch allocated different shared_hbm tensors")
        return T.SimTensor(t0._st, t0.dtype, t0.shape, t0.strides, 0, True)
    t = T.allocate(shape, dtype, buffer, name)
    if buffer.on_chip:
        launch.footprint.add(t._st, buffer.name, math.prod(t.shape[1:]) * t.dtype.itemsize, name)
    return t


def _check_source(fn):
    """The NKI tracer rejects `raise` in a kernel body; so do we (use assert)."""
    try:
        src = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Raise):
            raise SimError(f"kernel {fn.__name__}: `raise` is not allowed in a kernel body (use assert)")


def _to_numpy(x):
    """Accept NumPy arrays and CPU torch tensors (converted bitwise for bf16 / fp8)."""
    if isinstance(x, np.ndarray):
        return x, None
    mod = type(x).__module__
    if mod.startswith("torch"):
        from ._torch_bridge import torch_to_numpy
        return torch_to_numpy(x), "torch"
    return None, None


class Kernel:
    def __init__(self, fn, grid=1):
        self.fn, self.grid = fn, grid
        self.__name__ = getattr(fn, "__name__", "kernel")
        self.__doc__ = getattr(fn, "__doc__", None)
        self.__wrapped__ = fn

    def __getitem__(self, grid):
        if isinstance(grid, tuple):
            if len(grid) != 1:
                raise SimError("only a 1-D launch grid is simulated")
            grid = grid[0]
        grid = int(grid)
        if grid < 1:
            raise SimError(f"bad grid {grid}")
        RU.check_grid(grid)
        return Kernel(self.fn, grid)

    def __call__(self, *args, **kwargs):
        return launch(self.fn, self.grid, args, kwargs)

    def __repr__(self):
        return f"<nki_sim kernel {self.__name__}[{self.grid}]>"


def jit(fn=None, **options):
    """@nki.jit / @nki.jit(...): options (platform, debug flags) have no effect in the simulator."""
    if fn is None:
        return lambda f: jit(f, **options)
    if isinstance(fn, Kernel):
        return fn
    _check_source(fn)
    return Kernel(fn)


def simulate(kernel):
    """nki.simulate(kernel) / nki.simulate(kernel[2]): a callable running the kernel on NumPy inputs."""
    if isinstance(kernel, Kernel):
        return kernel
    return jit(kernel)


def launch(fn, grid, args, kwargs):
    global _current
    if _current is not None:
        raise SimError("nested kernel launch")
    RU.check_grid(grid)
    kind = None
    wrapped = []
    for i, a in enumerate(args):
        arr, k = _to_numpy(a)
        if arr is None:
            wrapped.append(a)
        else:
            kind = kind or k
            wrapped.append(T.wrap_array(arr, T.shared_hbm, f"arg{i}"))
    kw = {}
    for name, a in kwargs.items():
        arr, k = _to_numpy(a)
        if arr is None:
            kw[name] = a
        else:
            kind = kind or k
            kw[name] = T.wrap_array(arr, T.shared_hbm, name)
    state = _Launch(grid)
    results = []
    try:
        _current = state
        with single_thread():
            for pid in range(grid):
                state.pid, state.n_shared, state.act_regs = pid, 0, None
                state.footprint = RU.Footprint()
                state.ledger = C.Ledger()
                state.ledgers.append(state.ledger)
                results.append(fn(*wrapped, **kw))
                state.peaks.append((state.footprint.peak_sbuf, state.footprint.peak_psum_banks))
    finally:
        _current = None
        global last_peaks, last_cost
        last_peaks = state.peaks
        last_cost = C.CallCost(state.ledgers)
    out = results[0]
    if out is None:  # a kernel without outputs (all programs must agree)
        if any(r is not None for r in results):
            raise SimError("programs of one launch returned different outputs")
        return None
    single = not isinstance(out, (tuple, list))
    outs = [out] if single else list(out)
    for r in results[1:]:
        rs = [r] if single else list(r)
        if len(rs) != len(outs) or any(a._st is not b._st for a, b in zip(rs, outs)):
            raise SimError("programs of one launch returned different outputs")
    arrays = []
    for o in outs:
        if not isinstance(o, T.SimTensor) or o.buffer is not T.shared_hbm or not o._base:
            raise SimError("kernel outputs must be shared_hbm nl.ndarray tensors")
        if not o._st.written.all():
            missing = int((~o._st.written).sum())
            raise SimError(f"kernel output {o.name!r}: {missing} elements were never written")
        a = o._data().copy()
        if kind == "torch":
            from ._torch_bridge import numpy_to_torch
            a = numpy_to_torch(a)
        arrays.append(a)
    return arrays[0] if single else tuple(arrays)
