"""The Neuron launch as the served path runs it, checked on CPU without a device.

- the dry run of a W = 64 neuron launch (`group.rank_entry.launch_plan`, which uses the same
  `rank_group.node_command` and `rank_entry.prepare` as `RankGroup.launch` and every rank): 64 ranks
  over the node(s), every rank on its own logical NeuronCore, the compiler flags in NEURON_CC_FLAGS,
  LNC=2 for the runtime and the kernels' grid, one shared compile cache, the nki ops; a dropped flag,
  a shared core or a mismatched LNC fails the check;
- `rank_entry.main` (what torchrun starts) puts that environment into the process that becomes the
  worker, with the documented override variables applied once;
- a Neuron rank started without it is refused by the worker.
"""

import json
import os
import shlex

import pytest

from v4flash_backend.group import rank_entry
from v4flash_backend.settings import Settings

FP8 = "--experimental-unsafe-fp8e4m3fn-as-fp8e4m3"  # trn2 has no e4m3fn: the checkpoint bytes read as e4m3
CACHE = "/var/cache/v4flash/neuron"


def release_settings(**kw) -> Settings:
    """The trn2 image's settings: 64 ranks, the NKI kernels, static decode graphs."""
    return Settings(checkpoint_dir="/models/v4flash", world_size=64, ops_backend="nki", decode_graph="static", **kw)


def check_rank(env: dict, local_rank: int, lnc: int = 2, cache: str = CACHE) -> list[str]:
    """What is wrong with one rank's environment of a trn2 launch (empty: nothing)."""
    flags = shlex.split(env.get("NEURON_CC_FLAGS", ""))
    problems = [f"flag {f} missing" for f in (f"--lnc={lnc}", "--auto-cast=none") if f not in flags]
    if not any(FP8 in f for f in flags):
        problems.append("fp8 flag missing")
    if [f for f in flags if f.startswith("--lnc") and f != f"--lnc={lnc}"]:
        problems.append("a second --lnc")
    want = {"NEURON_RT_VISIBLE_CORES": str(local_rank), "NEURON_LOGICAL_NC_CONFIG": str(lnc),
            "V4FLASH_NKI_GRID": str(lnc), "V4FLASH_OPS": "nki", "V4FLASH_NUMERICS": "reference",
            "V4FLASH_DIST_BACKEND": "neuron", "TORCH_NEURONX_NEFF_CACHE_DIR": f"{cache}/neff",
            "NEURON_COMPILE_CACHE_URL": f"{cache}/neuronx-cc", "TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION": "1"}
    problems += [f"{k}={env.get(k)!r}, want {v!r}" for k, v in want.items() if env.get(k) != v]
    return problems


def check_plan(plan: list[dict], world: int, nnodes: int, **kw) -> list[str]:
    per_node = world // nnodes
    problems = [] if sorted(r["rank"] for r in plan) == list(range(world)) else ["ranks are not 0..W-1"]
    for node in range(nnodes):
        rows = [r for r in plan if r["node"] == node]
        cmd = rows[0]["command"]
        want = {"--nproc-per-node": str(per_node), "--nnodes": str(nnodes), "--node-rank": str(node)}
        problems += [f"node {node}: {k} {cmd[cmd.index(k) + 1]}" for k, v in want.items() if cmd[cmd.index(k) + 1] != v]
        if cmd[cmd.index("-m", cmd.index("--monitor-interval")) + 1] != "v4flash_backend.group.rank_entry":
            problems.append(f"node {node}: ranks do not start in rank_entry")
        cores = [r["env"].get("NEURON_RT_VISIBLE_CORES") for r in rows]
        if sorted(cores, key=lambda c: int(c or -1)) != [str(i) for i in range(per_node)]:
            problems.append(f"node {node}: cores {cores} are not one per rank")
        for r in rows:
            problems += [f"rank {r['rank']}: {p}" for p in check_rank(r["env"], r["local_rank"], **kw)]
            sent = json.loads(r["worker_argv"][r["worker_argv"].index("--settings-json") + 1])
            if (sent["world_size"], sent["ops_backend"]) != (world, "nki"):
                problems.append(f"rank {r['rank']}: the worker gets other settings")
    return problems


