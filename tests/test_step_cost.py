"""The real step cost (forward + draft stages + host work) and speculation that steps aside.

Decisions are checked on hand-built costs (deterministic; a profile taken on a shared CI machine
is not), the profile itself on its robustness rules, and the engine on the golden checkpoint,
whose random drafts are almost never accepted: there DSpark must stop paying for draft stages,
probe now and then, and stay lossless (greedy output equal to plain decoding)."""

from __future__ import annotations

import pytest
import torch

from v4flash_backend.engine.dspark_sched import SPSTable
from v4flash_backend.engine.engine import Engine
from v4flash_backend.engine.runner import LocalRunner
from v4flash_backend.engine.step_cost import (
    StepCost,
    drafting_pays,
    expected_survivals,
    interleaved_medians,
)
from v4flash_backend.request import GenerateRequest
from v4flash_backend.settings import Settings


def flat_cost(fwd_s=0.040, draft_s=0.010, top=64):
    return StepCost(SPSTable(list(range(1, top + 1)), [1.0 / fwd_s] * top), {1: draft_s, 8: draft_s * 2})


def test_drafting_pays_weighs_accepted_tokens_against_the_draft_stages():
    cost = flat_cost()  # a flat forward: verifying more rows is free, the draft stages are not
    assert drafting_pays(cost, [expected_survivals([0.9] * 5)]) == (True, 5)
    # plain: 1 token / 40 ms; drafting: (1 + 0.1 + ...) / 50 ms < 1 / 40 ms
    assert drafting_pays(cost, [expected_survivals([0.1] * 5)])[0] is False
    # break-even: 1 / 40 ms vs (1 + a) / 50 ms -> a = 0.25
    assert drafting_pays(cost, [[0.26] + [0.0] * 4])[0] and not drafting_pays(cost, [[0.24] + [0.0] * 4])[0]
    # a steep forward (compute-bound, large batch) makes extra rows expensive
    steep = StepCost(SPSTable([1, 8, 16, 48], [25.0, 20.0, 10.0, 3.0]), {8: 0.004})
    assert drafting_pays(steep, [expected_survivals([0.5] * 5)] * 8)[0] is False
    assert drafting_pays(flat_cost(), [])[0] is False


def test_draft_cost_lookup_and_round_trip(tmp_path):
    cost = StepCost(SPSTable([1, 4], [10.0, 8.0]), {1: 0.01, 4: 0.02, 8: 0.03}, replaced=[4])
    assert [cost.t_draft(r) for r in (0, 1, 3, 4, 8, 16)] == [0.0, 0.01, 0.01, 0.02, 0.03, 0.06]
    sps2 = cost.sps_for(2)(torch.tensor([4]))
    assert float(sps2) == pytest.approx(1 / (1 / 8.0 + 0.01))
    cost.save(tmp_path / "c.json")
    back = StepCost.load(tmp_path / "c.json")
    assert back.draft_seconds == cost.draft_seconds and back.forward.sps == cost.forward.sps
    SPSTable([1, 2], [3.0, 2.0]).save(tmp_path / "old.json")  # a forward-only table still loads
    assert StepCost.load(tmp_path / "old.json").t_draft(4) == 0.0


def test_profile_is_interleaved_and_robust_to_a_burst():
    calls = []
    clock_t = [0.0]

    def fn(b):
        calls.append(b)
        # 1 ms + 1 ms per token, and one burst of load on the 3rd call of size 8
        extra = 0.5 if (b == 8 and calls.count(8) == 3) else 0.0
        clock_t[0] += 0.001 + 0.001 * b + extra

    med = interleaved_medians(fn, [1, 8, 16], rounds=3, clock=lambda: clock_t[0])
    assert calls == [1, 8, 16] + [1, 8, 16] * 3  # warm-up, then round-robin
    assert med[8] == pytest.approx(0.009)  # the median ignores the burst


