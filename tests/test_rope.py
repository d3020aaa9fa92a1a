"""RoPE under 'exact' numerics: op by op a complex128 product; in a compiled graph fp64 real arithmetic on
(cos, sin) pairs with the same bits and no complex tensor (inductor generates no code for complex
operators)."""

import pytest
import torch

from v4flash_backend import ops
from v4flash_backend.model.rope import Rope, TableRope, _rotate_exact, rope_freqs


def _complex128(x, rope: Rope, positions, inverse):
    """The definition: the tail as complex128 times the table's complex64 entries widened to complex128."""
    rd = 2 * rope.freqs.numel()
    cis = rope.at(positions).to(torch.complex128)
    if inverse:
        cis = cis.conj()
    cis = cis.view(cis.shape[0], *([1] * (x.dim() - 2)), cis.shape[-1])
    tail = torch.view_as_complex(x[..., -rd:].double().unflatten(-1, (-1, 2)).contiguous())
    rot = torch.view_as_real(tail * cis).flatten(-2).to(x.dtype)
    return torch.cat([x[..., :-rd], rot], dim=-1)


@pytest.fixture
def exact():
    before = ops.get_numerics()
    ops.set_numerics("exact")
    yield
    ops.set_numerics(before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("shape", [(37, 4, 64), (37, 48)])
def test_exact_rotation_is_the_complex128_product_bit_for_bit(exact, dtype, inverse, shape):
    # exact equality: every product of a <= 24-bit significand pair is exact in fp64, so one rounding
    # per output whatever the evaluation order; any other formula (a sign, a swapped pair) differs
    g = torch.Generator().manual_seed(7)
    freqs = rope_freqs(16, 160000.0, 65536, 16.0, 32, 1)  # a YaRN table, as on compressed layers
    rope = Rope(freqs)
    x = (torch.randn(*shape, generator=g) * torch.logspace(-3, 3, shape[-1])).to(dtype)
    positions = torch.randint(0, 70000, (shape[0],), generator=g)
    want = _complex128(x, rope, positions, inverse)
    got = rope.apply(x, positions, inverse)  # op by op: the complex128 form
    assert got.dtype == dtype
    assert torch.equal(got, want)
    # the real form, which a compiled graph takes, directly and through a trace of TableRope.apply
    rd = 2 * freqs.numel()
    real = _rotate_exact(x[..., -rd:], rope.cos_sin(positions), inverse).to(dtype)
    assert torch.equal(real, want[..., -rd:])
    table = TableRope(rope, 70000)
    traced = torch.compile(lambda x, p: table.apply(x, p, inverse), backend="eager", fullgraph=True)
    assert torch.equal(traced(x, positions), want)
    assert not torch.equal(_rotate_exact(x[..., -rd:], rope.cos_sin(positions), not inverse).to(dtype),
                           want[..., -rd:])  # the direction matters


def test_a_static_graph_holds_no_complex_tensor(exact):
    freqs = rope_freqs(16, 10000.0, 0, 1.0, 32, 1)
    table = TableRope(Rope(freqs), 512)
    seen = set()

    def backend(gm, example_inputs):
        for node in gm.graph.nodes:
            v = node.meta.get("example_value")
            if isinstance(v, torch.Tensor):
                seen.add(v.dtype)
        return gm.forward

    def step(x, pos):
        return table.apply(x, pos) + table.apply(x, pos, inverse=True)

    x = torch.randn(6, 4, 64).to(torch.bfloat16)
    pos = torch.tensor([0, 5, 100, 200, 300, 511])
    out = torch.compile(step, backend=backend, fullgraph=True, dynamic=False)(x, pos)
    assert torch.equal(out, step(x, pos))
    assert seen and not any(d.is_complex for d in seen), seen
