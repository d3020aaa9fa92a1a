"""Serving from a read-only checkpoint: the engine's own files go to `state_dir`.

The checkpoint is copied and `chmod -R a-w`. Tests run as root, which chmod does not stop, so the
engine runs in a child process whose capability bounding set lacks CAP_DAC_OVERRIDE,
CAP_DAC_READ_SEARCH and CAP_FOWNER: the kernel then applies the mode bits to it (the child first
checks that it really cannot write there, so the test cannot pass vacuously). It serves with
DSpark and online calibration on, profiles its step cost into state_dir, and a second start loads
that profile instead of profiling again; the checkpoint's files (names, sizes, mtimes) are unchanged.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PR_CAPBSET_DROP = 24
CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER = 1, 2, 3

CHILD = r"""
import json, os, sys, threading
ckpt, state = sys.argv[1], sys.argv[2]
try:
    open(os.path.join(ckpt, "probe"), "w").close()
    enforced = False
except PermissionError:
    enforced = True
import v4flash_backend.engine.step_profile as E
profiled = []
real = E.interleaved_medians
E.interleaved_medians = lambda *a, **k: (profiled.append(1), real(*a, **k))[1]
from v4flash_backend.request import GenerateRequest
from v4flash_backend.serving.engine_inprocess import InProcessEngine
from v4flash_backend.settings import Settings
s = Settings(checkpoint_dir=ckpt, state_dir=state, launcher="inprocess", spec_mode="dspark",
             calibration_online=True, max_num_seqs=2, max_model_len=96,
             dspark_adaptive=False)  # every step drafts: verified blocks to refit from in 24 tokens
eng = InProcessEngine(s, log=lambda m: None)
eng.engine.calib.refit_every = 4  # refit within this short run (the default waits for 64 blocks)
done, tokens = threading.Event(), []
def on_event(ev):
    tokens.extend(ev.get("token_ids", []))
    if ev.get("finish_reason") is not None or ev.get("event") == "error":
        done.set()
eng.submit(GenerateRequest(prompt=[0, 5, 6, 7], max_tokens=24, ignore_eos=True), "r1", on_event)
assert done.wait(120)
stats = eng.stats()
eng.close()
print(json.dumps({"enforced": enforced, "profiled": bool(profiled), "tokens": tokens, "sps_file": s.sps_file,
                  "drafted": stats.get("drafted"), "online": eng.engine.calib.enabled,
                  "refits": stats["calibration_refits"]["greedy"]}))
"""


def _drop_dac_caps() -> None:
    """In the child before exec: no capability that overrides file modes (the exec'd program, even
    as root, gets none of them)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "PR_CAPBSET_DROP")


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns, stat.S_IMODE(p.stat().st_mode))
            for p in [root, *root.rglob("*")]}


def _run(ckpt: Path, state: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(SRC), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", CHILD, str(ckpt), str(state)], capture_output=True, text=True,
                       env=env, timeout=300, preexec_fn=_drop_dac_caps if os.geteuid() == 0 else None)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_serves_from_a_read_only_checkpoint_with_state_in_state_dir(golden_dir, tmp_path):
    ckpt, state = tmp_path / "ckpt", tmp_path / "state"
    shutil.copytree(golden_dir, ckpt)
    subprocess.run(["chmod", "-R", "a-w", str(ckpt)], check=True)
    before = _snapshot(ckpt)
    try:
        first = _run(ckpt, state)
        assert first["enforced"], "the child could write into the read-only checkpoint: the test would prove nothing"
        assert len(first["tokens"]) == 24 and first["drafted"] > 0  # served, with DSpark drafting
        assert first["online"] and first["refits"] > 0  # online calibration ran (it lives in memory)
        assert first["profiled"] and Path(first["sps_file"]).parent == state and Path(first["sps_file"]).is_file()
        second = _run(ckpt, state)
        assert not second["profiled"] and second["sps_file"] == first["sps_file"]  # the saved profile, loaded
        assert second["tokens"] == first["tokens"]  # greedy: the same continuation
        assert _snapshot(ckpt) == before  # nothing written, renamed or touched in the checkpoint
        assert sorted(p.name for p in state.iterdir()) == [Path(first["sps_file"]).name]
    finally:
        subprocess.run(["chmod", "-R", "u+w", str(ckpt)], check=True)


def test_without_state_dir_nothing_is_written_and_sps_path_wins(tmp_path, monkeypatch):
    from v4flash_backend.settings import Settings

    monkeypatch.delenv("V4FLASH_STATE_DIR", raising=False)
    assert Settings().sps_file == ""  # the default writes no file anywhere
    monkeypatch.setenv("V4FLASH_STATE_DIR", str(tmp_path / "env"))  # what the images set
    assert Path(Settings().sps_file).parent == tmp_path / "env"
    s = Settings(checkpoint_dir="/ckpt", state_dir=str(tmp_path))
    assert Path(s.sps_file).parent == tmp_path and Path(s.sps_file).name.startswith("sps-")
    assert s.replace(sps_path="/elsewhere.json").sps_file == "/elsewhere.json"
    assert s.replace(max_num_seqs=3).sps_file != s.sps_file  # a profile per slot count (its tables' R range)
