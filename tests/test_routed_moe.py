"""The routed-experts MoE of the static graph (issue 47 item 3): (row, expert) pairs packed into a fixed
capacity of slots, the routed kernel reading only the occupied slots' experts, the exact overflow pass,
and the same results as the dense form on every backend and at W = 1, 2 and 4 (shards of the experts
in this process; each rank's fp32 carry summed as the world all-reduce sums it)."""

import numpy as np
import pytest
import torch

from v4flash_backend import ops
from v4flash_backend.formats import quant
from v4flash_backend.model import ffn
from v4flash_backend.model.weights import Weights

LAYER = "layers.1"
BACKENDS = [("torch", "exact"), ("torch", "reference"), ("nki-sim", "reference")]


class _NoComm:
    """The MoE's collective hooks of one rank in this process: keeps its fp32 carry (what the world
    all-reduce would sum), unreduced."""

    def moe_out(self, y):
        self.carry = y.clone()
        return y

    def sp_local(self, x):
        return x


@pytest.fixture
def backend(request):
    saved = ops.get_backend(), ops.get_numerics()
    ops.set_backend(request.param[0])
    ops.set_numerics(request.param[1])
    yield request.param
    ops.set_backend(saved[0])
    ops.set_numerics(saved[1])


def _shard(W, E: int, world: int, rank: int) -> Weights:
    """Rank `rank`'s experts of `world` (contiguous by id, as `parallel.layout`), its expert offset a
    tensor as `load_shard` makes it; every other tensor as it is."""
    per = E // world
    keep = range(rank * per, (rank + 1) * per)
    out = Weights({k: v.clone() if ".ffn.experts." in k else v for k, v in W.items()
                   if ".ffn.experts." not in k or int(k.split(".ffn.experts.")[1].split(".")[0]) in keep})
    out.meta["rank_offsets"] = {f"expert_start.{LAYER}.ffn": torch.tensor(rank * per)}
    return out


def _routed_only(x, W, cfg):
    """The fp32 carry of `W`'s routed experts (before the all-reduce and the shared expert)."""
    comm = _NoComm()
    ffn.moe(W, cfg, LAYER, cfg.n_activated_experts, x, comm, form="all")
    return comm.carry


def _pairs_per_expert(W, cfg, x):
    _, ids = ffn.route(W, cfg, LAYER + ".ffn", x, cfg.n_activated_experts)
    return torch.bincount(ids.flatten(), minlength=cfg.n_routed_experts)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True, ids=lambda b: "-".join(b))
def test_forced_overflow_equals_the_dense_form(tiny_model, backend, monkeypatch):
    """Capacity 1 with several of a rank's pairs per step: the pairs past the first slot go through the
    overflow pass, and the carry equals the dense form's (every local expert on every row) bit for bit;
    with the capacity at every pair the rank can hold, no overflow pass, the same bits again. A mistake
    that drops the overflow pairs (or routes them to the wrong expert) fails here."""
    cfg = tiny_model.cfg
    E = cfg.n_routed_experts
    W = _shard(tiny_model.W, E, 2, 1)  # 4 local experts of 8: capacity 1 < 4 takes the routed form
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(6, cfg.dim, generator=g) * 3).to(torch.bfloat16)
    local = _pairs_per_expert(W, cfg, x)[E // 2:]
    assert int(local.sum()) > 3, "the rows route too few pairs here to overflow capacity 3"
    calls = []
    real = ffn._routed_experts
    monkeypatch.setattr(ffn, "_routed_experts", lambda *a: calls.append(a[-1]) or real(*a))
    monkeypatch.setattr(ffn, "moe_capacity", lambda *a: 10 ** 6)  # >= local experts: the dense form
    dense = _routed_only(x, W, cfg)
    assert not calls
    for cap in (1, 2, 3):  # below the local experts (4): the routed form, overflowing
        monkeypatch.setattr(ffn, "moe_capacity", lambda *a, c=cap: c)
        got = _routed_only(x, W, cfg)
        assert calls[-1] == cap
        assert torch.equal(got, dense), cap
    assert bool((dense != 0).any())
    # one row, capacity = its top-k: every pair has a slot, no overflow pass
    monkeypatch.setattr(ffn, "moe_capacity", lambda *a: 10 ** 6)
    dense1 = _routed_only(x[:1], W, cfg)
    monkeypatch.setattr(ffn, "moe_capacity", lambda *a: cfg.n_activated_experts)
    assert torch.equal(_routed_only(x[:1], W, cfg), dense1)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True, ids=lambda b: "-".join(b))