def _seq(max_tokens: int = 8):
    """A decoding request as the stepping-aside decision sees it (its evidence ages while aside)."""
    from v4flash_backend.engine.seq import Seq

    return Seq(req=GenerateRequest(prompt=[0, 1], max_tokens=max_tokens), slot=0, tokens=[0, 1])


def _engine(model, **kw):
    return Engine(LocalRunner(model, 3, 200), Settings(max_num_seqs=2, max_model_len=200, spec_mode="dspark", **kw))


def test_engine_steps_aside_when_drafts_are_not_accepted_and_stays_lossless(tiny_model):
    prompt = [0, 5, 6, 7, 8]
    plain = [t for e in _engine(tiny_model).run_request(
        GenerateRequest(prompt=prompt, max_tokens=60, ignore_eos=True)) for t in e.token_ids]
    # a probe every 8; deterministic decisions: the flat cost, not a profile or the learner's correction
    # of it from measured steps (both timed on a machine that may be loaded)
    eng = _engine(tiny_model, probe_every=8, probe_max_every=8, dspark_adaptive=True, step_cost_online=False)
    eng.cost = flat_cost()
    calls = []  # (forward computed taps?, ring rows written by the dspark call after it, drafted?)
    fwd, dsp = eng.runner.forward, eng.runner.dspark
    eng.runner.forward = lambda t, sp, rows, taps: (calls.append([taps, 0, False]), fwd(t, sp, rows, taps))[1]

    def dspark(writes, items):
        calls[-1][1] += sum(len(r) for _, r, _ in writes)
        calls[-1][2] = bool(items)
        return dsp(writes, items)

    eng.runner.dspark = dspark
    probes, real_draft = [], eng._draft

    def draft(writes, seqs, decision="draft"):  # a probe's block must renew the confidences the next decision reads
        real_draft(writes, seqs, decision)
        if decision == "probe":
            for s in seqs:
                c = eng.calib.cal.confidence(s.conf_logits[None], ["greedy"])
                probes.append((s.last_c, c[0].tolist()))

    eng._draft = draft
    ev = eng.run_request(GenerateRequest(prompt=prompt, max_tokens=60, ignore_eos=True))
    st = eng.stats()
    assert [t for e in ev for t in e.token_ids] == plain
    # the first blocks are drafted (no evidence yet), then the draft stages stop, probing every 8 steps
    assert st["draft_skipped"] > 30 and st["draft_probes"] >= 3 and st["accept_rate_at"][0] < 0.25
    # a step that steps aside costs what plain decoding costs: no taps, no ring writes, no draft stages
    # calls[0]: the prefill (its rows fill the ring); the last step drafts for nobody (the request ends)
    aside = [c for c in calls[1:-1] if not c[2]]
    assert len(aside) == st["draft_skipped"] and all(c == [False, 0, False] for c in aside)
    assert st["ring_rows_skipped"] >= len(aside) and calls[0][0] and calls[0][1] == len(prompt)
    assert len(probes) == st["draft_probes"] and all(a == pytest.approx(b) for a, b in probes)


def test_probe_gap_doubles_while_speculation_stays_aside_and_resets_when_drafting_pays(tiny_model):
    eng = _engine(tiny_model, probe_every=4, probe_max_every=16, dspark_adaptive=True)
    eng.cost = flat_cost(draft_s=0.0005)  # a probe costs 1/80 of a plain step: no floor on the gap
    rate = [0.0]
    eng._expected_survivals = lambda s: [rate[0]] * eng.gamma  # every draft rejected: drafting never pays
    decide = [eng._drafting_decision([_seq()]) for _ in range(60)]
    probes = [i for i, d in enumerate(decide) if d == "probe"]
    assert set(decide) == {"skip", "probe"}
    # the 4th decision probes, then every 8th, every 16th, and every 16th again (the cap)
    assert [b - a for a, b in zip([-1] + probes, probes)] == [4, 8, 16, 16, 16], probes
    rate[0] = 1.0  # drafts accepted: drafting pays, and the gap is back to probe_every
    assert eng._drafting_decision([_seq()]) == "draft"
    rate[0] = 0.0
    assert [eng._drafting_decision([_seq()]) for _ in range(4)] == ["skip"] * 3 + ["probe"]


