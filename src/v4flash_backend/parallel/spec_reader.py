"""`SpecReader`: the reader interface `layout.load_shard` uses, answering every read with an empty
tensor of the stored shape and dtype -- from a checkpoint's headers (no tensor data is read) or from
a config's tensor specs (`placement.tensor_specs`). Under a `FakeTensorMode` the tensors are fake
(no memory): `trn2-check` builds a rank's runner this way, and so does the compile command
(`group.aot`), which traces the graphs of a rank without its weights."""

from __future__ import annotations

import torch

from v4flash_backend.config import ModelConfig


class SpecReader:
    def __init__(self, specs: dict[str, tuple[tuple[int, ...], torch.dtype]]):
        self.specs = specs

    @classmethod
    def from_checkpoint(cls, path) -> "SpecReader":
        from v4flash_backend.formats.checkpoint import CheckpointReader

        with CheckpointReader(path) as r:  # headers only: no tensor data is read
            return cls({n: (tuple(r.shape(n)), r.dtype(n)) for n in r.keys()})

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "SpecReader":
        from v4flash_backend.formats.checkpoint import ST_TO_TORCH

        from .placement import tensor_specs

        return cls({n: (tuple(shape), ST_TO_TORCH[st]) for n, shape, st in tensor_specs(cfg)})

    def keys(self):
        return list(self.specs)

    def __contains__(self, name):
        return name in self.specs

    def __iter__(self):
        return iter(self.specs)

    def shape(self, name):
        return self.specs[name][0]

    def dtype(self, name):
        return self.specs[name][1]

    def get(self, name, shape=None, dtype=None):
        s, d = self.specs[name]
        return torch.empty(s, dtype=d)

    def get_slice(self, name, dim, start, stop):
        s, d = self.specs[name]
        s = tuple(stop - start if i == dim else n for i, n in enumerate(s))
        return torch.empty(s, dtype=d)