@pytest.mark.parametrize("world", [2, 4])
def test_world_sizes_give_the_w1_carry(tiny_model, backend, world, monkeypatch):
    """W = 1, 2, 4: each rank runs the routed form on its own experts (a small capacity, so ranks
    overflow), and the ranks' fp32 carries summed in rank order equal W = 1's (the dense form) -- the
    sum the world all-reduce forms. Per row <= top-k bf16 outputs, so the fp32 sums are exact."""
    cfg = tiny_model.cfg
    E = cfg.n_routed_experts
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(2, cfg.dim, generator=g) * 3).to(torch.bfloat16)
    monkeypatch.setattr(ffn, "moe_capacity", lambda *a: 10 ** 6)
    want = _routed_only(x, tiny_model.W, cfg)
    monkeypatch.setattr(ffn, "moe_capacity", lambda *a: 1)
    parts = [_routed_only(x, _shard(tiny_model.W, E, world, r), cfg) for r in range(world)]
    got = parts[0]
    for p in parts[1:]:
        got = got + p
    assert torch.equal(got, want)


def _stack(E=4, n=96, k=128):
    ws, ss = zip(*(quant.quantize_fp4_weight(torch.randn(n, k, generator=torch.Generator().manual_seed(40 + e)))
                   for e in range(E)))
    return torch.stack(ws), torch.stack(ss)


def test_routed_kernel_is_the_linear_on_each_slots_expert():
    """linear_fp4_routed: slot s meets stack entry experts[s] (the bits of linear_fp4 on that entry),
    an empty slot (-1) gives zeros; a kernel reading another entry for a slot fails here."""
    from v4flash_backend.ops import nki_ops

    saved = ops.get_backend()
    ops.set_backend("nki-sim")
    try:
        w, s = _stack()
        experts = torch.tensor([2, -1, 0, 3, -1])
        x = (torch.randn(5, 3, 128, generator=torch.Generator().manual_seed(3)) * 2).to(torch.bfloat16)
        got = nki_ops.linear_fp4(x, w, s, experts)
        for i, e in enumerate(experts.tolist()):
            if e < 0:
                assert not bool(got[i].any()), i
            else:
                assert torch.equal(got[i], nki_ops.linear_fp4(x[i], w[e], s[e])), i
    finally:
        ops.set_backend(saved)


def test_empty_slots_read_no_weight_bytes():
    """The simulator's DMA ledger of the routed kernel: with k of S slots occupied it moves exactly k x
    (an expert's weight and scale bytes + its slot's activation rows) more than with none -- an empty
    slot reads no weight byte, an occupied one reads its own expert's once (the zero rows an empty slot
    writes and the output rows an occupied one writes are the same size)."""
    import nki_sim._runtime as R
    from v4flash_backend.kernels import linear

    w, s = _stack()
    E, N, Kh = w.shape
    S, M, K = 6, 2, 2 * Kh
    x = (torch.randn(S, M, K, generator=torch.Generator().manual_seed(8))).to(torch.bfloat16)
    from nki_sim._torch_bridge import torch_to_numpy

    def hbm_bytes(ids):
        e = np.array(ids, dtype=np.int32).reshape(S, 1)
        linear.linear_fp4_routed_kernel[1](torch_to_numpy(x), torch_to_numpy(w), s.view(torch.uint8).numpy(), e)
        return R.last_cost.hbm_bytes

    per_slot = N * Kh + N * (K // 32) + M * K * 2  # weight bytes, scale bytes, the slot's bf16 rows
    empty = hbm_bytes([-1] * S)
    assert empty < N * Kh  # not even one expert's weights
    for ids in ([1, -1, -1, -1, -1, -1], [3, -1, 0, -1, 3, -1], [0, 1, 2, 3, 0, 1]):
        k = sum(i >= 0 for i in ids)
        assert hbm_bytes(ids) - empty == k * per_slot, ids
