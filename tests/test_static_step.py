"""The static decode step (`static_step`) computes what the eager forward computes, with no host
sync and no graph break.

- On the golden tiny checkpoint, after a prefill: a verify step of a bucket (a 3-row verify, a
  1-row decode and a padding sequence) gives logits and DSpark taps bit-identical to
  `V41Model.forward`, leaves the per-slot state bit-identical, and the DSpark draft graph gives the
  eager drafter's U, hidden rows, greedy chain and ring contents. 'exact' numerics make each row's
  result independent of the batch shape, so equality is exact (torch.equal), not approximate.
- On a 5-layer random model covering every layer type (window-only, ratio-2 KV source + indexer,
  ratio-2 reader, ratio-1 source + indexer + candidate blocks, ratio-1 candidate-masked indexer,
  Engram, one DSpark stage): both graphs compile under torch.compile(fullgraph=True) -- which raises
  on any graph break or host sync -- into exactly one graph each, reproduce the eager results, and
  run again without recompiling.
"""

import copy
import sys
from pathlib import Path

import pytest
import torch

from v4flash_backend import ops
from v4flash_backend.config import ModelConfig
from v4flash_backend.model.state import ModelState, make_segments
from v4flash_backend.trn2.static_step import (
    Bucket,
    HostSyncCounter,
    StaticDecoder,
    graph_host_syncs,
    pick_bucket,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "perf"))
import trn2_projection  # noqa: E402  (the random-model builder)

STATE_BUFFERS = ("window", "ckv", "ik", "pend_kv", "pend_score", "dspark")  # dicts; engram_hist apart


def _seq(n, seed):
    s = torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(seed))
    s[0] = 0
    return s


def _same_state(a: ModelState, b: ModelState) -> list[str]:
    """Names of state tensors that differ (NaN == NaN: never-written pend rows hold -inf only)."""
    bad = []
    for name in STATE_BUFFERS:
        x, y = getattr(a, name), getattr(b, name)
        for k in x:
            if not torch.equal(torch.nan_to_num(x[k].float()), torch.nan_to_num(y[k].float())):
                bad.append(f"{name}[{k}]")
    if not torch.equal(a.engram_hist, b.engram_hist):
        bad.append("engram_hist")
    return bad


@pytest.fixture(scope="module")
def golden_step(tiny_model):
    """Two prefilled sequences (slots 0 and 2; slot 3 is the scratch slot), then the same step eager
    and static on copies of the state."""
    m = tiny_model
    ops.set_numerics("exact")
    st = ModelState(m.cfg, 4, 64)
    a, b = _seq(21, 1), _seq(14, 2)  # 21 and 14: a partial ratio-2 group on one, not the other
    m.forward(st, torch.cat([a, b]), make_segments([(0, 0, 21), (2, 0, 14)]), logits_rows="none")
    se, ss = copy.deepcopy(st), copy.deepcopy(st)
    nxt = torch.tensor([5, 6, 7, 9])
    with HostSyncCounter() as eager_syncs:
        out = m.forward(se, nxt, make_segments([(0, 21, 3), (2, 14, 1)]), logits_rows="all", want_taps=True)
    dec = StaticDecoder(m, ss)
    tokens = torch.zeros(3, 6, dtype=torch.long)
    tokens[0, :3], tokens[1, 0] = nxt[:3], nxt[3]
    plan = (tokens, torch.tensor([0, 2, 3]), torch.tensor([21, 14, 0]), torch.tensor([3, 1, 0]))
    with HostSyncCounter() as static_syncs:
        logits, taps = dec.verify(*plan, ctx=32)
    return dict(m=m, se=se, ss=ss, out=out, dec=dec, plan=plan, logits=logits, taps=taps,
                eager_syncs=eager_syncs.total, static_syncs=static_syncs.calls)