@pytest.mark.parametrize("nnodes", [1, 2])
def test_w64_neuron_launch_dry_run(nnodes):
    plan = rank_entry.launch_plan(release_settings(), nnodes=nnodes)
    assert len(plan) == 64
    assert check_plan(plan, 64, nnodes) == []
    r = next(r for r in plan if r["rank"] == 63)
    assert (r["node"], r["local_rank"], r["env"]["NEURON_RT_VISIBLE_CORES"]) == (nnodes - 1, 64 // nnodes - 1,
                                                                                str(64 // nnodes - 1))


@pytest.mark.parametrize("mistake, settings", [
    ("dropped --auto-cast=none",
     release_settings(neuron_cc_flags_override=f"--lnc=2 -O1 --internal-hlo2tensorizer-options={FP8}")),
    ("dropped fp8 flag", release_settings(neuron_cc_flags_override="--lnc=2 -O1 --auto-cast=none")),
    ("cores not pinned", release_settings(neuron_pin_cores=False)),
    ("other cache", release_settings(neuron_cache_dir="/tmp/elsewhere")),
])
def test_the_dry_run_check_catches_a_wrong_launch(mistake, settings):
    assert check_plan(rank_entry.launch_plan(settings), 64, 1), mistake


def test_cpu_launches_add_nothing():
    plan = rank_entry.launch_plan(Settings(checkpoint_dir="/c", world_size=2, ops_backend="nki-sim"))
    assert [r["env"] for r in plan] == [{}, {}]


def test_overrides_are_read_once_and_reach_the_flags():
    """The documented variables override the settings in rank_entry; the worker gets the result."""
    environ = {"NEURON_LOGICAL_NC_CONFIG": "1", "V4FLASH_NEURON_CACHE": "/tmp/c", "LOCAL_RANK": "7"}
    argv, env, s = rank_entry.prepare(["--settings-json", release_settings().to_json()], environ)
    assert (s.neuron_lnc, s.neuron_cache_dir) == (1, "/tmp/c") and Settings.from_json(argv[1]) == s
    assert check_rank(env, 7, lnc=1, cache="/tmp/c") == []
    with pytest.raises(ValueError, match="one LNC degree"):  # flags and runtime disagreeing: refused
        rank_entry.prepare(["--settings-json", release_settings().to_json()], {"NEURON_CC_FLAGS": "--lnc=1"})


def test_the_rank_entry_gives_the_worker_its_environment(monkeypatch, tmp_path):
    """rank_entry.main (torchrun's module for every rank) becomes the worker with the rank's
    environment, and creates the compile cache."""
    from v4flash_backend.ops import kernel_ops

    calls = []
    monkeypatch.setattr(os, "execve", lambda path, args, env: calls.append((path, args, env)))
    monkeypatch.setenv("LOCAL_RANK", "5")
    monkeypatch.delenv("NEURON_CC_FLAGS", raising=False)
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    monkeypatch.setenv("V4FLASH_NEURON_CACHE", str(tmp_path / "cache"))
    rank_entry.main(["--settings-json", release_settings().to_json(), "--port", "0"])
    (path, args, env), = calls
    assert args[1:4] == ["-u", "-m", "v4flash_backend.group.worker"] and args[-2:] == ["--port", "0"]
    assert check_rank(env, 5, cache=str(tmp_path / "cache")) == []
    assert (tmp_path / "cache" / "neff").is_dir()
    assert env["MALLOC_MMAP_THRESHOLD_"] == "131072"  # glibc's threshold pinned (rank_entry.ALLOCATOR_ENV)
    # the kernels' launch grid under that environment is the LNC degree the compiler gets
    monkeypatch.setattr(os, "environ", dict(env))
    assert kernel_ops._grid(True) == 2


def test_a_rank_pins_the_allocators_threshold_unless_told_otherwise(monkeypatch):
    """Every rank, CPU or Neuron, execs its worker with glibc's mmap threshold pinned at 128 KiB
    (rank_entry.ALLOCATOR_ENV: why there); a value already in the environment is kept."""
    calls = []
    monkeypatch.setattr(os, "execve", lambda path, args, env: calls.append(env))
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    cpu = Settings(checkpoint_dir="/c", world_size=2).to_json()
    rank_entry.main(["--settings-json", cpu])
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4194304")
    rank_entry.main(["--settings-json", cpu])
    assert [env.get("MALLOC_MMAP_THRESHOLD_") for env in calls] == ["131072", "4194304"]


def test_a_neuron_worker_without_its_environment_is_refused(monkeypatch):
    from v4flash_backend.group import lifetime
    from v4flash_backend.trn2.launch import rank_environment

    s = release_settings()
    monkeypatch.setenv("LOCAL_RANK", "3")
    for k in rank_environment(s, 3):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(SystemExit, match="rank_entry"):
        lifetime._check_rank_env(s)
    for k, v in rank_environment(s, 3).items():
        monkeypatch.setenv(k, v)
    lifetime._check_rank_env(s)  # applied: accepted
    lifetime._check_rank_env(Settings(ops_backend="torch"))  # CPU ranks need nothing


def test_dry_run_prints_the_plan(monkeypatch):
    import io

    for k in ("NEURON_CC_FLAGS", "NEURON_LOGICAL_NC_CONFIG", "V4FLASH_NEURON_CACHE", "V4FLASH_NEURON_BACKEND",
              "V4FLASH_DIST_BACKEND"):
        monkeypatch.delenv(k, raising=False)
    out = io.StringIO()
    monkeypatch.setattr("sys.stdout", out)
    assert rank_entry.main(["--dry-run", "--nnodes", "2", "--settings-json", release_settings().to_json()]) == 0
    lines = out.getvalue().splitlines()
    assert [ln.split(":")[0] for ln in lines if ln.startswith("node")] == ["node 0", "node 1"]
    ranks = [ln for ln in lines if ln.startswith("  rank")]
    assert len(ranks) == 64 and "NEURON_RT_VISIBLE_CORES=31 " in ranks[-1] and "--auto-cast=none" in ranks[-1]
