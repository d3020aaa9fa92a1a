"""The decode loop's dtype policy (engine/precision.py) on the engine side.

- loop_dtype is float64 only for the CPU reference (torch ops, exact numerics), float32 under the
  kernels' numerics (nki-sim, nki) and torch with reference numerics.
- Under reference numerics (fp32 loop, the same selection as nki-sim and much faster) an eager
  sampled engine step makes no float64 tensor (a dispatch-mode recorder over the whole step: sampling,
  Markov drafting, acceptance, residual, calibrated confidence, admission, log-probs, penalties), and
  a static decode round makes none inside its graphs; eager and static serving commit the same tokens,
  log-probs and admissions at T = 0.8 with a seed (exact equality: the same fp32 ops on the same
  values, the forward's GEMMs in the row-invariant order: see the test). The round inputs are given
  in the loop dtype and the seed as int32 words, the form trn2/static_runner.py's round_inputs is to build
  (this test casts them until it does).
- Captured by dynamo (fullgraph), the static loop forms (Markov drafting, verification, residual,
  noise, calibrated confidence, admission, log-probs, the read-back pack) hold no float64 node under
  the fp32 loop, and the noise graph over int32 seed words no 64-bit integer either.
- Host admission and admit_static agree in fp32 with draft seconds and past the table's last size
  (the shared `staircase_sps`); the read-back's bit-cast round-trips fp32 and fp64 values exactly.
"""

import traceback

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from v4flash_backend import ops
from v4flash_backend.engine import noise
from v4flash_backend.engine.dspark_accept import markov_draft_static, verify_static
from v4flash_backend.engine.dspark_sched import SPSTable, _sps_values, admit, admit_static, sps_tensors, staircase_sps
from v4flash_backend.engine.engine import Engine
from v4flash_backend.engine.precision import loop_dtype, loop_int_dtype, pack_bits, unpack_bits
from v4flash_backend.engine.round_plan import pad_sps
from v4flash_backend.engine.runner import LocalRunner
from v4flash_backend.engine.step_cost import StepCost
from v4flash_backend.request import GenerateRequest
from v4flash_backend.settings import Settings
from v4flash_backend.trn2.launch import NeuronSettings
from v4flash_backend.trn2.static_round import calibrated_confidence, logprobs_pack, pack
from v4flash_backend.trn2.static_runner import StaticRunner

SPS = SPSTable([1, 2, 4, 8, 16], [10.0, 9.8, 9.5, 9.0, 8.0])
PROMPT = [0, 17, 230, 5, 99, 41, 8, 300, 12]
# float64 the policy allows on the host: the calibration's fits (offline and online) keep their
# observations in fp64 and never run in a graph (engine/calibration.py)
HOST_F64 = ("calibration.py",)


class F64Recorder(TorchDispatchMode):
    """Where float64 tensors are made while active (the v4flash frames of each op's stack)."""

    def __init__(self, allow_fns: tuple = ()):
        super().__init__()
        self.where = []
        self.allow_fns = allow_fns  # v4flash functions inside which float64 is allowed

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(isinstance(t, torch.Tensor) and t.dtype == torch.float64 for t in pytree.tree_leaves(out)):
            stack = [f for f in traceback.extract_stack() if "v4flash_backend" in f.filename]
            frames = [f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in stack]
            if not any(f.startswith(HOST_F64) for f in frames) and not any(f.name in self.allow_fns for f in stack):
                self.where.append((str(func), frames[-3:]))
        return out


def test_loop_dtype_policy():
    assert (loop_dtype(), loop_int_dtype()) == (torch.float64, torch.int64)  # torch + exact: the reference
    ops.set_numerics("reference")
    assert (loop_dtype(), loop_int_dtype()) == (torch.float32, torch.int32)
    ops.set_numerics("exact")
    ops.set_backend("nki-sim")
    assert loop_dtype() == torch.float32


@pytest.mark.parametrize("numerics", ["exact", "reference"])
def test_read_back_bits_round_trip(numerics):
    ops.set_numerics(numerics)
    x = torch.tensor([0.0, -0.0, 1.5, -3.25e-7, 3.4e38, float("-inf"), float("inf"), 1 / 3], dtype=loop_dtype())
    cols = pack_bits(x)
    assert cols.dtype == torch.int64
    back = unpack_bits(cols.tolist())
    assert back.dtype == loop_dtype() and torch.equal(back.view(loop_int_dtype()), x.view(loop_int_dtype()))