@pytest.mark.parametrize("max_every,gaps", [(1024, [600] * 8 + [1024] * 2), (64, [64] * 7)])
def test_probes_take_at_most_their_share_of_plain_decoding(tiny_model, max_every, gaps):
    """Where a probe's draft stages cost 3 plain steps (the compiled CPU path's draft round) and the
    round verifying its drafts as much again, stepping aside probes no more often than every
    2 x 3 / PROBE_SHARE = 600 steps (then the doubled gap, up to probe_max_every, which also caps the
    floor): probing costs at most 1 % of plain decoding's time. Dropping the floor (a probe every 4, 8,
    16, ... steps), pricing the probe's round alone (every 300) or the old 3 % share (every 200) fails
    here."""
    eng = _engine(tiny_model, probe_every=4, probe_max_every=max_every, dspark_adaptive=True)
    eng.cost = flat_cost(fwd_s=0.010, draft_s=0.030)
    assert eng._probe_floor(1) == min(600, max_every)
    eng._expected_survivals = lambda s: [0.0] * eng.gamma  # drafting never pays
    decide = [eng._drafting_decision([_seq()]) for _ in range(sum(gaps))]
    probes = [i for i, d in enumerate(decide) if d == "probe"]
    assert [b - a for a, b in zip([-1] + probes, probes)] == gaps, probes
    # the default back-off cap leaves the floor in charge
    assert Settings().probe_max_every >= 600


def test_engine_keeps_drafting_where_drafts_are_accepted():
    from pathlib import Path

    from v4flash_backend import ops
    from v4flash_backend.model.loading import load_model

    ops.set_numerics("exact")
    model = load_model(Path(__file__).resolve().parents[1] / "models" / "v4flash-tiny")
    eng = _engine(model, dspark_adaptive=True)
    eng.cost = flat_cost()
    ev = eng.run_request(GenerateRequest(prompt=[0, 263, 1180, 11, 437, 13], max_tokens=40, ignore_eos=True))
    st = eng.stats()
    assert st["draft_skipped"] == 0 and st["tau"] > 2.0 and len([t for e in ev for t in e.token_ids]) == 40


# ---- dspark_adaptive on the static decode rounds (trn2 path) -----------------------------------------
# deterministic decisions, shared by both modes (at most 16 table entries: the static rounds' SPS input
# is fixed-width): a flat 40 ms forward with drafting at 10-20 ms, where drafting pays only for drafts
# that are accepted; and a forward that slows down with B, where admission weighs each draft's survival
FLAT = StepCost(SPSTable([1, 2, 4, 8, 16, 32], [25.0] * 6), {1: 0.010, 8: 0.020})
STEEP = StepCost(SPSTable([1, 2, 4, 8, 16, 32], [25.0, 24.5, 23.0, 19.0, 12.0, 6.0]), {1: 0.004, 8: 0.008})


def _serve_batch(runner, reqs, cost, **kw):
    """Requests of different lengths and temperatures decoded together (submitted together, so
    every decode step is a round on a static runner); returns (tokens per request, stats, engine)."""
    # step_cost_online off: the two engines' decisions must not follow their own (different) step timings
    eng = Engine(runner, Settings(max_num_seqs=3, max_model_len=96, spec_mode="dspark", dspark_adaptive=True,
                                  step_cost_online=False, **kw))
    eng.cost = cost
    outs = {}
    for i, (prompt, k, t, seed, *more) in enumerate(reqs):
        eng.submit(GenerateRequest(prompt=prompt, max_tokens=k, temperature=t, seed=seed, ignore_eos=True,
                                   **(more[0] if more else {}),
                                   callback=lambda e, i=i: outs.setdefault(i, []).extend(e.token_ids)))
    rings = []  # after each step, the DSpark rings of the requests still running
    while eng.has_work():
        eng.step()
        rings.append({(s.slot, k): r[s.slot].clone() for s in eng.running for k, r in runner.state.dspark.items()})
    eng.rings = rings
    return outs, eng.stats(), eng


