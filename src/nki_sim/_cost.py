"""Engine time of the instructions the simulator executes: a cost model of a NeuronCore-v3 (trn2).

Every compute instruction is charged to the engine that runs it (Tensor, Vector, Scalar, GpSimd) in that
engine's cycles, and every `dma_copy` to the core's DMA queues in bytes, after the instruction ran (a
refused instruction costs nothing). Each program of a launch grid is one physical NeuronCore (LNC=2: two
programs in parallel), so it keeps its own `Ledger`.

Per-instruction cycles are the "Estimated instruction cost" formulas of the NKI ISA reference (N =
elements per partition of the input tile, MIN_II = 64 engine cycles the minimum initiation interval),
with the Trainium2 Vector Engine performance modes, at the Trainium2 engine clocks. Constants and their
sources are in `CONSTANTS`; `ASSUMED` names what the documents do not say and this model assumes.

Overlap rule (one kernel call): the four engines and the DMA queues run their streams in parallel (the
architecture guide's engine model), so a program takes its busiest queue's time; its first input has to
arrive before any engine starts and its last output has to land after the last one finishes, one DMA
latency each:  program_ns = 2 * DMA_LATENCY_NS + max(busiest engine ns, DMA ns);  call_ns = the slowest
program. Latency inside a dependency chain of small instructions is not modelled beyond MIN_II.
"""

import math

from . import _dtypes as D
from . import _runtime as R
from ._tensor import SimTensor, psum

ENGINES = ("tensor", "vector", "scalar", "gpsimd")
MIN_II = 64  # engine cycles
DMA_LATENCY_NS = 1300.0  # one transfer's descriptor / semaphore-to-start latency
DMA_GBPS = 368.0  # DMA bandwidth of one NeuronCore-v3: 16 engines x 23 B/ns
HBM_GBPS_PER_CORE = 2900.0 / 8  # a trn2 device's HBM bandwidth shared by its 8 NeuronCores
CLOCK_GHZ = {"tensor": 2.4, "vector": 0.96, "scalar": 1.2, "gpsimd": 1.2}

_TRN2 = "NKI Trainium2 architecture guide (aws-neuron-sdk nki/guides/architecture/trainium2_arch.rst)"
_TRN1 = "NKI Trainium/Inferentia2 architecture guide (nki/guides/architecture/trainium_inferentia2_arch.rst)"
_ISA = ("NKI ISA reference, 'Estimated instruction cost' of each nki.isa instruction "
        "(awsdocs-neuron general/nki/api/generated/nki.isa.*.html)")
_DMA = "NKI DMA bandwidth guide (nki/deep-dives/nki-dma-bandwidth-guide.rst) and DMA overview"
CONSTANTS = {
    "tensor_ghz": (2.4, _TRN2 + ": Tensor Engine frequency 2.4 GHz"),
    "vector_ghz": (0.96, _TRN2 + ": Vector Engine frequency 0.96 GHz"),
    "scalar_ghz": (1.2, _TRN2 + ": Scalar Engine frequency 1.2 GHz"),
    "gpsimd_ghz": (1.2, _TRN2 + ": GpSimd Engine frequency 1.2 GHz"),
    "min_ii_cycles": (MIN_II, _ISA + ": MIN_II 'roughly 64 engine cycles'"),
    "matmul_cycles": ("max(min(64, N_stationary), N_moving), x4 for fp32",
                      _ISA + " (nc_matmul); 79 BF16 / 20 FP32 TFLOPS on NC-v3 = 128x128 PEs at 2.4 GHz, " + _TRN2),
    "pe_transpose_cycles": ("max(P, min(64, F)), x2 for 4-byte data",
                            _ISA + " (nc_transpose); transpose mode 2x faster for FP32, " + _TRN2),
    "vector_perf_mode": ("bf16 tensor_copy / tensor_scalar: N/4 SBUF contiguous, N/2 otherwise",
                         _TRN2 + ": Vector Engine performance mode"),
    "dma_gbps": (DMA_GBPS, _DMA + ": Trainium2 16 engines x 23 B/ns = 368 GB/s per NeuronCore"),
    "dma_latency_ns": (DMA_LATENCY_NS, _DMA + ": ~1300 ns descriptor setup / semaphore-to-start per transfer"),
    "hbm_gbps_per_core": (HBM_GBPS_PER_CORE, "NKI Trainium2 architecture guide (awsdocs-neuron "
                          "nki/arch/trainium2_arch.html): HBM 2.9 TB/s per device, over its 8 NeuronCores"),
}
ASSUMED = [
    "NC-v3 instruction costs = the ISA reference's per-instruction estimates (written for NC-v2) at the NC-v3 "
    "clocks; the Trainium2 guide gives clocks, data-path widths and the Vector performance modes only (its "
    "'256 elements/cycle for other data types' Vector width would halve the fp32 Vector costs)",
    "MIN_II floors every compute instruction, scalar_tensor_tensor included (its ISA entry gives N / 2N only)",
    "an instruction left to the compiler's choice of engine (tensor_scalar, tensor_copy, memset) runs on the "
    "least busy engine that supports it (Scalar: multiply/add only; GpSimd: no PSUM)",
    "DMA occupancy = bytes moved / 368 GB/s (no small-transfer inefficiency); its latency counts twice per call",
    "indirect (gather / scatter) DMA: software descriptor generation on GpSimd not charged",
    "the static instruction overhead of dependent back-to-back small instructions (~100 cycles, " + _TRN1
    + ") is not added on top of MIN_II",
    "a register load and a compiled loop's (nl.fori_loop) compare-and-branch cost nothing; a loop iteration "
    "that does not run charges none of its body's instructions",
]