def test_verify_equals_eager_forward(golden_step):
    g = golden_step
    rows = torch.tensor([0, 1, 2, 6])  # the valid rows of the bucket, in the eager row order
    assert torch.equal(g["logits"][rows], g["out"].logits)
    assert torch.equal(g["taps"][rows], g["out"].taps)
    assert _same_state(g["se"], g["ss"]) == []


def test_verify_has_no_host_sync_and_the_counter_sees_eager_ones(golden_step):
    assert golden_step["static_syncs"] == {}
    # negative control: the eager forward reads its host tokens' id range (hasher.compress: int(min),
    # int(max)); since the forward runs on geometries, that is all it reads on the host here
    # ('exact' numerics: the MoE's batched form)
    assert golden_step["eager_syncs"] == 2


def test_draft_equals_eager_drafter(golden_step):
    g = golden_step
    dec, (_, slot, start, _) = g["dec"], g["plan"]
    drafter = dec.drafter
    # the engine's next move: 2 of seq A's 3 rows and seq B's 1 row are committed, drafts follow
    commit = torch.tensor([2, 1, 0])
    anchors = torch.tensor([17, 23, 0])
    se = g["se"]
    drafter.write_ring(se, 0, drafter.main_x(g["out"].taps[:2]), torch.arange(21, 23))
    drafter.write_ring(se, 2, drafter.main_x(g["out"].taps[3:4]), torch.arange(14, 15))
    eager = drafter.draft(se, [(0, 22, 17), (2, 14, 23)])
    e_ids, e_logits, e_conf = drafter.greedy_chain(eager, anchors[:2])
    with HostSyncCounter() as syncs:
        U, hidden, ids, z, conf = dec.draft(g["taps"], commit, slot, start, anchors)
    assert syncs.calls == {}
    assert torch.equal(U[:2], eager.base_logits) and torch.equal(hidden[:2], eager.hidden)
    assert torch.equal(ids[:2], e_ids) and torch.equal(z[:2], e_logits) and torch.equal(conf[:2], e_conf)
    assert _same_state(se, g["ss"]) == []


def test_reference_numerics_are_close(tiny_model):
    """'reference' numerics use fp32 GEMMs whose rounding may depend on the batch shape (rows per
    call), so the static step is only close: within 1e-5 relative, argmax identical."""
    m = tiny_model
    ops.set_numerics("reference")
    st = ModelState(m.cfg, 3, 48)
    m.forward(st, _seq(19, 3), make_segments([(0, 0, 19)]), logits_rows="none")
    se, ss = copy.deepcopy(st), copy.deepcopy(st)
    out = m.forward(se, torch.tensor([4, 8]), make_segments([(0, 19, 2)]), logits_rows="all")
    tokens = torch.zeros(1, 6, dtype=torch.long)
    tokens[0, :2] = torch.tensor([4, 8])
    logits, _ = StaticDecoder(m, ss).verify(tokens, torch.tensor([0]), torch.tensor([19]), torch.tensor([2]), 32)
    scale = out.logits.abs().max()
    assert (logits[:2] - out.logits).abs().max() <= 1e-5 * scale
    assert torch.equal(logits[:2].argmax(-1), out.logits.argmax(-1))


def test_plan_checks_and_buckets(tiny_model):
    dec = StaticDecoder(tiny_model, ModelState(tiny_model.cfg, 3, 64))
    b = Bucket(2, 6, 32)
    dec.check_plan(b, [0, 2], [20, 0], [6, 0])  # a padding sequence may sit anywhere
    for slot, start, n, what in (([2], [0], [1], "scratch"), ([0], [30], [3], "ctx"), ([0], [0], [7], "rows")):
        with pytest.raises(ValueError, match=what):
            dec.check_plan(b, slot, start, n)
    buckets = [Bucket(s, 6, c) for s in (1, 2, 4) for c in (32, 64)]
    assert pick_bucket(buckets, 3, 6, 40) == Bucket(4, 6, 64)
    assert pick_bucket(buckets, 1, 1, 10) == Bucket(1, 6, 32)
    with pytest.raises(ValueError):
        pick_bucket(buckets, 5, 6, 10)
    with pytest.raises(ValueError, match="margin"):
        StaticDecoder(tiny_model, ModelState(tiny_model.cfg, 3, 64, margin=2))


