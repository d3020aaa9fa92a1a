"""The documented Trainium2 (NeuronCore-v3) rules the simulator enforces, one function per rule, each with the
documentation line it implements. Citations are files of aws-neuron/aws-neuron-sdk (NKI 0.6 docs, Neuron SDK
2.32 tree) unless another repository is named.

R1  dtype policy per target (`check_dtype`)
    compiler/error-codes/EVRF051.rst: "Data type F8E4M3FN is not supported on TRN1/TRN2. ... natively supported
    on Trainium3 (Trn3) and later"; nki/api/nki/isa/__init__.py (nc_matmul): "Starting NeuronCore-v4,
    float8_e4m3fn (OCP FP8) is also supported"; nki/api/nki.api.shared.rst footnote [#2]: the packed x4 types
    are "custom data type for nki.isa.nc_matmul_mx and nki.isa.quantize_mx on NeuronCore-v4". float8_e8m0fnu is
    only the scale type of those NeuronCore-v4 MX instructions, so on trn2 neither float8_e4m3fn,
    float8_e8m0fnu nor the fp4 format may be the dtype of any tensor (argument, allocation, view, ap dtype).
R2  no division (`check_alu`)
    release-notes/components/nki.rst: "nki.language.divide is not supported -- Division is not available as a
    hardware instruction. As a workaround, multiply by the reciprocal"; nki/api/nki.api.shared.rst tbl-aluop
    has no divide operator.
R3  arithmetic ALU operators compute in fp32 (`arith_inputs_f32`, enforced in isa)
    nki/api/nki.api.shared.rst (nki-aluop): "instructions using *arithmetic* operators accept any valid NKI
    data type and convert input elements into float32 before performing the operators"; bitvec operators
    "treat input elements as bit patterns". So integer arithmetic is exact only below 2^24.
R4  indirect DMA stride (`indirect_stride`)
    nki/deep-dives/nki-aps.rst (and nki/migration/index.rst): "The stride on the leading dimension must be the
    total number of elements to the right of the leading dimension in the base tensor, and the stride
    specified in the leading dimension of the pattern in the .ap() is currently ignored."
R5  start partition of compute-engine accesses (`check_start_partition`)
    nki/guides/architecture/trainium_inferentia2_arch.rst: "If 64 < num_partition <= 128, start_partition must
    be 0; If 32 < num_partition <= 64, start_partition must be 0 or 64; If 0 < num_partition <= 32,
    start_partition must be one of 0/32/64/96".
R6  Tensor Engine tile placement (`check_pe_placement`)
    nki/api/nki/isa/__init__.py (nc_matmul, Tiling mode): "tile_position and tile_size must both be set to
    enable tiling mode. If they are not set, the default is to use the full systolic array, which is
    equivalent to tile_position=(0, 0) and tile_size=(128, 128)"; "The start_row must be a multiple of
    row_size ... Similarly, the start_column must be a multiple of column_size"; row/column tiles of 32, 64 or
    128 on NeuronCore-v3. The contraction rows enter PE rows from partition start_row and the stationary free
    dim leaves PE columns into PSUM partitions from start_column ("the free dimension of the stationary tile
    matches the partition dimension of the output dst tile"), so without tile_position both operands and the
    PSUM destination start at partition 0. nc_transpose has no tile_position: a Tensor Engine transpose
    reads from and writes to partition 0 (nc_matmul(is_transpose=True, tile_position=...) places it).
    (The parameter docstring's "start_column must be 0" contradicts the Tiling-mode text; the simulator
    follows the Tiling-mode text and the column rule above.)
R7  PSUM banks (`psum_banks_of`, `check_psum_bank`)
    nki/guides/architecture/trainium_inferentia2_arch.rst: "one PSUM partition has 16KiB", "with 8 PSUM banks
    per partition"; nc_matmul: the moving free size "must not exceed 512, matching the maximum number of
    float32 elements per PSUM bank". Banks are 2 KiB per partition; a PSUM tensor occupies whole banks and a
    matmul / transpose result must lie inside one bank.
R8  live SBUF / PSUM footprint (`Footprint`)
    nki/guides/architecture/trainium2_arch.rst: "NeuronCore-v3 SBUF capacity is 28MiB (or, 128 partitions of
    224KiB) ... PSUM capacity remains the same at 2MiB". The simulator budgets SBUF_USABLE = 192 KiB per
    partition of live tiles: the 192 KiB per partition of NeuronCore-v2
    (trainium_inferentia2_arch.rst: "one SBUF partitions has 192KiB"), i.e. the physical 224 KiB of v3 minus
    32 KiB left to the compiler (spills, semaphores, DMA descriptors, which nki/api/nki/language/__init__.py
    `total_available_sbuf_size` / `sbuf_fmax_bytes` -- "usable SBUF free dimension per partition" --
    reserve but do not quantify). A kernel inside 192 KiB therefore fits the device with margin; one between
    192 and 224 KiB might. Tiles are live from allocation until the kernel drops its last reference.
R9  launch grid = LNC degree (`check_grid`)
    nki/api/nki/__init__.py (jit): "The LNC (Logical NeuronCore) degree can be set at the callsite using
    bracket syntax: kernel[lnc](args) ... The LNC value must match the NEURON_LOGICAL_NC_CONFIG environment
    variable"; nki/get-started/about/lnc.rst: "you can opt to run the kernel on 1 or 2 logical cores".
R10 accumulate semantics (`check_accumulate`)
    nc_matmul: "accumulate=True ... Only valid after the PSUM location has been initialized by a matmul with
    accumulate=False"; "On NeuronCore-v2 and NeuronCore-v3, matmul accumulating into a PSUM location that
    was value-initialized by a non-matmul instruction (e.g., memset, tensor_copy) is not supported and is
    undefined behavior on hardware."
R11 no unsynchronised sharing of shared_hbm between the programs of a grid (`RaceDetector`)
    nki/get-started/about/lnc.rst: under LNC=2 the kernel "will be run on" both cores at once; inputs and
    outputs live in shared_hbm, visible to both. Two programs writing the same element, or one reading what
    the other wrote, is a race (the simulator runs them one after the other, so it must look for it).
"""