def _check_static_equals_eager(model, reqs, cost, **kw):
    """dspark_adaptive through the static rounds (op by op) against eager steps: the same tokens,
    the same decisions (drafted / stepped aside / probed), the same admitted and accepted drafts and
    the same blocks observed by the online calibration (their confidence logits bit for bit), the
    same DSpark ring contents after every step (a stepped-aside round writes no ring rows); 1 graph per stepped-aside
    round, 2 per drafting one, no host sync. Exact numerics: equality, no tolerance."""
    from v4flash_backend.trn2.launch import NeuronSettings
    from v4flash_backend.trn2.static_runner import StaticRunner

    want, est, eeng = _serve_batch(LocalRunner(model, 4, 96), reqs, cost, **kw)
    sr = StaticRunner(model, 3, 96, settings=NeuronSettings(backend="none"))
    got, st, seng = _serve_batch(sr, reqs, cost, **kw)
    assert got == want and all(len(got[i]) == r[1] for i, r in enumerate(reqs))
    assert st["static_steps"] == st["decode_steps"] == est["decode_steps"] > 0
    for k in ("drafted", "admitted", "accepted", "draft_skipped", "draft_probes", "ring_rows_skipped",
              "decode_steps_by_kind"):
        assert st[k] == est[k], k
    for reg in ("greedy", "sampled"):
        for a, b in zip(seng.calib.observations(reg), eeng.calib.observations(reg)):
            assert torch.equal(a, b), reg
    assert st["calibration"] == est["calibration"]
    assert len(seng.rings) == len(eeng.rings)
    for a, b in zip(seng.rings, eeng.rings):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    by_kind = st["graphs_per_step_by_kind"]
    assert st["host_syncs_per_step"] == 0
    assert all(by_kind[k] == n for k, n in (("draft", 2), ("probe", 2), ("aside", 1))
               if st["decode_steps_by_kind"][k])
    return st


def test_static_rounds_step_aside_like_eager_steps(tiny_model):
    """The golden checkpoint's random drafts are almost never accepted: after the first blocks both
    modes step aside (the static round: graph 1 alone) and probe every 4 steps, alike."""
    st = _check_static_equals_eager(tiny_model, [([0, 5, 6, 7, 8], 36, 0.0, None),
                                                 ([0, 17, 230, 5, 99, 41], 24, 0.8, 7)], FLAT, probe_every=4,
                                    probe_max_every=4)  # (which caps the probes' cost floor too)
    kinds = st["decode_steps_by_kind"]
    assert kinds["aside"] >= 8 and kinds["probe"] >= 2 and kinds["draft"] >= 1, kinds
    # a stepped-aside round with nothing left to verify runs the 1-row plain-decode graph
    assert st["plain_decode_rounds"] > 0


def test_static_rounds_keep_drafting_like_eager_steps():
    """models/v4flash-tiny's drafts are accepted and it ships a calibration (temperatures and shifts
    far from identity): both modes keep drafting (at most one step aside), admitting by the calibrated
    survivals (a forward that slows down with B: admission stops where a draft's survival does not pay
    for its row). The third request samples with min_tokens over its whole output and stop ids the
    model emits often (16, 265, 289: the target and the drafts put mass on them), so the drafting's
    min_tokens mask changes q: a draft graph without it commits other tokens than the eager engine."""
    from pathlib import Path

    from v4flash_backend import ops
    from v4flash_backend.model.loading import load_model

    ops.set_numerics("exact")
    ckpt = Path(__file__).resolve().parents[1] / "models" / "v4flash-tiny"
    st = _check_static_equals_eager(load_model(ckpt), [([0, 263, 1180, 11, 437, 13], 24, 0.0, None),
                                                       ([0, 263, 1180, 11], 16, 0.8, 3),
                                                       ([0, 263, 1180, 11, 437], 16, 0.8, 5,
                                                        dict(min_tokens=16, stop_token_ids=(16, 265, 289)))], STEEP,
                                    checkpoint_dir=str(ckpt))
    # the stages retrained on more data (issue 14) step aside once here, at T = 0.8 under the steep
    # cost; that decision, like every other, is the eager engine's too (checked above)
    kinds = st["decode_steps_by_kind"]
    assert st["draft_skipped"] == 0 and kinds["draft"] >= st["decode_steps"] - 1 and kinds["probe"] == 0
    assert 0 < st["admitted"] < st["drafted"] and st["tau"] > 1.5  # admission chose, not all-or-nothing


