"""Graphs compiled ahead of time (trn2/graph_key.py, trn2/artifacts.py, group/aot.py).

Fast, on small functions through the served compile path (`compile_step`, dynamo, backend eager):
- the graph key is the program's: the same function over other tensors of the same shapes keys the
  same, a different literal, shape or compiler flag keys differently, a collective's group counts by
  its role (`roles`), not its process-group name;
- an artifact is the graph's source: loaded, it computes what the traced function does, its
  collectives bound to this rank's groups;
- a server's source of graphs loads what the manifest has, compiles a missing graph with
  compile_on_miss and refuses it by name without; a manifest whose artifact file is gone, or that was
  compiled for another world size or graph-shaping setting, is refused before anything is traced,
  naming the graph or the setting;
- a bound graph (its binding: where each input comes from) is loaded by name and called on another
  process's objects without dynamo (its captured-graph counter stays), computing on those objects; a
  binding whose input is gone or has another shape is refused naming the graph and the input.

Slow, end to end: `python -m v4flash_backend compile` for a W = 2 static server (the 4-layer model,
one decode and one prefill bucket): graphs = distinct = compiled, a second run compiles nothing; a
W = 2 group started from the artifacts compiles and traces no graph (counted) and serves the ids (greedy, and
seeded at T = 0.8) of a group that compiled its own; with one artifact removed the group refuses to
start, naming that graph.
"""

import json
import re
from pathlib import Path

import pytest
import torch

from v4flash_backend.trn2.artifacts import ArtifactError, ArtifactSource, ArtifactStore, Manifest
from v4flash_backend.trn2.compiler import CompileStats, compile_step
from v4flash_backend.trn2.graph_key import KEY_VERSION, graph_key
from v4flash_backend.trn2.launch import NeuronSettings

REPO = Path(__file__).resolve().parents[1]
EAGER = NeuronSettings(backend="eager")


class _Keep:
    """An ArtifactSource stand-in that records each traced graph (the compile command's Capture)."""

    roles: dict = {}
    loaded = 0

    def __init__(self, roles=None):
        self.roles, self.seen = roles or {}, []

    def resolve(self, name, key, compile_fn, gm=None, example_inputs=None):
        self.seen.append((name, key, gm))
        return compile_fn()

    def record(self, name, rec):  # the graph's binding (what the compile command writes per graph name)
        self.rec = dict(rec, key=self.seen[-1][1])


def _capture(fn, *args, roles=None, settings=EAGER):
    keep = _Keep(roles)
    out = compile_step(fn, settings, CompileStats(), name="g", artifacts=keep)(*args)
    return keep.seen[0], out


def test_the_key_is_the_program():
    w = torch.randn(4, 4)
    (_, k1, _), _ = _capture(lambda x: (x @ w) - 3, torch.randn(2, 4))
    (_, k2, _), _ = _capture(lambda x: (x @ w) - 3, torch.randn(2, 4))  # other values, same shapes
    (_, k3, _), _ = _capture(lambda x: (x @ w) - 4, torch.randn(2, 4))  # a literal (a rank's offset, say)
    (_, k4, _), _ = _capture(lambda x: (x @ w) - 3, torch.randn(3, 4))  # another bucket
    (_, k5, _), _ = _capture(lambda x: (x @ w) - 3, torch.randn(2, 4), settings=NeuronSettings(backend="aot_eager"))
    assert k1 == k2 and len({k1, k3, k4, k5}) == 4


def test_a_collective_is_keyed_by_its_group_role():
    from v4flash_backend.trn2.graph_key import canonical

    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "3")))
    a = torch.fx.GraphModule(torch.nn.Module(), g)
    b = torch.fx.GraphModule(torch.nn.Module(), g.__deepcopy__())
    next(n for n in b.graph.nodes if n.op == "call_function").args = (next(iter(b.graph.nodes)), "sum", "7")
    ins = [torch.zeros(4)]
    assert graph_key(a, ins) != graph_key(b, ins)  # rank r's attention group is group 3, rank r' s is 7
    assert graph_key(a, ins, roles={"3": "attn"}) == graph_key(b, ins, roles={"7": "attn"})
    assert "@attn" in canonical(a, ins, roles={"3": "attn"})