from __future__ import annotations

import contextlib
import math
import os
import weakref

import numpy as np

from ._errors import SimError

# ---- targets ------------------------------------------------------------------------------------------------
_ALIASES = {"trn2": "trn2", "gen3": "trn2", "trn3": "trn3", "gen4": "trn3"}
_TARGET = None


def _from_env():
    name = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2").strip().lower() or "trn2"
    if name not in _ALIASES:
        raise SimError(f"NEURON_PLATFORM_TARGET_OVERRIDE={name!r}: the simulator models trn2 (gen3) and trn3 (gen4)")
    return _ALIASES[name]


def target() -> str:
    """'trn2' (NeuronCore-v3, the default) or 'trn3' (NeuronCore-v4)."""
    global _TARGET
    if _TARGET is None:
        _TARGET = _from_env()
    return _TARGET


def set_target(name: str | None) -> None:
    """Select the modelled target ('trn2' / 'gen3', 'trn3' / 'gen4'); None re-reads the environment."""
    global _TARGET
    if name is None:
        _TARGET = None
        return
    if name not in _ALIASES:
        raise SimError(f"unknown target {name!r}")
    _TARGET = _ALIASES[name]


@contextlib.contextmanager
def use_target(name: str):
    prev = _TARGET
    set_target(name)
    try:
        yield
    finally:
        globals()["_TARGET"] = prev


# ---- R1 dtypes -------------------------------------------------------------------------------------------------
def _nc_v4_only():
    import ml_dtypes

    return {np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e8m0fnu), np.dtype(ml_dtypes.float4_e2m1fn)}


_V4_ONLY = None


def check_dtype(dt: np.dtype, what: str) -> None:
    global _V4_ONLY
    if _V4_ONLY is None:
        _V4_ONLY = _nc_v4_only()
    if dt in _V4_ONLY and target() == "trn2":
        raise SimError(f"{what}: dtype {dt} is not a trn2 (NeuronCore-v3) data type (NCC_EVRF051: float8_e4m3fn "
                       "is Trn3+; e8m0 / fp4 exist only for NeuronCore-v4 MX instructions): bring the bytes in as "
                       "uint8 and decode them with integer and fp32 instructions")


# ---- R2 division -------------------------------------------------------------------------------------------------
def check_alu(op, what: str) -> None:
    if getattr(op, "name", None) == "divide":
        raise SimError(f"{what}: nl.divide is not a hardware ALU operator ('Division is not available as a "
                       "hardware instruction'); multiply by a reciprocal")


# ---- R4 indirect DMA -------------------------------------------------------------------------------------------
def indirect_stride(base, pattern) -> int:
    """The element step per index the device uses: the product of the base tensor's dims right of dim 0.
    A pattern that states another leading stride is rejected: the device would silently ignore it."""
    step = math.prod(base.shape[1:])
    if pattern[0][0] != step:
        raise SimError(f"indirect DMA on {base.name!r}{tuple(base.shape)}: the pattern's leading stride "
                       f"{pattern[0][0]} is ignored by the device, which steps {step} elements (the product of "
                       "the base tensor's dims right of the leading one) per index: reshape the base tensor so "
                       "that one index selects one row")
    return step