# ---- the eager profile by sequences and the stepping-aside estimate ---------------------------------
def test_seq_model_fit_recovers_the_step_and_leaves_a_burst_out():
    """t = a + s R + b B from medians over (R, B); one burst of load (3x) is left out, not averaged
    into the row cost; a negative slope is refitted as 0 (more rows never make a forward faster)."""
    from v4flash_backend.engine.step_cost import fit_seq_model

    a, s, b = 0.030, 0.009, 0.0012
    pts = {(R, R * k): a + s * R + b * R * k for R in (1, 2, 4, 8) for k in (1, 2, 4, 6)}
    pts[(4, 16)] *= 3.0
    (fa, fs, fb), dropped = fit_seq_model(pts)
    assert dropped == [(4, 16)]
    assert (fa, fs, fb) == pytest.approx((a, s, b), rel=1e-6)
    (_, _, fb), _ = fit_seq_model({(R, R * k): 0.05 + 0.01 * R - 1e-4 * R * k for R in (1, 2, 4) for k in (1, 3)})
    assert fb == 0.0
    # one R profiled (max_num_seqs 1): R's share is the intercept's, the row cost is still found
    (fa, fs, fb), _ = fit_seq_model({(1, k): 0.045 + 0.0015 * k for k in (1, 2, 4, 6)})
    assert (fa + fs, fb) == pytest.approx((0.045, 0.0015), rel=1e-6)


def test_cost_by_sequences_interpolates_in_R_and_round_trips(tmp_path):
    """An eager forward of B tokens costs more over more sequences: t_forward(B, R) reads R's table,
    interpolates between profiled R, and drafting_pays / sps_for use it (a cost that ignored R
    would price 8 sequences x 1 row as one sequence of 8 rows)."""
    def tab(R):
        return SPSTable([R, 2 * R, 6 * R], [1 / (0.03 + 0.01 * R + 0.001 * B) for B in (R, 2 * R, 6 * R)],
                        interpolate=True)

    cost = StepCost(tab(1), {1: 0.01, 8: 0.02}, by_seqs={1: tab(1), 4: tab(4), 8: tab(8)})
    assert cost.t_forward(8, 8) == pytest.approx(0.03 + 0.08 + 0.008)
    assert cost.t_forward(8, 1) < cost.t_forward(8, 8)
    assert cost.t_forward(12, 6) == pytest.approx((0.03 + 0.04 + 0.012 + 0.03 + 0.08 + 0.012) / 2)
    assert float(cost.sps_for(8)(torch.tensor([16]))) == pytest.approx(1 / (0.03 + 0.08 + 0.016 + 0.02))
    cost.save(tmp_path / "c.json")
    back = StepCost.load(tmp_path / "c.json")
    assert back.t_forward(12, 6) == pytest.approx(cost.t_forward(12, 6)) and sorted(back.by_seqs) == [1, 4, 8]
    # drafting_pays prices plain decoding of 8 sequences at R = 8's cost
    surv = [expected_survivals([0.6] * 5)] * 8
    plain = 8 / cost.t_forward(8, 8)
    _, ell = drafting_pays(cost, surv)
    rate = sum(1 + sum(a[:ell]) for a in surv) / (cost.t_forward(8 * (1 + ell), 8) + cost.t_draft(8))
    assert rate > plain


