"""A strict CPU simulator of the subset of NKI (nki >= 0.6) that the v4flash kernels use.

It provides the modules `nki`, `nki.isa` and `nki.language` (see `install()`), executes every instruction
eagerly with NumPy, and rejects what Trainium2 hardware or the NKI compiler rejects: partition dims above
128, oversized or mistyped matmuls, DMA touching PSUM, stationary operands with two free dims,
single-partition indirect DMA, `raise` in a kernel, reads of memory that was never written, outputs left
partly unwritten, and the documented trn2 rules of `_rules` (dtype policy per target, no divide, fp32
arithmetic ALU, indirect-DMA stride from the base tensor, start partitions, Tensor Engine tile placement,
PSUM banks and the live SBUF / PSUM footprint, grid = LNC degree, accumulate semantics, shared_hbm races
between the programs of a grid). Every instruction it runs is charged to its engine and every DMA to
the core's queues (`_cost`: the NKI guides' per-instruction costs and clocks, a stated overlap rule; a
model of engine time, read from `_runtime.last_cost`); its float32 math follows IEEE / torch CPU
rounding unless `device_like()` perturbs it within the documented precision.
"""

import sys

from . import isa, language
from ._devicelike import device_like
from ._errors import NkiValidationError, SimError
from ._rules import set_target, target, use_target
from ._runtime import Kernel, jit, simulate

__all__ = ["isa", "language", "jit", "simulate", "Kernel", "SimError", "NkiValidationError", "install",
           "is_installed", "device_like", "target", "set_target", "use_target"]

IS_SIMULATOR = True


def install():
    """Register this package as `nki`, `nki.isa` and `nki.language` in sys.modules (replacing whatever
    was there), so kernel sources written against the real package import the simulator."""
    me = sys.modules[__name__]
    sys.modules["nki"] = me
    sys.modules["nki.isa"] = isa
    sys.modules["nki.language"] = language


def is_installed():
    return getattr(sys.modules.get("nki"), "IS_SIMULATOR", False)
