"""The Markov head's per-token memo (DSparkDrafter.markov_bias), which the eager engine drafts with:
the same bits as computing the head on every call, bounded, and dropped when the weights change."""

import torch

from v4flash_backend import ops
from v4flash_backend.model.dspark import DSparkDrafter


def _direct(d: DSparkDrafter, prev: torch.Tensor) -> torch.Tensor:
    return d.markov(prev)[0]


def test_memo_rows_equal_the_head_bit_for_bit(tiny_model):
    d = DSparkDrafter(tiny_model)
    V = tiny_model.cfg.vocab_size
    g = torch.Generator().manual_seed(3)
    calls = [torch.randint(0, V, (r,), generator=g) for r in (1, 5, 8, 3)]
    calls.append(torch.tensor([7, 7, 9, 7]))  # a token twice in one call, hits of earlier calls
    calls.append(calls[1].flip(0))  # every row a hit, in another order
    for prev in calls:
        got = d.markov_bias(prev)
        # exact: 'exact' numerics sum in fp64 without rounding, so a row's bits do not depend on which
        # rows shared its call; any difference is a memo returning another token's row
        assert got.dtype == torch.float32 and got.shape == (len(prev), V)
        assert torch.equal(got, _direct(d, prev))
    assert 0 < len(d._bias_rows) <= len({t for c in calls for t in c.tolist()})


def test_memo_stays_within_its_budget(tiny_model, monkeypatch):
    d = DSparkDrafter(tiny_model)
    V = tiny_model.cfg.vocab_size
    monkeypatch.setattr(DSparkDrafter, "BIAS_MEMO_BYTES", 3 * V * 4)  # three rows
    for prev in (torch.tensor([1, 2]), torch.tensor([3, 4, 5]), torch.tensor([4]), torch.tensor([1, 6])):
        assert torch.equal(d.markov_bias(prev), _direct(d, prev))
        assert len(d._bias_rows) <= 3
    assert list(d._bias_rows) == [4, 1, 6]  # least recently used out first: the hit on 4 kept it


def test_memo_follows_replaced_weights(tiny_model):
    d = DSparkDrafter(tiny_model)
    W = tiny_model.W
    name = d.last + ".markov_head.head.weight"
    prev = torch.tensor([4, 11])
    before = d.markov_bias(prev)
    old = W[name]
    try:
        W[name] = old * 2  # a reload: another tensor under the same name
        after = d.markov_bias(prev)
        assert torch.equal(after, _direct(d, prev))
        assert not torch.equal(after, before)
    finally:
        W[name] = old
    assert torch.equal(d.markov_bias(prev), before)


def test_other_numerics_compute_every_call(tiny_model):
    d = DSparkDrafter(tiny_model)
    ops.set_numerics("reference")
    prev = torch.tensor([2, 3, 2])
    assert torch.equal(d.markov_bias(prev), _direct(d, prev))
    assert len(d._bias_rows) == 0  # fp32 sums round by call shape: no memo
