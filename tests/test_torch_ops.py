"""The torch ops' equal forms: what the CPU forward picks for speed must not change a bit."""

import pytest
import torch

from v4flash_backend import ops
from v4flash_backend.ops import torch_ops


@pytest.mark.parametrize("b,m,n,k", [(1, 125, 187, 80), (2, 6, 300, 80), (3, 5, 69, 69), (1, 40, 100, 24)])
def test_sparse_attn_dense_scores_equal_gathered_slots(monkeypatch, b, m, n, k):
    """Scoring every query against the whole bank and picking its slots gives the gathered form's
    output bit for bit, with -1 padding, a slot listed twice, and an all-empty row."""
    monkeypatch.setattr(ops, "_numerics", "exact")  # restored after the test
    g = torch.Generator().manual_seed(b * 1000 + m)
    q = torch.randn(b, m, 4, 64, generator=g).to(torch.bfloat16)
    kv = (3 * torch.randn(b, n, 64, generator=g)).to(torch.bfloat16)
    sink = torch.randn(4, generator=g)
    idx = torch.stack([torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(m)]) for _ in range(b)])
    idx[:, :, -3:] = -1
    idx[:, 0, 1] = idx[:, 0, 0]  # listed twice
    idx[0, -1] = -1  # nothing to attend to but the sink
    idx = idx.int()
    out = {}
    for dense in (False, True):
        monkeypatch.setattr(torch_ops, "_dense_scores", lambda *a, d=dense: d)
        out[dense] = torch_ops.sparse_attn(q, kv, sink, idx, 64 ** -0.5)
    assert torch.equal(out[True], out[False])
    assert out[True][0, -1].abs().max() == 0  # the sink alone: zero output


def test_prompt_chunks_take_the_dense_scores():
    """The prefill shapes of the embedded model take the dense form (so the model-level bit-exact
    tests run both forms: decode steps take the gathered one)."""
    assert torch_ops._dense_scores(125, 187, 80) and torch_ops._dense_scores(40, 40, 40)
    assert not torch_ops._dense_scores(1, 300, 80) and not torch_ops._dense_scores(64, 1000, 80)
