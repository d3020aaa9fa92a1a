"""ALU operators and activation functions (the `op=` arguments of nki.isa instructions).

Arithmetic runs in float32 with IEEE rounding (NumPy). Transcendentals use torch's CPU float32 kernels when
torch is importable, so that a kernel whose instruction sequence mirrors a torch reference reproduces it bit
for bit; the device's own approximations differ from both at the last-ulp level, so nothing here claims to
model them. Bitvec operators act on the raw integer bits.
"""

import numpy as np

from . import _devicelike as _DL
from ._errors import SimError

_TORCH = None


def torch_module():
    """torch if importable (imported on first use: the simulator itself does not need it), else None."""
    global _TORCH
    if _TORCH is None:
        try:
            import torch
            _TORCH = torch
        except ImportError:  # pragma: no cover - torch is a dependency of the project
            _TORCH = False
    return _TORCH or None


class Op:
    """An operator token such as nl.add or nl.exp. `alu` maps fp32 arrays (or ints for bitvec ops) to a
    result; `act` is the activation-function form (fp32 -> fp32)."""

    __slots__ = ("name", "kind", "alu", "act", "unary")

    def __init__(self, name, kind=None, alu=None, act=None, unary=False):
        self.name, self.kind, self.alu, self.act, self.unary = name, kind, alu, act, unary

    def __repr__(self):
        return f"nl.{self.name}"

    def __call__(self, *args, **kwargs):
        raise SimError(f"nl.{self.name}(...) as a tile function is outside the simulated subset; "
                       "use the nki.isa instructions")


def _np_sigmoid(x):
    return (np.float32(1) / (np.float32(1) + np.exp(-x))).astype(np.float32)


def _transcendental(path, fallback):
    """fp32 -> fp32 via torch.<path> when torch is available, else the NumPy fallback; perturbed within the
    assumed Scalar Engine precision in device-like mode (see _devicelike)."""
    def exact(x):
        t = torch_module()
        if t is None:  # pragma: no cover
            return np.asarray(fallback(x), np.float32)
        fn = t
        for part in path.split("."):
            fn = getattr(fn, part)
        return fn(t.from_numpy(np.ascontiguousarray(x, np.float32))).numpy()

    def run(x):
        y = exact(x)
        return _DL.transcendental(path, y) if _DL.active() else y
    return run


_exp = _transcendental("exp", np.exp)
_log = _transcendental("log", np.log)
_sqrt = _transcendental("sqrt", np.sqrt)
_rsqrt = _transcendental("rsqrt", lambda x: np.float32(1) / np.sqrt(x))
_sigmoid = _transcendental("sigmoid", _np_sigmoid)
_tanh = _transcendental("tanh", np.tanh)
_silu = _transcendental("nn.functional.silu", lambda x: x * _np_sigmoid(x))


def _f(x):
    return x.astype(np.float32, copy=False)


def _cmp(fn):
    return lambda a, b: fn(a, b).astype(np.float32)


def _lsr(a, b):
    """Logical right shift: bitvec operands arrive as non-negative int64 bit patterns (no sign extension;
    the ALU has no arithmetic shift)."""
    return a >> np.int64(b)


def _lsl(a, b):
    return a << np.int64(b)


# ---- arithmetic ALU operators (fp32) ----------------------------------------------------------------
add = Op("add", "arith", np.add)
subtract = Op("subtract", "arith", np.subtract)
multiply = Op("multiply", "arith", np.multiply)
divide = Op("divide", "arith", np.divide)
maximum = Op("maximum", "arith", np.maximum)
minimum = Op("minimum", "arith", np.minimum)
power = Op("power", "arith", np.power)
equal = Op("equal", "arith", _cmp(np.equal))
not_equal = Op("not_equal", "arith", _cmp(np.not_equal))
greater = Op("greater", "arith", _cmp(np.greater))
greater_equal = Op("greater_equal", "arith", _cmp(np.greater_equal))
less = Op("less", "arith", _cmp(np.less))
less_equal = Op("less_equal", "arith", _cmp(np.less_equal))
# ---- bitvec ALU operators (integer bit patterns) ------------------------------------------------------
bitwise_and = Op("bitwise_and", "bitvec", lambda a, b: a & np.int64(b))
bitwise_or = Op("bitwise_or", "bitvec", lambda a, b: a | np.int64(b))
bitwise_xor = Op("bitwise_xor", "bitvec", lambda a, b: a ^ np.int64(b))
left_shift = Op("left_shift", "bitvec", _lsl)
right_shift = Op("right_shift", "bitvec", _lsr)
logical_shift_left, logical_shift_right = left_shift, right_shift

# ---- activation functions (some double as unary ALU operators) -------------------------------------
copy = Op("copy", act=_f)
identity = copy
exp = Op("exp", act=_exp)
log = Op("log", act=_log)
sqrt = Op("sqrt", act=_sqrt)
rsqrt = Op("rsqrt", act=_rsqrt)
sigmoid = Op("sigmoid", act=_sigmoid)
silu = Op("silu", act=_silu)
tanh = Op("tanh", act=_tanh)
relu = Op("relu", act=lambda x: np.maximum(x, np.float32(0)))
square = Op("square", act=lambda x: x * x)
sign = Op("sign", act=lambda x: np.sign(x).astype(np.float32))
reciprocal = Op("reciprocal", act=_transcendental("reciprocal", lambda x: np.float32(1) / x))
abs = Op("abs", "arith", alu=lambda a, b=None: np.abs(a), act=np.abs, unary=True)  # noqa: A001
negative = Op("negative", "arith", alu=lambda a, b=None: -a, act=lambda x: -x, unary=True)

ALL = {name: o for name, o in globals().items() if isinstance(o, Op)}
__all__ = ["Op"] + list(ALL)
