"""The served static decode round (trn2/static_round.py) commits what eager serving commits.

- The static forms of the sampling functions equal the host forms row by row, bit for bit, given
  the same counter-based noise (exact equality: same ops on the same values, no tolerance).
- Engine + StaticRunner (graphs run op by op) gives the same tokens as Engine + LocalRunner, greedy
  and at T = 0.8 with a seed, in dspark and fixed spec modes, with 2 graph executions and 0 host
  syncs per decode step; the SPS table is pinned (admission reads it, and a profiled table is a
  timing, different per run).
- A spy at the device boundary fails a decode round that moves a weight or cache tensor (negative
  control: a round patched to read a cache back is caught).
- Compiled (torch.compile fullgraph, the 'eager' dynamo backend): one graph per entry point, no
  re-trace while serving, same tokens (slow).
"""

import dataclasses

import pytest
import torch

from v4flash_backend import ops
from v4flash_backend.engine import dspark_accept as acc
from v4flash_backend.engine import noise
from v4flash_backend.engine.dspark_sched import SPSTable, admit, admit_static, sps_tensors
from v4flash_backend.engine.engine import STOP_WIDTH, Engine
from v4flash_backend.engine.round_plan import RoundPlan, pad_sps
from v4flash_backend.engine.runner import LocalRunner
from v4flash_backend.engine.sampling import SamplingParams, process_logits, process_logits_static
from v4flash_backend.engine.step_cost import StepCost
from v4flash_backend.request import GenerateRequest
from v4flash_backend.settings import Settings
from v4flash_backend.trn2.launch import NeuronSettings
from v4flash_backend.trn2.static_runner import StaticRunner
from v4flash_backend.trn2.static_step import BoundarySpy

SPS = SPSTable([1, 2, 4, 8, 16], [10.0, 9.8, 9.5, 9.0, 8.0])
PROMPT = [0, 17, 230, 5, 99, 41, 8, 300, 12]


@pytest.mark.parametrize("numerics", ["exact", "reference"])  # the loop in fp64 (CPU reference) and in fp32
def test_static_sampling_forms_equal_the_host_forms(numerics):
    ops.set_numerics(numerics)
    g = torch.Generator().manual_seed(0)
    R, G, V = 3, 5, 50
    T = torch.tensor([0.8, 0.0, 1.2], dtype=torch.float64)
    K, P = torch.tensor([0, 0, 10]), torch.tensor([1.0, 1.0, 0.9], dtype=torch.float64)
    params = SamplingParams(T, K, P)
    x = torch.randn(R, V, generator=g)
    assert torch.equal(process_logits(x, params), process_logits_static(x, T, K, P))
    U, bias = torch.randn(R, G, V, generator=g), torch.randn(V, V, generator=g)
    seeds, rnd, anchor = torch.tensor([7, 8, 9]), torch.tensor([1, 2, 3]), torch.tensor([1, 2, 3])
    b1 = acc.markov_draft(U, anchor, lambda p: bias[p], params, noise.CounterSampler(seeds, rnd, noise.STREAM_DRAFT))
    u = torch.stack([noise.call_uniforms(seeds, rnd, noise.STREAM_DRAFT, j, None) for j in range(G)], 1)
    b2 = acc.markov_draft_static(U, anchor, lambda p: bias[p], T, K, P, u)
    assert torch.equal(b1.tokens, b2.tokens) and torch.equal(b1.q_token, b2.q_token) and torch.equal(b1.z, b2.z)
    for ell in (torch.tensor([2, 5, 0]), torch.tensor([5, 5, 5]), torch.tensor([0, 0, 0])):
        lg = torch.randn(R, G + 1, V, generator=g)
        flat = torch.cat([lg[r, :1 + ell[r]] for r in range(R)])
        stop, mt = torch.full((R, 8), -1), torch.tensor([100, 3, 100])
        r1 = acc.verify(flat, b1, ell, params, noise.CounterSampler(seeds, rnd, noise.STREAM_VERIFY), stop, mt)
        r2 = acc.verify_static(lg, b2.tokens, b2.q_token, b2.z, ell, T, K, P,
                               noise.call_uniforms(seeds, rnd, noise.STREAM_VERIFY, 0, G),
                               noise.call_uniforms(seeds, rnd, noise.STREAM_VERIFY, 1, None), stop, mt)
        for f in ("tokens", "num_tokens", "accepted", "stopped"):
            assert torch.equal(getattr(r1, f), getattr(r2, f)), f
    c = torch.rand(4, G, generator=g)
    live = torch.tensor([True, False, True, True])
    assert torch.equal(admit(c[live], SPS), admit_static(c, live, pad_sps(sps_tensors(SPS)))[live])


def test_noise_is_uniform_and_keyed():
    u = noise.uniforms(torch.arange(2000), torch.zeros(2000, dtype=torch.long), 1, torch.arange(8))
    assert u.shape == (2000, 8) and 0 <= float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01  # 16000 draws: sd of the mean ~0.0023
    v = noise.uniforms(torch.arange(2000), torch.ones(2000, dtype=torch.long), 1, torch.arange(8))
    assert not torch.equal(u, v)  # another round, other draws


def _run(runner, T, mode, max_tokens=12, seed=7, **sampling):
    # dspark_adaptive off: every step drafts, so every round runs both graphs (the adaptive rounds, which
    # step aside into the plain-decode graph, are test_step_cost's)
    eng = Engine(runner, Settings(max_num_seqs=2, max_model_len=64, spec_mode=mode, dspark_adaptive=False))
    eng.cost = StepCost(SPS)
    ev = eng.run_request(GenerateRequest(prompt=list(PROMPT), max_tokens=max_tokens, temperature=T, seed=seed,
                                         ignore_eos=True, **sampling))
    return [t for e in ev for t in e.token_ids], eng.stats()


