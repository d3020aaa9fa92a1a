"""trn2.express: a compiled static graph called without dynamo's guards once it has run through them.

Small closures shaped like the round graphs (captured weights and state, in-place state writes, a
tuple result with a constant), compiled by compile_step with the eager backend (dynamo's capture,
FX execution: results are bit-exact with plain Python). Each test runs the same calls through
`guard_every_call` (dynamo on every call) and the express path and asserts equal results, equal state
afterwards, and whether the express path was taken (CompileStats.express_calls)."""

from __future__ import annotations

import pytest
import torch

from v4flash_backend import ops
from v4flash_backend.trn2.compiler import CompileStats, compile_step
from v4flash_backend.trn2.launch import NeuronSettings


class Holder:
    def __init__(self, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.W = {f"w{i}": torch.randn(4, 4, generator=g) for i in range(6)}
        self.state = torch.zeros(3, 4)
        self.calls = 0


def round_fn(h: Holder):
    """A round-like graph: reads every weight, writes state row `slot`, returns (out, count, None, 7)."""
    def fn(x, slot, scale):
        y = x
        for w in h.W.values():
            y = torch.tanh(y @ w)
        y = y * scale
        h.state.index_copy_(0, slot, h.state.index_select(0, slot) + y)
        return y, h.state.sum(1), None, 7
    return fn


def compiled(fn, every: bool):
    stats = CompileStats()
    return compile_step(fn, NeuronSettings(backend="eager", guard_every_call=every), stats), stats


def args(seed: int, rows: int = 1):
    g = torch.Generator().manual_seed(100 + seed)
    return torch.randn(rows, 4, generator=g), torch.tensor([seed % 3] * rows), torch.rand(1, generator=g)


def both(make, calls):
    """Run `calls` (a list of argument tuples) through both modes on fresh holders; returns per mode
    (results, final state, express calls)."""
    out = {}
    for every in (True, False):
        h = Holder()
        run, stats = compiled(make(h), every)
        res = [run(*a) for a in calls]
        out[every] = (res, h.state.clone(), stats.express_calls, h)
    return out


def assert_same(a, b):
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def test_express_serves_the_guarded_results_and_state():
    calls = [args(i) for i in range(6)]
    out = both(round_fn, calls)
    assert out[True][2] == 0  # dynamo on every call
    assert out[False][2] == len(calls) - 1  # all but the first (which learns the result's layout)
    assert_same(out[True][0], out[False][0])
    assert torch.equal(out[True][1], out[False][1])
    assert out[False][1].abs().sum() > 0  # the state writes happened


def test_express_reads_each_call_s_arguments_not_the_first():
    # a plan that baked in the first call's arguments, or swapped two of them, fails here
    h = Holder()
    run, stats = compiled(round_fn(h), every=False)
    run(*args(0))
    x, slot, scale = args(1)
    y, *_ = run(x, slot, scale)
    assert stats.express_calls == 1
    ref = x
    for w in h.W.values():
        ref = torch.tanh(ref @ w)
    assert torch.equal(y, ref * scale)


def test_other_shapes_and_global_state_go_through_dynamo():
    h = Holder()
    run, stats = compiled(round_fn(h), every=False)
    run(*args(0))
    run(*args(1))
    assert stats.express_calls == 1
    y2, *_ = run(*args(2, rows=2))  # another shape: dynamo recompiles, the result is still right
    assert stats.express_calls == 1 and y2.shape == (2, 4)
    numerics = ops.get_numerics()
    other = next(m for m in ops.NUMERICS if m != numerics)
    try:
        ops.set_numerics(other)
        run(*args(3, rows=2))
        assert stats.express_calls == 1  # a global dynamo guards changed: not the express path
    finally:
        ops.set_numerics(numerics)
    with torch.no_grad():
        run(*args(4, rows=2))
    assert stats.express_calls == 1


def test_an_argument_aliasing_another_only_at_first_is_not_folded():
    def make(h):
        def fn(a, b):
            a.add_(1.0)
            return a + b + h.W["w0"].sum()
        return fn
    h = Holder()
    run, stats = compiled(make(h), every=False)
    t = torch.zeros(2)
    run(t, t)  # a and b are one tensor: dynamo folds them into one graph input
    run(t, t)
    assert stats.express_calls == 1
    a, b = torch.zeros(2), torch.zeros(2)
    got = run(a, b)  # distinct now: the folded graph would read a for b
    assert stats.express_calls == 1
    assert torch.equal(got, torch.ones(2) + h.W["w0"].sum())


def test_python_side_effects_keep_dynamo():
    def make(h):
        def fn(x):
            h.calls += 1  # a Python side effect dynamo replays after the graph
            return x * h.W["w0"][0]
        return fn
    out = both(make, [(args(i)[0],) for i in range(4)])
    assert out[False][2] == 0
    assert out[False][3].calls == 4 == out[True][3].calls


class Box:
    def __init__(self, t):
        self.t = t


@pytest.mark.parametrize("form", ["object", "passthrough"])
def test_a_result_dynamo_rebuilds_keeps_dynamo(form):
    def make(h):
        def fn(x):
            y = x * h.W["w0"][0]
            return Box(y) if form == "object" else (y, x)  # a new object; an input passed through
        return fn
    h = Holder()
    run, stats = compiled(make(h), every=False)
    for i in range(3):
        x = args(i)[0]
        got = run(x)
        if form == "object":
            assert torch.equal(got.t, x * h.W["w0"][0])
        else:
            assert got[1] is x and torch.equal(got[0], x * h.W["w0"][0])
    assert stats.express_calls == 0


@pytest.mark.parametrize("every", [True, False])
def test_express_only_without_guard_every_call(every):
    h = Holder()
    run, stats = compiled(round_fn(h), every=every)
    for i in range(3):
        run(*args(i))
    assert stats.express_calls == (0 if every else 2)
    assert (run.express is None) == every