def _store(tmp_path, **kw) -> ArtifactStore:
    m = Manifest(backend="eager", flags=["backend=eager"], world_size=2, model_config="m", key_version=KEY_VERSION,
                 **kw)
    s = ArtifactStore(tmp_path, m)
    s.save()
    return s


def test_an_artifact_loads_as_the_traced_program(tmp_path):
    w, st = torch.randn(4, 4), torch.zeros(3, 4)

    def f(x, idx):
        st.index_put_((idx,), x @ w)  # a state write, as the rounds' masked writes
        return (x @ w).sum(-1) * 2

    x, idx = torch.randn(2, 4), torch.tensor([0, 2])
    (name, key, gm), want = _capture(f, x, idx)
    store = _store(tmp_path)
    store.manifest.graphs[key] = {"name": name, "artifact": store.write_graph(key, gm, {}), "seconds": 0.0}
    store.save()
    src = ArtifactSource(ArtifactStore.open(tmp_path), {}, compile_on_miss=False)
    stats = CompileStats()
    st.zero_()
    got = compile_step(f, EAGER, stats, name=name, artifacts=src)(x, idx)
    assert torch.equal(got, want) and torch.equal(st[[0, 2]], x @ w) and st[1].abs().sum() == 0
    assert src.loaded == 1 and stats.graphs == 0  # loaded, nothing compiled
    text = (tmp_path / store.manifest.graphs[key]["artifact"]).read_text()
    assert "def forward(self" in text and "index_put_" in text


def test_a_missing_graph_is_compiled_or_refused_by_name(tmp_path):
    store = _store(tmp_path)
    with pytest.raises(ArtifactError, match=r"graph 'round verify S=1 Q=6 ctx=64' \(key abc\) is not among"):
        ArtifactSource(store, {}, compile_on_miss=False).resolve("round verify S=1 Q=6 ctx=64", "abc", lambda: 1)
    src = ArtifactSource(store, {}, compile_on_miss=True)
    assert src.resolve("g", "abc", lambda: "compiled") == "compiled" and src.missed == ["g"] and src.loaded == 0


def test_stale_or_incomplete_artifacts_are_refused_naming_what(tmp_path):
    store = _store(tmp_path, graphs={"k1": {"name": "prefill S=1 Q=16 ctx=64", "artifact": "graphs/k1.py"}})
    (tmp_path / "graphs").mkdir()
    (tmp_path / "graphs" / "k1.py").write_text("")
    want = {"backend": "eager", "flags": ["backend=eager"], "world_size": 2, "model_config": "m"}
    assert store.problems(want) == []
    (tmp_path / "graphs" / "k1.py").unlink()
    assert store.problems(want) == ["graph 'prefill S=1 Q=16 ctx=64': its artifact graphs/k1.py (key k1) is missing"]
    with pytest.raises(ArtifactError, match="world_size: compiled for 2, this server has 4"):
        store.check(dict(want, world_size=4))


def test_artifacts_of_other_model_code_are_refused(tmp_path):
    """A bound graph is loaded without a trace, so the manifest names the code it was traced from:
    artifacts compiled from other v4flash source (a digest of the packages' .py files) are stale."""
    from v4flash_backend.trn2.artifacts import source_digest, versions

    here = versions()
    assert here["v4flash-source"] == source_digest() and len(source_digest()) == 16
    store = _store(tmp_path, versions=dict(here, **{"v4flash-source": "0" * 16}))
    want = {"backend": "eager", "flags": ["backend=eager"], "world_size": 2, "model_config": "m", "versions": here}
    with pytest.raises(ArtifactError, match=r"versions: compiled for .*'v4flash-source': '0{16}'"):
        store.check(want)
    store.manifest.versions = here
    assert store.problems(want) == []


