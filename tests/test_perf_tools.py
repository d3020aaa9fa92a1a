"""The perf tools' own arithmetic on fixed inputs: perf/run_perf_analyzer.py's tables from a profile
export (the numbers it prints are checked against values worked out by hand below)."""

import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


# ---- perf/run_perf_analyzer.py: the tables from a profile export ------------------------------
def test_perf_summary_of_a_profile_export():
    spec = importlib.util.spec_from_file_location("run_perf_analyzer", REPO / "perf" / "run_perf_analyzer.py")
    perf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(perf)
    ms = 1_000_000  # export timestamps are nanoseconds

    def out(n, drafted=0, accepted=0):
        return {"num_output_tokens": n, "num_drafted_tokens": drafted, "num_accepted_tokens": accepted}

    exp = {"experiment": {"mode": "concurrency", "value": 2}, "requests": [
        # TTFT 100 ms; then 1 token after 50 ms, 3 tokens (a DSpark chunk) after 90 ms.
        {"timestamp": 0, "response_timestamps": [100 * ms, 150 * ms, 240 * ms],
         "response_outputs": [out(1), out(1, 5, 0), out(3, 5, 2)]},
        # TTFT 200 ms with 2 tokens at once, then 1 token after 100 ms.
        {"timestamp": 10 * ms, "response_timestamps": [210 * ms, 310 * ms],
         "response_outputs": [out(2), out(1, 5, 1)]},
        {"timestamp": 20 * ms, "response_timestamps": [], "response_outputs": []},  # never answered
    ]}
    r = perf.summarize_experiment(exp)
    assert (r["concurrency"], r["requests"], r["failed"], r["tokens"]) == (2, 2, 1, 8)
    assert r["ttft_s"][50] == pytest.approx(0.150) and r["ttft_s"][90] == pytest.approx(0.190)
    # ITL samples: 50, 30, 30, 30 (request 1); 0, 100 (request 2) ms. Sorted 0 30 30 30 50 100:
    # p50 at rank 2.5 -> 30, p99 at rank 4.95 -> 50 + 0.95 * 50.
    assert r["itl_s"][50] == pytest.approx(0.030) and r["itl_s"][99] == pytest.approx(0.0975)
    assert r["tok_per_s"] == pytest.approx(8 / 0.310)
    # per request (tokens - 1) / (last - first response): 4 / 0.140 and 2 / 0.100.
    assert r["tok_per_s_per_req"][50] == pytest.approx((4 / 0.140 + 2 / 0.100) / 2)
    assert (r["drafted"], r["accepted"]) == (15, 3)
    table = perf.format_table([r])
    assert "150.0/190.0/199.0" in table and "3/15 (20%)" in table and "(1 failed)" in table
    assert perf.parse_levels("1:8:2") == [1, 3, 5, 7] and perf.parse_levels("1,2,4") == [1, 2, 4]


# ---- perf/openai_overhead.py: the ratio line ----------------------------------------------------
def test_openai_overhead_ratios_are_medians_over_rounds():
    spec = importlib.util.spec_from_file_location("openai_overhead", REPO / "perf" / "openai_overhead.py")
    perf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(perf)
    rounds = [  # per round: the OpenAI way's median over Triton's, for TTFT and ITL
        {"triton_ttft": [1.0, 2.0, 3.0], "openai_ttft": [1.1, 2.2, 9.0], "triton_itl": [0.1, 0.2],
         "openai_itl": [0.1, 0.2]},  # medians 2.2 / 2.0 = 1.1; 0.15 / 0.15 = 1.0
        {"triton_ttft": [2.0], "openai_ttft": [2.5], "triton_itl": [0.1], "openai_itl": [0.12]},  # 1.25; 1.2
        {"triton_ttft": [4.0], "openai_ttft": [4.0], "triton_itl": [0.2], "openai_itl": [0.21]},  # 1.0; 1.05
    ]
    ttft, itl, spread = perf.ratio_summary(rounds)
    assert ttft == pytest.approx(1.1) and itl == pytest.approx(1.05)
    assert spread == "rounds=3 ttft_ratio min-max 1.000-1.250 itl_ratio min-max 1.000-1.200"


# ---- every perf script's imports from the package resolve ---------------------------------------
def test_perf_scripts_import_what_the_package_has():
    """A perf script imports from the package at run time only, so a module moved in the package
    (perf/round_profile.py once imported STOP_WIDTH from trn2.round_plan after it moved to engine/)
    breaks the script unseen. Every `from v4flash_backend... import names` of every perf/ script must
    name a module that imports and names it has."""
    import ast
    import importlib

    missing = []
    scripts = sorted((REPO / "perf").glob("*.py"))
    assert len(scripts) > 10
    for path in scripts:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("v4flash_backend"):
                try:
                    mod = importlib.import_module(node.module)
                except ImportError as e:
                    missing.append(f"{path.name}: {node.module} ({e})")
                    continue
                missing += [f"{path.name}: {node.module}.{a.name}" for a in node.names
                            if not hasattr(mod, a.name) and importlib.util.find_spec(f"{node.module}.{a.name}") is None]
    assert not missing, missing


