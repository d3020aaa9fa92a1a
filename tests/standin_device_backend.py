"""A stand-in device backend for the control-plane test (tests/test_control_plane.py), loaded into
every rank process through a `sitecustomize` the test writes (V4FLASH_STANDIN_RECORD names the file
each rank records into).

`v4flash_standin` is a torch.distributed backend (a Python ProcessGroup over a gloo group of its own)
playing the device backend of a Neuron launch (`dist_backend`), whose groups carry only the
forward's collectives: all-reduces and all-gathers of activations. It refuses what a device group
never carries in that design -- a broadcast (a step plan), a barrier, an integer tensor (plans, the
setup's pids) -- and records every call it serves (op, dtype, shape). On the CPU every tensor is a
CPU tensor, the model's too, so "no CPU tensor on the device group" is checked as "nothing of the
control plane on it"; on trn2 the device group's tensors are the NeuronCore's.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

NAME = "v4flash_standin"


class StandinDeviceGroup(dist.ProcessGroup):
    def __init__(self, store, rank, size, timeout):
        super().__init__(rank, size)
        self.inner = dist.ProcessGroupGloo(dist.PrefixStore("standin/", store), rank, size, timeout)

    def _take(self, op, tensors):
        for t in tensors:
            if op in ("broadcast", "barrier") or not (t.dtype.is_floating_point or t.dtype.is_complex):
                raise RuntimeError(f"{NAME}: refused a {op} of a {t.dtype} {tuple(t.shape)} tensor: the control "
                                   "plane's, not a device collective")
            _record([op, str(t.dtype), list(t.shape)])

    def allreduce(self, tensors, opts=None):
        self._take("allreduce", tensors)
        return self.inner.allreduce(tensors, opts) if opts is not None else self.inner.allreduce(tensors)

    def allgather(self, outs, ins, opts=None):
        self._take("allgather", ins)
        return self.inner.allgather(outs, ins) if opts is None else self.inner.allgather(outs, ins, opts)

    def broadcast(self, tensors, opts=None):
        self._take("broadcast", tensors or [torch.empty(0)])

    def barrier(self, opts=None):
        self._take("barrier", [torch.empty(0)])

    def getBackendName(self):  # noqa: N802 - torch's name
        return NAME


def _create(store, rank, size, timeout):
    return StandinDeviceGroup(store, rank, size, timeout)


def register() -> None:
    dist.Backend.register_backend(NAME, _create, devices=["cpu"])


def _record(entry) -> None:
    """One line per call served, in this rank's file (written as it happens: a rank may not exit cleanly)."""
    path = os.environ.get("V4FLASH_STANDIN_RECORD")
    if path:
        with open(f"{path}.{os.environ.get('RANK', 'x')}", "a") as f:
            f.write(json.dumps(entry) + "\n")
