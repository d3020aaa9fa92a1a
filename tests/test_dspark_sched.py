"""DSpark admission (paper Algorithm 1) and the SPS table."""

import json
import random

import pytest
import torch

from v4flash_backend.engine.dspark_sched import (
    SPSTable,
    admit,
    admit_fixed,
    admit_no_early_stop,
)


def reference_admit(c, sps, early_stop=True, extra=0):
    """Literal transcription of the notes' pseudocode (python floats, explicit loop), used to
    cross-check the vectorised implementation. Without early stop it takes the best prefix of the
    survival order (the 'global argmax' of App. A)."""
    R, G = len(c), len(c[0])
    a = [[0.0] * G for _ in range(R)]
    for r in range(R):
        s = 1.0
        for j in range(G):
            s *= min(max(c[r][j], 0.0), 1.0)
            a[r][j] = s
    E = sorted(((r, j) for r in range(R) for j in range(G) if a[r][j] > 0), key=lambda e: (-a[e[0]][e[1]], e[1], e[0]))
    B, tau = R + extra, float(R)
    best = R * sps(B)
    ell = [0] * R
    taken = []
    for (r, j) in E:
        B += 1
        tau += a[r][j]
        taken.append((r, j))
        if tau * sps(B) > best:
            best = tau * sps(B)
            if early_stop:
                assert j == ell[r], "admitted entries must extend each row's prefix"
                ell[r] = j + 1
            else:
                for (rr, jj) in taken:
                    ell[rr] = max(ell[rr], jj + 1)
        elif early_stop:
            break
    return ell


def table(values, start=1):
    return SPSTable(list(range(start, start + len(values))), values)


def test_worked_example_admits_three():
    # One request, c = .95, .92, .85, .30; SPS(B) for B = 1..5 = 1000, 520, 400, 340, 280.
    # By hand: survivals a = .95, .874, .7429, .222870.
    #   start  B=1 tau=1       best = 1 * 1000           = 1000
    #   a=.95    B=2 tau=1.95    1.95    * 520 = 1014.0     > 1000   admit (ell 1)
    #   a=.874   B=3 tau=2.824   2.824   * 400 = 1129.6     > 1014   admit (ell 2)
    #   a=.7429  B=4 tau=3.5669  3.5669  * 340 = 1212.746   > 1129.6 admit (ell 3)
    #   a=.22287 B=5 tau=3.78977 3.78977 * 280 = 1061.1356  < 1212.7 stop
    sps = table([1000, 520, 400, 340, 280])
    assert admit(torch.tensor([[0.95, 0.92, 0.85, 0.30]]), sps).tolist() == [3]
    # the same walk, made to continue by a cheaper 5-token forward (3.78977 * 330 = 1250.6 > 1212.7)
    assert admit(torch.tensor([[0.95, 0.92, 0.85, 0.30]]), table([1000, 520, 400, 340, 330])).tolist() == [4]
    # one extra (prefill) token in the forward: best = 1 * 520, then 1.95 * 400 = 780, 2.824 * 340 = 960.2,
    # 3.5669 * 280 = 998.7 all improve; B = 6 is beyond the table: 3.78977 * 280 * 5/6 = 884.3 stops -> 3
    assert admit(torch.tensor([[0.95, 0.92, 0.85, 0.30]]), sps, extra_tokens=1).tolist() == [3]


def test_paper_appendix_a_early_stop_gives_zero():
    # a1 = .8, SPS = (1, .5, .45): admitting x1 gives 1.8 * .5 = .9 < 1, so the walk stops at once.
    # Without the stop, a confident second draft (a2 = .8: 2.6 * .45 = 1.17 > 1) drags x1 in.
    sps = table([1.0, 0.5, 0.45])
    c = torch.tensor([[0.8, 1.0]])
    assert admit(c, sps).tolist() == [0]
    assert admit_no_early_stop(c, sps).tolist() == [2]
    assert admit_no_early_stop(torch.tensor([[0.8, 0.0]]), sps).tolist() == [0]


