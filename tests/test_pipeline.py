"""Pipeline stages (issue 16): the stage split, the boundary payload, the forward of 2 stages under
torchrun (gloo, loopback) against W = 1, sequence parallelism inside a stage, golden-check with
--pipeline-parallel, the rank group of two torchrun "nodes" and Triton serving through it.

Numerical claims: under 'exact' numerics (fp64 partial sums, the serving default) the stages
run the same layers on the same inputs and the boundary moves bytes (bf16 streams, fp32 pre-mix,
bf16 taps reinterpreted, never converted), so logits, taps and DSpark base logits of P = 2 must
equal W = 1 bit for bit, with and without sequence parallelism (its reduce-scatter sums the same
fp64 partials as the all-reduce, and at 2 ranks per group the fp32 MoE carry sums two terms).
Greedy decoding is lossless under DSpark and batch-invariant under exact numerics, so served
token sequences must equal the in-process W = 1 engine's exactly.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from v4flash_backend.config import ModelConfig
from v4flash_backend.parallel import layout as L
from v4flash_backend.parallel import pipeline as pp
from v4flash_backend.parallel import placement

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO.parent / "shared" / "golden" / "v41-tiny"
SRC = REPO / "src"
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _cfg():
    return ModelConfig.from_json(GOLDEN)


# ---- the split and the payload (in-process) ------------------------------------------------------
def test_stage_cuts_keep_cross_layer_state_inside_a_stage():
    """Tiny: layers 3 / 5 read the compressed KV of 2 / 4, 7..9 that of 6, 8 the candidate mask
    of 6, 9 the top-k of 8: a stage may begin only at 1, 2, 4 or 6; 2 stages cut at 6 (5 is
    not allowed; 4 and 6 are equally far, the later one is taken). Release: layers 20..39 all
    read layer 20's cache, so 2 stages are 0..19 | 20..39 (from the config by hand)."""
    cfg = _cfg()
    assert L.valid_cuts(cfg) == [1, 2, 4, 6]
    assert L.stage_cuts(cfg, 2) == [0, 6, 10]
    rel = ModelConfig.release()
    assert L.stage_cuts(rel, 2) == [0, 20, 40]
    with pytest.raises(ValueError, match="cannot be split"):
        L.stage_cuts(cfg, 6)  # 5 cuts needed, 4 exist


def test_layout_of_two_stages():
    lay = L.Layout(5, 8, 2, 2)  # rank 5 of 8, attention groups of 2, 2 stages of 4
    assert (lay.stage, lay.srank, lay.stage_world, lay.group_rank, lay.n_groups) == (1, 1, 4, 1, 2)
    assert lay.peer(0) == 1 and lay.driver == 4 and lay.group_ranks(lay.group_index) == [4, 5]
    assert lay.expert_range(8) == (2, 4) and lay.vocab_range(1024) == (256, 512)
    with pytest.raises(ValueError, match="multiple of pipeline_parallel"):
        L.Layout(0, 6, 8, 4)


@pytest.mark.parametrize("world", [2, 4])
def test_stage_shards_hold_only_their_layers_and_match_placement(golden_dir, world):
    """Each stage loads its layers' tensors alone (embedding on the first and the last stage, head,
    norm and the DSpark stages on the last), and placement's bytes equal the loaded shards."""
    from v4flash_backend.formats.checkpoint import CheckpointReader

    cfg = ModelConfig.from_json(golden_dir)
    predicted = placement.all_rank_bytes(cfg, world, pipeline=2)
    with CheckpointReader(golden_dir) as r:
        for rank in range(world):
            lay = L.Layout(rank, world, pipeline=2)
            w = L.load_shard(r, cfg, lay)
            layers = {int(n.split(".")[1]) for n in w if n.startswith("layers.")}
            assert layers == set(range(*L.stage_cuts(cfg, 2)[lay.stage:lay.stage + 2]))
            assert any(n.startswith("mtp.") for n in w) == lay.is_last_stage
            assert ("head.weight" in w) == lay.is_last_stage and "embed.weight" in w
            got = dict.fromkeys(placement.COMPONENTS, 0)
            for name, t in w.items():
                got[placement.component(name)] += t.numel() * t.element_size()
            assert got == predicted[rank], (world, rank)