@pytest.mark.parametrize("mode", ["dspark", "fixed"])
def test_static_round_serves_the_eager_tokens(tiny_model, mode):
    for T in (0.0, 0.8):
        want, est = _run(LocalRunner(tiny_model, 3, 64, count_host_syncs=True), T, mode)
        got, st = _run(StaticRunner(tiny_model, 2, 64, settings=NeuronSettings(backend="none")), T, mode)
        assert got == want and len(got) == 12, (mode, T)
        assert st["static_steps"] == st["decode_steps"] == est["decode_steps"] >= 2
        assert st["graphs_per_step"] == 2 and st["host_syncs_per_step"] == 0
        # the eager step's host reads are seen (not a vacuous counter): its tokens' id range, the
        # engine's sampling and acceptance (the forward itself reads little since issue 30)
        assert est["host_syncs_per_step"] > 2
        assert st["admitted"] == est["admitted"] and st["accepted"] == est["accepted"]
        # the first block after the prefill came from the round's draft graph, not the eager drafter
        assert st["first_block_graphs"] == 1 and est["first_block_graphs"] == 0
    # a budget that leaves the first block one draft of room (3 tokens: the prefill's, one draft, the bonus)
    want, est = _run(LocalRunner(tiny_model, 3, 64), 0.8, mode, max_tokens=3)
    got, st = _run(StaticRunner(tiny_model, 2, 64, settings=NeuronSettings(backend="none")), 0.8, mode, max_tokens=3)
    assert got == want and len(got) == 3 and st["first_block_graphs"] == 1
    assert st["admitted"] == est["admitted"] == 1 and st["accepted"] == est["accepted"]


def test_a_round_whose_bucket_is_cold_runs_padded_in_a_warm_larger_one(tiny_model):
    """While the background compile has warmed only the larger bucket's sets (trn2.warmup announces
    the smallest and the largest), one sequence's rounds run in the 2-sequence graphs, padded, with
    the eager engine's tokens; running them in the cold 1-sequence bucket instead fails here."""
    want, _ = _run(LocalRunner(tiny_model, 3, 64), 0.8, "dspark")
    sr = StaticRunner(tiny_model, 2, 64, settings=NeuronSettings(backend="none"), ctx_buckets=False)
    b1, b2 = sr.buckets
    assert (b1.seqs, b2.seqs) == (1, 2)
    sr.ready = {("round", b2, False), ("plain", b2, False)}  # b1 cold (a compile in progress)
    used = []
    run_round = sr.graphs.round
    sr.graphs.round = lambda b, *a: used.append(b.seqs) or run_round(b, *a)
    got, st = _run(sr, 0.8, "dspark")
    assert got == want and st["static_steps"] == st["decode_steps"] >= 2
    assert used and set(used) == {2}


@pytest.mark.parametrize("sampling", [dict(top_k=3), dict(top_p=0.3)])
def test_filtering_requests_take_the_processed_round(tiny_model, sampling, monkeypatch):
    """The plain round variant leaves the top-k / top-p filters out (static_round.stages_of): a
    request that filters runs the processed variant, with the eager engine's tokens. Sending it to
    the plain variant instead fails here (the filters change these draws: the unfiltered tokens differ),
    and StaticRunner refuses such a plain plan."""
    want, _ = _run(LocalRunner(tiny_model, 3, 64), 0.8, "dspark", **sampling)
    unfiltered, _ = _run(LocalRunner(tiny_model, 3, 64), 0.8, "dspark")
    assert want != unfiltered
    sr = StaticRunner(tiny_model, 2, 64, settings=NeuronSettings(backend="none"))
    variants = []
    real = sr.graphs.round
    sr.graphs.round = lambda b, mode, fl, x: (variants.append("n_out" in x), real(b, mode, fl, x))[1]
    got, st = _run(sr, 0.8, "dspark", **sampling)
    assert got == want and st["static_steps"] >= 2
    assert variants and all(variants)
    # a plain plan whose sampling filters is refused, not served without the filters
    from v4flash_backend.engine import round_step

    monkeypatch.setattr(round_step, "filters", lambda seqs, vocab: False)
    with pytest.raises(ValueError, match="processed round variant"):
        _run(StaticRunner(tiny_model, 2, 64, settings=NeuronSettings(backend="none")), 0.8, "dspark", **sampling)


def _resident(runner) -> list[torch.Tensor]:
    return runner.resident_tensors()


def test_a_decode_round_moves_no_weight_or_cache(tiny_model, monkeypatch):
    sr = StaticRunner(tiny_model, 2, 64, settings=NeuronSettings(backend="none"))
    # dspark_adaptive off: its host-side calibration reads the confidences out of the read-back (a host
    # list, which the spy cannot tell from a device read on CPU)
    eng = Engine(sr, Settings(max_num_seqs=2, max_model_len=64, dspark_adaptive=False))
    eng.cost = StepCost(SPS)
    eng.submit(GenerateRequest(prompt=list(PROMPT), max_tokens=20, ignore_eos=True))
    eng.step()  # prefill (eager)
    eng.step()  # first round (uploads the host-drafted block: not a steady step)
    spy = BoundarySpy(_resident(sr))
    with spy:
        eng.step()
    assert eng.decode_totals["static_steps"] == 2
    assert not [m for m in spy.moves if m[1]], spy.moves
    reads = [m for m in spy.moves if m[0] in ("tolist", "item", "numpy", "cpu")]
    assert reads == [("tolist", False)]  # the one read-back: committed tokens + counts
    # negative control: a round that reads a cache back is caught
    orig = sr.decoder.verify

    def leaky(*a, **k):
        sr.state.window[0].cpu()
        return orig(*a, **k)

    monkeypatch.setattr(sr.decoder, "verify", leaky)
    spy = BoundarySpy(_resident(sr))
    with spy:
        eng.step()
    assert ("cpu", True) in spy.moves


