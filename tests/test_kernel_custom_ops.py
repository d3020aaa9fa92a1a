"""The NKI kernels as PyTorch custom ops (`ops.kernel_ops`, namespace `v4flash`), on the `nki-sim` route:

- every op equals a direct simulator launch of its kernel bit for bit (the op only moves the launch
  behind the dispatcher; tolerance: none);
- every fake implementation gives the real output's shapes and dtypes (and `torch.library.opcheck`
  passes: schema, fake tensor, AOT dispatch), and a wrong fake is caught by the same check;
- a function calling several ops through `nki_ops` compiles with fullgraph=True on CPU backends,
  its captured graph holds the kernels as `v4flash` nodes, and it gives the eager result bit for bit;
- the host-sync counter sees a kernel op as one opaque call (the simulator's NumPy round trip inside
  it is not a host read), while a real `.item()` is still counted;
- registration asks torch.library whether the route's definer registered a fake: a stand-in for
  `nki_op` that registers its own keeps it (a second, unconditional `register_fake` would replace it
  or raise), a definer that registers none gets ours.
"""

import pytest
import torch

from v4flash_backend import ops
from v4flash_backend.engine.device_boundary import HostSyncCounter
from v4flash_backend.formats import quant
from v4flash_backend.ops import kernel_ops, nki_ops

BF16, F32, I32 = torch.bfloat16, torch.float32, torch.int32


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed, scale=1.0, dtype=F32):
    return (torch.randn(*shape, generator=_gen(seed)) * scale).to(dtype)


def _bytes(t):
    return t.contiguous().view(torch.uint8)


def _args():
    """Small kernel-level arguments per op (tensors as the kernels take them, then the scalars)."""
    w8, s8 = quant.quantize_fp8_weight(_randn(64, 128, seed=2))
    w4, s4 = quant.quantize_fp4_weight(_randn(64, 64, seed=4))
    idx = torch.randint(-1, 20, (1, 3, 128), generator=_gen(23), dtype=I32)
    gate, up = _randn(5, 96, seed=13, scale=6.0, dtype=BF16), _randn(5, 96, seed=14, scale=6.0, dtype=BF16)
    return {
        "linear_fp8": (_randn(5, 128, seed=1, dtype=BF16), _bytes(w8), _bytes(s8)),
        "linear_fp4": (_randn(5, 64, seed=3, dtype=BF16), w4, _bytes(s4)),
        # slots 0 and 2 on experts 1 and 0 of a 2-expert stack, slot 1 empty
        "linear_fp4_routed": (_randn(3, 2, 64, seed=4, dtype=BF16), torch.stack([w4, w4.flip(0)]),
                              _bytes(torch.stack([s4, s4.flip(0)])), torch.tensor([[1], [-1], [0]], dtype=torch.int32)),
        "linear_bf16": (_randn(3, 96, seed=5, dtype=BF16), _randn(80, 96, seed=6, dtype=BF16)),
        "linear_bf16_grouped": (_randn(5, 4, 64, seed=7, dtype=BF16), _randn(4, 32, 64, seed=8, scale=0.2, dtype=BF16)),
        "linear_f32": (_randn(5, 128, seed=9), _randn(24, 128, seed=10)),
        "rms_norm": (_randn(3, 128, seed=11, scale=0.3, dtype=BF16), _randn(128, seed=12, dtype=BF16), 1e-6),
        "swiglu": (gate, up, 10.0),
        "swiglu_weighted": (gate, up, torch.rand(5, 1, generator=_gen(15)), 10.0),
        "engram_gate": (_randn(7, 4, 64, seed=16, dtype=BF16), _randn(7, 4, 64, seed=17, dtype=BF16),
                        _randn(7, 64, seed=18, dtype=BF16), 1 + 0.1 * _randn(4, 64, seed=19), 1e-20),
        "sparse_attn": (_randn(1, 3, 4, 64, seed=20, dtype=BF16), _randn(1, 20, 64, seed=21, dtype=BF16),
                        _randn(4, seed=22), idx, 0.125),
        "indexer_scores": (_randn(1, 5, 8, 32, seed=30, dtype=BF16), _randn(1, 20, 32, seed=31, dtype=BF16),
                           _randn(1, 5, 8, seed=32, scale=0.1, dtype=BF16)),
        "softmax_pool": (_randn(6, 4, 16, seed=33), _randn(6, 4, 16, seed=34, scale=3.0)),
        "hc_mixes": (_randn(5, 4 * 32, seed=35, dtype=BF16), _randn(24, 128, seed=36, scale=128 ** -0.5),
                     torch.rand(3, generator=_gen(37)) * 0.4 + 0.1, _randn(24, seed=38, scale=0.5), 4, 3, 1e-6, 1e-20),
        "hc_expand": (_randn(5, 32, seed=39, dtype=BF16), 4),
        "hc_collapse": (_randn(5, 4, 32, seed=40, dtype=BF16), torch.rand(5, 4, generator=_gen(41))),
        "hc_post": (_randn(5, 32, seed=39, dtype=BF16), _randn(5, 4, 32, seed=40, dtype=BF16),
                    torch.rand(5, 4, generator=_gen(42)) * 2, torch.rand(5, 16, generator=_gen(43))),
    }


