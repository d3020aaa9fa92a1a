"""The parallel layout on the golden tiny checkpoint: shard loading, step plans, and the forward
at W = 2 and 4 (torchrun, gloo, loopback) against W = 1.

Numerical claims and their tolerances:
- 'exact' numerics (fp64 accumulation, the serving default): row-parallel partials are reduced in
  fp64, where sums of fp8/bf16 products are exact, so W > 1 must equal W = 1 bit for bit (batched
  prefill, decode, DSpark base logits);
- 'reference' numerics: the per-layer teacher-forced replay of case0 must pass the golden
  README's strict per-layer criteria (6.3: <= 5 % of rows above 2e-3 relative error on x_out /
  attn_out / ffn_out, pre-mix within 1e-4, same top-k sets) against the reference's W = 1
  captures, and end-to-end logits (every case, prefill and teacher-forced decode) must agree
  with our W = 1 at least as well as the reference's own W = 4 run agrees with its W = 1 run
  (cases_w4.safetensors): per case max |d| no larger, min row cosine and top-1 agreement no lower;
- the collectives counted during each forward equal `placement.collectives_per_forward`.

Run as a script under torchrun, this file is the per-rank side of those tests.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO.parent / "shared" / "golden" / "v41-tiny"
SRC = REPO / "src"


# ---- the checks every world size runs (in-process at W = 1, per rank under torchrun) ---------------
def _checks(m, coll, cases) -> dict:
    from v4flash_backend import ops
    from v4flash_backend.checks import golden
    from v4flash_backend.model.dspark import DSparkDrafter
    from v4flash_backend.model.state import ModelState, make_segments

    fx = golden.GoldenFixture(GOLDEN)
    res = {}
    ops.set_numerics("reference")
    if cases:
        rep = golden.Report()
        golden.replay_layers(fx, m, rep, "case0")
        res["replay"] = dict(ok=rep.layers_ok, total=rep.layers_total, max_err=rep.max_layer_err,
                             failures=rep.failures)
    for c in cases:  # golden.run_case's sequence: prefill all rows, then the reference's decode loop
        ids, dec = fx.t(f"{c}.prompt_ids"), fx.t(f"{c}.decode_input_ids")
        S = len(ids)
        st = ModelState(fx.cfg, 1, S + len(dec) + 8)
        st.reference_quirks = True
        res[f"{c}.prefill"] = m.forward(st, ids, make_segments([(0, 0, S)]), logits_rows="all").logits
        res[f"{c}.decode"] = torch.stack([m.forward(st, dec[k:k + 1], make_segments([(0, S + k, 1)])).logits[0]
                                          for k in range(len(dec))])
    ops.set_numerics("exact")
    g = torch.Generator().manual_seed(5)
    a, b = torch.randint(3, 1000, (33,), generator=g), torch.randint(3, 1000, (20,), generator=g)
    st = ModelState(fx.cfg, 3, 96)
    steps = {"batched_prefill": (torch.cat([a, b]), [(2, 0, 33), (0, 0, 20)], "all", True),
             "decode2": (torch.tensor([7, 9]), [(0, 20, 1), (2, 33, 1)], "last", True),
             "first_token": (torch.tensor([0]), [(1, 0, 1)], "last", False)}
    for name, (tok, spec, rows, taps) in steps.items():
        coll.begin_step()
        out = m.forward(st, tok, make_segments(spec), rows, taps)
        res[f"counts.{name}"] = dict(coll.end_step())
        res[f"sp_forwards.{name}"] = getattr(coll, "sp_forwards", 0)
        res[f"exact.{name}"] = out.logits
        res[f"spec.{name}"] = spec
        if taps:
            res[f"taps.{name}"] = out.taps
    if not getattr(m, "is_last_stage", True):  # an earlier pipeline stage: the drafter is on the last
        return res
    dr = DSparkDrafter(m)
    dr.write_ring(st, 2, dr.main_x(res["taps.batched_prefill"][:33]), torch.arange(33))
    coll.begin_step()
    res["exact.draft_U"] = dr.draft(st, [(2, 32, 17)]).base_logits
    res["counts.draft"] = dict(coll.end_step())
    return res


def _rank_main(out_path: str) -> None:
    from v4flash_backend.parallel.collectives import init_distributed
    from v4flash_backend.parallel.comm import load_sharded_model

    torch.set_num_threads(1)
    lay, coll = init_distributed(timeout_s=300)
    ckpt = os.environ.get("V4FLASH_TEST_CKPT", str(GOLDEN))
    m = load_sharded_model(ckpt, lay, coll, os.environ.get("V4FLASH_TEST_SP") == "1")
    res = _checks(m, coll, json.loads(os.environ["V4FLASH_TEST_CASES"]))
    if lay.rank == lay.driver:  # rank 0, or the last pipeline stage's first rank (it has the logits)
        torch.save(res, out_path)
    elif lay.srank == 0:  # the first rank of an earlier stage: its counters, for the pipeline tests
        torch.save(res, f"{out_path}.stage{lay.stage}")
    # tear the group down before interpreter exit: gloo's threads otherwise can abort a rank
    # ("terminate called without an active exception") while the process unwinds
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def torchrun(world: int, args: list[str], timeout: float = 600, env: dict | None = None):
    """Run `args` under torchrun with `world` local ranks (gloo over loopback, 1 thread per rank)."""
    from v4flash_backend.group.rank_group import free_port

    e = dict(os.environ, PYTHONPATH=str(SRC), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", **(env or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), "--monitor-interval", "0.5", *args]
    return subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=timeout)


# W = 2 runs the short cases (seconds); W = 4 runs every case (about a minute on 2 cores: slow)
RUNS = {2: ["case0", "case3"], 4: ["case0", "case1", "case2", "case3"]}
_W1: dict = {}


def w1_results(cases) -> dict:
    from v4flash_backend.model.loading import load_model
    from v4flash_backend.parallel.collectives import Collectives

    key = tuple(cases)
    if key not in _W1:
        _W1[key] = _checks(load_model(GOLDEN), Collectives(), cases)
    return _W1[key]


def _run_ranks(W: int, cases, tmp_path_factory, **env):
    out = tmp_path_factory.mktemp(f"w{W}") / "res.pt"
    r = torchrun(W, [__file__, "--rank-main", str(out)], env={"V4FLASH_TEST_CASES": json.dumps(cases), **env})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return torch.load(out)


@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)])
def wn(request, tmp_path_factory):
    W = request.param
    return W, _run_ranks(W, RUNS[W], tmp_path_factory), w1_results(RUNS[W])


# ---- distributed forward against W = 1 ----------------------------------------------------------------
@pytest.mark.numerics
def test_layer_replay_passes_strict_criteria(wn):
    W, res, w1 = wn
    rep = res["replay"]
    assert rep["total"] == 10 and rep["ok"] == 10, rep["failures"]
    assert rep["max_err"] <= w1["replay"]["max_err"]  # no worse than W = 1 (which replays it exactly)


def _agreement(mine: torch.Tensor, ref: torch.Tensor):
    cos = torch.nn.functional.cosine_similarity(mine, ref, dim=-1).min().item()
    return (mine - ref).abs().max().item(), cos, int((mine.argmax(-1) == ref.argmax(-1)).sum())


@pytest.mark.numerics
def test_end_to_end_logits_at_least_as_close_as_reference_w4(wn):
    from safetensors import safe_open

    W, res, w1 = wn
    with safe_open(str(GOLDEN / "cases.safetensors"), "pt") as f1, \
            safe_open(str(GOLDEN / "cases_w4.safetensors"), "pt") as f4:
        for c in RUNS[W]:
            for q, key in (("prefill", "prefill_logits"), ("decode", "decode_logits")):
                d_ref, cos_ref, top_ref = _agreement(f4.get_tensor(f"{c}.{key}"), f1.get_tensor(f"{c}.{key}"))
                d, cos, top = _agreement(res[f"{c}.{q}"], w1[f"{c}.{q}"])
                assert d <= d_ref and cos >= cos_ref and top >= top_ref, (W, c, q, d, cos, top, d_ref, cos_ref, top_ref)


@pytest.mark.numerics
def test_exact_numerics_are_bit_identical_to_w1(wn):
    W, res, w1 = wn
    for k in ("exact.batched_prefill", "exact.decode2", "exact.first_token", "exact.draft_U",
              "taps.batched_prefill", "taps.decode2"):
        assert res[k].shape == w1[k].shape and torch.equal(res[k], w1[k]), (W, k)


def test_counted_collectives_match_the_layout_formula(wn):
    from v4flash_backend.config import ModelConfig
    from v4flash_backend.parallel.placement import (
        collectives_per_draft,
        collectives_per_forward,
    )

    W, res, _ = wn
    cfg = ModelConfig.from_json(GOLDEN)
    for name in ("batched_prefill", "decode2", "first_token"):
        got = {k: c[0] for k, c in res[f"counts.{name}"].items()}
        want = collectives_per_forward(cfg, W, [(s, n) for _, s, n in res[f"spec.{name}"]])
        assert got == want, (name, got, want)
        # the embedding and the Engram layers' lookups travel in one world all-reduce (issue 47
        # item 5): one per MoE layer besides, not one more per Engram layer (2 here)
        assert got[("world", "all_reduce")] == 1 + cfg.n_layers and len(cfg.engram_layer_ids) == 2, name
    # the single-token step at position 0 reaches no ratio-2 group: only the ratio-1 indexers reduce
    assert {k: c[0] for k, c in res["counts.first_token"].items()}[("attn", "all_reduce")] == 10 + 2
    got = {k: c[0] for k, c in res["counts.draft"].items()}
    assert got == collectives_per_draft(cfg, W)
    # bytes: the MoE carry is fp32 [T, D]; the wo_b partials fp64 [T, D] under exact numerics
    T, D = 53, cfg.dim
    per = res["counts.batched_prefill"]
    engram = len(cfg.engram_layer_ids) * T * cfg.n_hash_cols * cfg.engram_head_dim * 2
    assert per[("world", "all_reduce")][1] == T * D * (2 + 4 * cfg.n_layers) + engram


@pytest.mark.slow
def test_golden_check_cli_under_torchrun_w4():
    """`golden-check` run by 4 ranks: every rank builds its shard (parallel.comm.model_for_env), only
    rank 0 prints, and the strict criteria pass as at W = 1."""
    import re

    r = torchrun(4, ["-m", "v4flash_backend", "golden-check", str(GOLDEN)], timeout=900)
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert sum(line.startswith("golden: ") for line in lines) == 1  # rank 0 alone reports
    m = re.match(r"^golden: cases=4 steps=48 layers_ok=(\d+)/(\d+) ", lines[-1])
    assert m and m.group(1) == m.group(2) == "10", lines[-1]


@pytest.mark.slow
def test_two_attention_groups_at_w4(tmp_path_factory):
    """W = 4 with attention groups of 2 ranks (V4FLASH_ATTN_GROUP=2), the shape of W = 64 with its
    8 groups of 8: attention is replicated per group and reduced within it, experts, vocab and
    Engram rows over all 4 ranks. Exact numerics: bit-identical to W = 1; counts as the formula."""
    from v4flash_backend.config import ModelConfig
    from v4flash_backend.parallel.placement import collectives_per_forward

    res = _run_ranks(4, [], tmp_path_factory, V4FLASH_ATTN_GROUP="2")
    w1 = w1_results([])
    for k in ("exact.batched_prefill", "exact.decode2", "exact.draft_U"):
        assert torch.equal(res[k], w1[k]), k
    cfg = ModelConfig.from_json(GOLDEN)
    got = res["counts.decode2"]
    want = collectives_per_forward(cfg, 4, [(20, 1), (33, 1)])
    assert {k: c[0] for k, c in got.items()} == want
    # group traffic: fp64 wo_b partials [2, D] per layer + fp64 index scores [1, 1, clen] per call
    assert got[("attn", "all_reduce")][1] == 8 * (cfg.n_layers * 2 * cfg.dim + sum(
        (s + 1) // cfg.compress_ratios[i] for i in cfg.index_source_layers for s in (20, 33)))


# ---- loading shards (in-process, no process group) ---------------------------------------------------
def test_shards_reassemble_the_full_weights(monkeypatch):
    from v4flash_backend.config import ModelConfig
    from v4flash_backend.formats.checkpoint import CheckpointReader
    from v4flash_backend.model.weights import load_weights
    from v4flash_backend.parallel.layout import Layout, load_shard, shard_spec

    cfg = ModelConfig.from_json(GOLDEN)
    with CheckpointReader(GOLDEN) as r:
        full = load_weights(r, cfg)
        whole_reads = []
        real_get = r.get
        monkeypatch.setattr(r, "get", lambda name, *a, **k: (whole_reads.append(name), real_get(name, *a, **k))[1])
        W = 4
        shards = [load_shard(r, cfg, Layout(k, W)) for k in range(W)]
        sharded = {n for n in r.keys() if shard_spec(n, r.shape(n), cfg, Layout(0, W)) not in (None, ("full",))}
    assert not set(whole_reads) & sharded  # sharded tensors are only ever read as slices
    V = cfg.vocab_size
    for name, t in full.items():
        held = [s[name] for s in shards if name in s]
        if ".ffn.experts." in name:
            assert len(held) == 1 and torch.equal(held[0], t), name  # each expert on exactly one rank
        elif name in ("embed.weight", "head.weight"):
            cat = torch.cat(held)
            assert torch.equal(cat[:V], t) and not cat[V:].any()
        elif name.endswith(("attn.wo_b.weight", "attn.wo_b.scale")):
            assert _raw(torch.cat(held, 1)) == _raw(t), name
        elif name in sharded:
            assert _raw(torch.cat(held)) == _raw(t), name
        else:
            assert len(held) == W and all(_raw(h) == _raw(t) for h in held), name
    s1 = shards[1]
    assert s1.meta["vocab_start"] == 256 and s1.meta["experts"]["layers.0.ffn"] == [2, 3]
    assert s1.meta["experts"]["mtp.0.ffn"] == [1]
    assert s1.meta["engram_row_start"] == {1: 786, 4: 856}  # ceil(3144 / 4), ceil(3424 / 4)
    assert s1["layers.0.attn.wq_b.weight"].shape == (64, 64) and s1["layers.0.attn.wo_a.weight"].dtype == torch.bfloat16


def _raw(t: torch.Tensor) -> bytes:
    t = t.contiguous() if t.dim() else t.reshape(1)
    return t.view(torch.uint8).numpy().tobytes()


def test_layout_rules():
    from v4flash_backend.parallel.layout import Layout

    lay = Layout(19, 64)
    assert (lay.group_size, lay.group_rank, lay.n_groups, lay.group_ranks(2)) == (8, 3, 8, list(range(16, 24)))
    assert lay.vocab_chunk(129280) == 2048 and lay.vocab_chunk(129280) % 128 == 0
    assert Layout(63, 64).vocab_range(129280) == (63 * 2048, 129280)
    assert lay.expert_range(384) == (114, 120) and lay.split(64 * 512, "wq_b rows", 32) == (3 * 4096, 4 * 4096)
    assert Layout(1, 4).group_size == 4
    with pytest.raises(ValueError, match="multiple of 8"):
        Layout(0, 12)
    with pytest.raises(ValueError, match="cannot be split 8 ways"):
        lay.split(12, "heads")


def test_lookups_reduce_every_part_in_one_collective():
    """DistComm.lookups (the embedding's and the Engram layers' rows): one world all-reduce of the
    parts end to end, in their own dtype (a promoted buffer would not be the bf16 sum W = 1 has),
    each part given back in its shape; a lone part is one call, none is none; mixed dtypes refused.
    The spy sums a second rank's buffer in, as the world would."""
    from v4flash_backend.parallel.collectives import Collectives
    from v4flash_backend.parallel.comm import DistComm
    from v4flash_backend.parallel.layout import Layout

    class Spy(Collectives):
        def all_reduce(self, t, group, label="all_reduce"):
            self.seen.append((group, t.dtype, t.numel()))
            return t + self.peer.reshape(t.shape)

    coll = Spy(sizes={"world": 2, "attn": 2})
    comm = DistComm(Layout(0, 2), coll, 64)
    g = torch.Generator().manual_seed(3)
    mine = [torch.randn(5, 8, generator=g).bfloat16(), torch.randn(5, 3, 4, generator=g).bfloat16()]
    theirs = [torch.randn(5, 8, generator=g).bfloat16(), torch.randn(5, 3, 4, generator=g).bfloat16()]
    coll.seen, coll.peer = [], torch.cat([p.flatten() for p in theirs])
    out = comm.lookups(mine)
    assert coll.seen == [("world", torch.bfloat16, 40 + 60)]
    assert all(torch.equal(o, a + b) for o, a, b in zip(out, mine, theirs, strict=True))
    coll.seen, coll.peer = [], theirs[0]
    assert torch.equal(comm.lookups(mine[:1])[0], mine[0] + theirs[0]) and len(coll.seen) == 1
    coll.seen = []
    assert comm.lookups([]) == [] and coll.seen == []
    with pytest.raises(TypeError, match="share a dtype"):
        comm.lookups([mine[0], mine[1].float()])