class Ledger:
    """Cycles and instruction counts per engine, DMA bytes and transfers, of one program."""

    __slots__ = ("cycles", "count", "dma_bytes", "dma_transfers", "hbm_bytes")

    def __init__(self):
        self.cycles = dict.fromkeys(ENGINES, 0.0)
        self.count = dict.fromkeys(ENGINES, 0)
        self.dma_bytes = 0
        self.dma_transfers = 0
        self.hbm_bytes = 0

    def engine_ns(self, e):
        return self.cycles[e] / CLOCK_GHZ[e]

    def busiest_ns(self):
        return max(self.engine_ns(e) for e in ENGINES)

    def dma_ns(self):
        return self.dma_bytes / DMA_GBPS

    def time_ns(self):
        return 2 * DMA_LATENCY_NS + max(self.busiest_ns(), self.dma_ns())


class CallCost:
    """The programs' ledgers of one kernel launch, and the overlap rule's time."""

    def __init__(self, ledgers):
        self.ledgers = list(ledgers)

    @property
    def call_ns(self):
        return max((g.time_ns() for g in self.ledgers), default=0.0)

    @property
    def engine_ns(self):  # busiest compute engine of the slowest program, no DMA, no latency
        return max((g.busiest_ns() for g in self.ledgers), default=0.0)

    @property
    def dma_ns(self):
        return max((g.dma_ns() for g in self.ledgers), default=0.0)

    @property
    def compute_ns(self):  # the call without its DMA bandwidth time (priced apart as HBM bytes)
        return max((2 * DMA_LATENCY_NS + g.busiest_ns() for g in self.ledgers), default=0.0)

    def per_engine_ns(self):
        return {e: max((g.engine_ns(e) for g in self.ledgers), default=0.0) for e in ENGINES}

    def instructions(self):
        return {e: sum(g.count[e] for g in self.ledgers) for e in ENGINES}

    @property
    def dma_bytes(self):
        return sum(g.dma_bytes for g in self.ledgers)

    @property
    def hbm_bytes(self):
        return sum(g.hbm_bytes for g in self.ledgers)

    def as_dict(self):
        return {"call_ns": self.call_ns, "compute_ns": self.compute_ns, "engine_ns": self.engine_ns,
                "dma_ns": self.dma_ns,
                "per_engine_ns": self.per_engine_ns(), "instructions": self.instructions(),
                "dma_bytes": self.dma_bytes, "hbm_bytes": self.hbm_bytes,
                "dma_transfers": sum(g.dma_transfers for g in self.ledgers)}


# ---- charging ------------------------------------------------------------------------------------------
def _ledger():
    cur = R._current
    return None if cur is None else cur.ledger


def _charge(engine, cycles):
    led = _ledger()
    if led is not None:
        led.cycles[engine] += float(cycles)
        led.count[engine] += 1


def _pick(options, requested):
    """The engine an instruction runs on: the requested one, else the least busy of `options`."""
    name = getattr(requested, "value", requested)
    if name in options:
        return name
    led = _ledger()
    if led is None:
        return options[0]
    best, best_ns = options[0], led.engine_ns(options[0])
    for e in options[1:]:  # the first of the least busy, as min() by (ns, position) would pick
        ns = led.engine_ns(e)
        if ns < best_ns:
            best, best_ns = e, ns
    return best


def _n(t):
    return math.prod(t.shape[1:]) if len(t.shape) > 1 else 1


_DT16 = frozenset((D.bfloat16, D.float16))


def _is16(t):
    return getattr(t, "dtype", None) in _DT16


def _contig(t):
    return t.shape[-1] == 1 or t.strides[-1] == 1


def _in_psum(t):
    if type(t) is SimTensor:  # the common case, without the getattr chain
        return t._st.buffer is psum
    return getattr(getattr(t, "buffer", None), "name", "") == "psum"


def _vector_copy_cycles(dst, src, n):
    """tensor_copy / tensor_scalar on the Vector Engine with the trn2 performance mode."""
    if _is16(dst) and _is16(src):
        if not (_in_psum(dst) or _in_psum(src)) and _contig(dst) and _contig(src):
            return n / 4
        return n / 2
    return n


def _floor(c):
    return max(MIN_II, c)