# the kernel each op launches (module, function) and the names of its non-tensor arguments
KERNELS = {
    "linear_fp8": ("linear", "linear_fp8_kernel", ()), "linear_fp4": ("linear", "linear_fp4_kernel", ()),
    "linear_fp4_routed": ("linear", "linear_fp4_routed_kernel", ()),
    "linear_bf16": ("linear", "linear_bf16_kernel", ()),
    "linear_bf16_grouped": ("linear", "linear_bf16_grouped_kernel", ()),
    "linear_f32": ("linear", "linear_f32_kernel", ()), "rms_norm": ("rms_norm", "rms_norm_kernel", ("eps",)),
    "swiglu": ("swiglu", "swiglu_kernel", ("limit",)),
    "swiglu_weighted": ("swiglu", "swiglu_weighted_kernel", ("limit",)),
    "engram_gate": ("engram", "engram_gate_kernel", ("eps",)),
    "sparse_attn": ("sparse_attn", "sparse_attn_kernel", ("scale",)),
    "indexer_scores": ("indexer", "indexer_scores_kernel", ()),
    "softmax_pool": ("softmax_pool", "softmax_pool_kernel", ()),
    "hc_mixes": ("hc", "hc_mixes_kernel", ("hc", "iters", "hc_eps", "norm_eps")),
    "hc_expand": ("hc", "hc_expand_kernel", ("hc",)), "hc_collapse": ("hc", "hc_collapse_kernel", ()),
    "hc_post": ("hc", "hc_post_kernel", ()),
}


@pytest.fixture(autouse=True)
def _sim():
    ops.set_backend("nki-sim")  # conftest restores the torch backend
    kernel_ops.ensure()


def _direct(name, args, grid=1):
    """The kernel launched directly in the simulator (what nki_ops did before the custom ops)."""
    from nki_sim._torch_bridge import numpy_to_torch, torch_to_numpy
    from v4flash_backend import kernels

    module, fn, static_names = KERNELS[name]
    tensors, scalars = args[:len(args) - len(static_names)], args[len(args) - len(static_names):]
    kernel = getattr(getattr(kernels, module), fn)
    res = kernel[grid](*[torch_to_numpy(t) for t in tensors], **dict(zip(static_names, scalars)))
    return tuple(numpy_to_torch(r) for r in res) if isinstance(res, (tuple, list)) else numpy_to_torch(res)


def _as_tuple(r):
    return r if isinstance(r, tuple) else (r,)