# ---- step plans -------------------------------------------------------------------------------------------
def test_step_plans_round_trip():
    from v4flash_backend.group.plan_codec import (
        pack_dspark,
        pack_forward,
        unpack_dspark,
        unpack_forward,
    )

    tok = torch.tensor([5, 6, 7, 8])
    for rows in ("last", "all", "none", torch.tensor([1, 3])):
        a, body = pack_forward(tok, [(2, 10, 3), (0, 0, 1)], rows, True)
        t2, spec, r2, taps = unpack_forward(a, torch.cat([body, torch.full((9,), -7)]))  # trailing junk ignored
        assert torch.equal(t2, tok) and spec == [(2, 10, 3), (0, 0, 1)] and taps is True
        assert r2 == rows if isinstance(rows, str) else torch.equal(r2, rows)
    writes = [(1, torch.arange(3, 6), torch.arange(40, 43)), (0, torch.tensor([], dtype=torch.long), torch.tensor([]))]
    a, body = pack_dspark(writes, [(1, 42, 17), (3, 9, 0)])
    w2, items = unpack_dspark(a, body)
    assert items == [(1, 42, 17), (3, 9, 0)] and len(w2) == 2
    assert w2[0][0] == 1 and torch.equal(w2[0][1], writes[0][1]) and torch.equal(w2[0][2], writes[0][2])
    assert w2[1][0] == 0 and w2[1][1].numel() == 0


