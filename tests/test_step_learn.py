"""The step cost learned from the engine's own steps (engine/step_learn.py) and the fixed-length
guard (engine/fixed_guard.py), issue 32.

Timing is never read from the wall clock here: the learner's unit tests feed it seconds, and the
engine tests run on an injected clock (`Engine(clock=)`) that only stand-ins of the runner's forward
and draft stages advance, by a known cost per call. So the expected values are that known cost, not
anything the code under test computed, and machine load cannot move them."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch

from v4flash_backend.engine.dspark_sched import SPSTable
from v4flash_backend.engine.engine import Engine
from v4flash_backend.engine.fixed_guard import FixedGuard, fixed_tokens
from v4flash_backend.engine.runner import LocalRunner
from v4flash_backend.engine.step_cost import StepCost
from v4flash_backend.engine.step_learn import LearnedStepCost, StepCostLearner
from v4flash_backend.request import GenerateRequest
from v4flash_backend.settings import Settings

REPO = Path(__file__).resolve().parents[1]
EMBEDDED = REPO / "models" / "v4flash-tiny"


def true_step(B: int, R: int) -> float:
    """The 'machine': 10 ms + 0.5 ms a verify row, + 6 ms when the step drafts."""
    return 0.010 + 0.0005 * B + (0.006 if R else 0.0)


def prior_off(factor: float = 2.0) -> StepCost:
    """A start-up profile `factor` x the machine (taken under load): forward and draft seconds."""
    sizes = list(range(1, 49))
    return StepCost(SPSTable(sizes, [1.0 / (factor * (0.010 + 0.0005 * b)) for b in sizes]),
                    {1: factor * 0.006})


def test_learned_cost_recovers_a_profile_2x_off_in_the_cells_it_saw_and_beyond():
    """Steps at B = 6..12 measured at the machine's cost: the learned t_step matches the machine
    there (tolerance 1e-9 s: exact sums), and beyond the cells the outermost ratio scales the prior
    (the machine is exactly 0.5 x the prior: exact there too); the prior is left as it was."""
    prior = prior_off()
    lr = StepCostLearner(window=64, floor=8)
    for i in range(120):
        B = 6 + i % 7
        lr.observe("eager", B, 1, 1, true_step(B, 1), prior)
    v = lr.view(prior, "eager")
    assert isinstance(v, LearnedStepCost)
    for B in range(6, 13):
        assert v.t_step(B, 1, 1) == pytest.approx(true_step(B, 1), abs=1e-9), B
    for B in (1, 3, 30, 48):  # outside the observed cells
        assert v.t_step(B, 1, 1) == pytest.approx(true_step(B, 1), abs=1e-9), B
    assert prior.t_step(8, 1, 1) == pytest.approx(2 * true_step(8, 1))
    # admission reads it: the static form (forward table + draft seconds) prices the learned step
    sps = v.sps_for(1)
    assert float(sps(torch.tensor([8]))) == pytest.approx(1.0 / true_step(8, 1), rel=1e-9)


def test_a_cell_moves_only_with_its_floor_of_samples_and_per_cell():
    """Below `floor` samples a cell leaves the prior alone; drafting and plain steps are separate
    cells (a learner that mixed them, or keyed the wrong B, prices one kind with the other's time)."""
    prior = prior_off(1.0)
    lr = StepCostLearner(window=64, floor=8)
    for _ in range(7):
        lr.observe("eager", 8, 1, 1, 0.5 * true_step(8, 1), prior)
    assert lr.view(prior, "eager") is prior
    lr.observe("eager", 8, 1, 1, 0.5 * true_step(8, 1), prior)
    assert lr.view(prior, "eager").t_step(8, 1, 1) == pytest.approx(0.5 * true_step(8, 1), abs=1e-9)
    # plain steps at the same B ran at the prior's cost: their cell is learned on its own
    for _ in range(8):
        lr.observe("eager", 8, 1, 0, true_step(8, 0), prior)
    v = lr.view(prior, "eager")
    assert v.t_step(8, 1, 0) == pytest.approx(true_step(8, 0), abs=1e-9)
    assert v.t_step(8, 1, 1) == pytest.approx(0.5 * true_step(8, 1), abs=1e-9)
    # a B far from the drafting cell is priced by its own cell's B, not another bucket's
    for _ in range(8):
        lr.observe("eager", 40, 1, 1, true_step(40, 1), prior)
    v = lr.view(prior, "eager")
    assert v.t_step(40, 1, 1) == pytest.approx(true_step(40, 1), abs=1e-9)
    assert v.t_step(8, 1, 1) == pytest.approx(0.5 * true_step(8, 1), abs=1e-9)
    # paths are separate: the static path has learned nothing
    assert lr.view(prior, "static") is prior


def test_a_loaded_machine_is_damped():
    """After 16 steps at the machine's cost, a burst of 40 steps 5x slower (load on a shared machine,
    most of the window) moves the learned step by a bounded amount per sample (the winsorisation at
    the cell's median + max(4 MAD, 0.1) creeps up 0.1 at a time: at most 1.5x after the burst), where
    an undamped median would read the loaded 5x; every step learned stays within 4x the prior."""
    prior = prior_off(1.0)
    lr = StepCostLearner(window=64, floor=8)
    B, t = 8, true_step(8, 1)
    for _ in range(16):
        lr.observe("eager", B, 1, 1, t, prior)
    for _ in range(40):
        lr.observe("eager", B, 1, 1, 5.0 * t, prior)
    learned = lr.view(prior, "eager").t_step(B, 1, 1)
    assert learned <= 1.5 * t, learned / t
    assert lr.damped == 40
    lr2 = StepCostLearner(window=64, floor=8)
    for _ in range(64):
        lr2.observe("eager", B, 1, 1, 100 * t, prior)  # a machine 100x slower: bounded at 4x the prior
    assert lr2.view(prior, "eager").t_step(B, 1, 1) == pytest.approx(4 * t)


def test_greedy_and_sampled_steps_learn_apart():
    """Sampled steps cost 1.5x the greedy steps of the same rows (their host sampling work): each
    regime's view prices its own steps (exact: tolerance 1e-9 s); a regime with no cell borrows the
    other's; a sampled drafting step with no cell of its own borrows the sampled plain steps' factor.
    One set of cells for both (the deliberate mistake) prices sampled drafting at the greedy cost."""
    prior = prior_off(1.0)
    lr = StepCostLearner(window=64, floor=8)
    for _ in range(16):
        lr.observe("eager", 8, 1, 1, true_step(8, 1), prior)  # greedy drafting
    assert lr.view(prior, "eager", sampled=True).t_step(8, 1, 1) == pytest.approx(true_step(8, 1), abs=1e-9)
    for _ in range(16):
        lr.observe("eager", 2, 1, 0, 1.5 * true_step(2, 0), prior, sampled=True)  # sampled plain only
    smp, grd = lr.view(prior, "eager", sampled=True), lr.view(prior, "eager", sampled=False)
    assert smp.t_step(2, 1, 0) == pytest.approx(1.5 * true_step(2, 0), abs=1e-9)
    assert smp.t_step(8, 1, 1) == pytest.approx(1.5 * true_step(8, 1), abs=1e-9)  # the sampled regime's factor
    assert grd.t_step(8, 1, 1) == pytest.approx(true_step(8, 1), abs=1e-9)
    assert grd.t_step(2, 1, 0) == pytest.approx(true_step(2, 0), abs=1e-9)  # greedy plain: from greedy drafting
    for _ in range(16):
        lr.observe("eager", 8, 1, 1, 1.5 * true_step(8, 1), prior, sampled=True)
    assert lr.view(prior, "eager", sampled=True).t_step(8, 1, 1) == pytest.approx(1.5 * true_step(8, 1), abs=1e-9)
    assert lr.view(prior, "eager").t_step(8, 1, 1) == pytest.approx(true_step(8, 1), abs=1e-9)
    assert lr.measured("eager", 8, True, sampled=True) and not lr.measured("eager", 2, False)
    assert set(lr.stats()["step_cost_cells"]) == {"eager/draft/greedy/B~8", "eager/plain/sampled/B~2",
                                                  "eager/draft/sampled/B~8"}


@pytest.mark.slow
def test_engine_prices_sampled_steps_from_sampled_steps():
    """An engine serving greedy requests, then sampled ones, on a machine (injected clock) where a
    sampled step costs 1.5x a greedy step of the same rows: the late sampled steps read
    ~1.0 over the learned cost (median within 0.9-1.1), and the greedy view still prices greedy steps
    (within 10 %) after the sampled phase. An engine that learns both regimes in one set of cells
    (the deliberate mistake: the step's regime dropped) moves the greedy view to the sampled cost."""
    model = _embedded()
    for mistake in (False, True):
        eng, now = _fake_clock_engine(model, [1.0, 1.0])
        if mistake:
            eng._sampled_step = lambda: False
        real_run, real_learn = eng._run_step, eng._learn_step
        sampled_phase, late = [False], []

        def run_step():
            t0 = now[0]
            real_run()
            if sampled_phase[0]:
                now[0] += 0.5 * (now[0] - t0)  # the sampled steps' host work: 1.5x the step

        def learn(path, B, S, R, seconds, sampled=False):
            if sampled_phase[0]:
                late.append(seconds / float(eng.learned_cost(sampled).t_step(B, S, R)))
            real_learn(path, B, S, R, seconds, sampled)

        eng._run_step, eng._learn_step = run_step, learn
        for temperature in (0.0, 1.0):
            sampled_phase[0] = temperature > 0
            for i, p in enumerate(PROMPTS * 3):
                eng.submit(GenerateRequest(prompt=p, max_tokens=40, ignore_eos=True, temperature=temperature,
                                           seed=i))
            while eng.has_work():
                eng.step()
        greedy = eng.learned_cost(False)
        probe = [(B, R) for B, R in ((2, 0), (2, 2), (12, 2)) if eng.learner.measured("eager", B, R > 0)]
        assert probe
        t_greedy = [float(greedy.t_step(B, 2, R)) for B, R in probe]
        # the machine's greedy step (the stand-ins' cost of a forward + drafting of 2 requests)
        want = [0.005 + 0.002 * 2 + 0.0005 * B + (0.003 + 0.001 * 2 if R else 0.0) for B, R in probe]
        ok = all(abs(t / w - 1.0) <= 0.10 for t, w in zip(t_greedy, want))
        med = statistics.median(late[len(late) // 2:])
        if not mistake:
            assert ok, list(zip(probe, t_greedy, want))
            assert 0.9 <= med <= 1.1, med
        else:
            assert not ok, list(zip(probe, t_greedy, want))


# ---- the engine on an injected clock --------------------------------------------------------------
def _fake_clock_engine(model, slow: list, **settings):
    """An engine whose clock only the runner's stand-ins advance: a forward of n tokens over k
    segments costs slow[0] x (5 ms + 2 ms k) + slow[1] x 0.5 ms n, the draft stages of R requests
    slow[0] x (3 ms + 1 ms R). Returns (engine, the clock's list)."""
    now = [0.0]
    runner = LocalRunner(model, 3, 256)
    fwd, dsp = runner.forward, runner.dspark

    def forward(tokens, spec, rows, taps):
        now[0] += slow[0] * (0.005 + 0.002 * len(spec)) + slow[1] * 0.0005 * len(tokens)
        return fwd(tokens, spec, rows, taps)

    def dspark(writes, items):
        if items:
            now[0] += slow[0] * (0.003 + 0.001 * len(items))
        return dsp(writes, items)

    runner.forward, runner.dspark = forward, dspark
    eng = Engine(runner, Settings(max_num_seqs=2, max_model_len=250, spec_mode="dspark", dspark_adaptive=True,
                                  checkpoint_dir=str(EMBEDDED), **settings), clock=lambda: now[0])
    return eng, now


PROMPTS = [[0, 263, 1180, 11, 437, 13], [0, 263, 1180, 11], [0, 263, 1180, 11, 437], [0, 263, 11, 437, 13]]


def _embedded():
    from v4flash_backend import ops
    from v4flash_backend.model.loading import load_model

    ops.set_numerics("exact")
    return load_model(EMBEDDED)


@pytest.mark.slow
def test_engine_learns_from_its_steps_after_a_profile_taken_2x_slow():
    """The engine profiles its step on a machine twice as slow as the one it then serves on, and 4x
    as slow per verify row (the start-up profile 2x off, more at large B), then decodes: every step
    measured over the profile reads 0.25-0.5, over the learned cost it reads 1.0 once the cells have
    their samples (median of the second half of the steps within 0.9-1.1: the learned model
    interpolates between cells whose B differ), and the output is the plain engine's (lossless:
    greedy). Learning from the wrong cell (the B of the step after, say) misprices the late steps."""
    model = _embedded()
    slow = [2.0, 4.0]
    eng, now = _fake_clock_engine(model, slow)
    prior = eng.ensure_cost()
    slow[:] = [1.0, 1.0]
    steps = []
    real = eng._learn_step

    def learn(path, B, S, R, seconds, sampled=False):
        steps.append((seconds / float(prior.t_step(B, S, R)),
                      seconds / float(eng.learned_cost(sampled).t_step(B, S, R))))
        real(path, B, S, R, seconds, sampled)

    eng._learn_step = learn
    outs = {}
    for i, p in enumerate(PROMPTS * 2):
        eng.submit(GenerateRequest(prompt=p, max_tokens=48, ignore_eos=True,
                                   callback=lambda e, i=i: outs.setdefault(i, []).extend(e.token_ids)))
    while eng.has_work():
        eng.step()
    assert len(steps) > 30
    assert all(0.25 <= a <= 0.5 for a, _ in steps), [a for a, _ in steps]
    late = [b for _, b in steps[len(steps) // 2:]]
    assert 0.9 <= statistics.median(late) <= 1.1, late
    q = statistics.quantiles(late, n=4)
    assert 0.85 <= q[0] and q[-1] <= 1.15, q
    assert eng.stats()["step_cost_samples"] == len(steps)
    plain = Engine(LocalRunner(model, 3, 256), Settings(max_num_seqs=2, max_model_len=250, spec_mode="off"))
    for i, p in enumerate(PROMPTS):  # the first four (the last four repeat their prompts)
        want = [t for e in plain.run_request(GenerateRequest(prompt=p, max_tokens=48, ignore_eos=True))
                for t in e.token_ids]
        assert outs[i] == want, i


# ---- the fixed-length guard -------------------------------------------------------------------------
def test_fixed_tokens_counts_known_and_expected_positions():
    """A block that admitted 2 of F = 5 and had both accepted: fixed would have committed 1 + 2 +
    expected more under the calibrated conditionals; a rejection inside both is known; fixed stops at
    F where the schedule admitted more."""
    c = [0.9, 0.9, 0.5, 0.5, 0.5]
    assert fixed_tokens(2, 2, c, 5) == pytest.approx(1 + 2 + 0.5 + 0.25 + 0.125)
    assert fixed_tokens(3, 1, c, 5) == 2.0
    assert fixed_tokens(5, 5, c, 3) == 4.0
    assert fixed_tokens(0, 0, [1.0] * 5, 5) == 6.0


def test_guard_raises_the_floor_only_while_the_schedule_is_behind():
    """Per regime: blocks of 1 admitted draft, accepted, where fixed would have had ~3.7 more at c = 0.9
    for 1.1 x the time, raise the greedy regime's floor (one step per MOVE_EVERY steps, up to F) and
    leave the sampled regime's at 0; blocks whose one draft was rejected (fixed: the same tokens, for
    more time) raise nothing."""
    g = FixedGuard(5, 5)
    for _ in range(64):
        g.observe_step([("greedy", 1, 1, [0.9] * 5, 50)] * 2, 0.020, 0.020, 0.022, 2)
    assert g.floor("greedy") == 5 and g.floor("sampled") == 0
    g2 = FixedGuard(5, 5)
    for _ in range(64):
        g2.observe_step([("greedy", 1, 0, [0.9] * 5, 50)] * 2, 0.020, 0.020, 0.030, 2)
    assert g2.floor("greedy") == 0


def _guard_run(model, guard: bool):
    """Decoding under a deliberate mis-costing: admission reads a prior that prices a step with more
    verify rows than requests (B >= 3 for 2 requests) at 60 ms, the machine at 15-20 ms (a profile
    that timed its larger forwards during a burst of load), so no draft ever pays, with learning kept
    out of admission, so only the guard can correct it. Returns (mean admitted drafts per block over
    the last half of the blocks, tokens per fake second, the engine)."""
    slow = [1.0, 1.0]
    eng, now = _fake_clock_engine(model, slow)
    sizes = list(range(1, 49))
    eng.cost = StepCost(SPSTable(sizes, [1.0 / (0.010 if b <= 2 else 0.060) for b in sizes]), {1: 0.005, 2: 0.005})
    eng.learn_admit = False
    eng._drafting_decision = lambda seqs: "draft"  # stepping aside reads the same cost: out of this test
    if not guard:
        eng.guard = None
    ells = []
    real = eng._account_verify

    def account(s, n_acc):
        if s.adm == "admit":
            ells.append(s.ell)
        real(s, n_acc)

    eng._account_verify = account
    for p in PROMPTS * 2:
        eng.submit(GenerateRequest(prompt=p, max_tokens=64, ignore_eos=True))
    while eng.has_work():
        eng.step()
    st = eng.stats()
    return statistics.mean(ells[len(ells) // 2:]), st["output_tokens"] / now[0], eng


def test_guard_corrects_a_deliberate_miscosting(monkeypatch):
    """Admission on a profile that prices steps with drafts ~6x what they cost admits no draft of
    blocks the embedded model mostly accepts; fixed-5 on the same blocks is known to be faster (the guard's fixed-length
    steps measure its rows). The guard raises the greedy regime's floor until admission verifies the
    drafts: more drafts admitted (the last half of the blocks: >= 3 more a block) and more tokens per
    (fake) second (>= 1.5x) than without the guard. A guard that counts the positions admission left
    unverified as rejected (the deliberate mistake: no calibrated estimate of what fixed would have
    had there) sees fixed gain nothing on these blocks and does not correct."""
    model = _embedded()
    ell_off, rate_off, _ = _guard_run(model, guard=False)
    ell_on, rate_on, eng = _guard_run(model, guard=True)
    assert ell_off == 0.0
    assert eng.guard.floor("greedy") >= 3 and eng.stats()["fixed_guard"]["greedy"]["moves"] >= 3
    assert ell_on >= 3.0, (ell_on, ell_off)
    assert rate_on >= 1.5 * rate_off, (rate_on, rate_off)
    import v4flash_backend.engine.fixed_guard as fg

    monkeypatch.setattr(fg, "fixed_tokens", lambda ell, n_acc, c, F: 1.0 + min(n_acc, F))
    _, _, bad = _guard_run(model, guard=True)
    assert bad.guard.floor("greedy") == 0


def test_static_rounds_take_the_learned_cost_as_their_table_input(tiny_model):
    """On a static runner the learner's cells are the static path's, and the rounds' admission inputs
    (the SPS table, t_draft) become the learned cost's once a cell has its floor: same width (SPS_WIDTH
    entries, padded), other values -- a tensor input, no new graph shape. The rounds run op by op here
    (backend none) on an injected clock advanced by a stand-in of decode_round: 10 ms + 5 ms a sequence,
    the profile priced at twice that (by B: the table's staircase by sequences of 1 + gamma rows); after
    learning the inputs price the machine (tolerance 1e-9 relative: fake-clock float sums)."""
    from v4flash_backend.engine.dspark_sched import sps_tensors
    from v4flash_backend.engine.round_plan import SPS_WIDTH, pad_sps
    from v4flash_backend.trn2.launch import NeuronSettings
    from v4flash_backend.trn2.static_runner import StaticRunner

    sr = StaticRunner(tiny_model, 3, 96, settings=NeuronSettings(backend="none"))
    now, plans = [0.0], []
    real_round = sr.decode_round

    def decode_round(plan):
        plans.append(plan)
        now[0] += 0.010 + 0.005 * len(plan.slot)
        return real_round(plan)

    sr.decode_round = decode_round
    eng = Engine(sr, Settings(max_num_seqs=2, max_model_len=96, spec_mode="dspark", dspark_adaptive=True),
                 clock=lambda: now[0])
    Q = 1 + eng.gamma
    sizes = [1, 2, Q, 2 * Q]
    eng.cost = StepCost(SPSTable(sizes, [1.0 / (2 * (0.010 + 0.005 * -(-b // Q))) for b in sizes]), {1: 1e-4, 2: 1e-4})
    eng._drafting_decision = lambda seqs: "draft"
    eng.guard = None  # the table alone (the guard's floors are fixed_ell inputs: test_static_round)
    for p in ([0, 5, 6, 7, 8], [0, 17, 230, 5]):
        eng.submit(GenerateRequest(prompt=p, max_tokens=40, ignore_eos=True))
    while eng.has_work():
        eng.step()
    assert eng.stats()["static_steps"] > 20
    assert eng.learner.cells and all(p == "static" for p, _, _, _ in eng.learner.cells)
    learned = eng.learned_cost()
    assert isinstance(learned, LearnedStepCost)
    last = plans[-1]
    assert last.sps.shape == sps_tensors(eng.cost.forward).shape
    assert torch.equal(last.sps, sps_tensors(learned.forward))
    assert pad_sps(last.sps).shape == pad_sps(plans[0].sps).shape == (2, SPS_WIDTH)
    # the rounds of 2 sequences at their most frequent B (verify rows): the learned step is the
    # machine's 20 ms, and so is what the round's inputs price (the table at B plus t_draft of 2)
    bs = [sum(1 + max(e, 0) for e in p.ell) for p in plans if len(p.slot) == 2]
    B = max(set(bs), key=bs.count)
    assert learned.t_step(B, 2, 2) == pytest.approx(0.020, rel=1e-9)
    assert 1.0 / float(learned.forward.lookup(B)) + learned.t_draft(2) == pytest.approx(0.020, rel=1e-9)
    assert float(eng.cost.t_step(B, 2, 2)) > 0.029  # the profile's price, 1.5-2x


def test_guard_floor_is_the_same_admission_on_eager_steps_and_static_rounds(tiny_model):
    """The guard's floor reaches the static rounds as fixed_ell = -1 - floor (engine.round_plan): with a
    floor of 2 in both modes (held, the guard's own control out of it: a deterministic decision), the
    static rounds (op by op) admit and accept exactly what eager steps do, every block admission chose
    verifies at least 2 drafts (or its room), and the tokens are the same (lossless either way)."""
    from v4flash_backend.trn2.launch import NeuronSettings
    from v4flash_backend.trn2.static_runner import StaticRunner

    def serve(runner):
        eng = Engine(runner, Settings(max_num_seqs=2, max_model_len=96, spec_mode="dspark", dspark_adaptive=True))
        eng.cost = StepCost(SPSTable([1, 2, 4, 8, 16], [25.0, 24.0, 20.0, 12.0, 6.0]), {1: 0.03, 2: 0.03})
        eng.learn_admit = False  # admission on the given cost (the two modes' timings differ)
        eng._drafting_decision = lambda seqs: "draft"
        eng.guard.floor = lambda reg: 2
        eng.guard.observe_step = lambda *a, **k: None
        blocks, real = [], eng._account_verify
        eng._account_verify = lambda s, n: (blocks.append((s.adm, s.ell, s.req.max_tokens - s.n_out)), real(s, n))
        outs = {}
        for i, (p, t, seed) in enumerate((([0, 5, 6, 7, 8], 0.0, None), ([0, 17, 230, 5], 0.8, 3))):
            eng.submit(GenerateRequest(prompt=p, max_tokens=24, temperature=t, seed=seed, ignore_eos=True,
                                       callback=lambda e, i=i: outs.setdefault(i, []).extend(e.token_ids)))
        while eng.has_work():
            eng.step()
        return outs, eng.stats(), blocks

    want, est, eblocks = serve(LocalRunner(tiny_model, 3, 96))
    got, st, sblocks = serve(StaticRunner(tiny_model, 2, 96, settings=NeuronSettings(backend="none")))
    assert got == want and st["static_steps"] == st["decode_steps"] > 0
    assert (st["admitted"], st["accepted"]) == (est["admitted"], est["accepted"])
    assert sblocks == eblocks
    chosen = [(ell, left) for adm, ell, left in eblocks if adm == "admit"]
    assert chosen and all(ell >= min(2, left - 1) for ell, left in chosen), chosen


def test_held_steps_change_nothing_a_reader_sees():
    """observe holds a step whose cell has its floor (`_pending`) and takes it later: a learner
    that takes every step at once (the reference, `_take` directly) must agree with it after every
    step -- the version (the views' and the stepping-aside verdict's key), and, read at irregular
    points, the learned t_step, `measured` and the stats -- over steps of several cells, bursts
    (winsorised) and invalid samples. And the holding must happen (else the host work it saves is
    not saved): some steps are held."""
    prior = prior_off()

    class AtOnce(StepCostLearner):
        def observe(self, path, B, S, R, seconds, prior, sampled=False):
            self._take(path, B, S, R, seconds, prior, sampled)

    g = torch.Generator().manual_seed(5)
    held, ref = StepCostLearner(window=16, floor=8), AtOnce(window=16, floor=8)
    most_held = 0
    for i in range(600):
        B = int(torch.randint(1, 13, (1,), generator=g))
        R = int(torch.randint(0, 2, (1,), generator=g)) * (1 if i % 5 else 0)
        burst = 3.0 if i % 37 == 0 else 1.0
        secs = -1.0 if i % 91 == 0 else burst * true_step(B, R) * (1 + 0.05 * float(torch.rand(1, generator=g)))
        sampled = i % 3 == 0
        for lr in (held, ref):
            lr.observe("static", B, 1, R, secs, prior, sampled)
        most_held = max(most_held, len(held._pending))
        assert held.version == ref.version, i
        if i % 13 == 0:
            for smp in (False, True):
                a, b = held.view(prior, "static", 6, smp), ref.view(prior, "static", 6, smp)
                assert [float(a.t_step(x, 1, r)) for x in (1, 6, 12) for r in (0, 1)] == \
                    [float(b.t_step(x, 1, r)) for x in (1, 6, 12) for r in (0, 1)], i
            assert [held.measured("static", x, d) for x in range(1, 13) for d in (False, True)] == \
                [ref.measured("static", x, d) for x in range(1, 13) for d in (False, True)]
        if i % 97 == 0:
            assert held.stats() == ref.stats(), i
    assert held.stats() == ref.stats()
    assert most_held >= 5  # steps were held (at most REFRESH - 1 at once)
