"""Bitwise torch <-> NumPy conversion for the dtypes NumPy lacks natively (bf16 and the 8-bit floats)."""

import ml_dtypes
import numpy as np
import torch

_SPECIAL = {
    torch.bfloat16: (torch.int16, np.dtype(ml_dtypes.bfloat16)),
    torch.float8_e4m3fn: (torch.uint8, np.dtype(ml_dtypes.float8_e4m3fn)),
    torch.float8_e5m2: (torch.uint8, np.dtype(ml_dtypes.float8_e5m2)),
    torch.float8_e8m0fnu: (torch.uint8, np.dtype(ml_dtypes.float8_e8m0fnu)),
}
_BACK = {npdt: (carrier, tdt) for tdt, (carrier, npdt) in _SPECIAL.items()}
_CARRIER_NP = {torch.int16: np.int16, torch.uint8: np.uint8}


def torch_to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.dtype in _SPECIAL:
        carrier, npdt = _SPECIAL[t.dtype]
        return t.view(carrier).numpy().view(npdt)
    return t.numpy()


def numpy_to_torch(a: np.ndarray) -> torch.Tensor:
    a = np.ascontiguousarray(a)
    if a.dtype in _BACK:
        carrier, tdt = _BACK[a.dtype]
        return torch.from_numpy(a.view(_CARRIER_NP[carrier]).copy()).view(tdt)
    return torch.from_numpy(a.copy())