@pytest.mark.slow
def test_compiled_round_is_fullgraph_and_serves_the_eager_tokens(small_model):
    """torch.compile(fullgraph=True) with the 'eager' dynamo backend (captures the whole graph,
    then runs the FX graph op by op: a CPU stand-in for neuronx-cc): one graph per entry point and
    variant (plain, and processed: min_tokens / penalties / log-probs), none re-traced while
    serving, no host sync in a graph (compile_step refuses one); the eager engine's tokens and
    log-probs (exact). With dspark_adaptive (one request under a step cost where drafting pays, one where
    it does not):
    calibrated admission, probes and stepped-aside rounds (graph 1 alone) in the same compiled
    graphs, the same decisions as the eager engine. On the 4-layer model (conftest.SMALL: every
    block type, under half the golden model's trace)."""
    ops.set_numerics("exact")
    sr = StaticRunner(small_model, 1, 40, settings=NeuronSettings(backend="eager"))
    sr.graphs.warm_up(None, mode="dspark", stop_width=STOP_WIDTH)
    assert sr.graphs.stats.graphs == 4
    sr.warm_up_prefill(None)  # + the bare verify graph: the 5-token prompts are short segments
    assert sr.graphs.stats.graphs == 5
    sr.warm_up_nodraft(None, stop_width=STOP_WIDTH)  # + the plain-decode graph (1 row), both variants
    assert sr.graphs.stats.graphs == 7
    reqs = [dict(temperature=0.8, seed=7),
            dict(temperature=0.8, seed=5, frequency_penalty=0.5, presence_penalty=0.3, min_tokens=6, logprobs=2)]

    def serve(runner):
        # step_cost_online off: both engines decide on the given cost, not on their own step timings
        # probe_max_every 3: a probe every 3 steps aside (it also caps the probes' cost floor, which at a
        # draft of twice a forward would wait ~67 steps: no probe in these 12 tokens)
        eng = Engine(runner, Settings(max_num_seqs=1, max_model_len=40, dspark_adaptive=True, probe_every=3,
                                      probe_max_every=3, step_cost_online=False))
        out = []
        # the first request with drafting at half a forward (a new engine's regime has no verified
        # blocks yet: it drafts), the second at twice a forward after 8 verified blocks whose drafts
        # were all rejected (does not pay: stepped aside, with probes); host inputs only
        for i, (kw, draft_s) in enumerate(zip(reqs, (0.05, 0.2))):
            eng.cost = StepCost(SPS, {1: draft_s})
            for _ in range(8 * i):
                eng.calib.observe("sampled", torch.zeros(eng.gamma), eng.gamma, 0)
            ev = eng.run_request(GenerateRequest(prompt=PROMPT[:5], max_tokens=12, ignore_eos=True, **kw))
            out.append([(e.token_ids, e.logprobs) for e in ev])
        return out, eng.stats()

    def calls():
        return sr.graphs.executions + sr.ngraphs.executions, sr.graphs.stats.express_calls

    before = calls()
    got, st = serve(sr)
    assert sr.graphs.stats.graphs == 7, "a graph was re-traced while serving"
    # trn2.express: after warm-up, graph calls skip dynamo's guards (the tokens below are compared)
    runs, express = (a - b for a, b in zip(calls(), before))
    assert runs > 0 and express == runs
    # every graph input has a dtype inductor's CPU code generator takes (the Engram tables' e8m0 scales
    # enter as their bytes): `graph_backend inductor` compiles these graphs
    from torch._inductor.codegen.cpp_utils import DTYPE_TO_CPP

    assert sr.graphs.stats.input_dtypes and not sr.graphs.stats.input_dtypes - set(DTYPE_TO_CPP)
    want, est = serve(LocalRunner(small_model, 2, 40))
    assert got == want and got[1][-1][1] is not None
    assert st["host_syncs_per_step"] == 0 and st["static_fallback_steps"] == 0
    kinds = st["decode_steps_by_kind"]
    assert kinds == est["decode_steps_by_kind"] and all(kinds.values()), kinds  # drafted, probed, stepped aside
    assert st["graphs_per_step_by_kind"] == {"draft": 2, "probe": 2, "aside": 1}
    assert sr.counters["plain_decode_rounds"] > 0  # stepped-aside rounds after the first: 1 row per sequence
    # issue 32: the learned step cost reaches the compiled rounds as input values, never as a new graph
    # (a learner fed steps at half the profile's time, so the round's SPS table is another one)
    eng = Engine(sr, Settings(max_num_seqs=1, max_model_len=40, dspark_adaptive=True))
    eng.cost = StepCost(SPS, {1: 0.05})
    for B in (1, 2, 4, 6):
        for _ in range(8):
            eng.learner.observe("static", B, 1, 1, 0.5 * eng.cost.t_step(B, 1, 1), eng.cost)
    plans, real_round = [], sr.decode_round
    sr.decode_round = lambda plan: (plans.append(plan), real_round(plan))[1]
    eng.run_request(GenerateRequest(prompt=PROMPT[:5], max_tokens=12, ignore_eos=True, **reqs[0]))
    sr.decode_round = real_round
    assert sr.graphs.stats.graphs == 7, "a graph was re-traced for the learned step cost"
    assert plans and all(p.sps is not None and not torch.equal(p.sps, sps_tensors(SPS)) for p in plans)