def test_every_op_family_has_its_ops():
    from v4flash_backend import kernels

    launched = {getattr(getattr(kernels, m), f) for m, f, _ in KERNELS.values()}
    assert launched == {k for ks in kernels.KERNELS.values() for k in ks}  # every kernel of every family
    assert set(KERNELS) == set(kernel_ops.OPS) == set(kernel_ops.FAKES)
    for name in KERNELS:
        op = kernel_ops.op(name)
        assert op.namespace == "v4flash" and kernel_ops.is_kernel_target(op)


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_op_equals_the_direct_kernel_launch_bit_for_bit(name, monkeypatch):
    args = _args()[name]
    for grid in (1, 2):
        monkeypatch.setenv("V4FLASH_NKI_GRID", str(grid))
        got, want = _as_tuple(kernel_ops.op(name)(*args)), _as_tuple(_direct(name, args, grid))
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.dtype == w.dtype
            assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))  # every bit, NaN payloads included


def _fake_mismatches(op, args, real):
    """The differences between the fake implementation's outputs (under FakeTensorMode) and `real`."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake = _as_tuple(op(*fake_args))
    real = _as_tuple(real)
    if len(fake) != len(real):
        return [f"{len(fake)} outputs, not {len(real)}"]
    return [f"output {i}: fake {tuple(f.shape)} {f.dtype}, real {tuple(r.shape)} {r.dtype}"
            for i, (f, r) in enumerate(zip(fake, real)) if f.shape != r.shape or f.dtype != r.dtype]


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_fake_gives_the_real_shapes_and_dtypes(name):
    args = _args()[name]
    op = kernel_ops.op(name)
    assert _fake_mismatches(op, args, op(*args)) == []
    result = torch.library.opcheck(op, args)
    assert set(result.values()) == {"SUCCESS"}, result


def test_fp32_inputs_keep_their_dtype_through_the_fakes():
    """The dtype-following kernels (rms_norm, hc_*) keep fp32 activations fp32; the fakes follow."""
    args = _args()
    cases = {"rms_norm": (args["rms_norm"][0].float(), args["rms_norm"][1].float(), 1e-6),
             "hc_collapse": (args["hc_collapse"][0].float(), args["hc_collapse"][1]),
             "hc_expand": (args["hc_expand"][0].float(), 4)}
    for name, a in cases.items():
        op = kernel_ops.op(name)
        real = op(*a)
        assert real.dtype == F32 and _fake_mismatches(op, a, real) == []


def test_a_wrong_fake_is_caught():
    """The check above fails a fake that gets a shape wrong (here: rms_norm's fake with the rows dropped)."""
    lib = torch.library.Library("v4flash_selftest", "FRAGMENT")
    try:
        op = torch.library.custom_op("v4flash_selftest::rms_norm", mutates_args=())(kernel_ops.rms_norm)
        op.register_fake(lambda x, weight, eps: x.new_empty(x.shape[1:]))
        args = _args()["rms_norm"]
        real = kernel_ops.op("rms_norm")(*args)
        assert _fake_mismatches(torch.ops.v4flash_selftest.rms_norm.default, args, real) == [
            "output 0: fake (128,) torch.bfloat16, real (3, 128) torch.bfloat16"]
    finally:
        lib._destroy()


class _DefinerWithFake:
    """A stand-in for torch-neuronx's `nki_op` (never run here): it defines the op as a custom op and
    registers a fake of its own, which records its calls."""

    def __init__(self):
        self.fake_calls = 0

    def __call__(self, qualname, mutates_args=()):
        def define(fn):
            op = torch.library.custom_op(qualname, mutates_args=mutates_args)(fn)
            name = qualname.split("::")[1]

            def fake(*a, **kw):
                self.fake_calls += 1
                return kernel_ops.FAKES[name](*a, **kw)

            op.register_fake(fake)
            return op

        return define


def _ns(tag):
    import uuid

    return f"v4flash_{tag}_{uuid.uuid4().hex[:8]}"  # a fresh namespace per test: an op is defined once


def test_a_definer_s_own_fake_is_kept():
    from torch._subclasses import FakeTensorMode

    ns, definer = _ns("nkiop"), _DefinerWithFake()
    assert kernel_ops._register(definer, ns) == []  # every fake is the definer's: none of ours registered
    with FakeTensorMode():
        x, w = torch.empty(3, 128, dtype=BF16), torch.empty(128, dtype=BF16)
        out = getattr(torch.ops, ns).rms_norm(x, w, 1e-6)
    assert definer.fake_calls == 1 and out.shape == (3, 128)


def test_a_definer_without_fakes_gets_ours():
    ns = _ns("plain")
    assert set(kernel_ops._register(torch.library.custom_op, ns)) == set(kernel_ops.OPS)
    assert all(kernel_ops.has_fake(f"{ns}::{name}") for name in kernel_ops.OPS)
    # a Library-defined op (no custom_op): torch.library's registry answers the same question
    lib = torch.library.Library(_ns("lib"), "DEF")
    try:
        lib.define("f(Tensor x) -> Tensor")
        q = f"{lib.ns}::f"
        assert not kernel_ops.has_fake(q)
        torch.library.register_fake(q, lambda x: torch.empty_like(x), lib=lib)
        assert kernel_ops.has_fake(q)
    finally:
        lib._destroy()


def _layer(x, w_norm, w8, s8, gate_up, fn, scale, base):
    """A small slice of a layer through the op seam: mHC mixes, collapse, RMSNorm, an fp8 projection,
    SwiGLU and hc_post -- host reshapes between the kernel calls, as in the model."""
    pre, post, comb = ops.hc_mixes(x, fn, scale, base, 4, 3, 1e-6, 1e-20)
    h = ops.hc_collapse(x, pre)
    h = ops.rms_norm(h, w_norm, 1e-6)
    y = ops.linear_fp8(h, w8, s8)
    g, u = y.chunk(2, dim=-1)
    f = ops.linear_bf16(ops.swiglu(g.contiguous(), u.contiguous(), None, 10.0), gate_up)
    return ops.hc_post(f, x, post, comb)


def _layer_inputs():
    w8, s8 = quant.quantize_fp8_weight(_randn(64, 32, seed=51))
    return (_randn(1, 3, 4, 32, seed=50, dtype=BF16), _randn(32, seed=52, dtype=BF16), w8, s8,
            _randn(32, 32, seed=53, scale=0.2, dtype=BF16), _randn(24, 128, seed=54, scale=128 ** -0.5),
            torch.rand(3, generator=_gen(55)) * 0.4 + 0.1, _randn(24, seed=56, scale=0.5))


def test_ops_compile_as_graph_nodes():
    """fullgraph=True on a CPU backend: the kernels are `v4flash` nodes of the captured graph (one per
    call: 7), nothing breaks the graph, and the compiled function gives the eager result bit for bit
    (aot_eager runs the ops through AOT autograd's functionalization as well)."""
    import torch._dynamo

    args = _layer_inputs()
    eager = _layer(*args)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    got = torch.compile(_layer, backend=capture, fullgraph=True, dynamic=False)(*args)
    assert len(graphs) == 1
    assert kernel_ops.kernel_nodes(graphs[0]) == {"hc_mixes": 1, "hc_collapse": 1, "rms_norm": 1, "linear_fp8": 1,
                                                  "swiglu": 1, "linear_bf16": 1, "hc_post": 1}
    assert torch.equal(got, eager)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(_layer, backend="aot_eager", fullgraph=True, dynamic=False)(*args), eager)