# ---- per-instruction cost functions (same parameters as the nki.isa instructions) ----------------------
def nc_matmul(dst, stationary, moving, is_stationary_onezero=False, is_moving_onezero=False,
              is_transpose=False, accumulate=None, tile_position=(), tile_size=(), perf_mode=None, name=None):
    if is_transpose:
        return _pe_transpose(stationary)
    c = max(min(64, _n(stationary)), _n(moving))
    if stationary.dtype == D.float32 or moving.dtype == D.float32:
        c *= 4
    _charge("tensor", c)


def _pe_transpose(data):
    c = max(data.shape[0], min(64, _n(data)))
    _charge("tensor", c * (2 if data.dtype.itemsize == 4 else 1))


def nc_transpose(dst, data, engine=None, name=None):
    if _in_psum(dst) and getattr(engine, "value", engine) != "vector":
        return _pe_transpose(data)
    _charge("vector", _floor(_n(data)))


def tensor_copy(dst, src, engine=None, name=None):
    options = ("vector", "scalar") if (_in_psum(dst) or _in_psum(src)) else ("vector", "scalar", "gpsimd")
    e = _pick(options, engine)
    n = _n(src)
    _charge(e, _floor(_vector_copy_cycles(dst, src, n) if e == "vector" else n))


def tensor_tensor(dst, data1, data2, op, engine=None, name=None):
    n = _n(data1)
    one_psum = _in_psum(data1) != _in_psum(data2)
    bf16 = D.bfloat16
    fast = (dst.dtype == bf16 and data1.dtype == bf16 and data2.dtype == bf16 and not one_psum
            and op.name in ("add", "multiply", "subtract") and _contig(data1) and _contig(data2))
    _charge("vector", _floor(n if (one_psum or fast) else 2 * n))


def tensor_scalar(dst, data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False,
                  engine=None, name=None):
    scalar_ok = (op0.kind == "arith" and not _in_psum(dst) and
                 ((op0.name == "multiply" and (op1 is None or op1.name == "add")) or
                  (op0.name == "add" and op1 is None)))
    e = _pick(("vector", "scalar") if scalar_ok else ("vector",), engine)
    n = _n(data)
    _charge(e, _floor(_vector_copy_cycles(dst, data, n) if e == "vector" else n))


def scalar_tensor_tensor(dst, data, op0, operand0, op1, operand1, reverse0=False, reverse1=False, name=None):
    n = _n(data)
    fast = (data.dtype == D.bfloat16 and operand1.dtype == D.bfloat16 and op0.name == "subtract"
            and op1.name == "multiply" and n % 2 == 0)
    _charge("vector", _floor(n if fast else 2 * n))


def tensor_reduce(dst, op, data, axis, negate=False, keepdims=False, name=None):
    n = _n(data)
    half = data.dtype == D.bfloat16 and dst.dtype == D.bfloat16 and op.name in ("add", "maximum")
    _charge("vector", _floor(n / 2 if half else n))


def activation(dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None, reduce_cmd=None, name=None):
    _charge("scalar", _floor(_n(data)) + (MIN_II if reduce_res is not None else 0))


def reciprocal(dst, data, name=None):
    _charge("vector", _floor(8 * _n(data)))


def iota(dst, pattern, offset=0, channel_multiplier=0, name=None):
    _charge("gpsimd", 150 + _n(dst))


def memset(dst, value, engine=None, name=None):
    e = _pick(("vector", "gpsimd"), engine)
    n = _n(dst)
    _charge(e, _floor(n / 2 if (value == 0 and _is16(dst) and e == "vector") else n))


def dma_copy(dst, src, priority=None, oob_mode=None, dge_mode=None, engine=None, name=None):
    led = _ledger()
    if led is None:
        return
    n = src.size
    for ind in (src, dst):  # rows an indirect access skips (oob_mode skip: empty slots) move nothing
        if hasattr(ind, "rows"):
            _, inner, valid = ind.rows()
            n = int(valid.sum()) * len(inner)
    isz = max(dst.dtype.itemsize, src.dtype.itemsize)
    led.dma_bytes += n * isz
    led.dma_transfers += 1
    for t in (dst, src):
        if not getattr(t.buffer, "on_chip", True):
            led.hbm_bytes += n * t.dtype.itemsize


COSTS = {f.__name__: f for f in (nc_matmul, nc_transpose, tensor_copy, tensor_tensor, tensor_scalar,
                                 scalar_tensor_tensor, tensor_reduce, activation, reciprocal, iota, memset,
                                 dma_copy)}


def instrument(namespace):
    """Wrap the nki.isa instructions of `namespace` (the isa module's globals) so that each charges its cost
    after it ran. Instructions implemented by another wrapped one (activation_reduce -> activation) are
    charged once, through the inner call."""
    for fname, cost in COSTS.items():
        fn = namespace[fname]

        def wrapped(*args, _fn=fn, _cost=cost, **kwargs):
            out = _fn(*args, **kwargs)
            _cost(*args, **kwargs)
            return out

        wrapped.__name__, wrapped.__doc__, wrapped.__wrapped__ = fn.__name__, fn.__doc__, fn
        namespace[fname] = wrapped


def fill(t, value):
    """nl.zeros / nl.full / nl.ones: a memset instruction on the device."""
    memset(t, value)