def _group_compiled_vs_w1_eager(ckpt, world, model):
    """Serve a greedy and a seeded T = 0.8 request through a rank group of `world` ranks on the
    compiled static path; the same requests through the in-process W = 1 eager engine."""
    import tempfile

    from v4flash_backend.group.rank_group import RankGroup

    with tempfile.TemporaryDirectory() as tmp:
        sps_path = f"{tmp}/sps.json"
        SPS.save(sps_path)
        settings = Settings(checkpoint_dir=str(ckpt), world_size=world, max_num_seqs=1, max_model_len=40,
                            prefill_chunk=16,  # one prefill bucket (16 rows): one more compiled graph
                            decode_graph="static", graph_backend="eager", sps_path=sps_path,
                            warm_processed=False,  # the logit-processing variant: not compiled (not used)
                            startup_timeout_s=900.0, collective_timeout_s=300.0,
                            # the same prompt twice: each request prefills it (the counts below), and
                            # admission reads the given table, not the group's own step timings
                            prefix_cache_bytes=0, step_cost_online=False,
                            dspark_adaptive=False)  # every step drafts: the three graphs counted below
        reqs = [(PROMPT, 8, 0.0, None), (PROMPT, 8, 0.8, 7)]
        g = RankGroup.launch(settings)
        try:
            got = []
            for p, k, t, s in reqs:
                params = {"max_tokens": k, "temperature": t, "ignore_eos": True}
                params |= {"seed": s} if s is not None else {}
                got.append([i for ev in g.submit(p, params) for i in ev["token_ids"]])
            st = g.stats()
        finally:
            g.shutdown(timeout=60)
    want = []
    for p, k, t, s in reqs:
        eng = Engine(LocalRunner(model, 2, 40), Settings(max_num_seqs=1, max_model_len=40, step_cost_online=False,
                                                         dspark_adaptive=False))
        eng.cost = StepCost(SPS)
        ev = eng.run_request(GenerateRequest(prompt=list(p), max_tokens=k, temperature=t, seed=s, ignore_eos=True))
        want.append([i for e in ev for i in e.token_ids])
    return got, want, st


def _check_compiled_group(got, want, st, world):
    assert got == want and len(got[0]) == 8
    e = st["engine"]
    assert st["world_size"] == world
    assert e["decode_graph"] == "static" and e["static_steps"] == e["decode_steps"] > 0
    # one verify + one draft round graph and the bare verify graph (the forward of short segments);
    # a re-trace while serving would add one
    assert e["graphs_compiled"] == 3, "a graph was re-traced while serving (or more than one per entry point)"
    assert e["prefill_graphs"] == 2  # one 9-token prompt chunk per request, through the compiled prefill graph
    assert e["prefill_step_eager_forwards"] == 0
    assert e["first_block_graphs"] == 2  # each request's first block by the draft graph on every rank (FIRST_BLOCK)
    assert e["graphs_per_step"] == 2 and e["host_syncs_per_step"] == 0
    traced = {k: v for k, v in st["collectives_total"].items() if k.startswith("graph.")}
    assert traced and all(v["calls"] > 0 for v in traced.values()), st["collectives_total"]


@pytest.mark.slow
def test_rank_group_w2_compiled_static_equals_w1_eager(small_model, small_ckpt):
    """torchrun + gloo, W = 2, the round graphs compiled (fullgraph, 'eager' dynamo backend) with the
    functional collectives inside them: the same tokens as the in-process W = 1 eager engine, greedy
    and at T = 0.8 with a seed (same pinned SPS table), no graph re-traced while serving, 2 graph
    executions and 0 host syncs per decode step, the traced collectives counted outside the graphs."""
    _check_compiled_group(*_group_compiled_vs_w1_eager(small_ckpt, 2, small_model), 2)


@pytest.mark.slow
def test_rank_group_w4_compiled_static_equals_w1_eager(small_model, small_ckpt):
    """As at W = 2, at W = 4 (the 4-layer model has the embedded model's attention shape, 2 o-groups:
    attention groups of 2 ranks, replicated twice, `layout.attention_group_max`), four ranks
    compiling on the CI's 2 cores: one decode bucket (1 sequence x 40 positions) and one prefill
    bucket, ~4 graphs per rank."""
    _check_compiled_group(*_group_compiled_vs_w1_eager(small_ckpt, 4, small_model), 4)


def test_place_resident_moves_every_weight_and_cache(golden_dir):
    """At load, every tensor a decode round reads lives on the rank's device ('meta' stands in for a
    NeuronCore: moving there keeps shapes, so a forgotten buffer shows up as a CPU tensor)."""
    from v4flash_backend.model.loading import load_model
    from v4flash_backend.trn2.static_runner import place_resident

    m = load_model(golden_dir)  # its own copy: the session model stays on the CPU
    sr = StaticRunner(m, 2, 64, settings=NeuronSettings(backend="none"))
    n = place_resident(sr, "meta")
    left = [t for t in _resident(sr) if t.device.type != "meta"]
    assert n > len(m.W) and not left
    assert all(t.device.type == "meta" for st in m.W.meta["stacked"].values() for t in st)


def test_nki_device_args_pass_resident_tensors_and_count_copies(monkeypatch):
    from v4flash_backend.ops import nki_ops

    resident, host = torch.empty(2, device="meta"), torch.zeros(2)
    nki_ops.device_copies.clear()
    out = nki_ops.device_args([resident, host], "k", device_type="meta")
    assert out[0] is resident and out[1].device.type == "meta" and nki_ops.device_copies == {"k": 1}
    monkeypatch.setenv("V4FLASH_NKI_STRICT", "1")
    with pytest.raises(RuntimeError, match="place weights and caches"):
        nki_ops.device_args([host], "k", device_type="meta")