def test_a_finished_compile_is_known_without_a_trace(tmp_path):
    """group.aot._complete: a rerun of the compile command needs no trace when the manifest is for the
    same source, model, compiler, world and settings and holds every start-up graph bound, with its
    artifact; a missing artifact, a missing binding or another expectation sends it back to the trace."""
    from v4flash_backend.group.aot import _complete

    order = [["round verify S=1 Q=6 ctx=40", "k1"], ["prefill S=1 Q=16 ctx=40", "k2"]]
    store = _store(tmp_path, per_rank=order, bindings={n: {"key": k} for n, k in order},
                   graphs={k: {"name": n, "artifact": f"graphs/{k}.py"} for n, k in order})
    (tmp_path / "graphs").mkdir()
    for _, k in order:
        (tmp_path / "graphs" / f"{k}.py").write_text("")
    want = {"backend": "eager", "flags": ["backend=eager"], "world_size": 2, "model_config": "m"}
    assert _complete(tmp_path, want) == ["k1", "k2"]
    assert _complete(tmp_path, dict(want, world_size=4)) is None
    (tmp_path / "graphs" / "k2.py").unlink()
    assert _complete(tmp_path, want) is None
    (tmp_path / "graphs" / "k2.py").write_text("")
    store.manifest.bindings.pop(order[0][0])
    store.save()
    assert _complete(tmp_path, want) is None


# ---- bound graphs: loaded by name, called without dynamo -------------------------------------------------
_DEQ: dict = {}  # an id()-keyed cache of derived weights, as ops.torch_ops' dequantized weights


class _Weights(dict):
    """A dict subclass, as model.weights' (dynamo names its items by their position among the keys)."""


class _Model:
    """What a served graph closes over: weights in a dict (by key), a stack held beside them (found by
    search, as ffn's stacked experts in W.meta), a state buffer written in place, a derived weight in an
    id()-keyed module cache."""

    def __init__(self, seed):
        g = torch.Generator().manual_seed(seed)
        self.W = _Weights({f"w{i}": torch.randn(4, 4, generator=g) for i in range(3)})
        self.meta = {"stack": [torch.randn(2, 4, generator=g)]}
        self.state = torch.zeros(3, 4)
        _DEQ[id(self.meta["stack"][0])] = (self.meta["stack"][0], self.meta["stack"][0] * 2)


def _served_fn(m):
    def step(x, idx):
        h = None
        for k, w in m.W.items():  # keyed by position in dynamo's sources (as the model's weights are)
            if k != "w1":
                h = x @ w if h is None else h + x @ w
        h = h + _DEQ[id(m.meta["stack"][0])][1].sum(0)
        m.state.index_put_((idx,), h)
        return {"y": h.sum(-1) * 2, "dtype": torch.float32}, m.state[0]

    return step


def _expected(m, x, idx):
    h = x @ m.W["w0"] + x @ m.W["w2"] + (m.meta["stack"][0] * 2).sum(0)
    return h.sum(-1) * 2, h


def _compiled_bound(tmp_path, m0, x, idx):
    """The compile command's part on `m0`: the graph traced, its artifact and binding written."""
    keep = _Keep()
    compile_step(_served_fn(m0), EAGER, CompileStats(), name="step S=2", artifacts=keep)(x, idx)
    name, key, gm = keep.seen[0]
    store = _store(tmp_path, bindings={name: keep.rec})
    store.manifest.graphs[key] = {"name": name, "artifact": store.write_graph(key, gm, {}), "seconds": 0.0}
    store.save()
    return keep.rec