# ---- torch.compile(fullgraph=True) on a small model with every layer type --------------------------
def small_config(golden_dir) -> ModelConfig:
    from v4flash_backend.model.engram_hash import bucket_primes, table_rows

    g = ModelConfig.from_json(golden_dir)
    d = g.to_dict()
    d.update(n_layers=5, compress_ratios=[0, 2, 2, 1, 1, 0], kv_source_layers=[1, 3], index_source_layers=[1, 3, 4],
             candidate_source_layer=3, engram_layer_ids=[1], dspark_target_layer_ids=[2, 3, 4], n_mtp_layers=1,
             n_routed_experts=4, n_activated_experts=2, dspark_n_routed_experts=2, dspark_n_activated_experts=1,
             hc_sinkhorn_iters=2, window_size=8,
             engram_num_embeddings=table_rows(bucket_primes(1, g.engram_max_ngram_size, g.engram_n_heads,
                                                            g.engram_vocab_size)))
    return ModelConfig.from_dict(d)


class GraphCounter:
    """A torch.compile backend that runs the captured graph as is and counts graphs and runs."""

    def __init__(self):
        self.graphs = 0
        self.runs = 0
        self.syncs: list[str] = []

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        self.syncs += graph_host_syncs(gm)

        def run(*args):
            self.runs += 1
            return gm.forward(*args)
        return run


@pytest.fixture(scope="module")
def compiled(golden_dir):
    ops.set_numerics("exact")
    cfg = small_config(golden_dir)
    m = trn2_projection.build_random_model(cfg, golden_dir / "tokenizer.json", seed=3)
    st = ModelState(cfg, 3, 48)
    m.forward(st, _seq(23, 4), make_segments([(0, 0, 23)]), logits_rows="none")  # window 8: crossed
    se, ss = copy.deepcopy(st), copy.deepcopy(st)
    nxt = torch.tensor([5, 6, 7])
    out = m.forward(se, nxt, make_segments([(0, 23, 3)]), logits_rows="all", want_taps=True)
    dec = StaticDecoder(m, ss)
    bucket = Bucket(2, 6, 32)
    before = copy.deepcopy(ss)
    dec.prime(bucket)
    primed_clean = _same_state(before, ss) == []
    tokens = torch.zeros(2, 6, dtype=torch.long)
    tokens[0, :3] = nxt
    plan = (tokens, torch.tensor([0, 2]), torch.tensor([23, 0]), torch.tensor([3, 0]))
    vb, db = GraphCounter(), GraphCounter()
    verify = torch.compile(lambda *a: dec.verify(*a, ctx=bucket.ctx), fullgraph=True, backend=vb, dynamic=False)
    draft = torch.compile(dec.draft, fullgraph=True, backend=db, dynamic=False)
    logits, taps = verify(*plan)
    d_out = draft(taps, torch.tensor([2, 0]), plan[1], plan[2], torch.tensor([11, 0]))
    return dict(m=m, se=se, ss=ss, out=out, dec=dec, plan=plan, logits=logits, taps=taps, d_out=d_out,
                verify=verify, draft=draft, vb=vb, db=db, primed_clean=primed_clean)


def test_compiled_verify_is_one_graph_and_equals_eager(compiled):
    c = compiled
    assert c["vb"].graphs == 1 and c["vb"].runs == 1 and c["vb"].syncs == []
    assert torch.equal(c["logits"][:3], c["out"].logits)
    assert torch.equal(c["taps"][:3], c["out"].taps)
    assert c["primed_clean"], "a padding plan must not change the state"


