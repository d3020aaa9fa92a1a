"""A launched rank group dies with the process that launched it, however that process ends.

The Triton stub that launches the group can die without running finalize() (SIGSEGV, SIGKILL,
the server killed under it); its group must not outlive it holding the devices. Each test runs a
throwaway parent process that starts something and then SIGKILLs itself:

- the ranks' own watch (`worker --watch-launcher`, what `RankGroup.launch` passes): the launched
  group (torchrun agent and both workers) is gone within seconds, while a group started by hand
  (`node_command`, no watch: the `rank_group_address` mode) that the same parent was connected to,
  with a request in flight, keeps serving and frees that request's slot;
- the watch alone, on both of its paths (pidfd and /proc polling) and against a reused pid;
- torchrun's PR_SET_PDEATHSIG guard (`rank_group._guarded`), on a stand-in command.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from v4flash_backend.group import rank_group
from v4flash_backend.group.rank_group import RankGroup, free_port, launcher_identity, node_command
from v4flash_backend.settings import Settings

SRC = Path(__file__).resolve().parents[1] / "src"
ENV = dict(os.environ, PYTHONPATH=str(SRC), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")


def _alive(pid: int) -> bool:
    return rank_group.process_start_time(pid) is not None  # a zombie counts as gone


def _wait_gone(pids, within_s: float) -> list[int]:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _kill(pids) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _settings(golden_dir, world_size):
    return Settings(checkpoint_dir=str(golden_dir), world_size=world_size, max_num_seqs=1, max_model_len=64,
                    spec_mode="off", heartbeat_s=1.0, collective_timeout_s=20.0, startup_timeout_s=120.0)


# The parent: launches a group (tie_to_thread=False: only the ranks' watch can end it), connects to the
# hand-started group and leaves a long request in flight there, prints the pids, SIGKILLs itself.
PARENT = r"""
import json, os, signal, sys, time
from v4flash_backend.group.rank_group import RankGroup
from v4flash_backend.settings import Settings
settings, hand_port_file = Settings.from_json(sys.argv[1]), sys.argv[2]
group = RankGroup.launch(settings, tie_to_thread=False)
while not os.path.exists(hand_port_file):
    time.sleep(0.1)