def test_stepping_aside_estimate_follows_the_requests_own_blocks(tiny_model):
    """A request's expected survivals: its regime's rate as a prior of 4 blocks, then its blocks
    with decay 0.75. One block whose head is unsure does not make a request with a good record
    step aside (the last block's survivals alone did: 191 of 290 steps stepped aside at batch 1 on
    the embedded model); blocks admit keeps declining pull the estimate down, so a request the head
    keeps doubting stops paying for the draft stages; verified outcomes count as they fell."""
    from v4flash_backend.engine.seq import Seq

    eng = _engine(tiny_model, dspark_adaptive=True)
    G = eng.gamma
    for n_acc in [0] * 8 + [1] * 4 + [2] * 2 + [3, 5]:  # the regime's window: each draft accepted half the time
        eng.calib.observe("greedy", torch.zeros(G), G, n_acc)
    prior = eng.calib.acceptance_rates("greedy")
    assert prior == [0.5] * G
    cost = flat_cost(draft_s=0.028)  # 40 ms forward, 28 ms drafting: pays when the survivals sum > 0.7
    s = Seq(req=GenerateRequest(prompt=[0, 1], max_tokens=8), slot=0, tokens=[0, 1])
    assert eng._expected_survivals(s) == pytest.approx(expected_survivals(prior))
    for _ in range(6):  # six blocks, every admitted draft accepted
        s.ell, s.last_c, s.conf_logits = G, [0.9] * G, torch.zeros(G)
        eng._account_verify(s, G)
    good = eng._expected_survivals(s)
    assert good[0] > 0.7 and drafting_pays(cost, [good])[0]
    s.ell, s.last_c = 0, [0.05] * G  # one block admit declined: counted in expectation
    eng._account_verify(s, 0)
    one_bad = eng._expected_survivals(s)
    assert 0.55 < one_bad[0] < good[0] and drafting_pays(cost, [one_bad])[0]
    for _ in range(8):
        eng._account_verify(s, 0)
    doubted = eng._expected_survivals(s)
    assert doubted[0] < 0.35 and not drafting_pays(cost, [doubted])[0]
    # verified outcomes: draft 0 accepted, draft 1 rejected -> position 1 reached, not accepted;
    # positions 2.. not reached (no evidence)
    t = Seq(req=GenerateRequest(prompt=[0, 1], max_tokens=8), slot=1, tokens=[0, 1])
    t.ell, t.last_c, t.conf_logits = 3, [0.5] * G, torch.zeros(G)
    eng._account_verify(t, 1)
    assert t.ev_trials == [1.0, 1.0, 0.0, 0.0, 0.0] and t.ev_hits == [1.0, 0.0, 0.0, 0.0, 0.0]
    # every verified draft accepted: the unverified ones count with the head's calibrated chances
    u = Seq(req=GenerateRequest(prompt=[0, 1], max_tokens=8), slot=2, tokens=[0, 1])
    u.ell, u.last_c, u.conf_logits = 2, [0.5, 0.5, 0.8, 0.5, 0.4], torch.zeros(G)
    eng._account_verify(u, 2)
    assert u.ev_trials == pytest.approx([1, 1, 1, 0.8, 0.4]) and u.ev_hits == pytest.approx([1, 1, 0.8, 0.4, 0.16])


def _rejected_twice(eng):
    """A request whose two verified blocks (3 drafts each) had their first draft rejected."""
    G = eng.gamma
    s = _seq(max_tokens=64)
    for _ in range(2):
        s.ell, s.last_c, s.conf_logits = 3, [0.5] * G, torch.zeros(G)
        eng._account_verify(s, 0)
    return s


