"""scripts/serve_openai.sh without tritonserver (seconds): a stand-in server command beside the real
frontend. The server's exit takes the frontend with it and is the script's exit code; a frontend
that keeps dying (here: an API key file others can read) stops the server too after
OPENAI_MAX_RESTARTS restarts; a taken port stops everything before it starts.
With tritonserver: tests/test_openai_e2e.py (a killed frontend comes back; SIGTERM stops both)."""

from __future__ import annotations

import os
import socket
import subprocess
import time

from _triton import REPO, free_ports


def _run(server_cmd: str, port: int, timeout: float = 60, **env):
    full = dict(os.environ, OPENAI_PORT=str(port), GRPC_PORT=str(free_ports(1)[0]), **env)
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(REPO / "scripts" / "serve_openai.sh"), "bash", "-c", server_cmd], env=full,
                       capture_output=True, text=True, timeout=timeout)
    return r, time.monotonic() - t0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def test_the_servers_exit_stops_the_frontend_and_is_the_exit_code(tmp_path):
    port = free_ports(1)[0]
    # the stand-in server waits until the frontend answers, then exits with 3
    cmd = (f"for i in $(seq 100); do (echo > /dev/tcp/127.0.0.1/{port}) 2>/dev/null && break; sleep 0.1; done; "
           "exit 3")
    r, _ = _run(cmd, port)
    assert r.returncode == 3, r.stderr
    assert "the server exited with code 3; stopping the OpenAI frontend" in r.stderr
    pid = int(r.stderr.split("(pid ")[1].split(")")[0])
    assert not _alive(pid)


def test_a_frontend_that_keeps_dying_stops_the_server(tmp_path):
    key = tmp_path / "key"  # readable by others: the frontend refuses it at every start
    key.write_text("k" * 20)
    key.chmod(0o644)
    marker = tmp_path / "server_pid"
    r, seconds = _run(f"echo $$ > {marker}; exec sleep 120", free_ports(1)[0], OPENAI_MAX_RESTARTS="1",
                      V4FLASH_OPENAI_KEY_FILE=str(key))
    assert r.returncode == 1 and seconds < 60, r.stderr
    assert "is accessible to other users (mode 644): chmod 600 it" in r.stderr
    assert "restarting it in 1 s (restart 1 of at most 1)" in r.stderr
    assert "1 restart(s) already, stopping the server too" in r.stderr
    assert not _alive(int(marker.read_text()))


def test_a_taken_port_stops_it_before_anything_starts(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    marker = tmp_path / "started"
    try:
        r, seconds = _run(f"touch {marker}; sleep 120", taken.getsockname()[1])
    finally:
        taken.close()
    assert r.returncode == 1 and seconds < 10 and "is already in use" in r.stderr, r.stderr
    assert not marker.exists()