info = json.load(open(hand_port_file))
hand = RankGroup.connect(f"{info['host']}:{info['port']}")
stream = hand.submit([0, 5, 6], {"max_tokens": 60, "ignore_eos": True})
assert next(iter(stream))["event"] == "chunk"
print(json.dumps({"torchrun": group.proc.pid, "workers": group.pids, "log": group.log_path}), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_launched_group_dies_with_its_launcher_and_a_hand_started_one_does_not(golden_dir, tmp_path):
    hand_port_file = str(tmp_path / "hand.json")
    hand_cmd = node_command(_settings(golden_dir, 1), sys.executable, 1, 1, 0, "127.0.0.1", free_port(),
                            port_file=hand_port_file)
    assert "--watch-launcher" not in hand_cmd
    with open(tmp_path / "hand.log", "wb") as log:
        hand = subprocess.Popen(hand_cmd, stdout=log, stderr=subprocess.STDOUT, env=ENV, start_new_session=True)
    launched = []
    try:
        parent = subprocess.run([sys.executable, "-c", PARENT, _settings(golden_dir, 2).to_json(), hand_port_file],
                                capture_output=True, text=True, env=ENV, timeout=180)
        assert parent.returncode == -signal.SIGKILL, parent.stderr[-3000:]
        out = json.loads(parent.stdout.strip().splitlines()[-1])
        launched = [out["torchrun"], *out["workers"]]
        assert len(out["workers"]) == 2
        t0 = time.monotonic()
        left = _wait_gone(launched, 5.0)
        log = Path(out["log"]).read_text(errors="replace")
        assert not left, f"still running {time.monotonic() - t0:.1f} s after the launcher died: {left}\n{log[-3000:]}"
        assert log.count("is gone (exited): stopping the rank group") == 2, log[-3000:]

        # the hand-started group serves on; the dead client's request was cancelled, its slot freed
        assert hand.poll() is None
        info = json.loads(Path(hand_port_file).read_text())
        g = RankGroup.connect(f"{info['host']}:{info['port']}", timeout_s=10)
        assert g.health()["ok"]
        deadline = time.monotonic() + 10
        while g.stats()["engine"]["slots_in_use"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert g.stats()["engine"]["slots_in_use"] == 0
        assert g.submit([0, 7], {"max_tokens": 2, "ignore_eos": True}).result(timeout=30)["error"] is None
        g.shutdown(timeout=30)
        assert hand.wait(30) == 0
    finally:
        _kill(launched)
        if hand.poll() is None:
            os.killpg(hand.pid, signal.SIGKILL)
            hand.wait()


WATCHER = r"""
import os, sys, time
if sys.argv[2] == "poll":
    del os.pidfd_open  # the fallback: /proc polled every second
from v4flash_backend.group.lifetime import _watch_launcher
_watch_launcher(sys.argv[1])
print("watching", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("path", ["pidfd", "poll"])
def test_the_watch_ends_a_rank_when_a_watched_process_exits(path):
    """Two watched processes (as the Triton model passes: its stub and the server); the second dies."""
    stub, server = subprocess.Popen(["sleep", "60"]), subprocess.Popen(["sleep", "60"])
    spec = f"{launcher_identity(stub.pid)},{launcher_identity(server.pid)}"
    w = subprocess.Popen([sys.executable, "-c", WATCHER, spec, path], env=ENV,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert w.stdout.readline() == "watching\n"
        time.sleep(0.3)
        assert w.poll() is None
        server.kill()  # left unreaped for a moment: a zombie is gone too
        t0 = time.monotonic()
        code = w.wait(timeout=5)
        elapsed = time.monotonic() - t0
        assert code == 3 and f"launcher pid {server.pid} is gone (exited)" in w.stderr.read()
        assert elapsed < (0.5 if path == "pidfd" else 2.0)
    finally:
        for p in (stub, server, w):
            p.kill()
            p.wait()


def test_the_watch_refuses_a_launcher_whose_pid_now_names_another_process():
    pid, start = launcher_identity().split(":")
    w = subprocess.run([sys.executable, "-c", WATCHER, f"{pid}:{int(start) + 1}", "pidfd"], env=ENV,
                       capture_output=True, text=True, timeout=60)
    assert w.returncode == 3 and "its pid now names another process" in w.stderr, w.stderr[-2000:]


GUARDED = r"""
import os, signal, subprocess, sys, time
from v4flash_backend.group.rank_group import _guarded
quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
child = subprocess.Popen(_guarded([sys.argv[1], "60"], sys.executable), **quiet)
while os.path.realpath(f"/proc/{child.pid}/exe") != os.path.realpath(sys.argv[1]):
    time.sleep(0.01)  # past the guard's own parent check: the stand-in runs
print(child.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_torchrun_gets_sigterm_when_its_launcher_dies():
    """The guard `launch` puts before torchrun (a stand-in `sleep` here, so no torch in the child)."""
    parent = subprocess.run([sys.executable, "-c", GUARDED, shutil.which("sleep")], capture_output=True, text=True,
                            env=ENV, timeout=60)
    child = int(parent.stdout.split()[0])
    try:
        assert not _wait_gone([child], 3.0), "the guarded child outlived its launcher"
    finally:
        _kill([child])
    # started after its launcher is already gone (here: a parent pid that is not ours): it refuses
    late = subprocess.run(rank_group._guarded([shutil.which("sleep"), "60"], sys.executable, parent_pid=1),
                          capture_output=True, text=True, timeout=30)
    assert late.returncode == 1 and "launcher already gone" in late.stderr
