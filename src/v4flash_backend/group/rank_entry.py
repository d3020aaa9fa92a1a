"""torchrun's entry for every rank: `torchrun ... -m v4flash_backend.group.rank_entry --settings-json ...`.

A rank's environment must be complete before it imports torch: PyTorch loads torch_neuronx on
`import torch`, and the Neuron runtime and compiler read NEURON_RT_VISIBLE_CORES, NEURON_LOGICAL_NC_CONFIG
and NEURON_CC_FLAGS from the process environment (see `trn2.launch`). torchrun gives every rank of a
node one environment (plus LOCAL_RANK, RANK, ...), so the per-rank part is added here, in the rank's
own process, with the standard library only; then the process becomes the worker
(`python -m v4flash_backend.group.worker`, exec: same pid) with the same arguments.

Here, and only here, the documented override variables of `Settings` (`Settings.with_env_overrides`:
NEURON_LOGICAL_NC_CONFIG, NEURON_CC_FLAGS, V4FLASH_NEURON_CACHE, V4FLASH_NEURON_BACKEND) are read; the
worker receives the settings with them applied, so every later reader sees one value.

`launch_plan` is the dry run: the torchrun command of each node and the environment of each rank that
a launch of the given settings would run, without starting anything (`--dry-run` prints it).
"""

from __future__ import annotations

import os
import sys

from v4flash_backend.settings import Settings
from v4flash_backend.trn2.launch import rank_environment

SETTINGS_FLAG = "--settings-json"

# glibc serves an allocation of at least its mmap threshold (128 KiB at start) with its own mapping,
# returned on free; but each time such a chunk is freed it raises the threshold to that chunk's size
# (up to 32 MiB). A rank frees tensors of many sizes (and its background compile more), so soon every
# mid-size tensor comes from the heap instead, whose free space fragments and stays resident: a rank of
# `make serve` grew 11-108 MiB in a 3-minute soak, and 13-18 MiB in each of three with the threshold
# pinned (perf/soak.py --kill-worker; docs/performance.md "Soak and faults"). Setting the variable
# pins it (glibc's mallopt(3): a fixed threshold turns the adjustment off); one the environment
# already has wins.
ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}


def allocator_environment(environ) -> dict[str, str]:
    """The allocator variables a rank adds to `environ` (those it does not set already)."""
    return {k: v for k, v in ALLOCATOR_ENV.items() if k not in environ}


def _settings_arg(argv: list[str]) -> tuple[int, str] | None:
    """(index of the value, value) of --settings-json in argv, or None."""
    for i, a in enumerate(argv):
        if a == SETTINGS_FLAG and i + 1 < len(argv):
            return i + 1, argv[i + 1]
        if a.startswith(SETTINGS_FLAG + "="):
            return i, a.split("=", 1)[1]
    return None


def prepare(argv: list[str], environ) -> tuple[list[str], dict[str, str], Settings | None]:
    """(the worker's argv with the overridden settings, the variables this rank adds to `environ`,
    the settings)."""
    found = _settings_arg(argv)
    if found is None:  # flags only (a hand-started worker): the worker's parser reports what is missing
        return list(argv), {}, None
    i, text = found
    settings = Settings.from_json(text).with_env_overrides(environ)
    argv = list(argv)
    argv[i] = settings.to_json() if argv[i] == text else f"{SETTINGS_FLAG}={settings.to_json()}"
    return argv, rank_environment(settings, int(environ.get("LOCAL_RANK", "0"))), settings


def launch_plan(settings: Settings, nnodes: int = 1, python: str = "python", master_addr: str = "127.0.0.1",
                master_port: int = 29500, environ: dict | None = None) -> list[dict]:
    """The dry run of a launch of `settings` over `nnodes` nodes (world_size / nnodes ranks each): per
    rank {rank, node, local_rank, command (its node's torchrun command), env (what the rank adds to
    `environ`, default empty: no overrides)}."""
    from .rank_group import node_command

    if settings.world_size % nnodes:
        raise ValueError(f"world_size {settings.world_size} does not split over {nnodes} nodes")
    per_node = settings.world_size // nnodes
    environ = dict(environ or {})
    plan = []
    for node in range(nnodes):
        cmd = node_command(settings, python, per_node, nnodes, node, master_addr, master_port)
        for local in range(per_node):
            # what torchrun sets for the rank (static rendezvous: ranks in node order)
            rank_env = {**environ, "LOCAL_RANK": str(local), "RANK": str(node * per_node + local)}
            argv, env, _ = prepare(cmd[cmd.index("v4flash_backend.group.rank_entry") + 1:], rank_env)
            plan.append(dict(rank=node * per_node + local, node=node, local_rank=local, command=cmd,
                             worker_argv=argv, env=env))
    return plan


def print_plan(argv: list[str], out=None) -> int:
    """`python -m v4flash_backend.group.rank_entry --dry-run [--nnodes N] --settings-json JSON`: print
    each node's torchrun command and each rank's added environment (with this environment's overrides)."""
    import shlex

    out = out or sys.stdout
    nnodes = int(argv[argv.index("--nnodes") + 1]) if "--nnodes" in argv else 1
    found = _settings_arg(argv)
    if found is None:
        out.write("--dry-run needs --settings-json\n")
        return 2
    plan = launch_plan(Settings.from_json(found[1]).with_env_overrides(os.environ), nnodes, sys.executable,
                       environ=dict(os.environ))
    for r in plan:
        if r["local_rank"] == 0:
            out.write(f"node {r['node']}: {shlex.join(r['command'])}\n")
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(r["env"].items()))
        out.write(f"  rank {r['rank']} (local {r['local_rank']}): {env or '(nothing added)'}\n")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--dry-run"]:
        return print_plan(argv[1:])
    argv, env, settings = prepare(argv, os.environ)
    if env:
        from v4flash_backend.trn2.launch import cache_dirs

        for d in cache_dirs(settings.neuron_cache_dir).values():
            os.makedirs(d, exist_ok=True)
    # exec, not import: the worker's interpreter starts with the complete environment (nothing of the
    # Neuron stack can have read it earlier), keeps this pid (torchrun watches it) and its command line
    # names the worker (what the supervision tests and perf/soak.py look for)
    cmd = [sys.executable, "-u", "-m", "v4flash_backend.group.worker", *argv]
    os.execve(sys.executable, cmd, {**os.environ, **allocator_environment(os.environ), **env})
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