def test_host_and_static_admission_agree_in_fp32():
    ops.set_numerics("reference")
    g = torch.Generator().manual_seed(1)
    small = SPSTable([1, 2, 3], [10.0, 9.7, 9.1])  # B runs past the last size: the tokens/s branch
    B = torch.arange(1, 80)
    for table in (SPS, small):
        for td in (0.0, 0.013):
            # the SPS values both sides compare against, bit for bit (an fp64 lookup rounded to fp32
            # once differs from the graph's fp32 ops at some B: the early stop could then differ)
            host = _sps_values(StepCost(table, {3: td} if td else {}).sps_for(3), B, torch.float32)
            sps_t = pad_sps(sps_tensors(table)).to(loop_dtype())
            static = staircase_sps(sps_t[0].long(), sps_t[1], B, torch.tensor(td, dtype=loop_dtype()))
            assert host.dtype == static.dtype == torch.float32 and torch.equal(host, static)
            for _ in range(40):
                c = torch.rand(5, 4, generator=g) ** 0.3
                live = torch.rand(5, generator=g) < 0.8
                R = int(live.sum())
                t_draft = torch.tensor([td] * 6, dtype=loop_dtype())
                host = admit(c[live], StepCost(table, {R: td} if td else {}).sps_for(R))
                static = admit_static(c, live, pad_sps(sps_tensors(table)).to(loop_dtype()), t_draft)
                assert torch.equal(host, static[live]) and int(static[~live].sum()) == 0


def _engine(runner, mode):
    # step_cost_online off: both engines admit on the given cost, not on their own step timings
    eng = Engine(runner, Settings(max_num_seqs=3, max_model_len=64, spec_mode=mode, dspark_adaptive=True,
                                  step_cost_online=False))
    eng.cost = StepCost(SPS, {1: 0.004, 2: 0.005, 3: 0.006})  # draft seconds: admission's t_draft form
    eng._drafting_decision = lambda seqs: "draft"  # every step drafts (stepping aside: test_step_cost)
    return eng


def _run(runner, mode, rec=None):
    eng = _engine(runner, mode)
    outs = {}
    specs = [dict(temperature=0.8, seed=7, logprobs=2), dict(temperature=0.8, seed=2**40 + 9, frequency_penalty=0.5),
             dict(temperature=0.0)]
    for i, kw in enumerate(specs):
        eng.submit(GenerateRequest(prompt=PROMPT[:6 + i], max_tokens=10, ignore_eos=True, **kw,
                                   callback=lambda e, i=i: outs.setdefault(i, []).append((e.token_ids, e.logprobs))))
    n = 0
    while eng.has_work():
        if rec is not None and n >= 1:  # every step after the prefill
            with rec:
                eng.step()
        else:
            eng.step()
        n += 1
    return outs, eng.stats()


def _loop_dtype_inputs(sr: StaticRunner) -> None:
    """The round inputs as the dtype policy has them (trn2/static_runner.py's part: float inputs and the
    penalty counts in the loop dtype, the seed as int32 words, the round counter int32)."""
    orig = sr.round_inputs

    def round_inputs(plan):
        b, x = orig(plan)
        x = {k: v.to(loop_dtype()) if v.dtype == torch.float64 else v for k, v in x.items()}
        x.update(seed=noise.seed_words(x["seed"]), rnd=x["rnd"].to(torch.int32))
        return b, x

    sr.round_inputs = round_inputs
    sr.blocks.counts = sr.blocks.counts.to(loop_dtype())


@pytest.mark.numerics
@pytest.mark.parametrize("mode", ["dspark", pytest.param("fixed", marks=pytest.mark.slow)])
def test_fp32_loop_eager_equals_static_and_makes_no_float64(tiny_model, mode):
    """The fp32 loop, eager steps against the static rounds. The forward's GEMMs run in the 'invariant'
    order (ops.GEMM_ORDERS: fp64 accumulation rounded to fp32 once): an eager step and a round GEMM
    different row counts, and in the platform's own order MKL picks its kernel by the row count on an
    Intel CPU (fewer than ~6 rows take another kernel), so the same fp32 forward then differs in its last
    bits between the two paths and no equality holds on every CPU (seen there: the same tokens, log-probs
    an ulp or more apart). The loop itself -- this test's subject -- is fp32 in both orders, and the
    recorder allows float64 only inside those GEMMs (`matmul_f32`)."""
    ops.set_numerics("reference")
    ops.set_gemm_order("invariant")
    assert loop_dtype() == torch.float32
    rec = F64Recorder(allow_fns=("matmul_f32",))
    want, est = _run(LocalRunner(tiny_model, 4, 64), mode, rec)
    assert rec.where == [], rec.where[:5]  # eager decode steps: no float64 anywhere in the loop
    sr = StaticRunner(tiny_model, 3, 64, settings=NeuronSettings(backend="none"))
    _loop_dtype_inputs(sr)
    rec = F64Recorder(allow_fns=("matmul_f32",))
    graphs = sr.graphs.round

    def recorded_round(*a, **k):
        with rec:
            return graphs(*a, **k)

    sr.graphs.round = recorded_round
    got, st = _run(sr, mode)
    assert st["static_steps"] > 0 and st["graphs_per_step"] > 1
    assert rec.where == [], rec.where[:5]  # inside the round graphs: no float64
    assert got == want  # tokens and log-probs, bit for bit
    assert (st["admitted"], st["accepted"]) == (est["admitted"], est["accepted"]) and est["admitted"] > 0
    toks = [t for ids, _ in want[0] for t in ids]
    assert len(toks) == 10 and all(lp is not None and isinstance(lp[0][0], float) for _, lp in want[0] if lp)


