"""The prefix cache (engine.prefix_cache, model.snapshot): a request served from cached prefix
state gives bit-identical logits and tokens to the same request prefilled cold.

Exactness is checked bit for bit (torch.equal, no tolerance): under the exact numerics a row's
result does not depend on chunking, so any difference is a state the restore got wrong. The
comparison engine runs the same history (the same requests before, in the same order) with the
cache off, so everything but the prefill of the cached part is the same computation. Prefixes on the
tiny checkpoint (window 16, compress ratio 2 and 1, Engram n-grams of 4) with prefill_chunk 7:
boundaries 7 and 14 (inside the first window), 21 (past the window, mid compression group: 21 is
odd, inside every Engram n-gram that spans it) and the whole-prompt hit (the last position run again).
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from v4flash_backend.engine.engine import Engine
from v4flash_backend.engine.prefix_cache import PrefixCache
from v4flash_backend.engine.runner import LocalRunner
from v4flash_backend.model import snapshot
from v4flash_backend.request import GenerateRequest
from v4flash_backend.settings import Settings


class RecordingRunner(LocalRunner):
    """LocalRunner that keeps, per request (`log` reset between requests), every row with logits:
    (slot, position, input token, logits row)."""

    def forward(self, tokens, spec, logits_rows, want_taps):
        out = super().forward(tokens, spec, logits_rows, want_taps)
        if out.logits is not None and not isinstance(logits_rows, str):
            where, off = [], 0
            for slot, start, n in spec:
                where += [(slot, start + i) for i in range(n)]
                off += n
            for i, r in enumerate(logits_rows.tolist()):
                self.log.append((*where[r], int(tokens[r]), out.logits[i].clone()))
        return out


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(3, 1000, (n - 1,), generator=g).tolist()


SHARED = _prompt(21, 1)
A = SHARED + _prompt(9, 2)[1:]  # 29 tokens: entries at 7, 14, 21, 28, 29
B = SHARED + _prompt(6, 3)[1:]  # 26: B hits A's 21, then B again hits its own 26 (the whole prompt)


def _run(model, mode: str, temperature: float, cache: bool, max_tokens: int = 8):
    """A, then B twice, one at a time; per request (tokens, num_cached_tokens, rows with logits)."""
    runner = RecordingRunner(model, 3, 96)
    runner.log = []
    tick = itertools.count()  # the step-cost profile's clock (spec_mode dspark): deterministic admission
    eng = Engine(runner, Settings(max_num_seqs=2, max_model_len=96, spec_mode=mode, prefill_chunk=7,
                                  prefix_cache_bytes=(64 << 20) if cache else 0),
                 clock=lambda: next(tick) * 1e-3)
    out = []
    for prompt in (A, B, B):
        runner.log = []
        ev = eng.run_request(GenerateRequest(prompt=prompt, max_tokens=max_tokens, ignore_eos=True,
                                             temperature=temperature, seed=11))
        out.append(([t for e in ev for t in e.token_ids], ev[-1].num_cached_tokens, runner.log))
    return out, eng


_COLD: dict = {}


def _cold(model, mode, temperature):
    key = (mode, temperature)
    if key not in _COLD:
        _COLD[key] = _run(model, mode, temperature, cache=False)[0]
    return _COLD[key]


def _assert_same(got, want):
    """Tokens equal, and every logits row of the decode (and the first token's prompt row) equal
    bit for bit at the same position and input token."""
    for (t1, _, log1), (t0, _, log0) in zip(got, want):
        assert t1 == t0
        # the cold run's prefill rows without logits are absent in both; rows with logits: the last
        # prompt row, then every verify row
        assert [(p, tok) for _, p, tok, _ in log1] == [(p, tok) for _, p, tok, _ in log0]
        for (_, p, tok, lg1), (_, _, _, lg0) in zip(log1, log0):
            assert torch.equal(lg1, lg0), f"logits differ at position {p}"


@pytest.mark.slow
@pytest.mark.parametrize("mode,temperature", [("off", 0.0), ("off", 0.9), ("fixed", 0.0), ("dspark", 0.9)])
def test_a_cached_prefix_gives_the_cold_logits_and_tokens(tiny_model, mode, temperature):
    got, eng = _run(tiny_model, mode, temperature, cache=True)
    assert [c for _, c, _ in got] == [0, 21, 25]  # A cold; B from A's 21; B again: all but its last row
    st = eng.stats()
    assert st["prefix_cache_hits"] == 2 and st["prefix_cache_misses"] == 1
    assert st["prefix_cache_cached_tokens"] == 46
    _assert_same(got, _cold(tiny_model, mode, temperature))


PARTS = ("window", "pend", "engram", "dspark", "ckv", "ik")


@pytest.mark.slow
@pytest.mark.parametrize("part", PARTS)
def test_a_part_restored_one_position_off_fails(tiny_model, monkeypatch, part):
    """The check above sees each part of the state: one part written one position (one group for
    ckv / ik) late makes the logits or tokens differ from the cold run's."""
    capture = snapshot.capture

    def off_by_one(state, slot, p, q0=0):
        snap = capture(state, slot, p, q0)
        if part == "engram":
            lo, rows = snap["engram"]
            snap["engram"] = (lo + 1, rows)
        else:
            snap[part] = {k: (v[0] + 1, *v[1:]) for k, v in snap[part].items()}
        return snap

    monkeypatch.setattr(snapshot, "capture", off_by_one)
    got, _ = _run(tiny_model, "fixed", 0.0, cache=True)
    with pytest.raises(AssertionError):
        _assert_same(got, _cold(tiny_model, "fixed", 0.0))


# ---- the index, without a model ----------------------------------------------------------------
class FakeRunner:
    """Keeps which entries exist and their byte sizes (`size` per boundary)."""

    def __init__(self, size=lambda p, q0: 100):
        import types

        self.size, self.held, self.loads = size, {}, []
        self.state = types.SimpleNamespace(reference_quirks=False)

    def save_prefix(self, slot, entry, p, q0):
        self.held[entry] = (p, q0)
        return self.size(p, q0)

    def load_prefix(self, slot, chain):
        self.loads.append(list(chain))

    def drop_prefix(self, entries):
        for e in entries:
            del self.held[e]


class S:
    """The Seq fields the cache reads and writes."""

    def __init__(self, prompt, slot=0):
        from v4flash_backend.engine.seq import Seq

        self.__dict__.update(vars(Seq(GenerateRequest(prompt=prompt), slot, list(prompt))))

    @property
    def prefilling(self):
        return self.n_cached < len(self.req.prompt)


def _prefill(cache, s, chunk):
    cache.admit(s)
    while s.prefilling:
        before = cache.prefilling([s])
        s.n_cached = min(s.n_cached + chunk, len(s.req.prompt))
        cache.after_step([s], before)


def test_a_shared_beginning_shares_entries_and_the_longest_match_wins():
    r = FakeRunner()
    c = PrefixCache(r, 10_000)
    a = S(list(range(1, 21)))  # entries at 8, 16, 20
    _prefill(c, a, 8)
    assert sorted(p for p, _ in r.held.values()) == [8, 16, 20]
    assert sorted(q0 for _, q0 in r.held.values()) == [0, 8, 16]  # each extends its parent
    b = S(list(range(1, 17)) + [99, 98])  # shares 16 tokens: restores 8 and 16, prefills 2
    _prefill(c, b, 8)
    assert r.loads[-1] == [0, 1] and b.num_cached_tokens == 16
    assert len(r.held) == 4  # b added only its own boundary 18
    x = S([5, 6, 7])
    c.admit(x)
    assert x.n_cached == 0 and c.counts["misses"] == 2  # a and x
    same = S(list(range(1, 21)))  # the whole prompt cached: its last position runs again
    c.admit(same)
    assert same.n_cached == 19 and r.loads[-1] == [0, 1, 2]
    near = S(list(range(1, 16)) + [0, 17])  # differs at token 16: only the entry at 8 matches
    c.admit(near)
    assert near.n_cached == 8


def test_budget_evicts_least_recently_used_leaves_never_a_pinned_entry():
    r = FakeRunner()
    c = PrefixCache(r, 350)  # three entries of 100 bytes fit
    a = S([1] * 4 + [2] * 4)
    _prefill(c, a, 4)  # entries 4, 8 (chain)
    b = S([3] * 4)
    _prefill(c, b, 4)  # entry at 4 of another prompt
    assert c.bytes == 300 and c.counts["evictions"] == 0
    d = S([7] * 8)
    c.admit(d)
    before = c.prefilling([d])
    d.n_cached = 4
    c.after_step([d], before)  # a 4th entry: the LRU leaf goes (a's 8), not a's 4 (it has a child)
    assert c.counts["evictions"] == 1 and c.bytes <= 350
    assert sorted(r.held.values()) == [(4, 0), (4, 0), (4, 0)]
    # d's entry is pinned while d prefills: filling the cache from others never evicts it
    for k in range(5):
        _prefill(c, S([20 + k] * 4), 4)
    assert any(e.pins for e in c.entries.values())
    assert d.prefix_entry is not None and d.prefix_entry.id in r.held
    assert c.bytes <= 350
    c.release(d)
    c.clear()
    assert r.held == {} and c.bytes == 0


def test_an_entry_larger_than_the_budget_is_refused():
    r = FakeRunner(size=lambda p, q0: 1000)
    c = PrefixCache(r, 500)
    a = S(list(range(1, 9)))
    _prefill(c, a, 4)
    assert r.held == {} and c.bytes == 0 and c.counts["refused"] >= 1


def test_snapshot_holds_only_what_a_continuation_reads(tiny_model):
    """Bytes: the window ring's last `window` rows per layer, the last Engram n-gram's ids, the DSpark
    rings' last rows, the unfinished compressor group, and the compressed groups since the parent."""
    from v4flash_backend.model.state import ModelState

    cfg = tiny_model.cfg
    st = ModelState(cfg, 2, 96)
    p, q0 = 21, 14
    snap = snapshot.capture(st, 0, p, q0)
    hd = cfg.head_dim
    want = cfg.n_layers * 16 * hd * 2  # window: 16 rows of bf16 per layer
    want += 4 * 8  # Engram: 4 int64 ids
    want += cfg.n_mtp_layers * 16 * hd * 2  # DSpark rings
    for src in cfg.kv_source_layers:
        r = cfg.compress_ratios[src]
        groups = p // r - q0 // r
        want += groups * hd * 2
        if src in cfg.index_source_layers:
            want += groups * cfg.index_head_dim * 2
        if r > 1:
            want += (p - ((p - 1) // r) * r) * hd * 4 * 2  # pending kv + scores, fp32
    assert snapshot.nbytes(snap) == want


# ---- the static path ---------------------------------------------------------------------------
def test_static_path_restores_a_prefix_and_prefills_only_the_rest(tiny_model):
    """decode_graph static: a hit restores into the static runner's resident state, its prefill
    graphs run for the uncached rest only (B2 = 21 shared + 17: chunks 7, 7, 3 -> two prefill
    graphs; cold: 38 in chunks of 7 -> five), and the tokens equal the cold static run's."""
    from v4flash_backend.engine.step_cost import StepCost
    from v4flash_backend.trn2.launch import NeuronSettings
    from v4flash_backend.trn2.static_runner import StaticRunner

    b2 = SHARED + _prompt(18, 4)[1:]
    Q = 1 + tiny_model.cfg.dspark_block_size  # chunks of more rows run the prefill graphs

    def run(cache, prompts):
        sr = StaticRunner(tiny_model, 2, 96, settings=NeuronSettings(backend="none"), prefill_rows=8)
        eng = Engine(sr, Settings(max_num_seqs=2, max_model_len=96, spec_mode="fixed", prefill_chunk=7,
                                  prefix_cache_bytes=(64 << 20) if cache else 0))
        eng.cost = StepCost(snapshot_sps())
        out = []
        for p in prompts:
            before = sr.counters["prefill_graphs"]
            ev = eng.run_request(GenerateRequest(prompt=p, max_tokens=6, temperature=0.8, seed=3, ignore_eos=True))
            out.append(([t for e in ev for t in e.token_ids], ev[-1].num_cached_tokens,
                         sr.counters["prefill_graphs"] - before))
        return out, eng.stats()

    got, st = run(True, [A, b2])
    want, _ = run(False, [A, b2])
    assert [t for t, _, _ in got] == [t for t, _, _ in want]
    assert got[1][1] == 21 and st["prefix_cache_hits"] == 1 and st["static_steps"] > 0
    rest = [min(7, len(b2) - k) for k in range(21, len(b2), 7)]
    cold = [min(7, len(b2) - k) for k in range(0, len(b2), 7)]
    assert got[1][2] == sum(n > Q for n in rest) == 2
    assert want[1][2] == sum(n > Q for n in cold) == 5


def snapshot_sps():
    from v4flash_backend.engine.dspark_sched import SPSTable

    return SPSTable([1, 2, 4, 8, 16], [10.0, 9.8, 9.5, 9.0, 8.0])


# ---- the rank group: every rank keeps and restores its own shard ---------------------------------
@pytest.mark.slow
def test_rank_group_w2_cached_prefix_equals_w1_cold(golden_dir, tiny_model):
    """W = 2 (gloo, loopback), cache on: A, B, B with seeded sampling give the tokens and log-probs
    (top 3 alternatives: functions of the logits) of the W = 1 engine with the cache off on the same
    history. Exact numerics make the sharded forward bit-identical to W = 1, so a rank that did not
    restore its own shard (the plan not carried to rank 1) changes them."""
    from v4flash_backend.group.rank_group import RankGroup

    settings = Settings(checkpoint_dir=str(golden_dir), world_size=2, max_num_seqs=2, max_model_len=96,
                        spec_mode="fixed", prefill_chunk=7, prefix_cache_bytes=64 << 20, heartbeat_s=1.0,
                        collective_timeout_s=20.0, startup_timeout_s=300.0)
    params = {"max_tokens": 8, "ignore_eos": True, "temperature": 0.9, "seed": 11, "logprobs": 3}
    g = RankGroup.launch(settings)
    try:
        got = []
        for p in (A, B, B):
            res = g.submit(p, dict(params)).result(timeout=300)
            assert res["error"] is None
            ev = res["events"]
            got.append((res["token_ids"], ev[-1]["num_cached_tokens"], [x for e in ev for x in e.get("logprobs", [])]))
        st = g.stats()["engine"]
    finally:
        g.shutdown(timeout=30)
    eng = Engine(LocalRunner(tiny_model, 3, 96), Settings(max_num_seqs=2, max_model_len=96, spec_mode="fixed",
                                                          prefill_chunk=7, prefix_cache_bytes=0))
    want = []
    for p in (A, B, B):
        ev = eng.run_request(GenerateRequest(prompt=p, max_tokens=8, ignore_eos=True, temperature=0.9, seed=11,
                                             logprobs=3))
        want.append(([t for e in ev for t in e.token_ids], [x for e in ev for x in (e.logprobs or [])]))
    assert [c for _, c, _ in got] == [0, 21, 25] and st["prefix_cache_hits"] == 2
    for (t1, _, lp1), (t0, lp0) in zip(got, want):
        assert t1 == t0
        assert json.loads(json.dumps(lp1)) == json.loads(json.dumps(lp0))


# ---- metrics -----------------------------------------------------------------------------------
def test_prefix_cache_metrics_follow_the_engine_counts():
    from v4flash_backend.serving.metrics import ServingMetrics

    class M:
        def __init__(self):
            self.value = 0.0

        def increment(self, v):
            self.value += v

        def set(self, v):
            self.value = v

    class Fam:
        COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
        names = []

        def __init__(self, name, description, kind):
            Fam.names.append(name)

        def Metric(self, labels, buckets=None):  # noqa: N802 - pb_utils' spelling
            return M()

    class Pb:
        MetricFamily = Fam

    m = ServingMetrics(Pb(), "v4flash", "1")
    assert {"v4flash:prefix_cache_hits_total", "v4flash:prefix_cache_misses_total",
            "v4flash:prefix_cache_cached_tokens_total", "v4flash:prefix_cache_evictions_total",
            "v4flash:prefix_cache_bytes"} <= set(Fam.names)
    m.set_prefix_cache({"prefix_cache_hits": 3, "prefix_cache_misses": 2, "prefix_cache_cached_tokens": 700,
                        "prefix_cache_evictions": 1, "prefix_cache_bytes": 4096})
    m.set_prefix_cache({"prefix_cache_hits": 5, "prefix_cache_misses": 2, "prefix_cache_cached_tokens": 900,
                        "prefix_cache_evictions": 1, "prefix_cache_bytes": 2048})
    c = m.prefix_counters
    assert (c["hits"].value, c["misses"].value, c["cached_tokens"].value, c["evictions"].value) == (5, 2, 900, 1)
    assert m.prefix_bytes.value == 2048
    m.set_prefix_cache({"prefix_cache_hits": 1, "prefix_cache_misses": 0, "prefix_cache_cached_tokens": 10,
                        "prefix_cache_evictions": 0, "prefix_cache_bytes": 0}, epoch=1)  # a restarted group
    assert c["hits"].value == 6 and c["cached_tokens"].value == 910 and m.prefix_bytes.value == 0


# ---- perf/bench_prefix_cache.py ----------------------------------------------------------------
def test_bench_prefix_cache_ends_with_its_summary_line():
    """The bench's last line has the issue's format (its numbers are not checked: a tiny run)."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    args = "--shared 24 --tail 4 --requests 2 --turns 2 --rounds 1 --max-tokens 2 --prefill-chunk 8".split()
    r = subprocess.run([sys.executable, str(repo / "perf" / "bench_prefix_cache.py"), *args],
                       capture_output=True, text=True, timeout=600, cwd=repo)
    assert r.returncode == 0, r.stderr
    last = r.stdout.strip().splitlines()[-1]
    num = r"[0-9]+(\.[0-9]+)?"
    assert re.fullmatch(rf"prefix-cache: shared_tokens=24 ttft_off_ms={num} ttft_on_ms={num} ttft_speedup={num} "
                        rf"hit_rate={num} same_tokens=(yes|no)", last), last
    assert last.endswith("same_tokens=yes")  # the cache never changes a request's tokens


# ---- the trn2 arithmetic -----------------------------------------------------------------------
def test_placement_prefix_bytes_are_what_a_snapshot_holds(tiny_model):
    """parallel.placement.prefix_cache_bytes (the trn2 figures of `v4flash_backend placement`) counts
    what model.snapshot keeps: an entry 32 tokens after its parent, past the window, at a boundary
    p = 64 (a continuation from p - 1 = 63 reads the pending rows 62, 63: r rows, the most it holds)."""
    from v4flash_backend.model.state import ModelState
    from v4flash_backend.parallel.placement import prefix_cache_bytes

    cfg = tiny_model.cfg
    snap = snapshot.capture(ModelState(cfg, 1, 96), 0, 64, 32)
    assert snapshot.nbytes(snap) == prefix_cache_bytes(cfg, 32, 1)


def test_placement_report_prints_the_prefix_cache_line(capsys):
    import argparse
    import re

    from v4flash_backend.parallel import placement

    ap = argparse.ArgumentParser()
    placement.add_arguments(ap)
    placement.main(ap.parse_args([]))
    lines = capsys.readouterr().out.strip().splitlines()
    line = next(x for x in lines if x.startswith("prefix-cache-trn2:"))
    m = re.fullmatch(r"prefix-cache-trn2: world=64 bytes_per_token=(\d+) leftover_gib=([\d.]+) \(of 24\) "
                     r"tokens_in_leftover=(\d+) tokens_in_default_budget=(\d+)", line)
    assert m, line
    per_token, left = int(m.group(1)), float(m.group(2))
    # leftover_gib is printed to 2 decimals: tokens within that rounding (0.005 GiB) of left / per_token
    assert abs(int(m.group(3)) - left * 2**30 / per_token) <= 0.005 * 2**30 / per_token
    assert lines[-1].startswith("placement: world=64 ")  # the summary line stays last


def test_a_pipeline_stage_snapshots_the_caches_it_keeps(tiny_model):
    """A stage's trimmed state (parallel.pipeline.trim_state: its layers' caches, no DSpark rings
    before the last stage) is captured and restored as it is: the rows of its layers come back."""
    from v4flash_backend.model.state import ModelState
    from v4flash_backend.parallel.pipeline import trim_state

    cfg = tiny_model.cfg
    st = trim_state(ModelState(cfg, 2, 96), 0, 5, keep_dspark=False)
    g = torch.Generator().manual_seed(0)
    for d in (st.window, st.ckv, st.ik, st.pend_kv, st.pend_score):
        for t in d.values():
            t[0] = torch.randn(t[0].shape, generator=g).to(t.dtype)
    snapshot.restore(st, 1, [snapshot.capture(st, 0, 40, 0)])
    assert set(st.window) == set(range(5)) and not st.dspark
    for layer, t in st.window.items():  # the window rows a continuation from 39 reads: 24..39
        pos = torch.arange(40 - cfg.window_size, 40) % t.shape[1]
        assert torch.equal(t[1, pos], t[0, pos]), layer
    for layer, t in st.ckv.items():
        n = 40 // cfg.compress_ratios[layer]
        assert torch.equal(t[1, :n], t[0, :n]) and not t[1, n:].any(), layer


def test_the_cache_is_off_under_reference_numerics_and_at_budget_0():
    """Reference numerics make a row depend on chunking: a restored prefix would change results, so
    the cache neither restores nor keeps entries there (nor with a budget of 0)."""
    from v4flash_backend import ops

    r = FakeRunner()
    on = PrefixCache(r, 10_000)
    _prefill(on, S(list(range(1, 17))), 8)
    assert len(r.held) == 2
    ops.set_numerics("reference")  # the autouse fixture restores the serving defaults afterwards
    s = S(list(range(1, 17)) + [5])
    _prefill(on, s, 8)
    assert s.num_cached_tokens == 0 and len(r.held) == 2 and not r.loads
    ops.set_numerics("exact")
    off = PrefixCache(FakeRunner(), 0)
    _prefill(off, S(list(range(1, 17))), 8)
    assert not off.entries and off.stats()["prefix_cache_enabled"] is False
