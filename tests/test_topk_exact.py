"""'exact' numerics' top-k: the first k of a stable descending sort (ties by lowest index), computed as
one top-k over integer keys; checked against torch's stable sort on rows full of ties, signed zeros and
infinities."""

import pytest
import torch

from v4flash_backend.model.attention import _first_k_of_stable_sort


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("k", [1, 4, 16, 37])
def test_equals_the_first_k_of_a_stable_sort(dtype, k):
    g = torch.Generator().manual_seed(k)
    # few distinct values (many ties), both zeros, both infinities, tiny and huge magnitudes
    vals = torch.tensor([0.0, -0.0, 1.0, -1.0, 2.5, -2.5, 1e-30, -1e-30, 3e30, -3e30, float("inf"), float("-inf")])
    score = vals[torch.randint(0, len(vals), (3, 5, 37), generator=g)].to(dtype)
    score[0, 0] = -torch.inf  # a row with nothing reachable
    score[1] += torch.randn(5, 37, generator=g).to(dtype)  # and rows of distinct values
    want = torch.sort(score, dim=-1, descending=True, stable=True).indices[..., :k]
    assert torch.equal(_first_k_of_stable_sort(score, k), want)
    # the ties matter: a top-k that breaks them another way differs (highest index first)
    flipped = score.flip(-1)
    other = 36 - torch.sort(flipped, dim=-1, descending=True, stable=True).indices[..., :k]
    assert k == 37 or not torch.equal(other, want)


def test_under_torch_compile():
    score = torch.tensor([[1.0, 3.0, 3.0, -0.0, 0.0, 2.0, -1.0]]).to(torch.bfloat16)
    got = torch.compile(_first_k_of_stable_sort, fullgraph=True, backend="eager")(score, 6)
    assert got.tolist() == [[1, 2, 5, 0, 3, 4]]  # 3, 3, 2, 1, then -0 and +0 tie: lower index first
