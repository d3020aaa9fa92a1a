"""Calibration of the DSpark confidence head (engine/calibration.py) and its wiring in the engine.

Synthetic heads have a known truth: per position the real acceptance is sigmoid(2 z + 1) while the
head says sigmoid(z), so the raw survivals are off by a known amount and a fit can be judged on
blocks it never saw. Tolerances: ECE estimates from n samples carry about sqrt(1/n) binomial noise
per bin; with 4000 held-out blocks the 3 % bound sits well above that noise and far below the raw
head's error (> 10 %)."""

from __future__ import annotations

import json

import pytest
import torch

from v4flash_backend.engine import calibration as C
from v4flash_backend.engine.dspark_sched import SPSTable
from v4flash_backend.engine.engine import Engine
from v4flash_backend.engine.runner import LocalRunner
from v4flash_backend.engine.step_cost import StepCost
from v4flash_backend.request import GenerateRequest
from v4flash_backend.settings import Settings

G = 4


def synthetic_blocks(n: int, seed: int, slope=2.0, shift=1.0):
    """logits [n, G] ~ N(0, 1); draft k accepted (given the earlier ones) with p = sigmoid(slope z + shift)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, G, generator=g, dtype=torch.float64)
    ok = torch.rand(n, G, generator=g, dtype=torch.float64) < torch.sigmoid(slope * z + shift)
    accepted = torch.cumprod(ok.long(), dim=1).sum(dim=1)  # length of the all-accepted prefix
    return z, accepted


def test_ece_and_auroc_on_known_values():
    conf = torch.tensor([0.2, 0.2, 0.8, 0.8])
    label = torch.tensor([0, 1, 1, 1])
    assert C.ece(conf, label) == pytest.approx(0.3 * 2 / 4 + 0.2 * 2 / 4)
    assert C.auroc(torch.tensor([0.1, 0.2, 0.8, 0.9]), torch.tensor([0, 0, 1, 1])) == 1.0
    assert C.auroc(torch.tensor([0.9, 0.8, 0.2, 0.1]), torch.tensor([0, 0, 1, 1])) == 0.0
    assert C.auroc(torch.tensor([0.5, 0.5, 0.5, 0.5]), torch.tensor([0, 1, 0, 1])) == 0.5


def test_ece_noise_matches_the_binomial_floor():
    """calibrate.ece_noise: a perfectly calibrated constant c = 1/2 on n blocks has one bin whose
    ECE is |mean(label) - 1/2|, of mean s sqrt(2 / pi) with s = sqrt(1 / (4 n)) (half-normal): the
    floor, within 15 % (200 draws). The bootstrap resamples |N(d, s)| around the observed offset d,
    whose standard deviation lies between s sqrt(1 - 2 / pi) (d = 0) and s (d >> s)."""
    from v4flash_backend.training.calibrate import ece_noise

    n = 4000
    g = torch.Generator().manual_seed(3)
    conf = torch.full((n,), 0.5, dtype=torch.float64)
    label = torch.bernoulli(conf, generator=g)
    sd, floor = ece_noise(conf, label)
    s = (1 / (4 * n)) ** 0.5
    assert floor == pytest.approx(s * (2 / torch.pi) ** 0.5, rel=0.15)
    assert 0.85 * s * (1 - 2 / torch.pi) ** 0.5 < sd < 1.15 * s


def test_sts_calibrates_held_out_survivals_and_keeps_their_order():
    fit_z, fit_acc = synthetic_blocks(4000, 1)
    ev_z, ev_acc = synthetic_blocks(4000, 2)
    params = C.fit_sts(fit_z, fit_acc)
    labels = C.prefix_labels(ev_acc, G)
    raw, cal = C.survivals(ev_z, [C.IDENTITY] * G), C.survivals(ev_z, params)
    for k in range(G):
        before, after = C.ece(raw[:, k], labels[:, k]), C.ece(cal[:, k], labels[:, k])
        assert before > 0.10 and after < 0.03, (k, before, after)
    # per position the map is monotone: the conditional confidences keep the head's order
    c_raw, c_cal = torch.sigmoid(ev_z), C.scaled(ev_z, params)
    for k in range(G):
        assert C.auroc(c_cal[:, k], ev_z[:, k] > 0) == pytest.approx(C.auroc(c_raw[:, k], ev_z[:, k] > 0))


def test_a_temperature_alone_cannot_fix_a_head_on_the_wrong_side_of_zero():
    """Why each position also gets a shift: negative logits with 90 % acceptance."""
    z = -torch.rand(3000, G, dtype=torch.float64) - 0.2  # every logit < 0: sigmoid / T stays below 1/2
    acc = torch.full((3000,), G)
    acc[:300] = 0
    labels = C.prefix_labels(acc, G)
    t_only = min(C.ece(torch.sigmoid(z[:, 0] / t), labels[:, 0]) for t in C.T_GRID.tolist())
    with_shift = C.ece(C.survivals(z, C.fit_sts(z, acc))[:, 0], labels[:, 0])
    assert t_only > 0.4 and with_shift < 0.02


def test_online_calibration_follows_a_change_of_workload():
    cal = C.Calibration(G)
    online = C.OnlineCalibrator(cal, window=512, refit_every=128)
    for regime, (slope, shift) in (("sampled", (2.0, 1.0)), ("sampled", (1.0, -2.0))):
        z, acc = synthetic_blocks(768, 7 if shift > 0 else 8, slope, shift)
        for i in range(len(acc)):
            online.observe(regime, z[i], G, int(acc[i]))  # all G verified
        # position 0's calibrated confidence tracks the new acceptance rate within a window
        truth = torch.sigmoid(slope * z[:, 0] + shift).mean()
        assert float(C.scaled(z[:, :1], cal.of(regime)[:1]).mean()) == pytest.approx(float(truth), abs=0.05)
    assert online.refits["sampled"] == 12 and cal.of("greedy") == [C.IDENTITY] * G  # regimes are separate


def test_conditional_fit_reads_only_verified_positions():
    """Blocks where position k was not admitted, or an earlier draft was rejected, say nothing about k."""
    z, acc = synthetic_blocks(3000, 3)
    admitted = torch.full((3000,), 1)  # only draft 0 verified
    params = C.fit_conditional(z, admitted, acc.clamp(max=1), G, [C.IDENTITY] * G)
    assert params[1:] == [C.IDENTITY] * (G - 1) and params[0] != C.IDENTITY


def test_calibration_file_round_trip_and_refusals(tmp_path):
    cal = C.Calibration(G, {"greedy": [(2.0, 0.5)] * G})
    path = tmp_path / C.FILE_NAME
    cal.save(path)
    assert C.Calibration.load(path, G).params == cal.params
    with pytest.raises(ValueError, match="block of 4 drafts"):
        C.Calibration.load(path, 5)
    bad = json.loads(path.read_text())
    bad["params"]["greedy"][0] = [0.0, 1.0]
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"pairs \[T > 0, b\]"):
        C.Calibration.load(path, G)
    bad["params"] = {"warm": [[1.0, 0.0]] * G}
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="unknown regime"):
        C.Calibration.load(path, G)


def _engine(model, **kw):
    return Engine(LocalRunner(model, 3, 160), Settings(max_num_seqs=2, max_model_len=160, spec_mode="dspark", **kw))


def test_engine_loads_the_checkpoint_calibration(tiny_model, tmp_path):
    gamma = tiny_model.cfg.dspark_block_size
    C.Calibration(gamma, {"sampled": [(3.0, -1.0)] * gamma}).save(tmp_path / C.FILE_NAME)
    eng = _engine(tiny_model, checkpoint_dir=str(tmp_path))
    assert eng.calib.cal.of("sampled") == [(3.0, -1.0)] * gamma and eng.calib.cal.of("greedy")[0] == C.IDENTITY
    assert _engine(tiny_model).calib.cal.params == {}  # no file: uncalibrated


def test_engine_feeds_the_head_the_predecessors_and_calibrates_online(tiny_model, monkeypatch):
    """c_k must read x_{k-1} (the anchor for k = 0), never x_k: the engine's head input is checked
    against the block's predecessors, and the deliberate mistake (the drafted tokens) is shown to
    be a different input, so feeding it would fail here. The golden checkpoint's random drafts are
    almost never accepted: online calibration must pull position 0's confidence towards 0."""
    from v4flash_backend.engine import dspark_accept as acc

    # step_cost_online off: the learner would replace the fixed cost below by this machine's timings
    # (a fresh-clone run under load ended at verify_rows 47 against 37 + 10 admitted)
    eng = _engine(tiny_model, dspark_adaptive=True, step_cost_online=False)
    eng._drafting_decision = lambda seqs: "draft"  # calibration alone (stepping aside: tests/test_step_cost.py)
    # a fixed step cost (20 ms + 4 ms a verify row, 10 ms of draft stages) instead of a profile timed
    # on this machine: on a loaded machine the profiled cost of a row came out near 0, so admission
    # kept admitting every draft however low the calibrated confidence (1 failure in 2 runs on main;
    # with this table's row cost set to 0 the last assertion fails the same way)
    sizes = list(range(1, 2 * (1 + eng.gamma) + 1))
    eng.cost = StepCost(SPSTable(sizes, [1.0 / (0.02 + 0.004 * b) for b in sizes]), {1: 0.01, 2: 0.01})
    eng.calib.refit_every = 8
    d = eng.runner.drafter
    seen = {}
    real_draft, real_conf = acc.markov_draft, d.confidence

    def spy_draft(*a, **k):
        seen["block"] = real_draft(*a, **k)
        return seen["block"]

    def spy_conf(hidden, markov_embed):
        seen["embed"] = markov_embed
        return real_conf(hidden, markov_embed)

    monkeypatch.setattr(acc, "markov_draft", spy_draft)
    monkeypatch.setattr(d, "confidence", spy_conf)
    eng.run_request(GenerateRequest(prompt=[0, 5, 6, 7], max_tokens=48, ignore_eos=True))
    block = seen["block"]
    assert torch.equal(block.prev[:, 1:], block.tokens[:, :-1])  # prev = [anchor, x_0 .. x_{G-2}]
    assert torch.equal(seen["embed"], d.markov(block.prev)[1])
    assert not torch.equal(seen["embed"], d.markov(block.tokens)[1])  # the mistake is distinguishable
    st = eng.stats()
    logits, admitted, _ = eng.calib.observations("greedy")
    assert st["calibration_refits"]["greedy"] >= 1 and len(admitted) >= 24
    raw = torch.sigmoid(logits[:, 0]).mean()
    cal = C.scaled(logits[:, :1], eng.calib.cal.of("greedy")[:1]).mean()
    assert st["accept_rate_at"][0] < 0.1 and float(cal) < 0.1 < float(raw)
    # once calibrated, admit stops spending verify rows on drafts that are never accepted
    assert st["verify_rows"] > len(admitted) + 10