# ---- R5 start partition --------------------------------------------------------------------------------------
def allowed_starts(nparts: int):
    if nparts > 64:
        return (0,)
    if nparts > 32:
        return (0, 64)
    return (0, 32, 64, 96)


def check_start_partition(t, instr: str) -> None:
    if t is None or not t.buffer.on_chip:
        return
    p, s = t.shape[0], t.pstart()
    if s and s not in allowed_starts(p):  # partition 0 starts an access of any size
        raise SimError(f"{instr}: {t.name!r} accesses {p} partitions from partition {s}; compute engines start a "
                       f"{p}-partition access only at {'/'.join(map(str, allowed_starts(p)))} (start_partition rule)")


# ---- R6 Tensor Engine placement --------------------------------------------------------------------------------
_TILES = (32, 64, 128)


def check_pe_placement(k_rows, k_start, m_cols, dst_start, tile_position, tile_size, instr="nc_matmul"):
    tp, ts = tuple(tile_position or ()), tuple(tile_size or ())
    if bool(tp) != bool(ts):
        raise SimError(f"{instr}: tile_position and tile_size must both be set to enable tiling mode")
    if not tp:
        if k_start != 0:
            raise SimError(f"{instr}: contraction operands start at partition {k_start}; without tile_position "
                           "the full systolic array (row 0) is used -- set tile_position/tile_size")
        if dst_start != 0:
            raise SimError(f"{instr}: PSUM destination starts at partition {dst_start}; without tile_position the "
                           "result leaves PE columns 0.. into PSUM partitions 0.. -- set tile_position/tile_size")
        return
    (r, c), (rs, cs) = (int(tp[0]), int(tp[1])), (int(ts[0]), int(ts[1]))
    if rs not in _TILES or cs not in _TILES:
        raise SimError(f"{instr}: tile_size {ts} must use row/column tiles of 32, 64 or 128")
    if r % rs or c % cs or r + rs > 128 or c + cs > 128:
        raise SimError(f"{instr}: tile_position {tp} must be a multiple of tile_size {ts} inside the 128x128 array")
    if k_rows > rs or m_cols > cs:
        raise SimError(f"{instr}: a {k_rows}x{m_cols} stationary does not fit the {rs}x{cs} tile")
    if k_start != r:
        raise SimError(f"{instr}: contraction operands start at partition {k_start}, the tile at PE row {r}")
    if dst_start != c:
        raise SimError(f"{instr}: PSUM destination starts at partition {dst_start}, the tile at PE column {c}")


# ---- R7 / R8 memory -------------------------------------------------------------------------------------------
SBUF_PHYSICAL = {"trn2": 224 * 1024, "trn3": 224 * 1024}
SBUF_USABLE = 192 * 1024
PSUM_BANK_BYTES = 2 * 1024
PSUM_BANKS = 8