def test_vllm_budget_example():
    # vllm tests/v1/spec_decode/test_dspark_confidence.py::test_select_budget_uses_sps_argmax:
    # survivals r0 (.9, .72), r1 (.6, .3), rates indexed by B = 0..6 = (1, 1, 1, .95, .9, .2, .1).
    # Walk from B=2 (best 2): .9 -> 2.9*.95=2.755, .72 -> 3.62*.9=3.258, .6 -> 4.22*.2=.844 stop.
    # Budget 2 = both drafts of r0.
    sps = SPSTable(list(range(1, 7)), [1.0, 1.0, 0.95, 0.90, 0.20, 0.10])
    ell = admit(torch.tensor([[0.90, 0.80], [0.60, 0.50]]), sps)
    assert ell.tolist() == [2, 0]
    assert int(ell.sum()) == 2


def test_tie_order_is_position_then_request():
    # Every survival is .6 (c2 = 1 ties a2 with a1). B starts at 2, tau_k = 2 + .6k:
    # k=1 2.6*.9=2.34 > 2, k=2 3.2*.8=2.56 > 2.34, k=3 3.8*.5=1.9 stop -> two entries.
    # Order (-a, j, r): (r0,j1), (r1,j1), (r0,j2), (r1,j2) -> ell = [1, 1] (an (r, j) order
    # would give [2, 0]; a (j, -r) order [1, 1] too, so the 1-entry case below pins r).
    c = torch.tensor([[0.6, 1.0], [0.6, 1.0]])
    assert admit(c, table([1.0, 1.0, 0.9, 0.8, 0.5, 0.4])).tolist() == [1, 1]
    # one entry: 2.6*.9 = 2.34 > 2, then 3.2*.7 = 2.24 stop -> the lower request wins the tie
    assert admit(c, table([1.0, 1.0, 0.9, 0.7, 0.5, 0.4])).tolist() == [1, 0]
    # three entries: (r0, j2) comes before (r1, j2)
    assert admit(c, table([1.0, 1.0, 0.9, 0.8, 0.7, 0.4])).tolist() == [2, 1]


def test_zero_survival_entries_are_never_admitted():
    # An (unsmoothed) SPS that grows with B would reward padding; entries with a = 0 are excluded.
    rising = SPSTable([1, 2, 3, 4], [1.0, 2.0, 3.0, 4.0], smooth=False)
    assert admit(torch.tensor([[1.0, 0.0, 1.0]]), rising).tolist() == [1]
    assert admit_no_early_stop(torch.tensor([[1.0, 0.0, 1.0]]), rising).tolist() == [1]
    # NaN confidence counts as 0; c > 1 is clamped to 1
    assert admit(torch.tensor([[float("nan"), 1.0]]), rising).tolist() == [0]
    assert admit(torch.tensor([[1.5, 1.0]]), rising).tolist() == [2]


def _random_case(rng, R, G, tie_values=False):
    if tie_values:
        c = [[rng.choice([0.0, 0.5, 0.8, 1.0]) for _ in range(G)] for _ in range(R)]
    else:
        c = [[rng.random() ** 0.3 for _ in range(G)] for _ in range(R)]
    # a random monotone SPS curve with plateaus and cliffs, B = 1 .. R(G+1)
    vals, s = [], 1.0
    for _ in range(R * (G + 1)):
        vals.append(s)
        s *= rng.choice([1.0, 0.97, 0.9, 0.8, 0.5])
    return c, table(vals)


def test_vectorised_admit_matches_the_pseudocode():
    rng = random.Random(0)
    for trial in range(300):
        R, G = rng.randint(1, 5), rng.randint(1, 5)
        c, sps = _random_case(rng, R, G, tie_values=trial % 2 == 0)
        ct = torch.tensor(c, dtype=torch.float64)
        assert admit(ct, sps).tolist() == reference_admit(c, sps), (c, sps)
        assert admit_no_early_stop(ct, sps).tolist() == reference_admit(c, sps, early_stop=False), (c, sps)
        extra = rng.randint(0, 3)  # prefill tokens sharing the forward: costlier, commit nothing
        assert admit(ct, sps, extra_tokens=extra).tolist() == reference_admit(c, sps, extra=extra), (c, sps, extra)