def test_a_kernel_op_is_one_opaque_call_to_the_host_sync_counter():
    """Inside a kernel op the simulator converts tensors to NumPy and back (`.numpy()` on every input):
    launched directly those are host reads to a torch function mode; as an op they are not, while a
    real `.item()` around it is still counted."""
    args = _args()["rms_norm"]
    with HostSyncCounter() as direct:
        kernel_ops._sim_launch(kernel_ops._kernel("rms_norm", "rms_norm_kernel"), args[:2], {"eps": args[2]})
    assert direct.calls.get("numpy", 0) >= 2  # the counter does see the NumPy conversions made outside an op
    with HostSyncCounter() as hs:
        y = nki_ops.rms_norm(args[0], args[1], args[2])
        y = nki_ops.linear_bf16(y, _randn(16, 128, seed=60, dtype=BF16))
    assert hs.total == 0 and hs.kernel_calls == {"rms_norm": 1, "linear_bf16": 1}
    with HostSyncCounter() as hs:
        y = nki_ops.rms_norm(args[0], args[1], args[2])
        y[0, 0].item()  # a deliberate host read in the step
    assert hs.calls == {"item": 1} and hs.kernel_calls == {"rms_norm": 1}


PROMPT = [0, 17, 230, 5, 99]


def _serve(runner, max_tokens=6, **kw):
    from v4flash_backend.engine.engine import Engine
    from v4flash_backend.request import GenerateRequest
    from v4flash_backend.settings import Settings

    eng = Engine(runner, Settings(max_num_seqs=1, max_model_len=40))
    ev = eng.run_request(GenerateRequest(prompt=PROMPT, max_tokens=max_tokens, ignore_eos=True, **kw))
    return [e.token_ids for e in ev], eng.stats()


