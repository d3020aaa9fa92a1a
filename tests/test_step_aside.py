"""A step that steps aside is the plain step: the same round plan and graph inputs, the same graph, no
taps, no ring writes, no draft stages -- on the static rounds and on eager steps, the prefill included.

DSpark engines here are forced aside from their first decision (every draft expected rejected, no
probe within the request), and each is compared step by step with a plain engine (spec_mode off)
serving the same greedy request: exact numerics, so both commit the same tokens and every step
lines up. Adding an input to a stepped-aside round (the SPS table, dspark_adaptive's admission
inputs), a tap or a ring write to its prefill fails here."""

from __future__ import annotations

from dataclasses import fields

import torch

from v4flash_backend.engine.dspark_sched import SPSTable
from v4flash_backend.engine.engine import Engine
from v4flash_backend.engine.runner import LocalRunner
from v4flash_backend.engine.seq import Seq
from v4flash_backend.engine.step_cost import StepCost
from v4flash_backend.request import GenerateRequest
from v4flash_backend.settings import Settings

COST = StepCost(SPSTable([1, 2, 4, 8], [25.0] * 4), {1: 0.010, 2: 0.015})
PROMPT = [0, 5, 6, 7, 8, 9, 10]


def _engine(runner, spec_mode: str) -> Engine:
    eng = Engine(runner, Settings(max_num_seqs=2, max_model_len=64, spec_mode=spec_mode, dspark_adaptive=True,
                                  step_cost_online=True, prefix_cache_bytes=0, probe_max_every=64))
    eng.cost = COST
    if spec_mode == "dspark":
        eng._expected_survivals = lambda s: [0.0] * eng.gamma  # drafting never pays: aside from the start
        eng._probe_floor = lambda R: 10 ** 6  # and no probe within the request
    return eng


def _spy(runner) -> dict:
    """Record what the engine hands the runner: forwards (taps asked?), DSpark calls, round plans with
    the graph inputs they pad to and the graph executions they take."""
    log = {"forward_taps": [], "dspark": [], "rounds": []}
    fwd, dsp = runner.forward, runner.dspark
    runner.forward = lambda t, sp, rows, taps: (log["forward_taps"].append(bool(taps)), fwd(t, sp, rows, taps))[1]
    runner.dspark = lambda writes, items: (log["dspark"].append((len(writes), len(items))), dsp(writes, items))[1]
    if hasattr(runner, "decode_round"):
        dr = runner.decode_round

        def decode_round(plan):
            _, x = runner.round_inputs(plan)
            before = (runner.graphs.executions, runner.ngraphs.executions)
            out = dr(plan)
            ran = (runner.graphs.executions - before[0], runner.ngraphs.executions - before[1])
            log["rounds"].append((plan, {k: v.clone() for k, v in x.items()}, ran))
            return out

        runner.decode_round = decode_round
    return log


def _serve(runner, spec_mode: str, max_tokens: int = 20):
    eng = _engine(runner, spec_mode)
    log = _spy(runner)
    ev = eng.run_request(GenerateRequest(prompt=PROMPT, max_tokens=max_tokens, ignore_eos=True, seed=3))
    return [t for e in ev for t in e.token_ids], log, eng.stats()


def test_a_stepped_aside_round_is_the_plain_round(tiny_model):
    from v4flash_backend.trn2.launch import NeuronSettings
    from v4flash_backend.trn2.static_runner import StaticRunner

    def runner():
        return StaticRunner(tiny_model, 2, 64, settings=NeuronSettings(backend="none"), count_host_syncs=False)

    plain, plog, _ = _serve(runner(), "off")
    got, log, st = _serve(runner(), "dspark")
    assert got == plain and st["draft_skipped"] == len(log["rounds"]) and st["draft_probes"] == 0
    assert len(log["rounds"]) == len(plog["rounds"]) == st["static_steps"] > 10
    for (p, x, ran), (pp, px, pran) in zip(log["rounds"], plog["rounds"]):
        # the same plan (spec mode off, no SPS table, no admission inputs), the same graph inputs
        assert [f.name for f in fields(p) if getattr(p, f.name) != getattr(pp, f.name)] == []
        assert x.keys() == px.keys() and all(torch.equal(x[k], px[k]) for k in x)
        assert ran == pran == (0, 1)  # one graph: the bucket's 1-row plain-decode round
    # the prefill (an eager forward here) asks no taps and writes no ring row; no draft stage runs
    assert log["forward_taps"] == plog["forward_taps"] == [False] and log["dspark"] == []


