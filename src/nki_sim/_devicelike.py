"""Device-like numerics: perturb what the documentation leaves open, within the documented precision.

The default simulator is deterministic and as exact as the documentation allows (exactly rounded PE column
sums, IEEE / torch fp32 transcendentals), so that a kernel mirroring the reference reproduces it bit for bit.
On a trn2 two things are not bit-specified:

- the Tensor Engine: "The accumulation precision internal to Tensor Engine is float32" (nc_matmul docstring,
  aws-neuron-sdk nki/api/nki/isa/__init__.py) -- the order in which a PE column adds its K products is not
  documented. Device-like mode sums them in fp32 in a random order per matmul (products of bf16 / fp16 / fp8
  operands are exact in fp32; fp32 x fp32 products are rounded to fp32). Free-axis add-reductions
  (tensor_reduce, activation reduce registers) likewise add in fp32 in a random order.
- the Scalar Engine: "activation functions are approximated with piece-wise polynomials on Scalar Engine"
  (nki/api/nki.api.shared.rst) with no error bound stated. Device-like mode multiplies every transcendental
  result (exp, log, sqrt, rsqrt, sigmoid, silu, tanh, reciprocal) by (1 + u * act_ulps * 2^-23), u uniform in
  [-1, 1], i.e. up to `act_ulps` fp32 ulps of relative error (an assumption: 4 by default).

Everything else (DMA casts, bitvec operators, fp32 ALU arithmetic, PSUM fp32 accumulation across matmuls,
bf16 / fp8 output rounding) is IEEE-specified and stays exact.

Use: `with nki_sim.device_like(seed=0, act_ulps=4): ...`.
"""

from __future__ import annotations

import contextlib

import numpy as np

_state = None  # (rng, act_ulps) while active


def active() -> bool:
    return _state is not None


@contextlib.contextmanager
def device_like(seed: int = 0, act_ulps: float = 4.0):
    global _state
    prev = _state
    _state = (np.random.default_rng(seed), float(act_ulps))
    try:
        yield
    finally:
        _state = prev


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a [K, M], b [K, N] fp32 -> [M, N]: fp32 accumulation of the K products in a random order."""
    rng = _state[0]
    k = a.shape[0]
    acc = np.zeros((a.shape[1], b.shape[1]), np.float32)
    for i in rng.permutation(k):
        acc = acc + np.multiply.outer(a[i], b[i]).astype(np.float32)
    return acc


def sum_rows(v: np.ndarray) -> np.ndarray:
    """fp32 sum over the last axis in a random order."""
    rng = _state[0]
    v = np.asarray(v, np.float32)
    if v.shape[-1] == 0:
        return np.zeros(v.shape[:-1], np.float32)
    perm = rng.permutation(v.shape[-1])
    return np.add.accumulate(v[..., perm], axis=-1, dtype=np.float32)[..., -1]


def transcendental(name: str, y: np.ndarray) -> np.ndarray:
    rng, ulps = _state
    y = np.asarray(y, np.float32)
    u = rng.uniform(-1.0, 1.0, size=y.shape)
    return (y.astype(np.float64) * (1.0 + u * ulps * 2.0 ** -23)).astype(np.float32)
