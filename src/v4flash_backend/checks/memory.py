"""Memory of the release-shaped checks: this process's RSS while a load runs, and the meta device
that lets a release-size model be traced after its weights are freed."""

from __future__ import annotations

import gc
import threading
from contextlib import contextmanager

import torch


def _status_kib(*keys) -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k = line.split(":")[0]
            if k in keys:
                out[k] = int(line.split()[1])
    return out


class _RssSampler:
    """Peak anonymous and file-backed RSS of this process while a block runs (sampled every 50 ms):
    the loader's memory map shows up as file-backed RSS (clean page-cache pages, reclaimable), the
    tensors it returns as anonymous RSS."""

    def __init__(self):
        self.peak_anon = self.peak_file = 0
        self._stop = threading.Event()

    def _run(self):
        while not self._stop.is_set():
            s = _status_kib("RssAnon", "RssFile")
            self.peak_anon = max(self.peak_anon, s.get("RssAnon", 0))
            self.peak_file = max(self.peak_file, s.get("RssFile", 0))
            self._stop.wait(0.05)

    def __enter__(self):
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def to_meta(model) -> None:
    """Move the model's weights and Engram hasher to the meta device, freeing the real weights (the
    model is then good for shape tracing only)."""
    W = model.W
    for k in list(W):
        W[k] = W[k].to("meta")
    if model.hasher is not None:
        model.hasher.to("meta")
    gc.collect()
    release_freed_memory()


def release_freed_memory() -> None:
    """Hand the freed weights back to the OS: glibc keeps freed heap chunks (most tensors under its
    32 MiB mmap threshold land on the heap) as resident memory until malloc_trim."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


@contextmanager
def meta_device():
    """Factories create meta tensors; the quant module's constant tables (CPU tensors that would meet
    meta operands) are swapped for meta copies for the duration."""
    from v4flash_backend.formats import quant

    saved = {k: v for k, v in vars(quant).items() if isinstance(v, torch.Tensor) and v.dim()}
    for k, v in saved.items():
        setattr(quant, k, v.to("meta"))
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None)
        for k, v in saved.items():
            setattr(quant, k, v)