@pytest.mark.slow
def test_generate_step_report_lines(golden_dir, tmp_path):
    """`generate --step-report`: the last two stdout lines are exactly `ids: ...` and `step-report: ...`;
    static at W = 1 (through the rank group) gives the eager ids at T = 0.8 with a seed and a shared
    SPS table, with 2 graphs and 0 host syncs per decode step (eager: 0 graphs, > 2 syncs: the
    eager step's id check, sampling and acceptance reads)."""
    import re
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    sps = tmp_path / "sps.json"
    SPS.save(sps)
    common = ["--checkpoint", str(golden_dir), "--prompt", "Once upon a time", "--max-tokens", "10",
              "--temperature", "0.8", "--seed", "7", "--sps-path", str(sps), "--step-report"]
    lines = {}
    for mode in ("eager", "static"):
        out = _cli(common + ["--world-size", "1", "--decode-graph", mode], repo)
        assert re.fullmatch(r"ids: \d+(,\d+)*", out[-2]), out[-2]
        m = re.fullmatch(r"step-report: decode_graph=(\w+) world=1 steps=(\d+) graphs_per_step=([\d.]+) "
                         r"host_syncs_per_step=([\d.]+) host_to_device_bytes_per_step=(\d+)", out[-1])
        assert m and m.group(1) == mode, out[-1]
        lines[mode] = (out[-2], m)
    assert lines["eager"][0] == lines["static"][0] and len(lines["eager"][0].split(",")) == 10
    e, s = lines["eager"][1], lines["static"][1]
    assert e.group(2) == s.group(2) and int(s.group(2)) > 0
    assert float(s.group(3)) == 2 and float(s.group(4)) == 0
    assert float(e.group(3)) == 0 and float(e.group(4)) > 2


def _cli(args, cwd):
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(cwd / "src"), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-m", "v4flash_backend", "generate", *args], capture_output=True, text=True,
                         env=env, cwd=cwd, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout.rstrip("\n").split("\n")


@pytest.mark.parametrize("numerics", ["exact", "reference"])
def test_round_and_block_plans_round_trip(numerics, monkeypatch):
    """The round plan a follower rank receives equals rank 0's, in both loop dtypes (fp64 under
    exact numerics, fp32 under reference: the SPS table then crosses as widened float64 bits)."""
    from v4flash_backend.group.worker import pack_block, pack_round, unpack_block, unpack_round

    monkeypatch.setattr(ops, "_numerics", numerics)

    plan = RoundPlan(slot=[0, 3], start=[9, 20], pending=[5, 6], ell=[2, 0], top_k=[0, 40], seed=[7, (1 << 62) + 5],
                     rnd=[1, 4], budget=[8, 1], len_left=[50, 30], temperature=[0.8, 0.0], top_p=[0.95, 1.0],
                     stop_ids=[[1, -1], [2, 3]], spec_mode="dspark", fixed_len=5,
                     sps=sps_tensors(SPS), t_draft=[0.0, 0.01, 0.0125],  # dspark_adaptive's inputs
                     cal=[[[0.97, -1.4], [1.0, 0.0]], [[6.3, -1.05], [0.0, 0.0]]], fixed_ell=[1, -1])
    back = unpack_round(*pack_round(plan))
    assert isinstance(back, RoundPlan) and back.diff(plan) == []
    assert back.sps.dtype == pad_sps(plan.sps).dtype and torch.equal(back.sps, pad_sps(plan.sps))
    # without dspark_adaptive's inputs (fixed / off rounds): none are sent
    plain = dataclasses.replace(plan, t_draft=None, cal=None, fixed_ell=None)
    assert pack_round(plain)[1].numel() < pack_round(plan)[1].numel()
    assert unpack_round(*pack_round(plain)).cal is None
    # a field that does not cross is seen (the check can fail)
    assert back.diff(dataclasses.replace(plan, budget=[8, 2])) == ["budget"]
    z = torch.randn(5, 7)
    block = (torch.tensor([1, 2, 3, 4, 5]), None, torch.rand(5), z)
    slot, (t, _, q, z2) = unpack_block(*pack_block(3, block))
    assert slot == 3 and torch.equal(t, block[0]) and torch.equal(q, block[2]) and torch.equal(z2, z)


@pytest.mark.parametrize("mode", ["dspark", "off"])
def test_staggered_batch_switches_between_rounds_and_eager_steps(tiny_model, mode):
    """Requests arriving while others decode: steps alternate between static rounds and eager
    mixed steps (draft blocks read back, then uploaded again); every request still gets the tokens
    of the eager runner (seeded sampling and greedy, different lengths)."""
    def run(runner):
        eng = Engine(runner, Settings(max_num_seqs=3, max_model_len=64, spec_mode=mode, prefill_chunk=4))
        eng.cost = StepCost(SPS)
        outs = {}
        reqs = [GenerateRequest(prompt=PROMPT[:n], max_tokens=k, temperature=t, seed=s, ignore_eos=True,
                                callback=lambda e, i=i: outs.setdefault(i, []).extend(e.token_ids))
                for i, (n, k, t, s) in enumerate([(9, 14, 0.8, 3), (5, 6, 0.0, None), (7, 9, 0.8, 11)])]
        eng.submit(reqs[0])
        for _ in range(4):
            eng.step()
        eng.submit(reqs[1])
        eng.step()
        eng.submit(reqs[2])
        while eng.has_work():
            eng.step()
        return outs, eng.stats()

    want, est = run(LocalRunner(tiny_model, 4, 64))
    got, st = run(StaticRunner(tiny_model, 3, 64, settings=NeuronSettings(backend="none")))
    assert got == want
    assert 0 < st["static_steps"] < st["steps"]  # both kinds of step happened
    assert st["host_syncs_per_step"] < 1  # only the read-backs of blocks at eager decode steps


