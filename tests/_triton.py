"""Starting and stopping a tritonserver for the end-to-end tests (one copy of the loopback-port,
readiness and teardown logic that test_triton_e2e, test_triton_prepost, test_triton_static and
test_soak share)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from v4flash_backend.group.rank_group import free_ports  # noqa: F401 - the suite's servers take it from here

REPO = Path(__file__).resolve().parents[1]



def wait_ready(proc: subprocess.Popen, http_port: int, log_path, timeout_s: float, tail: int = 6000) -> None:
    """Poll /v2/health/ready until 200; fail the test with the log's tail if the server exits or
    is not ready within timeout_s."""
    deadline = time.monotonic() + timeout_s
    url = f"http://127.0.0.1:{http_port}/v2/health/ready"
    while True:
        if proc.poll() is not None:
            pytest.fail(f"tritonserver exited ({proc.returncode}):\n{log_path.read_text()[-tail:]}")
        try:
            if urllib.request.urlopen(url, timeout=2).status == 200:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"tritonserver not ready in {timeout_s:.0f}s:\n{log_path.read_text()[-tail:]}")
        time.sleep(0.25)


def stop(proc: subprocess.Popen, timeout_s: float = 60) -> None:
    """SIGTERM the server (its own session), SIGKILL the session if it does not exit in time."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def start_serve(repo, log_path, **env) -> tuple[subprocess.Popen, dict]:
    """scripts/serve.sh (what `make serve` runs) on the model repository `repo`, on three free loopback
    ports, stdout and stderr into log_path, in its own session (`stop` ends it); `env` adds or
    overrides environment variables. Without the OpenAI frontend (OPENAI_PORT off unless `env` names a
    port: tests/test_openai_e2e.py) and with restarts off (conftest), serve.sh execs run_tritonserver.sh,
    which execs tritonserver: the process is the server. Returns it and {http, grpc, metrics (URL),
    log, http_port} -- not yet ready (`wait_ready`)."""
    http, grpc, metrics = free_ports(3)
    env.setdefault("OPENAI_PORT", "off")
    full = dict(os.environ, MODEL_REPOSITORY=str(repo), HTTP_PORT=str(http), GRPC_PORT=str(grpc),
                METRICS_PORT=str(metrics), **env)
    full.pop("V4FLASH_CHECKPOINT_DIR", None)  # the repository's checkpoint_dir parameter decides
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(["bash", str(REPO / "scripts/serve.sh")], env=full, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    return proc, {"http": f"127.0.0.1:{http}", "grpc": f"127.0.0.1:{grpc}",
                  "metrics": f"http://127.0.0.1:{metrics}/metrics", "log": log_path, "http_port": http}