def _graph_dtypes(fn, *args) -> set:
    """The dtypes of every tensor in the FX graph dynamo captures of fn (fullgraph), and that the
    compiled function returns what eager returns."""
    seen = set()

    def backend(gm, example_inputs):
        for node in gm.graph.nodes:
            v = node.meta.get("example_value")
            seen.update(t.dtype for t in pytree.tree_leaves(v) if isinstance(t, torch.Tensor))
        return gm.forward

    torch._dynamo.reset()
    got = torch.compile(fn, fullgraph=True, backend=backend)(*args)
    for a, b in zip(pytree.tree_leaves(got), pytree.tree_leaves(fn(*args))):
        assert torch.equal(a, b)
    return seen


def test_captured_noise_graph_is_int32():
    ops.set_numerics("reference")
    seed, rnd = noise.seed_words(torch.tensor([7, 2**40 + 3, -1])), torch.tensor([0, 1, 2], dtype=torch.int32)
    fn = lambda s, r: (noise.call_uniforms(s, r, noise.STREAM_VERIFY, 0, 6),  # noqa: E731
                       noise.call_uniforms(s, r, noise.STREAM_DRAFT, 3, None))
    assert _graph_dtypes(fn, seed, rnd) == {torch.int32, torch.float32}


def test_captured_loop_graph_has_no_float64():
    ops.set_numerics("reference")
    dt = loop_dtype()
    S, G, V = 2, 3, 31
    bias = torch.randn(V, V, generator=torch.Generator().manual_seed(0))

    def loop(seed, rnd, U, anchor, T, K, P, lg, conf, live, sps_t, td, cal, stop, budget):
        u = torch.stack([noise.call_uniforms(seed, rnd, noise.STREAM_DRAFT, j, None) for j in range(G)], 1)
        blk = markov_draft_static(U, anchor, lambda p: bias[p], T, K, P, u)
        res = verify_static(lg, blk.tokens, blk.q_token, blk.z, torch.full((S,), G), T, K, P,
                            noise.call_uniforms(seed, rnd, noise.STREAM_VERIFY, 0, G),
                            noise.call_uniforms(seed, rnd, noise.STREAM_VERIFY, 1, None), stop, budget)
        ell = admit_static(calibrated_confidence(conf, cal), live, sps_t, td)
        lp = logprobs_pack(lg.reshape(S * (G + 1), V), res.tokens, T, K, P)
        return pack(res.tokens, res.num_tokens, res.accepted, res.stopped, ell, conf), lp

    g = torch.Generator().manual_seed(1)
    args = (noise.seed_words(torch.tensor([7, 2**40])), torch.tensor([1, 2], dtype=torch.int32),
            torch.randn(S, G, V, generator=g), torch.tensor([1, 2]), torch.tensor([0.8, 0.0], dtype=dt),
            torch.tensor([0, 3]), torch.tensor([1.0, 0.9], dtype=dt), torch.randn(S, G + 1, V, generator=g),
            torch.randn(S, G, generator=g), torch.tensor([True, True]),
            pad_sps(sps_tensors(SPSTable([1, 2, 4], [3.0, 2.0, 1.0]))).to(dt), torch.full((S + 1,), 0.01, dtype=dt),
            torch.tensor([1.3, 0.2]).expand(S, G, 2).to(dt), torch.full((S, 4), -1), torch.tensor([10, 10]))
    seen = _graph_dtypes(loop, *args)
    assert torch.float32 in seen and torch.float64 not in seen, seen