def test_prefill_chunks_run_the_prefill_graphs(tiny_model):
    """Segmented prefill through the prefill graphs (chunks of 16 rows in row buckets 16 / 32; a
    chunk longer than the rings is covered in test_static_step) gives the eager tokens; a 40-token
    prompt in chunks of 16 is 3 prefill graph executions."""
    prompt = [0] + torch.randint(3, 1000, (39,), generator=torch.Generator().manual_seed(2)).tolist()

    def run(runner):
        eng = Engine(runner, Settings(max_num_seqs=2, max_model_len=96, prefill_chunk=16, spec_mode="fixed"))
        ev = eng.run_request(GenerateRequest(prompt=prompt, max_tokens=8, temperature=0.8, seed=3, ignore_eos=True))
        return [t for e in ev for t in e.token_ids], eng.stats()

    want, _ = run(LocalRunner(tiny_model, 3, 96))
    got, st = run(StaticRunner(tiny_model, 2, 96, settings=NeuronSettings(backend="none"), prefill_rows=32))
    assert got == want and st["prefill_graphs"] == 3
    assert st["graphs_per_step"] == 2 and st["host_syncs_per_step"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dspark", "off"])
def test_mixed_and_multi_prompt_prefill_steps_run_graphs(tiny_model, mode):
    """Item 2 of issue 13: steps whose prefill rows come from several sequences (prompts of 5, 23
    and 40 tokens arriving together), and a 37-token prompt arriving while two others decode, run
    as fixed-shape graphs -- the step's short segments (decode rows, chunks of <= 1 + G rows) in one
    verify graph, each longer chunk in its prefill graph -- and every request gets the eager
    runner's tokens (exact numerics: bit-equal forwards, same counter-based noise; no tolerance)."""
    g = torch.Generator().manual_seed(5)
    prompts = [[0] + torch.randint(3, 1000, (n - 1,), generator=g).tolist() for n in (5, 23, 40, 37)]

    def run(runner):
        eng = Engine(runner, Settings(max_num_seqs=3, max_model_len=96, spec_mode=mode, prefill_chunk=16))
        eng.cost = StepCost(SPS)
        outs = {}

        def req(i, k, t, s):
            return GenerateRequest(prompt=prompts[i], max_tokens=k, temperature=t, seed=s, ignore_eos=True,
                                   callback=lambda e, i=i: outs.setdefault(i, []).extend(e.token_ids))
        for i, (k, t, s) in enumerate([(6, 0.8, 3), (9, 0.0, None), (7, 0.8, 11)]):
            eng.submit(req(i, k, t, s))  # three prompts arrive together
        while eng.has_work():
            eng.step()
        eng.submit(req(0, 12, 0.8, 4))
        eng.submit(req(1, 12, 0.0, None))
        for _ in range(3):
            eng.step()
        eng.submit(req(3, 8, 0.8, 9))  # a long prompt while two decode
        while eng.has_work():
            eng.step()
        return outs, eng.stats()

    want, _ = run(LocalRunner(tiny_model, 4, 96))
    sr = StaticRunner(tiny_model, 3, 96, settings=NeuronSettings(backend="none"), prefill_rows=16)
    got, st = run(sr)
    assert got == want and all(len(v) > 0 for v in got.values())
    assert st["prefill_steps"] >= 4 and st["prefill_step_eager_forwards"] == 0, st
    assert sr.counters["eager_forwards"] == 0
    assert st["prefill_graphs"] >= 6  # 23 + 40 + 37 tokens in chunks of <= 16 rows
    assert st["graphs_per_prefill_step"] > 1  # several sequences' rows in one step: several graphs


@pytest.mark.parametrize("mode", ["fixed", "dspark"])
def test_logit_processing_runs_in_the_static_rounds(tiny_model, mode):
    """Item 3 of issue 13: min_tokens, frequency / presence penalties and log-probs no longer send a
    step to the eager path: the rounds' processed variant applies them in the graphs (penalty counts
    device-resident per slot) and returns the log-probs in the one read-back. Tokens and log-probs
    equal the eager engine's exactly (the same float64 ops on the same values: no tolerance), greedy
    and seeded T = 0.8, with a request without processing in the same batch."""
    def run(runner):
        eng = Engine(runner, Settings(max_num_seqs=3, max_model_len=64, spec_mode=mode))
        eng.cost = StepCost(SPS)
        outs = {}
        specs = [dict(temperature=0.8, seed=3, frequency_penalty=0.7, presence_penalty=0.4, logprobs=3),
                 dict(temperature=0.0, min_tokens=9, logprobs=0), dict(temperature=0.8, seed=11)]
        for i, kw in enumerate(specs):
            eng.submit(GenerateRequest(prompt=PROMPT[:5 + i], max_tokens=12, stop_token_ids=(16, 265, 289), **kw,
                                       callback=lambda e, i=i: outs.setdefault(i, []).append(
                                           (e.token_ids, e.logprobs, e.finish_reason))))
        while eng.has_work():
            eng.step()
        return outs, eng.stats()

    want, est = run(LocalRunner(tiny_model, 4, 64))
    got, st = run(StaticRunner(tiny_model, 3, 64, settings=NeuronSettings(backend="none")))
    assert got == want
    toks = {i: [t for ids, _, _ in v for t in ids] for i, v in got.items()}
    assert len(toks[1]) >= 9 and all(len(lp[2]) == 3 for ids, lps, _ in got[0] if lps for lp in lps)
    assert (st["admitted"], st["accepted"]) == (est["admitted"], est["accepted"])  # the same drafts
    assert st["static_steps"] == st["decode_steps"] > 0 and st["static_fallback_steps"] == 0
    assert st["graphs_per_step"] == 2 and st["host_syncs_per_step"] == 0


def test_sps_profile_of_a_static_runner_times_its_round_graphs(tiny_model, monkeypatch, tmp_path):
    """Item 4 of issue 13: with a static runner, the step cost (the SPS table the rounds' admission
    reads) is timed on the decode rounds the server runs (both graphs of the bucket, through
    `decode_round`), not on the eager forward. The rounds are replaced by stand-ins that take a
    known time per bucket (1 seq: 20 ms, 2: 120 ms, 4: 60 ms) for the round that steps aside
    (graph 1 alone) and 40 ms more with the draft graph, on an injected clock that only the
    stand-ins advance: the forward table must show each bucket's stepped-aside time for the
    B = S x (1 + G) tokens it holds, the draft seconds exactly the 40 ms by R (tolerance 1e-9 s:
    float sums of the fake clock; no wall-clock time is read, so machine load cannot move it)."""

    sr = StaticRunner(tiny_model, 4, 64, settings=NeuronSettings(backend="none"))
    monkeypatch.setattr(sr, "forward", lambda *a, **k: pytest.fail("the SPS profile ran the eager forward"))
    delay = {1: 0.02, 2: 0.12, 4: 0.06}
    seen, now = [], [1000.0]

    def fake_round(b, mode, fixed_len, x):
        seen.append((b.seqs, mode))
        now[0] += delay[b.seqs] + (0.04 if mode != "off" else 0.0)  # the round's time, on the fake clock
        return torch.zeros(b.seqs, 2 * sr.G + 5, dtype=torch.long)

    monkeypatch.setattr(sr.graphs, "round", fake_round)
    monkeypatch.setattr(sr.ngraphs, "round", fake_round)  # the stepped-aside round: the plain-decode graph
    # the profile's timer is the engine's injected clock (step_profile passes it to interleaved_medians)
    eng = Engine(sr, Settings(max_num_seqs=4, max_model_len=64, sps_path=str(tmp_path / "sps.json")),
                 clock=lambda: now[0])
    cost = eng.ensure_cost()
    Q = 1 + eng.gamma
    sizes = list(cost.forward.sizes)
    assert sizes[-1] == 4 * Q and set(seen) == {(S, m) for S in (1, 2, 4) for m in ("off", "dspark")}
    for i, b in enumerate(sizes):
        S = min(s for s in delay if s * Q >= b)
        assert 1.0 / cost.forward.raw_sps[i] == pytest.approx(delay[S], abs=1e-9), (b, S)
    assert sorted(cost.draft_seconds) == [1, 2, 3, 4]  # every R up to max_num_seqs (R's bucket)
    assert all(v == pytest.approx(0.04, abs=1e-9) for v in cost.draft_seconds.values()), cost.draft_seconds
    assert StepCost.load(tmp_path / "sps.json").forward.sizes == cost.forward.sizes


@pytest.mark.slow
def test_in_process_generate_runs_the_engine_like_the_rank_group(tmp_path):
    """Item 5 of issue 13: `generate` without --world-size runs the serving Engine in this process
    (not the old torch.Generator loop), so the same request and seed give the ids of a W = 2 rank
    group: T = 0.8, --seed 7, models/v4flash-tiny, a shared SPS table (admission reads it)."""
    import re
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    sps = tmp_path / "sps.json"
    SPS.save(sps)
    common = ["--checkpoint", str(repo / "models" / "v4flash-tiny"), "--prompt", "Once upon a time",
              "--max-tokens", "12", "--temperature", "0.8", "--seed", "7", "--sps-path", str(sps), "--step-report"]
    local = _cli(common, repo)
    group = _cli(common + ["--world-size", "2"], repo)
    assert re.fullmatch(r"ids: \d+(,\d+){11}", local[-2]) and local[-2] == group[-2], (local[-2], group[-2])
    assert local[-1].startswith("step-report: decode_graph=eager world=1 ")
    assert group[-1].startswith("step-report: decode_graph=eager world=2 ")
    assert local[0] == group[0] and local[0].startswith("output_ids: ")


def test_processed_round_plans_round_trip():
    from v4flash_backend.group.worker import pack_round, unpack_round

    plan = RoundPlan(slot=[0, 3], start=[9, 20], pending=[5, 6], ell=[2, 0], top_k=[0, 40], seed=[7, 5], rnd=[1, 4],
                     budget=[8, 1], len_left=[50, 30], temperature=[0.8, 0.0], top_p=[0.95, 1.0],
                     stop_ids=[[1, -1], [2, 3]], spec_mode="fixed", fixed_len=5, sps=None,
                     n_out=[3, 1], min_tokens=[6, 0], frequency=[0.7, 0.0], presence=[0.0, -0.25])
    back = unpack_round(*pack_round(plan))
    assert back.processed and back.diff(plan) == []


@pytest.mark.slow
def test_rank_group_serves_logit_processing_in_the_rounds(tiny_model, golden_dir, tmp_path):
    """Through the rank group (W = 2, static path): penalties, min_tokens and log-probs in the
    rounds' processed variant (the penalty counts loaded on every rank with OP_COUNTS after the
    eager prefill step) give the in-process eager engine's tokens and log-probs exactly, with no
    decode step left to the eager path. With dspark_adaptive (the rounds' calibration, draft-cost
    and probe inputs broadcast in the round plan; a step cost where the golden checkpoint's random
    drafts do not pay): the same decisions as the eager engine, stepped-aside rounds included."""
    from v4flash_backend.group.rank_group import RankGroup

    sps_path = tmp_path / "sps.json"
    cost = StepCost(SPS, {1: 0.05})
    cost.save(sps_path)
    params = dict(max_tokens=16, temperature=0.8, seed=3, frequency_penalty=2.0, presence_penalty=1.5,
                  min_tokens=7, logprobs=2, stop_token_ids=[16, 265])
    adaptive = dict(dspark_adaptive=True, probe_every=3, step_cost_online=False)  # decisions on the given cost
    g = RankGroup.launch(Settings(checkpoint_dir=str(golden_dir), world_size=2, max_num_seqs=1, max_model_len=40,
                                  decode_graph="static", sps_path=str(sps_path), startup_timeout_s=600.0,
                                  **adaptive))
    try:
        evs = list(g.submit(PROMPT, params))
        st = g.stats()
    finally:
        g.shutdown(timeout=60)
    eng = Engine(LocalRunner(tiny_model, 2, 40), Settings(max_num_seqs=1, max_model_len=40, **adaptive))
    eng.cost = cost
    want = eng.run_request(GenerateRequest(prompt=list(PROMPT), **(params | {"stop_token_ids": (16, 265)})))
    assert [i for e in evs for i in e["token_ids"]] == [i for e in want for i in e.token_ids]
    assert [lp for e in evs for lp in e.get("logprobs") or []] == [lp for e in want for lp in e.logprobs or []]
    e = st["engine"]
    assert e["static_steps"] == e["decode_steps"] > 0 and e["static_fallback_steps"] == 0
    assert st["plans"]["set_counts"] >= 1
    kinds = e["decode_steps_by_kind"]
    assert kinds == eng.stats()["decode_steps_by_kind"] and kinds["aside"] > 0 and kinds["draft"] > 0, kinds
    assert e["graphs_per_step_by_kind"]["aside"] == 1 and e["host_syncs_per_step"] == 0


@pytest.mark.parametrize("processed", [False, True])
def test_round_result_reads_back_what_the_graphs_packed(processed):
    """The read-back's columns as the graphs write them (`pack_result`, `pack_logprobs`) read by
    `RoundResult` alone: committed tokens, counts, next ell, confidence logits (bit-exact) and the
    log-probs pack, for a G = 3 round and the plain-decode graph's G = 0 row width."""
    from v4flash_backend.engine.precision import loop_dtype
    from v4flash_backend.engine.round_plan import RoundResult, pack_logprobs, pack_result
    from v4flash_backend.engine.sampling import LOGPROB_WIDTH

    g = torch.Generator().manual_seed(5)
    for G in (3, 0):
        S = 2
        tokens = torch.tensor([[11, 12, 13, -1], [21, -1, -1, -1]])[:, :G + 1]
        committed, accepted = torch.tensor([min(3, G + 1), 1]), torch.tensor([min(2, G), 0])
        stopped, ell = torch.tensor([False, True]), torch.tensor([min(2, G), 0])
        conf = torch.randn(S, G, generator=g)
        out = pack_result(tokens, committed, accepted, stopped, ell, conf)
        tok_lp = -torch.rand(S * (G + 1), generator=g, dtype=torch.float64).to(loop_dtype())
        top_lp = -torch.rand(S * (G + 1), LOGPROB_WIDTH, generator=g, dtype=torch.float64).to(loop_dtype())
        top_ids = torch.randint(0, 500, (S * (G + 1), LOGPROB_WIDTH), generator=g)
        rank = torch.randint(1, 9, (S * (G + 1),), generator=g)
        if processed:
            out = torch.cat([out, pack_logprobs(tok_lp, rank, top_ids, top_lp, S)], 1)
        rows = RoundResult.rows(out.tolist(), processed)
        for i, r in enumerate(rows):
            assert r.G == G
            k = int(committed[i])
            assert r.tokens == tokens[i, :k].tolist() and r.committed == k
            assert (r.accepted, r.stopped, r.next_ell) == (int(accepted[i]), bool(stopped[i]), int(ell[i]))
            assert torch.equal(r.confidence(), conf[i].to(loop_dtype()).float())
            if processed:
                lps = r.logprobs(2)
                assert len(lps) == k
                for j, (lp, rk, alts) in enumerate(lps):
                    n = i * (G + 1) + j
                    assert lp == float(tok_lp[n]) and rk == int(rank[n])
                    assert alts == [[int(top_ids[n, a]), float(top_lp[n, a])] for a in range(2)]


@pytest.mark.slow
def test_reference_numerics_plain_round_traces_no_weight_dequant(golden_dir):
    """Under `reference` numerics the drafting round (1 + G rows a sequence) runs the MoE's
    per-expert loop and the 1-row plain round the routed form on the stacked experts: a server
    that primed only the drafting round traced the plain round with the stacks' dequantization
    inside (their e8m0 scales as graph inputs: inductor failed on the type, KeyError
    float8_e8m0fnu). Every graph such a runner compiles, drafting round first as a server warms
    them, takes only inputs inductor's C++ code generator has a type for (`exact` numerics: see
    test_compiled_round_is_fullgraph_and_serves_the_eager_tokens). A fresh model: the
    dequantized-weight caches key by weight, so a model another test ran would hide an unprimed
    form (~60 s: the traces of 3 graphs)."""
    from torch._inductor.codegen.cpp_utils import DTYPE_TO_CPP

    from v4flash_backend.model.loading import load_model

    ops.set_numerics("reference")
    sr = StaticRunner(load_model(golden_dir), 1, 40, settings=NeuronSettings(backend="eager"))
    with torch.inference_mode():
        sr.graphs.warm_up(None, mode="dspark", stop_width=STOP_WIDTH, processed=False)
        sr.warm_up_nodraft(None, stop_width=STOP_WIDTH, processed=False)
    assert sr.graphs.stats.graphs == 3  # verify and draft graphs, then the plain round
    dtypes = sr.graphs.stats.input_dtypes
    assert torch.float8_e8m0fnu not in dtypes and not dtypes - set(DTYPE_TO_CPP), dtypes
