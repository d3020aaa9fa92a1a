"""The eager forward follows its inputs' device: with the weights, the state, the RoPE and Engram
tables on a non-CPU device it makes no tensor on the CPU that meets them.

The device is the trn2-check's fake accelerator (`checks.trn2.FAKE_DEVICE`: cuda, or meta on a
CPU-only torch) under FakeTensorMode, which raises when a CPU tensor with dimensions meets a tensor
on another device -- what a real accelerator does. The step is a 2-segment one, a prefill chunk
and a decode row (the served path's fallback steps run this forward on the state's device), then
a DSpark draft. 'exact' numerics with the torch backend: the MoE's batched dense form (6 rows x 8
experts), which reads nothing on the host, so the fake tensors' missing values are never asked
for. A negative control builds the step's geometry on the CPU -- the old factories without a
device -- and must fail.
"""

import pytest
import torch

from v4flash_backend import ops
from v4flash_backend.checks.trn2 import FAKE_DEVICE
from v4flash_backend.model import transformer
from v4flash_backend.model.dspark import DSparkDrafter
from v4flash_backend.model.loading import load_model
from v4flash_backend.model.state import ModelState, make_segments


def _on_device(golden_dir, mode):
    """A fresh tiny model and a 2-slot state, every resident tensor on FAKE_DEVICE."""
    m = load_model(golden_dir)
    with mode:
        for k in list(m.W.keys()):
            m.W[k] = m.W[k].to(FAKE_DEVICE)
        st = ModelState(m.cfg, 2, 64)
        for name, v in list(vars(st).items()):
            if isinstance(v, torch.Tensor):
                setattr(st, name, v.to(FAKE_DEVICE))
            elif isinstance(v, dict):
                for k in v:
                    if isinstance(v[k], torch.Tensor):
                        v[k] = v[k].to(FAKE_DEVICE)
        for rope in m.ropes.values():
            rope.freqs, rope._table = rope.freqs.to(FAKE_DEVICE), rope._table.to(FAKE_DEVICE)
        m.hasher.to(FAKE_DEVICE)
    return m, st


def _step(m, st, mode):
    with mode:
        tokens = torch.tensor([0, 11, 12, 13, 14, 15], device=FAKE_DEVICE)
        out = m.forward(st, tokens, make_segments([(0, 0, 5), (1, 7, 1)]), logits_rows="last", want_taps=True)
        u = DSparkDrafter(m).draft(st, [(0, 4, 21), (1, 7, 22)]).base_logits
    return out, u


@pytest.fixture
def fake_mode():
    from torch._subclasses import FakeTensorMode

    ops.set_backend("torch")
    ops.set_numerics("exact")
    return FakeTensorMode(allow_non_fake_inputs=True)


def test_eager_forward_and_draft_run_on_a_non_cpu_device(golden_dir, fake_mode):
    m, st = _on_device(golden_dir, fake_mode)
    out, u = _step(m, st, fake_mode)
    cfg = m.cfg
    assert out.logits.device.type == FAKE_DEVICE.type and out.logits.shape == (2, cfg.vocab_size)
    assert out.taps.device.type == FAKE_DEVICE.type and out.taps.shape[0] == 6
    assert u.device.type == FAKE_DEVICE.type and u.shape == (2, cfg.dspark_block_size, cfg.vocab_size)


def test_a_cpu_factory_in_the_eager_forward_fails(golden_dir, fake_mode, monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError

    orig = transformer.segment_geometry
    # the mistake the issue found: a step's index tensors made with no device (on the CPU)
    monkeypatch.setattr(transformer, "segment_geometry", lambda seg, window, device: orig(seg, window, "cpu"))
    m, st = _on_device(golden_dir, fake_mode)
    with pytest.raises((FakeTensorDeviceMismatchError, RuntimeError), match="(?i)device"):
        _step(m, st, fake_mode)