def test_leading_batch_dims_are_independent_admissions():
    rng = random.Random(1)
    sps = table([1.0, 0.95, 0.9, 0.8, 0.7, 0.6, 0.55, 0.5, 0.45, 0.4, 0.35, 0.3, 0.25, 0.2, 0.15, 0.1])
    c = torch.tensor([[[rng.random() ** 0.3 for _ in range(3)] for _ in range(4)] for _ in range(20)])
    batched = admit(c.view(5, 4, 4, 3), sps).view(20, 4)
    for i in range(20):
        assert torch.equal(batched[i], admit(c[i], sps))


def test_non_anticipation_metamorphic():
    # Changing c[r, j'] for j' > j (confidences computed from drafts x_{>= j}) must never change whether
    # draft j of row r is verified. The no-early-stop control must violate this on the same cases,
    # which shows the check has power.
    rng = random.Random(2)
    violations_control = 0
    for _ in range(400):
        R, G = rng.randint(1, 4), rng.randint(2, 5)
        c, sps = _random_case(rng, R, G)
        ct = torch.tensor(c, dtype=torch.float64)
        base, base_ctl = admit(ct, sps), admit_no_early_stop(ct, sps)
        r, j = rng.randrange(R), rng.randrange(1, G)  # 1-based draft j; perturb drafts j+1..G
        c2 = ct.clone()
        c2[r, j:] = torch.tensor([rng.random() for _ in range(G - j)], dtype=torch.float64)
        assert bool(admit(c2, sps)[r] >= j) == bool(base[r] >= j)
        if bool(admit_no_early_stop(c2, sps)[r] >= j) != bool(base_ctl[r] >= j):
            violations_control += 1
    assert violations_control > 0


def test_admitted_sets_are_prefixes_and_fit_gamma():
    rng = random.Random(3)
    for _ in range(100):
        R, G = rng.randint(1, 6), rng.randint(1, 6)
        c, sps = _random_case(rng, R, G, tie_values=True)
        ell = admit(torch.tensor(c), sps)
        assert ell.dtype == torch.int64 and ell.shape == (R,)
        assert bool((ell >= 0).all()) and bool((ell <= G).all())
        for r in range(R):  # every admitted draft has positive survival
            assert all(x > 0 for x in c[r][: int(ell[r])])


def test_admit_fixed():
    assert admit_fixed(3, 2).tolist() == [2, 2, 2]
    assert admit_fixed(2, 9, gamma=5).tolist() == [5, 5]
    with pytest.raises(ValueError):
        admit_fixed(2, -1)


# --------------------------------------------------------------------------- SPS table


def test_sps_smoothing_is_monotone_pav():
    t = SPSTable([1, 2, 3, 4, 5], [100.0, 80.0, 90.0, 60.0, 70.0])
    # violators pooled to their means: (80, 90) -> 85, (60, 70) -> 65
    assert t.sps == (100.0, 85.0, 85.0, 65.0, 65.0)
    assert t.raw_sps == (100.0, 80.0, 90.0, 60.0, 70.0)
    mono = SPSTable([1, 2, 4], [10.0, 10.0, 3.0])
    assert mono.sps == (10.0, 10.0, 3.0)  # already non-increasing: unchanged
    # weights: a size measured 3 times pulls the pooled value towards itself
    w = SPSTable([1, 2], [10.0, 20.0], weights=[3, 1])
    assert w.sps == (12.5, 12.5)
    rng = random.Random(4)
    for _ in range(50):
        vals = [rng.uniform(1, 100) for _ in range(12)]
        s = SPSTable(list(range(1, 13)), vals).sps
        assert all(a >= b for a, b in zip(s, s[1:]))
        assert abs(sum(s) - sum(vals)) < 1e-9  # unweighted PAV preserves the total