def test_boundary_payload_round_trips_bit_exactly():
    cfg = _cfg()
    g = torch.Generator().manual_seed(0)
    h = torch.randn(5, cfg.hc_mult, cfg.dim, generator=g).to(torch.bfloat16)
    pm = torch.randn(5, cfg.hc_mult, generator=g)
    taps = torch.randn(5, 2 * cfg.dim, generator=g).to(torch.bfloat16)
    buf = pp.pack_boundary(h, pm, taps)
    assert buf.numel() == pp.payload_bytes(cfg, 5, 2) == 16 + 5 * (4 * 128 * 2 + 16 + 2 * 128 * 2)
    h2, pm2, t2 = pp.unpack_boundary(buf, cfg, 5, 2)
    assert torch.equal(h2, h) and torch.equal(pm2, pm) and torch.equal(t2, taps)
    short = pp.pack_boundary(h[:3], pm[:3], taps[:3])  # a shard of the rows, in a full-size buffer
    buf = torch.zeros(pp.payload_bytes(cfg, 5, 2), dtype=torch.uint8)
    buf[: short.numel()] = short  # what gloo's recv leaves when the sender sent less
    with pytest.raises(ValueError, match="header \\[3, 2\\].*5 full rows"):
        pp.unpack_boundary(buf, cfg, 5, 2)