def psum_banks_of(per_partition_bytes: int) -> int:
    return -(-per_partition_bytes // PSUM_BANK_BYTES)


def check_psum_bank(dst, instr: str) -> None:
    """A matmul / transpose result must lie inside one PSUM bank of its tensor (tensors start on a bank)."""
    ps = dst._pstride()
    isz = dst.dtype.itemsize
    lo = dst.offset % ps
    hi = lo + sum((n - 1) * s for n, s in zip(dst.shape[1:], dst.strides[1:]))
    if (lo * isz) // PSUM_BANK_BYTES != (hi * isz) // PSUM_BANK_BYTES:
        raise SimError(f"{instr}: destination {dst.name!r} spans bytes {lo * isz}..{hi * isz + isz - 1} of its PSUM "
                       f"partition, crossing a {PSUM_BANK_BYTES}-byte bank boundary")


# A kernel whose live tiles exceed the budget is refused (the device would not compile it). Tools that
# measure how far over budget a kernel is (checks.footprint, the release-shape check) switch the refusal
# off around their launches with `measure_only()` and compare the peaks themselves.
FOOTPRINT_RAISES = True


class measure_only:
    def __enter__(self):
        global FOOTPRINT_RAISES
        self._saved, FOOTPRINT_RAISES = FOOTPRINT_RAISES, False

    def __exit__(self, *exc):
        global FOOTPRINT_RAISES
        FOOTPRINT_RAISES = self._saved


class Footprint:
    """Live on-chip bytes per partition of one program (tiles die when the kernel drops them)."""

    def __init__(self):
        self.sbuf = 0
        self.psum_banks = 0
        self.peak_sbuf = 0
        self.peak_psum_banks = 0
        # weakref -> (buffer name, amount) of every live tile; a plain weakref with a callback costs a tenth
        # of a weakref.finalize, and kernels allocate a tile every few instructions
        self._live = {}

    def add(self, storage, buffer_name: str, per_partition_bytes: int, name: str) -> None:
        if buffer_name == "sbuf":
            self.sbuf += per_partition_bytes
            if self.sbuf > SBUF_USABLE and FOOTPRINT_RAISES:
                used, self.sbuf = self.sbuf, self.sbuf - per_partition_bytes
                raise SimError(f"SBUF overflow allocating {name!r}: {used} live bytes per partition exceed the "
                               f"{SBUF_USABLE} usable ({SBUF_PHYSICAL[target()]} physical) on {target()}")
            self.peak_sbuf = max(self.peak_sbuf, self.sbuf)
            self._live[weakref.ref(storage, self._died)] = ("sbuf", per_partition_bytes)
        else:
            banks = psum_banks_of(per_partition_bytes)
            self.psum_banks += banks
            if self.psum_banks > PSUM_BANKS and FOOTPRINT_RAISES:
                used, self.psum_banks = self.psum_banks, self.psum_banks - banks
                raise SimError(f"PSUM overflow allocating {name!r}: {used} live banks exceed the {PSUM_BANKS} banks "
                               f"of {PSUM_BANK_BYTES} bytes per partition")
            self.peak_psum_banks = max(self.peak_psum_banks, self.psum_banks)
            self._live[weakref.ref(storage, self._died)] = ("psum", banks)

    def _died(self, ref):
        kind, n = self._live.pop(ref)
        if kind == "sbuf":
            self.sbuf -= n
        else:
            self.psum_banks -= n


# ---- R9 grid -----------------------------------------------------------------------------------------------------
def check_grid(grid: int) -> None:
    if grid not in (1, 2):
        raise SimError(f"launch grid {grid}: a trn2 kernel runs on 1 or 2 logical cores (kernel[lnc] with the LNC "
                       "degree)")
    env = os.environ.get("NEURON_LOGICAL_NC_CONFIG")
    if env and int(env) != grid:
        raise SimError(f"launch grid {grid} does not match NEURON_LOGICAL_NC_CONFIG={env} (the LNC value must match)")


# ---- R10 accumulate ------------------------------------------------------------------------------------------
def check_accumulate(accumulate, written, by_matmul, name: str) -> None:
    """written / by_matmul: bool masks of the destination region."""
    init_other = written & ~by_matmul
    if accumulate is True:
        if not written.all():
            raise SimError(f"nc_matmul accumulate=True into never-written PSUM {name!r}")
        if init_other.any():
            raise SimError(f"nc_matmul accumulate=True into PSUM {name!r} last written by a non-matmul instruction "
                           "(memset / tensor_copy ...): undefined behavior on NeuronCore-v3")
    elif accumulate is None and init_other.any():
        raise SimError(f"nc_matmul accumulate=None onto PSUM {name!r} initialised by a non-matmul instruction: "
                       "undefined behavior on NeuronCore-v3 (start the group with accumulate=False)")


# ---- R11 races -------------------------------------------------------------------------------------------------
def owner_view(t):
    """int8 array (view of t's elements): -1 untouched / input, else the program id that wrote it."""
    st = t._st
    own = getattr(st, "owner", None)
    if own is None:
        own = st.owner = np.full(len(st.data), -1, np.int8)
    return t._view(own)


def check_shared_write(t, pid: int, idx=None) -> None:
    own = owner_view(t) if idx is None else _owner_flat(t)[idx]
    other = (own >= 0) & (own != pid)
    if other.any():
        raise SimError(f"race on shared_hbm {t.name!r}: program {pid} writes elements program "
                       f"{int(own[other].flat[0])} wrote; the programs of a grid run concurrently")
    if idx is None:
        own[...] = pid
    else:
        _owner_flat(t)[idx] = pid


def check_shared_read(t, pid: int, idx=None) -> None:
    own = owner_view(t) if idx is None else _owner_flat(t)[idx]
    other = (own >= 0) & (own != pid)
    if other.any():
        raise SimError(f"race on shared_hbm {t.name!r}: program {pid} reads elements program "
                       f"{int(own[other].flat[0])} writes; the programs of a grid run concurrently")


def _owner_flat(t):
    owner_view(t)
    return t._st.owner