def test_plan_runner_validates_before_broadcasting(tiny_model):
    """A bad call raises on rank 0 before any plan goes out (followers never see it), and plans
    larger than the buffer grow it with a GROW plan first."""
    from v4flash_backend.engine.runner import LocalRunner
    from v4flash_backend.group.worker import PlanRunner
    from v4flash_backend.parallel.collectives import Collectives

    class Spy(Collectives):
        def __init__(self):
            super().__init__()
            self.sent = []

        def broadcast(self, t, src, group="world"):
            self.sent.append(t[:8].tolist())
            return t

    coll = Spy()
    pr = PlanRunner(LocalRunner(tiny_model, 2, 64), coll, plan_size=16)
    for bad in ([(2, 0, 3)], [(0, 62, 3)], [(0, 0, 2)]):
        with pytest.raises(ValueError):
            pr.forward(torch.tensor([1, 2, 3]), bad, "last", False)
    with pytest.raises(ValueError, match="token ids"):
        pr.forward(torch.tensor([1, 2, 5000]), [(0, 0, 3)], "last", False)
    assert coll.sent == []
    out = pr.forward(torch.arange(3, 23), [(0, 0, 20)], "all", False)
    assert out.logits.shape == (20, tiny_model.cfg.vocab_size)
    ops = [h[1] for h in coll.sent]
    assert ops == [2, 4] and coll.sent[0][4] == 32 and pr.size == 32  # GROW to 32, then FORWARD
    assert [h[2] for h in coll.sent] == [0, 1]  # sequence numbers


if __name__ == "__main__" and "--rank-main" in sys.argv:
    sys.path.insert(0, str(SRC))
    _rank_main(sys.argv[sys.argv.index("--rank-main") + 1])