def test_running_acceptance_counts_equal_the_window_recomputed():
    """acceptance_rates reads running counts (no per-step pass over the window); they must equal the
    window's blocks recounted, also after the oldest blocks left it (ragged admitted / accepted)."""
    online = C.OnlineCalibrator(C.Calibration(G), window=40, refit_every=10**9)
    g = torch.Generator().manual_seed(5)
    for i in range(150):
        adm = int(torch.randint(1, G + 1, (1,), generator=g))
        online.observe("greedy", torch.zeros(G), adm, int(torch.randint(0, adm + 1, (1,), generator=g)))
        if i in (10, 39, 40, 41, 149):
            _, admitted, accepted = online.observations("greedy")
            assert len(admitted) == min(i + 1, 40)
            want = []
            for k in range(G):
                rows = (admitted > k) & (accepted >= k)
                want.append(float((accepted[rows] > k).double().mean()) if int(rows.sum()) >= 8 else None)
            got = online.acceptance_rates("greedy", fallback=[-1.0] * G)
            assert got == [w if w is not None else -1.0 for w in want]


def test_local_refit_finds_the_whole_grid_optimum_and_falls_back_when_it_moved():
    """The online refit searches a neighbourhood of the current calibration: started at the whole
    grid's optimum it returns that point scoring a 20th of the grid; started far off (the optimum
    left the neighbourhood: its best lies on the edge) it searches the whole grid and still
    returns it."""
    z, acc = synthetic_blocks(2000, 11)
    adm = torch.full((2000,), G)
    full = C.fit_conditional(z, adm, acc, G, [C.IDENTITY] * G)
    assert all(p != C.IDENTITY for p in full)
    st: dict = {}
    assert C.fit_conditional(z, adm, acc, G, full, local=True, stats=st) == full
    whole = len(C.T_GRID) * len(C.B_GRID)
    assert st["points"] <= G * whole / 20
    st = {}
    far = [(float(C.T_GRID[-1]), float(C.B_GRID[0]))] * G
    assert C.fit_conditional(z, adm, acc, G, far, local=True, stats=st) == full
    assert st["points"] > G * whole  # every position fell back to the whole grid


def test_online_refits_are_local_between_whole_grid_searches():
    online = C.OnlineCalibrator(C.Calibration(G), window=512, refit_every=128, full_every=4)
    z, acc = synthetic_blocks(128 * 8, 12)  # every position has >= 24 verified rows at every refit
    for i in range(len(acc)):
        online.observe("sampled", z[i], G, int(acc[i]))
    whole = len(C.T_GRID) * len(C.B_GRID) * G
    assert online.refits["sampled"] == 8
    # refits 0 and 4 search the whole grid, the other 6 their neighbourhoods (unless an optimum moved)
    assert 2 * whole <= online.points_scored["sampled"] < 2 * whole + 6 * whole / 4