@pytest.mark.parametrize("regime_rate,first_draft", [(0.97, 48), (0.9, None), (0.3, None)])
def test_a_request_aside_ages_its_evidence_back_to_the_regime(tiny_model, regime_rate, first_draft):
    """A request whose two verified blocks had their first draft rejected steps aside (flat 10 ms
    forward, 35 ms draft stages: drafting pays above 4.5 expected tokens a step; its own blocks put
    draft 0 at 4 r / (4 + 1.75), 4.18 tokens at r = 0.97). Stepping aside verifies nothing, so its
    evidence ages instead, EVIDENCE_DECAY for every 1 + G steps aside. Resuming must pay for its
    first step, which verifies nothing (drafting_pays' resume_blocks: 4 blocks here, the request has
    64 tokens left): (1 + 4 x tokens) / (45 + 4 x 45 ms) >= 1 / 10 ms needs 5.375 tokens. Where the
    regime's drafts are accepted at 0.97 (5.56 tokens at most) it drafts again once the weight is
    below 0.1 (8 blocks' worth: the 49th decision); at 0.9 (4.69 tokens at most) drafting would
    pay once under way but not the step that resumes it, so it stays aside; at 0.3 it stays aside.
    Without the aging (the deliberate mistake: _age = 1) it never drafts again; a probe is ~600
    steps away, longer than most requests. A verified block then folds the aging into its counts."""
    eng = _engine(tiny_model, probe_every=1000, probe_max_every=1000, dspark_adaptive=True)
    eng.cost = flat_cost(fwd_s=0.010, draft_s=0.035)
    G = eng.gamma
    eng.calib.acceptance_rates = lambda reg, min_rows=8, fallback=None: [regime_rate] * G
    s = _rejected_twice(eng)
    assert s.ev_trials == [1.75] + [0.0] * (G - 1) and s.aside == 0
    decide = [eng._drafting_decision([s]) for _ in range(60)]
    drafts = [i for i, d in enumerate(decide) if d == "draft"]
    assert (drafts[0] if drafts else None) == first_draft, decide
    if first_draft is not None:
        assert s.aside == first_draft and set(decide[:first_draft]) == {"skip"}
        s.ell, s.last_c, s.conf_logits = 2, [0.5] * G, torch.zeros(G)
        eng._account_verify(s, 2)  # aged by 0.75 ** 8, decayed by 0.75, then this block's counts
        assert s.aside == 0 and s.ev_trials[0] == pytest.approx(1.75 * 0.75 ** 9 + 1.0)


def test_resuming_after_a_step_aside_pays_for_its_first_step(tiny_model, monkeypatch):
    """The first drafting step after a stretch aside verifies nothing (the request has no block
    yet): on the compiled path it costs a whole drafting round (~13.6 ms against ~3.7 ms plain) for
    one token. At break-even that made DSpark switch back and forth (138 switches in 3 bench rounds,
    unseen code, batch 1, T = 0) and lose ~4-5 %. Flat 10 ms forward, 35 ms draft stages, regime
    at 0.9: once drafting it keeps drafting (4.69 tokens a step pays above 4.5), but after a step
    aside it does not resume (the stretch's first step needs 5.375 tokens a block over 4 blocks);
    where the request has only one block's worth of tokens left the bar is higher still (1 block:
    (1 + tokens) / 90 ms needs 8 tokens) and a regime at 0.97 stays aside there too. A new request
    is priced ordinarily (its first step verifies nothing under any policy). The deliberate
    mistake, pricing the resuming step as an ordinary drafting step (resume_blocks 0), drafts again
    at the 49th decision (3.6 / (4 + 1.75 w) reaches 0.855, 4.5 tokens)."""
    eng = _engine(tiny_model, probe_every=1000, probe_max_every=1000, dspark_adaptive=True)
    eng.cost = flat_cost(fwd_s=0.010, draft_s=0.035)
    G = eng.gamma
    rate = [0.9]
    eng.calib.acceptance_rates = lambda reg, min_rows=8, fallback=None: [rate[0]] * G
    s = _seq(max_tokens=64)
    assert [eng._drafting_decision([s]) for _ in range(5)] == ["draft"] * 5  # under way: no resume
    assert drafting_pays(eng.cost, [expected_survivals([0.9] * G)], resume_blocks=4)[0] is False
    assert drafting_pays(eng.cost, [expected_survivals([0.97] * G)], resume_blocks=4)[0] is True
    assert drafting_pays(eng.cost, [expected_survivals([0.97] * G)], resume_blocks=1)[0] is False

    def aside_then_decide(n=60):
        t = _rejected_twice(eng)
        return t, [eng._drafting_decision([t]) for _ in range(n)]

    _, decide = aside_then_decide()
    assert "draft" not in decide, decide
    # a new request (nothing verified, never aside) pays its first drafting step whatever the step
    # before did: it is priced as fixed-length drafting prices it, ordinarily, so it drafts; priced
    # as a resume (the mistake) a regime whose early blocks went badly stayed aside for good
    fresh = _seq(max_tokens=64)
    assert eng._skipped > 0 and eng._resume_blocks([fresh]) == 0 and eng._drafting_decision([fresh]) == "draft"
    assert drafting_pays(eng.cost, [eng._expected_survivals(_seq(max_tokens=64))], resume_blocks=4)[0] is False
    rate[0] = 0.97  # a regime that pays by a margin resumes ...
    t, decide = aside_then_decide()
    assert decide.index("draft") == 48, decide
    eng._drafting_decision([t])  # (drafting again: the next verdict is an ordinary one)
    eng._skipped = 1  # ... but not with one block's worth of tokens left
    t.n_out = 58
    assert eng._resume_blocks([t]) == 1 and eng._drafting_decision([t]) == "skip"
    rate[0] = 0.9
    monkeypatch.setattr(eng, "_resume_blocks", lambda seqs: 0)
    _, decide = aside_then_decide()
    assert decide.index("draft") == 48, decide