def test_a_bound_graph_runs_on_the_live_objects_without_dynamo(tmp_path):
    """The served path: a new process's objects (other values, same structure), the graph bound by its
    name and called without a trace (dynamo's captured-graph counter does not move), computing on those
    objects -- their weights, their id()-keyed cache entry, their state buffer written in place."""
    from torch._dynamo.utils import counters

    x, idx = torch.randn(2, 4), torch.tensor([0, 2])
    rec = _compiled_bound(tmp_path, _Model(1), x, idx)
    paths = {str(p) for _, p in rec["captured"]}
    assert any("id_item" in p and "'meta'" in p for p in paths), paths  # the stack, found beside the weights
    m = _Model(2)
    src = ArtifactSource(ArtifactStore.open(tmp_path), {}, compile_on_miss=False)
    stats, before = CompileStats(), counters["stats"]["unique_graphs"]
    step = compile_step(_served_fn(m), EAGER, stats, name="step S=2", artifacts=src)
    for k in range(2):  # the first call binds, the second takes the same path
        xk = x + k
        out, row0 = step(xk, idx)
        y, h = _expected(m, xk, idx)
        # the same ops in the same order on the same values as _expected: exact (tolerance 0)
        assert torch.equal(out["y"], y) and out["dtype"] is torch.float32
        assert torch.equal(m.state[[0, 2]], h) and m.state[1].abs().sum() == 0 and row0 is not None
    assert counters["stats"]["unique_graphs"] == before, "the bound graph was traced"
    assert (src.loaded, src.bound, stats.graphs, stats.express_calls) == (1, 1, 0, 2)


def test_a_binding_that_does_not_fit_is_refused_by_name(tmp_path):
    x, idx = torch.randn(2, 4), torch.tensor([0, 2])
    _compiled_bound(tmp_path, _Model(1), x, idx)
    m = _Model(2)
    m.W["w2"] = torch.zeros(4, 5)  # a weight of another shape than the graph was compiled for
    src = ArtifactSource(ArtifactStore.open(tmp_path), {}, compile_on_miss=False)
    with pytest.raises(ArtifactError, match=r"graph 'step S=2' .* does not bind on this server: graph input \d+ "
                                            r"\(L\['m'\]\.W\['w2'\]\) is \[\[4, 5\]"):
        compile_step(_served_fn(m), EAGER, CompileStats(), name="step S=2", artifacts=src)(x, idx)
    del m.W["w2"]  # gone
    with pytest.raises(ArtifactError, match=r"L\['m'\]\.W\['w2'\]: KeyError"):
        compile_step(_served_fn(m), EAGER, CompileStats(), name="step S=2", artifacts=src)(x, idx)


def test_a_graph_setting_other_than_the_compiles_is_refused_by_name(tmp_path):
    from v4flash_backend.settings import Settings
    from v4flash_backend.trn2.artifacts import graph_settings

    store = _store(tmp_path, settings={"max_model_len": 40, "world_size": 2})
    want = {"backend": "eager", "graph_settings": graph_settings(Settings(max_model_len=48))}
    assert "setting max_model_len: compiled for 40, this server has 48" in store.problems(want)


# ---- end to end ---------------------------------------------------------------------------------------
# dspark_adaptive off and a pinned step-cost table: admission then reads that table, not the group's own
# timings, so two groups' seeded ids can be compared (as tests/test_static_round.py's groups do)
SETTINGS = dict(world_size=2, max_num_seqs=1, max_model_len=40, prefill_chunk=16, warm_processed=False,
                decode_graph="static", graph_backend="eager", dspark_adaptive=False)
_LINE = re.compile(r"compile: graphs=(\d+) distinct=(\d+) ranks=(\d+) compiled=(\d+) reused=(\d+) seconds=[\d.]+")


