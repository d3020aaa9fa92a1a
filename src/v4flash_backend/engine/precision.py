"""The float dtype of the decode loop's own arithmetic: sampling, acceptance, residuals, the
calibrated confidence, admission and the values a round reads back.

A NeuronCore has no fp64 (its engines take cFP8, FP16, BF16, TF32, FP32, INT8, INT16, INT32), so
under the kernels' numerics (ops backends `nki` and `nki-sim`) this arithmetic runs in fp32, in the
static round graphs and in eager serving alike: the two paths then commit the same tokens for the
same seed. The torch backend with `exact` numerics is the CPU reference and keeps fp64.

Every host form and every static form asks `loop_dtype()` rather than naming a float type, so the
choice is made here once.
"""

from __future__ import annotations

import torch


def loop_dtype() -> torch.dtype:
    """float64 for the CPU reference (ops backend torch, exact numerics), else float32."""
    from v4flash_backend import ops

    if ops.get_backend() == "torch" and ops.get_numerics() == "exact":
        return torch.float64
    return torch.float32


def loop_int_dtype() -> torch.dtype:
    """The integer type whose bits carry a `loop_dtype` value through an int64 read-back (a
    bit-cast of the same width): int64 for float64, int32 for float32 (widened afterwards)."""
    return torch.int64 if loop_dtype() == torch.float64 else torch.int32


def pack_bits(x: torch.Tensor) -> torch.Tensor:
    """Float values as int64 columns of a read-back, bit-exactly: `x` in `loop_dtype()` bit-cast to
    `loop_int_dtype()` (fp32 -> int32 bits, then widened: no float64 op in an fp32 graph; fp64 ->
    int64 bits). The host reads them back with `unpack_bits`."""
    bits = x.to(loop_dtype()).contiguous().view(loop_int_dtype())
    return bits.to(torch.int64)


def unpack_bits(values) -> torch.Tensor:
    """The `loop_dtype()` values of `pack_bits` columns (int64 ints or tensor): narrowed back to the
    bit-cast width (exact: an int32 widened to int64 narrows to itself) and reinterpreted."""
    t = torch.as_tensor(values, dtype=torch.int64)
    return t.to(loop_int_dtype()).view(loop_dtype())
