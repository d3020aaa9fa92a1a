"""The torch ops' equal forms: what the CPU forward picks for speed must not change a bit."""

import pytest
import torch

from v4flash_backend import ops
from v4flash_backend.formats import quant
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


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_sinkhorn_in_numpy_equals_the_torch_loop(monkeypatch, dtype, rows):
    """The Sinkhorn normalizations of a few rows run in numpy (fewer per-call costs); over mixes
    spread wide enough that any other summation order would show (exp of N(0, 4^2) logits), the
    results must equal the torch loop's bit for bit, in both numerics' dtypes, inside inference mode."""
    g = torch.Generator().manual_seed(rows)
    hc, iters, eps = 4, 20, 1e-6
    scale = torch.rand(3, generator=g, dtype=dtype) + 0.5
    base = torch.randn(2 * hc + hc * hc, generator=g, dtype=dtype)
    calls = []
    real = torch_ops._sinkhorn_numpy
    monkeypatch.setattr(torch_ops, "_sinkhorn_numpy", lambda *a: calls.append(1) or real(*a))
    for trial in range(50):
        m = torch.randn(rows, 2 * hc + hc * hc, generator=g, dtype=dtype) * 4
        with torch.inference_mode():
            got = torch_ops._split_sinkhorn(m, scale, base, hc, iters, eps)
        monkeypatch.setattr(torch_ops, "_NUMPY_SINKHORN_MAX", 0)
        want = torch_ops._split_sinkhorn(m, scale, base, hc, iters, eps)
        monkeypatch.setattr(torch_ops, "_NUMPY_SINKHORN_MAX", 16)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), trial
    assert len(calls) == 50  # the numpy loop ran (and the torch loop when it was off)
    m.requires_grad_(True)
    torch_ops._split_sinkhorn(m, scale, base, hc, iters, eps)[2].sum().backward()  # autograd: torch's loop
    assert len(calls) == 50 and m.grad is not None


def test_sinkhorn_under_torch_compile_keeps_the_torch_loop():
    """Inside torch.compile the traced tensors look plain; the numpy loop must not be traced (it
    would break the graph: the static rounds compile fullgraph). Same values as eager."""
    g = torch.Generator().manual_seed(7)
    m = torch.randn(2, 24, generator=g, dtype=torch.float64) * 4
    scale, base = torch.rand(3, generator=g, dtype=torch.float64) + 0.5, torch.randn(24, generator=g,
                                                                                      dtype=torch.float64)
    torch._dynamo.reset()
    compiled = torch.compile(torch_ops._split_sinkhorn, backend="eager", fullgraph=True)
    got = compiled(m, scale, base, 4, 20, 1e-6)
    want = torch_ops._split_sinkhorn(m, scale, base, 4, 20, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("numerics", ["exact", "reference"])
def test_compiled_one_row_expert_gemms_stay_one_gemm_per_entry(numerics):
    """The routed expert form's GEMMs (x [slots, 1, K] against stack entries [slots, N, K]) inside a
    compiled graph: one 2-D GEMM per entry, under both numerics. Inductor lowers a batched GEMM of
    one row per entry to a fused C++ reduction that recomputes the row's producers for every output
    column: under 'reference' the batch-1 plain round of the embedded model took 7.6 ms against
    3.6 ms with per-entry GEMMs (perf/round_profile.py --numerics exact,reference). Values against
    an fp64 product: at K = 64 an fp32 accumulation is within ~1e-6 relative of it (rtol 1e-5)."""
    ops.set_numerics(numerics)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 1, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(3, 32, 64, generator=g)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    got = torch.compile(torch_ops._bmm, backend=capture, fullgraph=True)(x, w)
    mms = [n for n in graphs[0].graph.nodes if n.op == "call_function" and "matmul" in str(n.target)]
    dims = [tuple(a.meta["example_value"].dim() for a in n.args[:2]) for n in mms]
    assert dims == [(2, 2)] * 3, dims
    want = (x.double() @ w.double().transpose(-1, -2))
    assert got.shape == want.shape and torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kept", ["f32", "all"])
def test_fp64_weight_copies_give_the_same_bits(monkeypatch, kept):
    """V4FLASH_F64_WEIGHTS keeps fp64 copies of weights under exact numerics instead of converting
    them per call: the conversion is exact, so the outputs must equal the uncached ones bit for bit
    (tolerance 0), for two weights of one shape (a copy served for the wrong weight fails) and on a
    second call (the cached copy)."""
    ops.set_numerics("exact")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=g)
    ws = [torch.randn(32, 64, generator=g) for _ in range(2)]
    monkeypatch.setattr(torch_ops, "F64_WEIGHTS", "none")
    want = [torch_ops.linear_f32(x, w) for w in ws]
    monkeypatch.setattr(torch_ops, "F64_WEIGHTS", kept)
    for _ in range(2):
        got = [torch_ops.linear_f32(x, w) for w in ws]
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_expert_stack_fp64_copies_serve_the_dense_form_only(monkeypatch):
    """V4FLASH_F64_WEIGHTS=experts: the dense expert form (every expert of a stack on every row,
    experts=None) multiplies an fp64 copy of the stack kept once; the routed form (slot entries
    gathered by `experts`) keeps gathering from the fp32 copy. The bits are those of 'none' either way
    (tolerance 0: the conversion is exact). The copy's presence is checked so that a mode that keeps
    nothing, or keeps the routed form's too, fails."""
    monkeypatch.setattr(ops, "_numerics", "exact")
    g = torch.Generator().manual_seed(1)
    stack_q, stack_s = zip(*(quant.quantize_fp4_weight(torch.randn(32, 64, generator=g)) for _ in range(3)))
    stack_q, stack_s = torch.stack(stack_q), torch.stack(stack_s)
    dense_x = torch.randn(3, 4, 64, generator=g).to(torch.bfloat16)  # [experts, rows, K]
    routed_x = torch.randn(2, 1, 64, generator=g).to(torch.bfloat16)  # [slots, 1, K]
    slots = torch.tensor([2, -1])
    monkeypatch.setattr(torch_ops, "F64_WEIGHTS", "none")
    want_dense = torch_ops.linear_fp4(dense_x, stack_q, stack_s)
    want_routed = torch_ops.linear_fp4(routed_x, stack_q, stack_s, slots)
    monkeypatch.setattr(torch_ops, "F64_WEIGHTS", "experts")
    monkeypatch.setattr(torch_ops, "_cache64", torch_ops._DequantCache())
    got_routed = torch_ops.linear_fp4(routed_x, stack_q, stack_s, slots)
    assert torch.equal(got_routed, want_routed)
    assert len(torch_ops._cache64._d) == 0  # the routed form made no fp64 copy
    for _ in range(2):
        assert torch.equal(torch_ops.linear_fp4(dense_x, stack_q, stack_s), want_dense)
    kept = list(torch_ops._cache64._d.values())
    assert len(kept) == 1 and kept[0][0] is stack_q and kept[0][1].dtype == torch.float64
    assert torch.equal(torch_ops.linear_fp4(routed_x, stack_q, stack_s, slots), want_routed)