# ---- perf/bench_dspark.py: where each mode's time went ------------------------------------------
@pytest.mark.slow
def test_bench_dspark_splits_each_mode_by_step_kind():
    """The `split:` lines come from the engine's real steps (eager path, 2 held-out prompts at batch
    1, ~10 s): each request prefills in one step (its prompt is shorter than a prefill chunk), plain
    decoding drafts in none of its steps, fixed-5 drafts (its first block at the prefill, so its
    decode steps that draft are all but the last), and every step of a mode lands in one kind."""
    import re
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(REPO / "perf" / "bench_dspark.py"), "--rounds", "1", "--batches", "1",
                          "--temps", "0", "--max-tokens", "6", "--num-prompts", "2"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    rows = {}
    for line in out.splitlines():
        if line.startswith("split: "):
            f = dict(kv.split("=") for kv in line.split()[1:])
            rows[f["mode"]] = f
    assert set(rows) == {"plain", "dspark", "fixed-5"}, out
    for mode, f in rows.items():
        assert int(f["prefill_steps"]) == 2, (mode, f)
        assert float(f["prefill_s"]) > 0 and float(f["prefill_ms"]) > 0
    assert int(rows["plain"]["drafting_steps"]) == 0 and float(rows["plain"]["drafting_s"]) == 0
    assert int(rows["plain"]["undrafted_steps"]) >= 2 * 5  # 5 decode steps a request after its first token
    fixed = rows["fixed-5"]
    assert int(fixed["drafting_steps"]) >= 1 and float(fixed["drafting_ms"]) > 0
    # fixed-5 drafts after every step but a request's last (which has no room left to draft into)
    assert int(fixed["undrafted_steps"]) <= 2
    cell = re.search(r"cell: batch=1 temp=0 plain_tok_s=([0-9.]+)", out)
    assert cell and float(cell.group(1)) > 0


# ---- perf/aside_cost.py: a stepped-aside round's host work over a plain one ----------------------
@pytest.mark.slow
def test_aside_cost_times_the_host_work_around_each_round():
    """perf/aside_cost.py on the op-by-op runner (2 held-out prompts, 6 tokens, T = 1, ~30 s): plain
    decoding's counted steps are all its decode steps (a request's first token comes from its
    prefill: 5 decode steps each); DSpark's only steps aside with nothing to verify, so no more than
    its steps aside; each has host and round seconds."""
    import ast
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(REPO / "perf" / "aside_cost.py"), "--backend", "eager", "--rounds", "1",
                          "--num-prompts", "2", "--max-tokens", "6"],
                         capture_output=True, text=True, timeout=600, check=True).stdout
    rows = {}
    for line in out.splitlines():
        if line.startswith("aside-cost: "):
            f = dict(kv.split("=") for kv in line.split() if "=" in kv)
            rows[f["mode"]] = f
    assert set(rows) == {"plain", "dspark"}, out
    assert int(rows["plain"]["steps"]) == 2 * 5
    assert float(rows["plain"]["host_s"]) > 0 and float(rows["plain"]["round_s"]) > 0
    totals = ast.literal_eval(out.split("dspark totals: ", 1)[1].splitlines()[0])
    # its steps aside: draft_skipped counts those after which the request runs on, + each one's last step
    assert 0 <= int(rows["dspark"]["steps"]) <= totals["draft_skipped"] + 2


# ---- perf/serve_ready.py: where the background compile's time went -----------------------------
def test_serve_ready_reads_each_set_from_the_compile_log(tiny_model, tmp_path):
    """perf/serve_ready.py's serve-ready-set lines come from the rank group's log: the server thread's
    "graphs warm" lines and the compile helper's "compiled" lines, as trn2.warmup writes them (a
    changed log line must fail here, not leave the tool printing nothing). Both loops run for real on
    the tiny model, their sets stubbed (no compile), their lines prefixed as group.build logs them."""
    import sys
    import threading
    import time

    from v4flash_backend.trn2.launch import NeuronSettings
    from v4flash_backend.trn2.static_runner import StaticRunner
    from v4flash_backend.trn2.warmup import BackgroundWarmup, _name

    spec = importlib.util.spec_from_file_location("serve_ready", REPO / "perf" / "serve_ready.py")
    sys.path.insert(0, str(REPO / "perf"))  # (serve_ready imports bench_serving beside it)
    try:
        sr = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sr)
    finally:
        sys.path.remove(str(REPO / "perf"))
    lines = []

    def warmup(prefix):
        r = StaticRunner(tiny_model, 2, 96, settings=NeuronSettings(backend="none"), prefill_rows=32,
                         ctx_buckets=False)
        r.graphs.primed = r.ngraphs.primed = True  # (no prime round: the sets are stubs)
        w = BackgroundWarmup(r, "dspark", 0, 8, processed=False, nodraft=True,
                             log=lambda m: lines.append(f"[v4flash rank 0] {prefix}{m}"))
        w._warm = lambda job: time.sleep(0.01)
        return w

    helper = warmup("compile helper: ")
    t = threading.Thread(target=helper.run_here, args=(lambda key, err: None,), daemon=True)
    t.start()
    assert helper.wait(30)
    helper.stop()
    t.join(10)
    server = warmup("")
    server.start()
    assert server.wait(30)
    server.close()
    log = tmp_path / "server.log"
    group_log = tmp_path / "group.log"
    group_log.write_text("\n".join(lines) + "\n")
    log.write_text(f'I1207 model.py:32] "[v4flash] rank group of 1 rank(s) up in 5.0 s (pids [1]; log {group_log})"\n')
    got = sr.set_lines(1, sr.group_log_text(log))
    n = len(server.jobs)
    assert n == 3 and len(got) == n  # the small bucket's plain and drafting rounds, the large one's plain
    pat = re.compile(r"serve-ready-set: start=1 n=(\d+)/(\d+) at_s=\d+ server_s=[0-9.]+ helper_s=([0-9.]+) set=(.+)")
    parsed = [pat.fullmatch(g) for g in got]
    assert all(parsed), got
    assert [int(m.group(1)) for m in parsed] == list(range(1, n + 1)) and {m.group(2) for m in parsed} == {str(n)}
    assert [m.group(4) for m in parsed] == [_name(j) for j in server.jobs]