def test_a_new_engine_explores_until_its_regime_has_verified_blocks(tiny_model):
    """A new engine's prior for a regime is 1 (draft) until its calibration window holds verified
    blocks, whatever the head's calibrated confidences say; then the observed acceptance decides.
    The head can be less sure than the drafts are good (on the compiled path at batch 1, T = 0, the
    first block's c put drafting below break-even while drafts were accepted at 0.87-0.96): a prior
    taken from the calibrated c (the deliberate mistake: the mean c of the drafted blocks, the old
    prior) keeps the regime aside before anything is verified, and nothing ever is. Flat 10 ms
    forward, 30 ms draft stages: drafting pays above 4 expected tokens a step."""
    eng = _engine(tiny_model, dspark_adaptive=True)
    eng.cost = flat_cost(fwd_s=0.010, draft_s=0.030)
    G = eng.gamma
    s = _seq(max_tokens=64)
    logit = float(torch.logit(torch.tensor(0.3)))
    eng._calibrated([s], torch.full((1, G), logit))  # a pessimistic head (no calibration shipped)
    assert s.last_c == pytest.approx([0.3] * G, rel=1e-5)
    assert eng._expected_survivals(s) == [1.0] * G and eng._drafting_decision([s]) == "draft"
    for _ in range(8):  # 8 blocks verified, 0.9 of the drafts accepted a position on average
        eng.calib.observe("greedy", torch.zeros(G), G, G)
    eng.calib.observe("greedy", torch.zeros(G), G, 0)
    t = _seq(max_tokens=64)  # a second request of the regime: its prior, no evidence of its own
    assert eng._expected_survivals(t)[0] == pytest.approx(8 / 9) and eng._drafting_decision([t]) == "draft"
    # where the observed drafts are rejected, the regime steps aside
    for _ in range(40):
        eng.calib.observe("greedy", torch.zeros(G), G, 0)
    assert eng._expected_survivals(t)[0] < 0.2 and eng._drafting_decision([t]) == "skip"


def test_scalar_lookup_equals_the_tensor_lookup():
    """SPSTable.lookup of an int (the per-step decision's path, Python floats) returns the same
    float64 as the tensor path admit uses, bit for bit, in and beyond the profiled sizes."""
    import random

    rnd = random.Random(1)
    for _ in range(100):
        for interp in (True, False):
            sizes = sorted(rnd.sample(range(1, 80), rnd.randint(1, 8)))
            t = SPSTable(sizes, [rnd.uniform(1, 60) for _ in sizes], interpolate=interp)
            bs = list(range(0, 160))
            assert [t.lookup(b) for b in bs] == t.lookup(torch.tensor(bs)).tolist()
