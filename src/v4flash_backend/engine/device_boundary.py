"""What crosses the host/device boundary: counters the eager runner and the static decode path
share (host syncs of torch code, moves of resident tensors, syncs left in a captured graph). Kept
below both (the engine's runner counts its own syncs; trn2 checks its graphs with the same rules)."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from v4flash_backend.ops.kernel_ops import kernel_op_name as _kernel_op  # a kernel op is one call

# ---- host-sync detection ------------------------------------------------------------------------
# Tensor methods / torch functions that read device values on the host (or whose output shape
# depends on them, which is the same stall on a device): inside a step each is a host sync.
_SYNC_NAMES = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__complex__",
                         "numpy", "cpu", "nonzero", "argwhere", "unique", "unique_consecutive",
                         "masked_select", "__repr__", "__format__", "bincount"})


class HostSyncCounter(TorchFunctionMode):
    """Counts host syncs (by op name) of the torch code that runs inside it.

    A kernel custom op (`v4flash::*`) is one opaque call, counted in `kernel_calls`: on a device it is
    one kernel launch, and whatever its implementation does inside (the simulator's NumPy round trip
    on CPU) is not a read the step makes. That holds by construction -- a torch function mode is off
    while its own handler runs, so the calls inside `func(...)` below never reach this mode -- and
    the kernel test suite checks it, with a deliberate `.item()` beside a kernel op still counted."""

    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = {}
        self.kernel_calls: dict[str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kernel = _kernel_op(func)
        if kernel is not None:
            self.kernel_calls[kernel] = self.kernel_calls.get(kernel, 0) + 1
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        sync = name in _SYNC_NAMES
        if name == "where" and len(args) + len(kwargs) == 1:  # torch.where(cond) is nonzero
            sync = True
        if name == "repeat_interleave" and len(args) > 1 and isinstance(args[1], torch.Tensor):
            sync = True  # tensor repeats: the output length is data-dependent
        if sync:
            self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.calls.values())


class NoSyncCounter:
    """HostSyncCounter's interface without the counting (and without its per-op cost)."""

    total = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False


class BoundarySpy(TorchFunctionMode):
    """Records every call that moves a tensor across the host/device boundary (.to(device) / .cpu /
    .cuda / copy_ from another tensor / .numpy / .tolist / .item) and whether that tensor is (a view
    of) a resident one (`resident`: the weights and caches). A decode round of the served static path
    must move no resident tensor and read back only its committed tokens (tests; the worker runs
    it on every round when V4FLASH_BOUNDARY_SPY=1 and reports the counts in the engine stats)."""

    MOVES = {"to", "cpu", "cuda", "copy_", "numpy", "tolist", "item", "pin_memory"}
    READS = {"tolist", "item", "numpy", "cpu"}

    def __init__(self, resident):
        super().__init__()
        self.ptrs = {t.untyped_storage().data_ptr() for t in resident if t.numel()}
        self.moves: list[tuple[str, bool]] = []

    def _res(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.numel() > 0 and t.untyped_storage().data_ptr() in self.ptrs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        kwargs = kwargs or {}
        if name == "to" and not ("device" in kwargs or any(isinstance(a, (str, torch.device)) for a in args[1:])):
            name = "to(dtype)"  # a cast, not a move
        if name in self.MOVES:
            src = args[1] if name == "copy_" and len(args) > 1 else (args[0] if args else None)
            self.moves.append((name, self._res(src)))
        return func(*args, **kwargs)

    @property
    def resident_moves(self) -> int:
        return sum(1 for _, r in self.moves if r)

    @property
    def reads(self) -> int:
        return sum(1 for n, _ in self.moves if n in self.READS)


def graph_host_syncs(gm) -> list[str]:
    """Host syncs left in a captured FX graph. torch.compile(fullgraph=True) raises on a
    data-dependent Python branch or .tolist(), but captures `.item()` and `nonzero` into the graph
    (as scalar / dynamic-shape ops) -- on a device each of those still stalls on a device-to-host
    read, so a compile backend of the static step checks the graph with this as well."""
    found = []
    for node in gm.graph.nodes:
        if node.op == "call_method":
            name = node.target
        elif node.op == "call_function":
            name = getattr(node.target, "__name__", str(node.target))
        else:
            continue
        name = name.split(".")[-1]
        if name in _SYNC_NAMES or name in ("_local_scalar_dense", "sym_constrain_range_for_size") or (
                name == "where" and len(node.args) + len(node.kwargs) == 1):
            found.append(str(node.target))
    return found
