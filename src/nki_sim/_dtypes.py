"""NKI data types as NumPy dtypes (ml_dtypes supplies bfloat16 and the 8/4-bit floats) and the casts the
engines perform: every engine computes in float32 and rounds once when it writes its destination."""

import ml_dtypes
import numpy as np

from ._errors import SimError

bool_ = np.dtype(np.bool_)
int8 = np.dtype(np.int8)
int16 = np.dtype(np.int16)
int32 = np.dtype(np.int32)
uint8 = np.dtype(np.uint8)
uint16 = np.dtype(np.uint16)
uint32 = np.dtype(np.uint32)
float16 = np.dtype(np.float16)
float32 = np.dtype(np.float32)
# tfloat32 is a Tensor Engine input format; storage is fp32, so the simulator treats it as fp32.
tfloat32 = float32
bfloat16 = np.dtype(ml_dtypes.bfloat16)
# legacy `float8_e4m3` is assumed IEEE-like (max 240, with inf), OCP `float8_e4m3fn` saturates at 448.
float8_e4m3 = np.dtype(ml_dtypes.float8_e4m3)
float8_e4m3fn = np.dtype(ml_dtypes.float8_e4m3fn)
float8_e5m2 = np.dtype(ml_dtypes.float8_e5m2)
float8_e8m0fnu = np.dtype(ml_dtypes.float8_e8m0fnu)
float4_e2m1fn = np.dtype(ml_dtypes.float4_e2m1fn)

_BY_NAME = {
    "bool": bool_, "bool_": bool_, "int8": int8, "int16": int16, "int32": int32, "uint8": uint8,
    "uint16": uint16, "uint32": uint32, "float16": float16, "float32": float32, "tfloat32": float32,
    "bfloat16": bfloat16, "float8_e4m3": float8_e4m3, "float8_e4m3fn": float8_e4m3fn,
    "float8_e5m2": float8_e5m2, "float8_e8m0fnu": float8_e8m0fnu, "float4_e2m1fn": float4_e2m1fn,
}
SUPPORTED = frozenset(_BY_NAME.values())
_INT_KINDS = "iub"


def normalize(dtype) -> np.dtype:
    """Accept an nl dtype, its name, or anything np.dtype understands; reject what NKI does not have."""
    if type(dtype) is not str and dtype in SUPPORTED:
        return dtype if isinstance(dtype, np.dtype) else np.dtype(dtype)
    if isinstance(dtype, str):
        if dtype not in _BY_NAME:
            raise SimError(f"unsupported dtype {dtype!r}")
        return _BY_NAME[dtype]
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise SimError(f"unsupported dtype {dtype!r}") from e
    if dt not in SUPPORTED:
        raise SimError(f"unsupported dtype {dt}")
    return dt


def is_int(dt: np.dtype) -> bool:
    return dt.kind in _INT_KINDS


def to_f32(a: np.ndarray) -> np.ndarray:
    """Engine input conversion: any dtype to float32 (integers above 2^24 lose bits, as on the device)."""
    return a.astype(np.float32)


def from_f32(v: np.ndarray, dt: np.dtype) -> np.ndarray:
    """Engine output conversion of float32 results: round-to-nearest-even for every float format; for
    integers round-to-nearest-even and saturate (nki 0.6 semantics), NaN becomes 0."""
    if not is_int(dt):
        return v.astype(dt)
    r = np.rint(v.astype(np.float64))
    info = np.iinfo(np.uint8 if dt == bool_ else dt)
    r = np.nan_to_num(r, nan=0.0, posinf=info.max, neginf=info.min)
    return np.clip(r, info.min, info.max).astype(dt)


def convert(a: np.ndarray, dt: np.dtype) -> np.ndarray:
    """Copy-with-conversion used by DMA and tensor_copy: bit-exact when the dtype is unchanged, otherwise
    through float32 (the documented DMA conversion path)."""
    if a.dtype == dt:
        return a
    return from_f32(to_f32(a), dt)