def test_placement_report_at_two_stages_of_64(capsys):
    """`placement --world-size 128 --pipeline-parallel 2` on the release config (a few seconds):
    the usual last line; each rank's experts are those of its stage's layers only
    (arithmetic from the layout: 6 experts per rank per layer, MXFP4 3 x inter x D x (1/2 + 1/32)
    bytes each; the last stage adds 2 per DSpark stage); p2p bytes per step from the payload
    definition (64 senders x (16-byte header + 8 decode rows x (4 streams x D bf16 + 4 f32)))."""
    import re

    from v4flash_backend.cli import main

    cfgp = str(REPO.parent / "shared" / "configs" / "deepseek-v4.1-flash.json")
    assert main(["placement", "--config", cfgp, "--world-size", "128", "--pipeline-parallel", "2",
                 "--sequence-parallel"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    m = re.match(r"^placement: world=128 max_gib_per_rank=([\d.]+) world_allreduce_per_step=(\d+) "
                 r"group_allreduce_per_step=(\d+)$", lines[-1])
    assert m, lines[-1]
    cfg = ModelConfig.from_json(cfgp)
    expert = 3 * cfg.moe_inter_dim * cfg.dim * (1 / 2 + 1 / 32)
    rows = {x.split()[1]: float(x.split()[2]) for x in lines if x.startswith("ranks ")}
    assert rows["0..63"] == pytest.approx(20 * 6 * expert / 2 ** 30, abs=1e-4)
    assert rows["64..127"] == pytest.approx((20 * 6 + cfg.n_mtp_layers * 2) * expert / 2 ** 30, abs=1e-4)
    p2p = [x for x in lines if x.startswith("pipeline: ")]
    assert p2p and f"p2p_bytes_per_step={64 * (16 + 8 * (4 * cfg.dim * 2 + 4 * 4))} " in p2p[0], p2p
    sp = [x for x in lines if x.startswith("sequence parallel")]
    assert sp and "layers 0..19 on (stage 0); layers 20..39 on (stage 1)" in sp[0] and "sp_layers=40/40" in sp[0]


# ---- the forward of 2 stages under torchrun ----------------------------------------------------------
def _tap_ckpt(tmp: Path) -> Path:
    """The golden checkpoint with DSpark tapping layers 3, 8, 9 instead of 7, 8, 9 (main_proj keeps
    its shape): layer 3's tap is computed on stage 0 and must cross the boundary."""
    d = tmp / "taps_ckpt"
    d.mkdir()
    for p in GOLDEN.iterdir():
        if p.name != "config.json":
            (d / p.name).symlink_to(p)
    c = json.loads((GOLDEN / "config.json").read_text())
    c["dspark_target_layer_ids"] = [3, 8, 9]
    (d / "config.json").write_text(json.dumps(c))
    return d


def _run_stages(W, tmp, **env):
    from test_parallel import torchrun

    out = tmp / "res.pt"
    r = torchrun(W, [str(REPO / "tests" / "test_parallel.py"), "--rank-main", str(out)],
                 env={"V4FLASH_TEST_CASES": "[]", "V4FLASH_PIPELINE": "2", **env})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    res = torch.load(out)
    stage0 = torch.load(f"{out}.stage0")
    return res, stage0


def _w1(ckpt):
    from test_parallel import _checks
    from v4flash_backend.model.loading import load_model
    from v4flash_backend.parallel.collectives import Collectives

    return _checks(load_model(ckpt), Collectives(), [])


EXACT = ("exact.batched_prefill", "exact.decode2", "exact.first_token", "exact.draft_U",
         "taps.batched_prefill", "taps.decode2")


def _counts(res, name):
    return {k: c[0] for k, c in res[f"counts.{name}"].items()}


def test_two_stages_of_one_rank_carry_taps_across_the_boundary(tmp_path):
    """W = 2 as 2 stages x 1 rank on the tap-moved checkpoint: bit-identical to W = 1 (the DSpark
    draft on the last stage reads a tap made on stage 0), and each stage's messages are one
    boundary send / recv of full rows with 1 tap (53 rows of the batched prefill)."""
    ckpt = _tap_ckpt(tmp_path)
    res, st0 = _run_stages(2, tmp_path, V4FLASH_TEST_CKPT=str(ckpt))
    w1 = _w1(ckpt)
    for k in EXACT:
        assert res[k].shape == w1[k].shape and torch.equal(res[k], w1[k]), k
    cfg = ModelConfig.from_json(ckpt)
    assert pp.taps_before(cfg, 6) == 1
    got = res["counts.batched_prefill"]  # one rank per stage: no in-stage collective at all
    assert set(got) == {("pp", "boundary_recv")} and got[("pp", "boundary_recv")][:2] == [1, 16 + 53 * (1040 + 256)]
    assert st0["counts.batched_prefill"][("pp", "boundary_send")][:2] == [1, pp.payload_bytes(cfg, 53, 1)]


@pytest.fixture(scope="module")
def stages_2x2(tmp_path_factory):
    """W = 4 as 2 stages x 2 ranks, without and with sequence parallelism (about 35 s each)."""
    out = {}
    for sp in ("0", "1"):
        out[sp] = _run_stages(4, tmp_path_factory.mktemp(f"pp_sp{sp}"), V4FLASH_TEST_SP=sp)
    return out, _w1(GOLDEN)


@pytest.mark.slow
def test_two_stages_of_two_ranks_equal_w1_bit_for_bit(stages_2x2):
    runs, w1 = stages_2x2
    for sp, (res, _) in runs.items():
        for k in EXACT:
            assert res[k].shape == w1[k].shape and torch.equal(res[k], w1[k]), (sp, k)


@pytest.mark.slow
def test_stage_collectives_match_the_formula(stages_2x2):
    """Without SP each stage's counts are placement.collectives_per_forward's (P = 2, stage s)."""
    runs, _ = stages_2x2
    cfg = _cfg()
    res, st0 = runs["0"]
    for name in ("batched_prefill", "decode2", "first_token"):
        segs = [(s, n) for _, s, n in res[f"spec.{name}"]]
        assert _counts(res, name) == placement.collectives_per_forward(cfg, 4, segs, pipeline=2, stage=1), name
        assert _counts(st0, name) == placement.collectives_per_forward(cfg, 4, segs, pipeline=2, stage=0), name


@pytest.mark.slow
def test_sequence_parallel_changes_the_collectives_and_sends_full_rows(stages_2x2):
    """SP on the 53-row prefill (>= 4 rows per rank of the 2-rank group): wo_b and the MoE carry
    become reduce-scatters (one each per layer of the stage), all-gathers appear (before attention
    and MoE per layer, plus h / pre-mix / taps at the stage's end), the attention all-reduces
    left are the indexer's; the 2-row decode step stays off. The boundary carries all 53 rows."""
    runs, _ = stages_2x2
    cfg = _cfg()
    (plain, _), (sp, s0) = runs["0"], runs["1"]
    n0, n1 = 6, 4  # layers of stage 0 and 1
    full = pp.payload_bytes(cfg, 53, 0)  # all 53 rows cross, not this rank's 26 or 27
    assert s0["counts.batched_prefill"][("pp", "boundary_send")][:2] == [1, full]
    assert sp["counts.batched_prefill"][("pp", "boundary_recv")][:2] == [1, full]
    assert _counts(s0, "batched_prefill")[("attn", "reduce_scatter")] == 2 * n0
    assert _counts(sp, "batched_prefill")[("attn", "reduce_scatter")] == 2 * n1
    assert _counts(s0, "batched_prefill")[("attn", "sp_all_gather")] == 2 * n0 + 2  # no taps on stage 0
    assert _counts(sp, "batched_prefill")[("attn", "sp_all_gather")] == 2 * n1 + 3
    assert ("stage", "all_reduce") not in _counts(sp, "batched_prefill")  # MoE reduce-scattered
    assert _counts(plain, "batched_prefill") != _counts(sp, "batched_prefill")
    assert _counts(sp, "decode2") == _counts(plain, "decode2")  # 2 rows: SP off
    assert sp["sp_forwards.batched_prefill"] > 0 and sp["sp_forwards.decode2"] == sp["sp_forwards.batched_prefill"]


@pytest.mark.slow
@pytest.mark.parametrize("sp", [False, True])
def test_golden_check_cli_at_two_stages_of_two_ranks(sp):
    """`golden-check --pipeline-parallel 2 [--sequence-parallel]` under torchrun at W = 4: every
    stage replays its layers, the last checks logits and DSpark, rank 0 prints the merged report."""
    import re

    from test_parallel import torchrun

    args = ["-m", "v4flash_backend", "golden-check", str(GOLDEN), "--pipeline-parallel", "2"]
    r = torchrun(4, args + (["--sequence-parallel"] if sp else []), timeout=900)
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert sum(line.startswith("golden: ") for line in lines) == 1
    m = re.match(r"^golden: cases=4 steps=48 layers_ok=(\d+)/(\d+) ", lines[-1])
    assert m and m.group(1) == m.group(2) == "10", lines[-1]


# ---- two torchrun "nodes" on loopback, and Triton serving through them ----------------------------------
def _settings(**kw):
    from v4flash_backend.settings import Settings

    # 'fixed' speculation drafts every step (the DSpark plans run on the last stage) without profiling
    base = {"checkpoint_dir": str(GOLDEN), "world_size": 2, "pipeline_parallel": 2, "decode_graph": "eager",
            "max_num_seqs": 3, "max_model_len": 128, "spec_mode": "fixed", "heartbeat_s": 1.0,
            "collective_timeout_s": 20.0}
    return Settings(**{**base, **kw})


def start_two_nodes(tmp: Path, settings, nproc_per_node: int = 1):
    """One torchrun per "node" (--nnodes 2 --node-rank 0 / 1, rendezvous on 127.0.0.1): one process
    group across both, stage 0 on node 0, stage 1 (the driver) on node 1, with a shared secret (a
    0600 file every node and the client read: group_secret_file). Returns (procs, address, info);
    info["secret_file"] names the secret."""
    from v4flash_backend.group.auth import new_secret, write_secret
    from v4flash_backend.group.rank_group import free_port, node_command

    port_file = str(tmp / "driver.json")
    secret_file = write_secret(str(tmp / "group.secret"), new_secret())
    settings = settings.replace(group_secret_file=secret_file)
    master = free_port()
    env = dict(os.environ, PYTHONPATH=str(SRC), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    procs = []
    for node in (0, 1):
        cmd = node_command(settings, sys.executable, nproc_per_node, 2, node, "127.0.0.1", master,
                           port_file=port_file)
        with open(tmp / f"node{node}.log", "wb") as log:
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
    deadline = time.monotonic() + 300
    while not os.path.exists(port_file):
        for k, p in enumerate(procs):
            if p.poll() is not None:
                stop_nodes(procs)
                pytest.fail(f"node {k} exited ({p.returncode}):\n" + (tmp / f"node{k}.log").read_text()[-4000:])
        if time.monotonic() > deadline:
            stop_nodes(procs)
            pytest.fail("two-node group not ready:\n" + (tmp / "node1.log").read_text()[-4000:])
        time.sleep(0.2)
    info = json.loads(Path(port_file).read_text())
    return procs, f"{info['host']}:{info['port']}", dict(info, secret_file=secret_file)


def stop_nodes(procs, timeout: float = 30) -> list:
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            codes.append(p.wait())
    return codes


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(3, 1000, (n - 1,), generator=g).tolist()


def _alone(model, prompt, max_tokens):
    from test_rank_group import _alone as alone

    return alone(model, prompt, max_tokens)


@pytest.mark.slow
def test_two_nodes_on_loopback_serve_what_w1_serves(tmp_path, tiny_model):
    """The rank group as two torchrun nodes of one stage each: the client connects to the driver
    by address; concurrent greedy requests (prefill, decode, DSpark drafts on the last stage)
    equal the in-process W = 1 engine; the stats show the boundary traffic; shutdown ends both."""
    from v4flash_backend.group.rank_group import RankGroup, RankGroupError

    procs, address, info = start_two_nodes(tmp_path, _settings())
    try:
        with pytest.raises(RankGroupError, match="requires a shared secret"):
            RankGroup.connect(address, timeout_s=60, secret=None)
        g = RankGroup.connect(address, timeout_s=60, secret_file=info["secret_file"])
        specs = [(9, 12, 1), (30, 7, 2), (4, 10, 3)]
        streams = [g.submit(_prompt(n, s), {"max_tokens": k, "ignore_eos": True}) for n, k, s in specs]
        for st, (n, k, s) in zip(streams, specs):
            res = st.result(timeout=180)
            assert res["error"] is None and res["token_ids"] == _alone(tiny_model, _prompt(n, s), k)
        assert res["events"][-1]["drafted"] > 0
        assert info["pipeline_parallel"] == 2 and info["driver_rank"] == 1 and len(info["pids"]) == 2
        stats = g.stats(timeout=10)
        assert stats["collectives_total"]["pp.boundary_recv"]["calls"] > 0  # the driver is stage 1
        assert g.shutdown(timeout=30) is None
    finally:
        codes = stop_nodes(procs)
    assert codes == [0, 0], [(tmp_path / f"node{k}.log").read_text()[-2000:] for k in (0, 1)]
    log1 = (tmp_path / "node1.log").read_text()
    assert "pipeline stage 1/2: layers 6..9" in log1 and "serving on" in log1


@pytest.mark.slow
def test_triton_streams_through_two_stages_the_text_of_w1(tmp_path, tiny_model):
    """tritonserver (scripts/serve.sh) whose v4flash model connects with rank_group_address to the
    two-node group: the streamed text of v4flash (text_input) and of the v4flash_text ensemble
    equals the W = 1 engine's greedy continuation of the same tokenized prompt. The group runs
    pipeline_micro_batches 2 (a prompt and its concurrent warm-up-free requests split per step)."""
    from tokenizers import Tokenizer

    from _triton import start_serve, wait_ready
    from _triton import stop as stop_server
    from test_triton_e2e import PROMPT_TEXT, N, _build_repository, _concurrently, _grpc, _set_param

    if not (REPO / ".triton/backends/python/triton_python_backend_stub").exists():
        pytest.fail("tritonserver is not set up: run `make triton` (scripts/setup_triton.sh)")
    # two micro-batches per forward of several sequences: stage 0 runs the second while stage 1 the first
    procs, address, info = start_two_nodes(tmp_path, _settings(pipeline_micro_batches=2))
    proc = None
    try:
        repo = _build_repository(tmp_path)
        cfg_path = repo / "v4flash" / "config.pbtxt"
        cfg = _set_param(cfg_path.read_text(), "rank_group_address", address)
        cfg_path.write_text(_set_param(cfg, "group_secret_file", info["secret_file"]))
        log_path = tmp_path / "tritonserver.log"
        proc, server = start_serve(repo, log_path)
        wait_ready(proc, server["http_port"], log_path, 240)
        tok = Tokenizer.from_file(str(GOLDEN / "tokenizer.json"))
        ids = tok.encode(PROMPT_TEXT, add_special_tokens=True).ids
        want = _alone(tiny_model, ids, N)
        both = _concurrently(*[lambda m=m: _grpc(server, model=m, prompt=PROMPT_TEXT, max_tokens=N)
                               for m in ("v4flash", "v4flash_text")])
        for model, chunks in zip(("v4flash", "v4flash_text"), both):
            assert len(chunks) > 1  # streamed
            assert [t for c in chunks for t in c.output_ids] == want, model
            assert "".join(c.text for c in chunks) == tok.decode(want), model
        from v4flash_backend.group.rank_group import RankGroup

        probe = RankGroup.connect(address, timeout_s=30, secret_file=info["secret_file"])
        assert probe.stats(timeout=10)["micro_batched"] > 0  # steps of both requests ran split
        probe.close()
        assert f"connected to the rank group at {address}" in log_path.read_text()
    finally:
        if proc is not None:
            stop_server(proc, 60)  # the v4flash model's finalize shuts the group down
        codes = stop_nodes(procs, 60)
    assert codes == [0, 0]


def test_micro_batches_reassemble_one_forward(tiny_model):
    """MicroBatchRunner (pipeline_micro_batches): a 3-sequence forward run as 2 micro-batches of
    whole segments gives the logits, hidden rows and taps of the single forward, bit for bit under
    exact numerics (rows of different sequences do not interact), for every logits_rows form."""
    from v4flash_backend import ops
    from v4flash_backend.engine.runner import LocalRunner
    from v4flash_backend.parallel.micro_batch import MicroBatchRunner

    assert MicroBatchRunner.split([(0, 0, 5), (1, 0, 1), (2, 0, 1)], 2) == [[(0, 0, 5)], [(1, 0, 1), (2, 0, 1)]]
    assert MicroBatchRunner.split([(0, 0, 1), (1, 0, 1), (2, 0, 1), (3, 0, 1)], 2) == [[(0, 0, 1), (1, 0, 1)],
                                                                                      [(2, 0, 1), (3, 0, 1)]]
    ops.set_numerics("exact")
    g = torch.Generator().manual_seed(3)
    tok = torch.randint(3, 1000, (9,), generator=g)
    spec = [(0, 0, 4), (1, 0, 3), (2, 0, 2)]
    for rows in ("last", "all", torch.tensor([8, 0, 4, 5])):
        one = LocalRunner(tiny_model, 3, 32).forward(tok, spec, rows, True)
        mb = MicroBatchRunner(LocalRunner(tiny_model, 3, 32), 2)
        two = mb.forward(tok, spec, rows, True)
        assert mb.micro_batched == 1
        assert torch.equal(one.logits, two.logits) and torch.equal(one.final_hidden, two.final_hidden)
        assert torch.equal(one.taps, two.taps) and torch.equal(mb.local.last_taps, one.taps)


@pytest.mark.slow
def test_rank_group_with_sequence_parallel_serves_what_w1_serves(tiny_model):
    """The served path with sequence_parallel at W = 2 (one stage, an attention group of 2):
    prompts of >= 8 tokens prefill sequence-parallel (the driver's counters show the
    reduce-scatters and all-gathers, the worker logs it at start), and greedy outputs equal the
    in-process W = 1 engine."""
    from v4flash_backend.group.rank_group import RankGroup

    g = RankGroup.launch(_settings(pipeline_parallel=1, sequence_parallel=True))
    try:
        specs = [(30, 6, 4), (12, 5, 5)]
        streams = [g.submit(_prompt(n, s), {"max_tokens": k, "ignore_eos": True}) for n, k, s in specs]
        for st, (n, k, s) in zip(streams, specs):
            res = st.result(timeout=180)
            assert res["error"] is None and res["token_ids"] == _alone(tiny_model, _prompt(n, s), k)
        tot = g.stats(timeout=10)["collectives_total"]
        assert tot["attn.reduce_scatter"]["calls"] > 0 and tot["attn.sp_all_gather"]["calls"] > 0
        log = Path(g.log_path).read_text()
        assert "sequence parallel on for forwards of >= 8 rows in layers 0..9" in log
    finally:
        g.shutdown(timeout=30)


@pytest.mark.slow
def test_sequence_parallel_with_two_attention_groups_in_a_stage(tmp_path):
    """W = 4 in one stage with attention groups of 2 (V4FLASH_ATTN_GROUP=2, the shape of a 64-rank
    stage's 8 groups of 8): SP splits rows within each group; the MoE carry, reduced over the whole
    stage, is all-reduced and sliced (not reduce-scattered: the group is not the stage). Exact
    numerics: bit-identical to W = 1 (the fp32 carry sums per-expert bf16 outputs, exact here as
    at W = 4 without SP)."""
    from test_parallel import torchrun

    out = tmp_path / "res.pt"
    r = torchrun(4, [str(REPO / "tests" / "test_parallel.py"), "--rank-main", str(out)],
                 env={"V4FLASH_TEST_CASES": "[]", "V4FLASH_TEST_SP": "1", "V4FLASH_ATTN_GROUP": "2"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    res, w1 = torch.load(out), _w1(GOLDEN)
    for k in EXACT:
        assert torch.equal(res[k], w1[k]), k
    got = _counts(res, "batched_prefill")
    cfg = _cfg()
    assert got[("attn", "reduce_scatter")] == cfg.n_layers  # wo_b only
    assert got[("world", "all_reduce")] == 1 + cfg.n_layers  # embed + Engram lookups (one), MoE
    assert got[("attn", "sp_all_gather")] == 2 * cfg.n_layers + 3


@pytest.mark.parametrize("stage", [0, 1])
def test_a_stage_keeps_only_its_caches(stage):
    """trim_state (what the worker applies at P > 1) leaves the bytes placement.cache_bytes counts
    for the stage (the served two-node and Triton tests run their stages on trimmed states)."""
    from test_placement import _state_bytes
    from v4flash_backend.model.state import ModelState

    cfg = _cfg()
    cuts = L.stage_cuts(cfg, 2)
    lo, hi = cuts[stage], cuts[stage + 1]
    st = pp.trim_state(ModelState(cfg, 3, 100), lo, hi, stage == 1)
    assert _state_bytes(st) == placement.cache_bytes(cfg, 3, 100, layers=(lo, hi), dspark=stage == 1)
    assert _state_bytes(st) < _state_bytes(ModelState(cfg, 3, 100))
    assert set(st.window) == set(range(lo, hi)) and bool(st.dspark) == (stage == 1)