def test_static_rounds_with_kernel_ops_read_nothing_unless_the_step_does(small_model, monkeypatch):
    """The static rounds run op by op (graph backend none) with nki-sim: 0 host syncs per decode step
    (each kernel is one opaque op); a deliberate `.item()` in the step (after every RMSNorm) is counted."""
    from v4flash_backend.trn2.launch import NeuronSettings
    from v4flash_backend.trn2.static_runner import StaticRunner

    def runner():
        return StaticRunner(small_model, 1, 40, settings=NeuronSettings(backend="none"))

    ids, st = _serve(runner(), max_tokens=4)
    assert st["host_syncs_per_step"] == 0 and st["static_fallback_steps"] == 0
    real = nki_ops.rms_norm

    def reading_rms_norm(x, weight, eps):
        y = real(x, weight, eps)
        y.flatten()[0].item()
        return y

    monkeypatch.setattr(nki_ops, "rms_norm", reading_rms_norm)
    ids2, st2 = _serve(runner(), max_tokens=4)
    assert ids2 == ids and st2["host_syncs_per_step"] > 0


@pytest.mark.slow
def test_compiled_static_rounds_hold_the_kernels_as_nodes(small_model, monkeypatch):
    """The served static round graphs with nki-sim, compiled fullgraph with the 'eager' dynamo backend:
    every captured graph holds the kernels as `v4flash` nodes, and serving gives the tokens of eager
    nki-sim serving (LocalRunner) with 0 host syncs per decode step."""
    import torch._dynamo

    from v4flash_backend.engine.runner import LocalRunner
    from v4flash_backend.trn2.launch import NeuronSettings
    from v4flash_backend.trn2.static_runner import StaticRunner

    real_lookup = torch._dynamo.lookup_backend
    captured = []

    def lookup(name):
        inner = real_lookup(name)

        def recording(gm, example_inputs, **kw):
            captured.append(kernel_ops.kernel_nodes(gm))
            return inner(gm, example_inputs, **kw)

        return recording

    monkeypatch.setattr(torch._dynamo, "lookup_backend", lookup)
    torch._dynamo.reset()
    sr = StaticRunner(small_model, 1, 40, settings=NeuronSettings(backend="eager"))
    got, st = _serve(sr)
    want, _ = _serve(LocalRunner(small_model, 1, 40))
    # the tokens, not their chunks: how many drafts a step admits follows each runner's own step-cost
    # profile (timings), so an accepted pair may arrive in one response on one path and two on the other
    assert sum(got, []) == sum(want, [])
    assert st["host_syncs_per_step"] == 0 and st["static_fallback_steps"] == 0
    assert captured and all(sum(c.values()) > 0 for c in captured), captured
    verify = max(captured, key=lambda c: sum(c.values()))
    assert {"linear_fp8", "rms_norm", "sparse_attn", "hc_mixes", "hc_post"} <= set(verify), verify
    print("kernel nodes per captured graph:", [sum(c.values()) for c in captured], verify)