def test_a_stepped_aside_eager_step_is_the_plain_step(tiny_model):
    plain, plog, _ = _serve(LocalRunner(tiny_model, 3, 64), "off")
    got, log, st = _serve(LocalRunner(tiny_model, 3, 64), "dspark")
    assert got == plain and st["draft_skipped"] == len(plain) - 1 and st["ring_rows_skipped"] > len(PROMPT)
    # every forward (the prefill's and each decode step's) without taps; no ring writes, no draft stages
    assert log["forward_taps"] == plog["forward_taps"] == [False] * len(plain)
    assert log["dspark"] == []


def test_the_stepping_aside_verdict_is_priced_once_while_its_inputs_stand(tiny_model, monkeypatch):
    """While speculation stays aside the decision's inputs do not move (the same learned-cost object,
    the same expected survivals): `drafting_pays` runs twice (under way, then resuming: after a step
    aside the verdict prices the resuming step), not every step; new inputs price again."""
    from v4flash_backend.engine import adaptive

    calls = []
    real = adaptive.drafting_pays
    monkeypatch.setattr(adaptive, "drafting_pays", lambda c, s, **kw: (calls.append(1), real(c, s, **kw))[1])
    eng = _engine(LocalRunner(tiny_model, 3, 64), "dspark")
    seqs = [Seq(req=GenerateRequest(prompt=[0, 1], max_tokens=8), slot=0, tokens=[0, 1])]
    assert [eng._drafting_decision(seqs) for _ in range(20)] == ["skip"] * 20 and len(calls) == 2
    eng._expected_survivals = lambda s: [1.0] * eng.gamma  # every draft accepted: priced again, and it pays
    seqs[0].last_c = [0.5] * eng.gamma
    eng._observe_block(seqs[0], 0)  # (the request's evidence moved: a verified block)
    assert eng._drafting_decision(seqs) == "draft" and len(calls) == 3
    eng.cost = StepCost(SPSTable([1, 2, 4, 8], [25.0] * 4), {1: 1.0})  # a new cost: priced again (drafts 1 s)
    assert eng._drafting_decision(seqs) == "skip" and len(calls) == 4


def test_a_step_aside_decides_again_only_when_the_verdicts_inputs_move(tiny_model):
    """While the verdict's inputs stand still a step aside prices nothing (no survivals, no step
    cost); each input moving decides again: the regime's observed acceptance (the calibration's
    blocks), the request's own evidence (a verified block), its age in whole blocks, the learner's
    version, the step cost. Leaving any of them out of `_aside_inputs` fails here; the regime's
    acceptance turning good must also turn the verdict (real survivals, not stand-ins)."""
    eng = Engine(LocalRunner(tiny_model, 3, 64), Settings(
        max_num_seqs=2, max_model_len=64, spec_mode="dspark", dspark_adaptive=True, step_cost_online=True,
        prefix_cache_bytes=0, probe_max_every=64))
    eng.cost = COST
    eng._probe_floor = lambda R: 10 ** 6
    G = eng.gamma
    for _ in range(16):  # the greedy regime's blocks: the first draft rejected every time
        eng.calib.observe("greedy", torch.zeros(G), G, 0)
    priced = []
    real = eng._expected_survivals
    eng._expected_survivals = lambda s: (priced.append(1), real(s))[1]
    s = Seq(req=GenerateRequest(prompt=[0, 1], max_tokens=40), slot=0, tokens=[0, 1])
    seqs = [s]

    def decide(n: int) -> tuple[list[str], int]:
        before = len(priced)
        return [eng._drafting_decision(seqs) for _ in range(n)], len(priced) - before

    assert decide(1) == (["skip"], 1)  # under way
    s.last_c = [0.5] * G
    eng._observe_block(s, 0)  # the request's own evidence: a verified block (nothing else moved)
    assert decide(1) == (["skip"], 1)
    assert decide(1) == (["skip"], 1)  # resuming after a step aside is priced apart
    assert decide(G - 1) == (["skip"] * (G - 1), 0)  # nothing moved: the same whole-block age
    assert decide(1) == (["skip"], 1)  # its evidence one block older
    eng.learner.version += 1  # the learner refreshed (its view is a new cost)
    assert decide(1) == (["skip"], 1)
    eng.cost = StepCost(SPSTable([1, 2, 4, 8], [25.0] * 4), {1: 0.010, 2: 0.015})  # a new profile
    assert decide(1) == (["skip"], 1)
    for _ in range(400):  # the regime's blocks now accepted in full: decided again, and drafting pays
        eng.calib.observe("greedy", torch.zeros(G), G, G)
    assert decide(1) == (["draft"], 1)
