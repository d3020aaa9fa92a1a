"""Rotary embeddings of V4.1: interleaved pairs of the LAST rope_head_dim channels, YaRN on
compressed layers (compress_rope_theta, ramp between beta_fast/beta_slow, no mscale), plain
rope_theta on window-only layers and DSpark stages. The attention output gets the inverse rotation.
"""

from __future__ import annotations

import math

import torch

from v4flash_backend.config import ModelConfig


def rope_freqs(dim: int, base: float, original_seq_len: int, factor: float, beta_fast: int,
               beta_slow: int) -> torch.Tensor:
    """Per-pair angular frequencies [dim/2] fp32, with YaRN blending when original_seq_len > 0."""
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if original_seq_len > 0:
        def corrected(rotations: float) -> float:
            # the dimension whose wavelength completes `rotations` turns over the training context
            return dim * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corrected(beta_fast)), 0)
        high = min(math.ceil(corrected(beta_slow)), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    return freqs


class Rope:
    """cos/sin (as complex64) for any absolute positions, cached by table growth."""

    def __init__(self, freqs: torch.Tensor):
        self.freqs = freqs
        self._table = torch.empty(0, freqs.numel(), dtype=torch.complex64)

    def reserve(self, need: int) -> None:
        """Grow the table to cover positions < need (a host-side Python value)."""
        if need > self._table.shape[0]:
            n = max(need, 2 * self._table.shape[0], 256)
            # int positions promote to fp32 as the reference does; the table grows where freqs live
            ang = torch.outer(torch.arange(n, device=self.freqs.device), self.freqs)
            self._table = torch.polar(torch.ones_like(ang), ang)

    def at(self, positions: torch.Tensor) -> torch.Tensor:
        self.reserve(int(positions.max()) + 1 if positions.numel() else 0)
        return self._table[positions.long()]

    def cos_sin(self, positions: torch.Tensor) -> torch.Tensor:
        """(cos, sin) of positions as fp32 pairs [T, rope_head_dim / 2, 2]: the table's values."""
        return torch.view_as_real(self.at(positions))

    def apply(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """Rotate the last rope channels of x [T, ..., d] by positions [T]; returns a new tensor."""
        rd = 2 * self.freqs.numel()
        from v4flash_backend import ops

        exact = ops.get_numerics() == "exact"
        if exact and torch.compiler.is_compiling():  # the same bits without complex tensors
            rot = _rotate_exact(x[..., -rd:], self.cos_sin(positions), inverse)
        else:
            # complex128 under 'exact' (op by op the real form's extra calls cost ~20 us a rotation
            # here), else the reference's complex64
            cis = self.at(positions)
            if inverse:
                cis = cis.conj()
            cis = cis.view(cis.shape[0], *([1] * (x.dim() - 2)), cis.shape[-1])
            tail = torch.view_as_complex(x[..., -rd:].to(torch.float64 if exact else torch.float32)
                                         .unflatten(-1, (-1, 2)))
            rot = torch.view_as_real(tail * cis.to(tail.dtype)).flatten(-2)
        return torch.cat([x[..., :-rd], rot.to(x.dtype)], dim=-1)


def _rotate_exact(tail: torch.Tensor, cs: torch.Tensor, inverse: bool) -> torch.Tensor:
    """(a + bi)(c + si) on interleaved pairs in fp64 real arithmetic, rounded once by the caller.

    a, b are bf16 or fp32 and c, s fp32 (<= 24-bit significands), so every product is exact in fp64
    and each output is one rounding of (ac - bs) or (as + bc): the same bits as a complex128 product
    however it is evaluated (fused or not, vectorized or not). Real ops, unlike complex ones, are
    what a compiler generates code for (inductor falls back to eager for complex operators)."""
    cs = cs.double().view(cs.shape[0], *([1] * (tail.dim() - 2)), cs.shape[-2], 2)
    c, s = cs[..., 0], cs[..., 1]
    if inverse:  # the conjugate rotation
        s = -s
    t = tail.double().unflatten(-1, (-1, 2))
    a, b = t[..., 0], t[..., 1]
    return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)


class TableRope(Rope):
    """A Rope whose table already covers every position a step can address, so `at` is a plain
    gather (`Rope.at` grows its table with `int(positions.max())`, a host read). It shares the
    table of `rope`, grown once on the host: row p is p * freqs whatever the table length."""

    def __init__(self, rope: Rope, n_positions: int):
        rope.reserve(n_positions)
        self.freqs, self._table = rope.freqs, rope._table
        # the same values as real pairs, so that a graph gathering them holds no complex tensor
        self._cos_sin = torch.view_as_real(self._table).clone()

    def at(self, positions: torch.Tensor) -> torch.Tensor:
        return self._table[positions.long()]

    def cos_sin(self, positions: torch.Tensor) -> torch.Tensor:
        return self._cos_sin[positions.long()]


def layer_rope(cfg: ModelConfig, layer: int) -> Rope:
    """Window-only layers and DSpark stages: rope_theta without YaRN; compressed: YaRN."""
    if cfg.compress_ratios[layer]:
        f = rope_freqs(cfg.rope_head_dim, cfg.compress_rope_theta, cfg.original_seq_len, cfg.rope_factor,
                       cfg.beta_fast, cfg.beta_slow)
    else:
        f = rope_freqs(cfg.rope_head_dim, cfg.rope_theta, 0, cfg.rope_factor, cfg.beta_fast, cfg.beta_slow)
    return Rope(f)
