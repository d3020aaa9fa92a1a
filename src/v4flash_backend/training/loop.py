"""Training-loop helpers shared by the target and the DSpark recipes: token streams and batches,
the learning-rate schedule, parameter groups, router balancing and the progress bar."""

from __future__ import annotations

import math
import sys
import time

import torch


def token_stream(tok, files) -> torch.Tensor:
    """All files' ids, each followed by EOS, as one int32 stream (sequences may span an EOS)."""
    from .tokenizer import EOS

    eos = tok.token_to_id(EOS)
    parts = []
    for enc in tok.encode_batch([f.text for f in files], add_special_tokens=False):
        parts.append(torch.tensor(enc.ids + [eos], dtype=torch.int32))
    return torch.cat(parts)


def sample_batch(stream: torch.Tensor, n: int, seq: int, g: torch.Generator, bos: int = 0) -> torch.Tensor:
    """n sequences [BOS] + stream[i : i + seq - 1] at random starts (int64 [n, seq])."""
    starts = torch.randint(0, len(stream) - seq, (n,), generator=g)
    rows = torch.stack([stream[s:s + seq - 1] for s in starts.tolist()]).long()
    return torch.cat([torch.full((n, 1), bos), rows], dim=1)


def heldout_batch(stream: torch.Tensor, n: int, seq: int, bos: int = 0) -> torch.Tensor:
    """n fixed, non-overlapping held-out sequences spread evenly over the stream."""
    step = max((len(stream) - seq) // n, seq)
    rows = [stream[i * step:i * step + seq - 1] for i in range(n) if i * step + seq - 1 <= len(stream)]
    return torch.cat([torch.full((len(rows), 1), bos), torch.stack(rows).long()], dim=1)


# ---- the training forward --------------------------------------------------------------------
def balance_router(masters: dict, captures: dict, prefix: str, n_exp: int, rate: float) -> None:
    """Auxiliary-loss-free load balancing (DeepSeek-V3): nudge each routing bias up when its expert
    is under-loaded and down when over-loaded; the bias only steers selection."""
    for i, cap in captures.items():
        ids = cap.get("gate_indices")
        if ids is None:
            continue
        load = torch.bincount(ids.flatten(), minlength=n_exp).float()
        with torch.no_grad():
            masters[f"{prefix}{i}.ffn.gate.bias"] += rate * torch.sign(load.mean() - load)


def param_groups(masters: dict, names, wd: float):
    decay = [masters[n] for n in names if masters[n].dim() >= 2 and not n.endswith(("_fn", "embed.weight"))]
    rest = [masters[n] for n in names if not (masters[n].dim() >= 2 and not n.endswith(("_fn", "embed.weight")))]
    return [{"params": decay, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}]


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


class Progress:
    """A one-line progress bar on stderr (no dependency); without a terminal, a line every 20 s."""

    def __init__(self, total: int, label: str):
        self.total, self.label, self.t0 = total, label, time.time()
        self.tty = sys.stderr.isatty()
        self.last = 0.0

    def update(self, i: int, info: str = "") -> None:
        done = i + 1
        now = time.time()
        if not self.tty and now - self.last < 20 and done != self.total:
            return
        self.last = now
        el = now - self.t0
        eta = el / done * (self.total - done)
        bar = "#" * int(30 * done / self.total)
        line = f"{self.label} [{bar:<30}] {done}/{self.total} {el:5.0f}s eta {eta:4.0f}s {info}"
        sys.stderr.write(("\r" if self.tty else "") + line + ("" if self.tty else "\n"))
        if self.tty and done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