def _compile(ckpt, out) -> dict:
    import subprocess
    import sys

    flags = [f"--{k.replace('_', '-')}={str(v).lower() if isinstance(v, bool) else v}" for k, v in SETTINGS.items()]
    r = subprocess.run([sys.executable, "-m", "v4flash_backend", "compile", "--checkpoint", str(ckpt), "--out",
                        str(out), "--jobs", "2", *flags], capture_output=True, text=True, timeout=1200,
                       env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    m = _LINE.fullmatch(r.stdout.strip().splitlines()[-1])
    assert m, r.stdout[-500:]
    traced = "nothing to do" not in r.stdout  # group.aot._complete: a finished compile is not traced again
    return dict(zip(("graphs", "distinct", "ranks", "compiled", "reused"), map(int, m.groups())), traced=traced)


def _serve(ckpt, sps_path, artifacts=""):
    from v4flash_backend.group.rank_group import RankGroup
    from v4flash_backend.settings import Settings

    s = Settings(checkpoint_dir=str(ckpt), compiled_artifacts=str(artifacts), compile_on_miss=not artifacts,
                 startup_timeout_s=900.0, collective_timeout_s=300.0, prefix_cache_bytes=0, step_cost_online=False,
                 sps_path=str(sps_path), **SETTINGS)
    g = RankGroup.launch(s)
    try:
        got = [g.submit([0, 17, 230, 5, 99], {"max_tokens": 6, "temperature": t, "seed": 3, "ignore_eos": True})
               .result(timeout=300)["token_ids"] for t in (0.0, 0.8)]
        return got, g.stats()["engine"]
    finally:
        g.shutdown(timeout=60)


@pytest.mark.slow
def test_compile_once_then_every_rank_loads(small_ckpt, tmp_path):
    from v4flash_backend.engine.dspark_sched import SPSTable
    from v4flash_backend.group.rank_group import RankGroupError
    from v4flash_backend.settings import Settings
    from v4flash_backend.trn2.graphs import startup_graphs

    sps = tmp_path / "sps.json"
    SPSTable([1, 2, 4, 8, 16], [10.0, 9.8, 9.5, 9.0, 8.0]).save(sps)
    out = tmp_path / "compiled"
    first = _compile(small_ckpt, out)
    per_rank = startup_graphs(Settings(**SETTINGS))  # verify + draft round, prefill, forward
    assert first == dict(graphs=per_rank, distinct=per_rank, ranks=2, compiled=per_rank, reused=0, traced=True), first
    # resumable: nothing left to do, known without a trace
    assert _compile(small_ckpt, out) == dict(first, compiled=0, reused=per_rank, traced=False)
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(manifest["graphs"]) == per_rank and manifest["world_size"] == 2

    loaded_ids, loaded = _serve(small_ckpt, sps, out)
    own_ids, own = _serve(small_ckpt, sps)  # a group that compiles its own graphs at start
    assert loaded_ids == own_ids and all(len(i) == 6 for i in loaded_ids)
    # loaded by name and bound: no graph traced by dynamo at start (counted), none compiled
    assert (loaded["startup_graphs_loaded"], loaded["startup_graphs_compiled"]) == (per_rank, 0)
    assert loaded["startup_graphs_traced"] == 0 and own["startup_graphs_traced"] == per_rank
    assert (own["startup_graphs_loaded"], own["startup_graphs_compiled"]) == (0, per_rank)
    assert len(manifest["bindings"]) == per_rank
    assert loaded["graphs_compiled"] == 0 and loaded["static_steps"] == loaded["decode_steps"] > 0

    victim = next(g for g in manifest["graphs"].values() if g["name"].startswith("prefill"))
    (out / victim["artifact"]).unlink()
    with pytest.raises(RankGroupError) as e:
        _serve(small_ckpt, sps, out)
    assert f"graph {victim['name']!r}: its artifact {victim['artifact']}" in str(e.value)


def test_one_compile_worker_compiles_many_graphs():
    """A compile worker process takes graph after graph (group.aot._compile_job): twelve in one process,
    past dynamo's limit of 8 cache entries per code object (each graph runs through the same loader)."""
    from v4flash_backend.group.aot import Job, _compile_job, _input_spec
    from v4flash_backend.trn2.artifacts import graph_source

    jobs = []
    for k in range(12):
        x = torch.randn(k + 1, 4)
        (name, key, gm), _ = _capture(lambda x, k=k: (x * k).sum(-1), x)
        jobs.append(Job(key, name, graph_source(gm, {}), [_input_spec(x)], "eager", {}, 1, 1, 1, {}, "torch"))
    with torch._dynamo.config.patch(recompile_limit=8):  # a fresh worker's (compile_step raised it here)
        assert [_compile_job(j)[0] for j in jobs] == [j.key for j in jobs]