def test_sps_from_samples_uses_median():
    t = SPSTable.from_samples([(4, 10.0), (4, 11.0), (4, 100.0), (8, 5.0)])
    assert t.sizes == (4, 8)
    assert t.raw_sps == (11.0, 5.0)
    with pytest.raises(ValueError):
        SPSTable([1, 1], [1.0, 2.0])
    with pytest.raises(ValueError):
        SPSTable([1], [0.0])


def test_sps_floor_lookup():
    t = SPSTable([2, 4, 8], [50.0, 40.0, 30.0])
    assert [t.lookup(b) for b in (1, 2, 3, 4, 7, 8)] == [50.0, 50.0, 50.0, 40.0, 40.0, 30.0]
    # beyond the largest size: constant tokens/s, 30 * 8 / 16
    assert t.lookup(16) == 15.0
    got = t.lookup(torch.tensor([[1, 5], [8, 16]]))
    assert got.dtype == torch.float64 and got.tolist() == [[50.0, 40.0], [30.0, 15.0]]
    # lookups are monotone non-increasing in B
    vals = t.lookup(torch.arange(1, 40))
    assert bool((vals[1:] <= vals[:-1]).all())


def test_sps_interpolated_lookup():
    """interpolate=True: seconds linear in B between profiled sizes (no cliff at a bucket edge), the
    profiled points themselves and the outside rules unchanged, saved and loaded with the table."""
    t = SPSTable([2, 4, 8], [50.0, 40.0, 30.0], interpolate=True)
    # B = 3: halfway between 1/50 s and 1/40 s; B = 6: halfway between 1/40 s and 1/30 s
    assert t.lookup(3) == pytest.approx(1 / (0.5 / 50 + 0.5 / 40), rel=1e-12)
    assert t.lookup(6) == pytest.approx(1 / (0.5 / 40 + 0.5 / 30), rel=1e-12)
    assert [t.lookup(b) for b in (1, 2, 4, 8, 16)] == [50.0, 50.0, 40.0, 30.0, 15.0]
    vals = t.lookup(torch.arange(1, 40))
    assert bool((vals[1:] < vals[:-1])[2:7].all()) and bool((vals[1:] <= vals[:-1]).all())
    u = SPSTable.from_dict(json.loads(json.dumps(t.to_dict())))
    assert u.interpolate and torch.equal(u.lookup(torch.arange(1, 20)), t.lookup(torch.arange(1, 20)))
    assert not SPSTable.from_dict(SPSTable([2, 4], [5.0, 4.0]).to_dict()).interpolate  # floor by default


def test_sps_save_load_round_trip(tmp_path):
    t = SPSTable.from_samples([(1, 1000.0), (2, 520.5), (2, 530.25), (4, 600.0), (8, 1 / 3)])
    p = tmp_path / "sps.json"
    t.save(p)
    u = SPSTable.load(p)
    assert (u.sizes, u.sps, u.raw_sps, u.weights) == (t.sizes, t.sps, t.raw_sps, t.weights)
    b = torch.arange(0, 20)
    assert torch.equal(u.lookup(b), t.lookup(b))
    assert json.loads(p.read_text())["format"] == "v4flash-sps-table"
    p.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError):
        SPSTable.load(p)


def test_sps_profile_times_the_callable():
    # a fake clock advanced by the callable: a forward of B tokens takes 1 ms + 0.25 ms * B, except one
    # slow outlier run at B = 4 that the median absorbs
    now = [0.0]
    calls = []

    def clock():
        return now[0]

    def fn(b):
        calls.append(b)
        slow = 0.5 if (b == 4 and calls.count(4) == 3) else 0.0
        now[0] += 1e-3 + 2.5e-4 * b + slow

    t = SPSTable.profile(fn, sizes=[1, 4, 16], repeats=3, warmup=1, clock=clock)
    assert calls == [1] * 4 + [4] * 4 + [16] * 4
    assert t.sizes == (1, 4, 16)
    for b, s in zip(t.sizes, t.sps):
        assert s == pytest.approx(1 / (1e-3 + 2.5e-4 * b), rel=1e-9)
