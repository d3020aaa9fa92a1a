"""The flags that restrict Triton's administrative protocols (scripts/triton_restrict.sh), as the
Neuron image's command (scripts/tritonserver_restricted.sh) and serve.sh's opt-in build them.
The wrapper execs `tritonserver` from PATH: here a stand-in that prints its arguments. A real
server honouring the flags is tests/test_triton_e2e.py::test_admin_protocols_need_the_key_and_the_rest_stays_open."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WRAPPER = REPO / "scripts" / "tritonserver_restricted.sh"
APIS = "shared-memory,model-repository,trace,logging"


def _run(tmp_path, **env):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "tritonserver"
    fake.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    full = {k: v for k, v in os.environ.items() if not k.startswith("V4FLASH_")}
    full.update(PATH=f"{bin_dir}:{os.environ['PATH']}", **env)
    return subprocess.run(["bash", str(WRAPPER), "--model-repository=/m"], capture_output=True, text=True, env=full,
                          timeout=30)


def test_a_key_is_generated_into_the_state_dir_when_none_is_mounted(tmp_path):
    state = tmp_path / "state"
    r = _run(tmp_path, V4FLASH_ADMIN_KEY_FILE=str(tmp_path / "absent"), V4FLASH_STATE_DIR=str(state))
    assert r.returncode == 0, r.stderr
    key_file = state / "admin_key"
    key = key_file.read_text()
    assert len(key) == 64 and int(key, 16) >= 0 and key_file.stat().st_mode & 0o777 == 0o600
    assert r.stdout.splitlines() == ["--model-repository=/m", f"--http-restricted-api={APIS}:v4flash-admin-key={key}",
                                     f"--grpc-restricted-protocol={APIS}:v4flash-admin-key={key}"]
    again = _run(tmp_path, V4FLASH_ADMIN_KEY_FILE=str(tmp_path / "absent"), V4FLASH_STATE_DIR=str(state))
    assert again.stdout == r.stdout  # kept across restarts, not regenerated


def test_a_mounted_key_is_used_and_a_bad_one_refused(tmp_path):
    key_file = tmp_path / "k"
    key_file.write_text("  abcdefghijklmnop0123\n")
    key_file.chmod(0o600)
    r = _run(tmp_path, V4FLASH_ADMIN_KEY_FILE=str(key_file))
    assert r.returncode == 0 and f"--http-restricted-api={APIS}:v4flash-admin-key=abcdefghijklmnop0123" in r.stdout
    key_file.chmod(0o644)
    r = _run(tmp_path, V4FLASH_ADMIN_KEY_FILE=str(key_file))
    assert r.returncode != 0 and "accessible to other users" in r.stderr and "--model-repository" not in r.stdout
    key_file.chmod(0o600)
    for bad in ("short", "has:colon-and=equals-signs"):
        key_file.write_text(bad)
        r = _run(tmp_path, V4FLASH_ADMIN_KEY_FILE=str(key_file))
        assert r.returncode != 0 and "at least 16 characters" in r.stderr, bad


def test_restriction_can_be_turned_off_explicitly(tmp_path):
    r = _run(tmp_path, V4FLASH_RESTRICT_ADMIN="0", V4FLASH_ADMIN_KEY_FILE=str(tmp_path / "absent"))
    assert r.returncode == 0 and r.stdout.splitlines() == ["--model-repository=/m"]
    assert not (tmp_path / "absent").exists()


def test_serve_sh_opt_in_without_a_key_file_does_not_start(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("V4FLASH_")}
    env.update(V4FLASH_RESTRICT_ADMIN="1", V4FLASH_ADMIN_KEY_FILE=str(tmp_path / "none"), SERVE_MAX_RESTARTS="0")
    r = subprocess.run(["bash", str(REPO / "scripts" / "serve.sh")], capture_output=True, text=True, env=env,
                       timeout=120, cwd=REPO)
    assert r.returncode == 1 and "admin key file" in r.stderr and "tritonserver on 127.0.0.1" not in r.stderr