def test_compiled_draft_is_one_graph_and_equals_eager(compiled):
    c = compiled
    assert c["db"].graphs == 1 and c["db"].runs == 1 and c["db"].syncs == []
    m, se = c["m"], c["se"]
    d = c["dec"].drafter
    d.write_ring(se, 0, d.main_x(c["out"].taps[:2]), torch.arange(23, 25))
    eager = d.draft(se, [(0, 24, 11)])
    e_ids, _, e_conf = d.greedy_chain(eager, torch.tensor([11]))
    U, hidden, ids, _, conf = c["d_out"]
    assert torch.equal(U[:1], eager.base_logits) and torch.equal(hidden[:1], eager.hidden)
    assert torch.equal(ids[:1], e_ids) and torch.equal(conf[:1], e_conf)
    assert _same_state(se, c["ss"]) == []
    assert m.cfg.n_layers == 5


def test_compiled_step_reruns_without_recompiling(compiled):
    c = compiled
    ops.set_numerics("exact")  # the autouse fixture restores ops settings between tests: put back
    ops.backend_module()  # what the graph was traced with (a set_backend() call drops the module)
    tokens, slot, start, n = c["plan"]
    c["verify"](tokens, slot, start + 3, torch.tensor([1, 0]))  # the next decode step: new values, same shapes
    assert c["vb"].graphs == 1 and c["vb"].runs == 2


def test_compile_checks_catch_host_syncs():
    """The mechanism the compile tests rely on, with negative controls: fullgraph=True raises on a
    data-dependent branch or .tolist(); .item() and nonzero are captured into the graph instead, and
    the graph scan (graph_host_syncs) reports them."""
    def item(x):
        return x * x.sum().item()

    def nonzero(x):
        return x[torch.nonzero(x > 0).squeeze(1)]

    def branch(x):
        return x + 1 if x.sum() > 0 else x - 1

    def tolist(x):
        return x * len([v for v in x.tolist() if v > 0])

    for fn in (item, nonzero):
        gc = GraphCounter()
        torch.compile(fn, fullgraph=True, backend=gc)(torch.ones(3))
        assert gc.graphs == 1 and gc.syncs, fn.__name__
    for fn in (branch, tolist):
        with pytest.raises(Exception, match="(?i)data.dependent|unsupported|graph break"):
            torch.compile(fn, fullgraph=True, backend=GraphCounter())(torch.ones(3))
    clean = GraphCounter()
    torch.compile(lambda x: (x * 2).sum(), fullgraph=True, backend=clean)(torch.ones(3))
    assert clean.syncs == []


def test_prefill_chunks_through_the_static_step_equal_the_eager_forward(golden_dir):
    """A long prefill chunk (more rows than every ring: window 8 + margin, pending rows, Engram
    history) and a second chunk starting mid-group, through `StaticDecoder(prefill=True)`: logits,
    taps and the whole per-slot state equal the eager forward bit for bit ('exact' numerics)."""
    ops.set_numerics("exact")
    cfg = small_config(golden_dir)
    m = trn2_projection.build_random_model(cfg, golden_dir / "tokenizer.json", seed=5)
    st = ModelState(cfg, 3, 64)
    se, ss = copy.deepcopy(st), copy.deepcopy(st)
    dec = StaticDecoder(m, ss, max_rows=32, prefill=True)
    seq = _seq(37, 6)
    for start, n in ((0, 23), (23, 14)):
        out = m.forward(se, seq[start:start + n], make_segments([(0, start, n)]), logits_rows="all", want_taps=True)
        tokens = torch.zeros(2, 32, dtype=torch.long)
        tokens[0, :n] = seq[start:start + n]
        with HostSyncCounter() as hs:
            logits, taps = dec.verify(tokens, torch.tensor([0, 2]), torch.tensor([start, 0]), torch.tensor([n, 0]),
                                      ctx=64)
        assert hs.total == 0
        assert torch.equal(logits[:n], out.logits) and torch.equal(taps[:n], out.taps), (start, n)
        assert _same_state(se, ss) == [], (start, n)
