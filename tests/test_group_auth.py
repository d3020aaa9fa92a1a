"""The rank-group socket's shared-secret authentication (group/auth.py, server.Server).

A real `Server` in front of a real `Engine` on the tiny checkpoint (in this process, no torchrun):
clients without the secret, with a wrong one, silent ones and ones flooding the handshake are
refused, logged and counted, and cost the server nothing (no connection kept, no thread left, no
engine request); the right secret is served. Binding beyond loopback without a secret fails
before anything is loaded, in the Server and in the worker's command line.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from v4flash_backend.group import auth
from v4flash_backend.group.rank_group import RankGroup, RankGroupError

SECRET = b"0123456789abcdef0123456789abcdef"
SRC = Path(__file__).resolve().parents[1] / "src"


def _wait(cond, within_s=5.0):
    deadline = time.monotonic() + within_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


@pytest.fixture
def served(tiny_model, monkeypatch):
    """(Server, log lines, engine) on 127.0.0.1 with SECRET; the engine loop on a thread."""
    from v4flash_backend.engine.engine import Engine
    from v4flash_backend.engine.runner import LocalRunner
    from v4flash_backend.group.server import Server
    from v4flash_backend.settings import Settings

    for k in (auth.SECRET_ENV, auth.SECRET_FILE_ENV):
        monkeypatch.delenv(k, raising=False)
    engine = Engine(LocalRunner(tiny_model, 2, 64), Settings(max_num_seqs=1, max_model_len=64, spec_mode="off"))
    submitted = []
    real_submit = engine.submit
    engine.submit = lambda req: (submitted.append(req.id), real_submit(req))[1]
    stop, logs = threading.Event(), []
    server = Server(engine, "127.0.0.1", 0, {"world_size": 1}, stop, secret=SECRET, auth_timeout_s=0.5,
                    max_pending=4, log=logs.append)
    loop = threading.Thread(target=engine.run, args=(stop,), daemon=True)
    loop.start()
    yield server, logs, submitted
    stop.set()
    server.close()
    loop.join(10)


def _raw(server):
    s = socket.create_connection(server.address, timeout=5)
    return s, s.makefile("rb")


def test_a_client_without_the_secret_is_refused_and_logged(served):
    server, logs, submitted = served
    s, f = _raw(server)
    hello = json.loads(f.readline())
    assert hello["auth"] == "hmac-sha256" and len(bytes.fromhex(hello["nonce"])) == 32
    # skipping the handshake: the first line is taken as the answer and refused, nothing is submitted
    s.sendall(b'{"op":"submit","id":1,"prompt_ids":[0,5],"params":{"max_tokens":2}}\n')
    reply = json.loads(f.readline())
    assert reply["code"] == "UNAUTHENTICATED" and "not an authentication" in reply["message"]
    assert f.readline() == b""  # closed by the server
    s.close()
    assert _wait(lambda: server.auth_refused == 1)
    assert submitted == [] and server.conns == {}
    assert any("refused a connection from 127.0.0.1" in m and "not an authentication" in m for m in logs), logs


def test_wrong_missing_and_slow_secrets_are_refused_and_the_right_one_is_served(served):
    server, logs, submitted = served
    address = "%s:%d" % server.address
    before = threading.active_count()
    with pytest.raises(RankGroupError, match="wrong secret"):
        RankGroup.connect(address, timeout_s=5, secret=b"f" * 32)
    with pytest.raises(RankGroupError, match="requires a shared secret"):
        RankGroup.connect(address, timeout_s=5)  # no secret anywhere (the fixture clears the env)
    s, f = _raw(server)  # connects and says nothing: refused after auth_timeout_s
    json.loads(f.readline())
    assert "no authentication within 0.5 s" in json.loads(f.readline())["message"]
    s.close()
    # a replayed answer: the right MAC for another connection's nonce
    s1, f1 = _raw(server)
    old = json.loads(f1.readline())["nonce"]
    s2, f2 = _raw(server)
    json.loads(f2.readline())
    s2.sendall(json.dumps({"op": "auth", "mac": auth.mac(SECRET, old)}).encode() + b"\n")
    assert json.loads(f2.readline())["code"] == "UNAUTHENTICATED"
    s1.close()
    s2.close()
    assert _wait(lambda: server.auth_refused == 5)
    assert sum("refused a connection" in m for m in logs) == 5
    assert any("wrong secret" in m for m in logs) and submitted == []
    # nothing was kept: no connection, no thread, every handshake slot free again
    assert _wait(lambda: threading.active_count() <= before), threading.enumerate()
    assert server.conns == {} and server._pending._value == 4

    g = RankGroup.connect(address, timeout_s=5, secret=SECRET)
    try:
        h = g.health()
        assert h["ok"] and h["auth_refused"] == 5 and h["connections"] == 1
        res = g.submit([0, 5, 6], {"max_tokens": 3, "ignore_eos": True}).result(timeout=60)
        assert res["error"] is None and len(res["token_ids"]) == 3 and len(submitted) == 1
    finally:
        g.close()


def test_secret_from_file_and_environment(served, tmp_path, monkeypatch):
    server, _, _ = served
    address = "%s:%d" % server.address
    path = auth.write_secret(str(tmp_path / "secret"), SECRET + b"\n")  # a trailing newline is not part of it
    assert os.stat(path).st_mode & 0o777 == 0o600
    monkeypatch.setenv(auth.SECRET_FILE_ENV, path)
    RankGroup.connect(address, timeout_s=5).close()
    monkeypatch.delenv(auth.SECRET_FILE_ENV)
    monkeypatch.setenv(auth.SECRET_ENV, SECRET.decode())
    RankGroup.connect(address, timeout_s=5).close()
    os.chmod(path, 0o644)  # readable by others: refused, whatever it holds
    with pytest.raises(RankGroupError, match="accessible to other users"):
        RankGroup.connect(address, timeout_s=5, secret_file=path)
    with pytest.raises(auth.AuthError, match="at least 16 bytes"):
        auth.load_secret(environ={auth.SECRET_ENV: "short"})


def test_a_flood_of_handshakes_is_capped(served):
    server, logs, _ = served
    held = [_raw(server) for _ in range(4)]  # every handshake slot taken by silent clients
    for _, f in held:
        json.loads(f.readline())
    s, f = _raw(server)
    assert f.readline() == b""  # closed at once, no hello
    assert any("too many connections authenticating" in m for m in logs)
    for s_, _ in held:
        s_.close()
    s.close()
    assert _wait(lambda: server._pending._value == 4)
    RankGroup.connect("%s:%d" % server.address, timeout_s=5, secret=SECRET).close()


def test_listening_beyond_loopback_needs_a_secret(tiny_model):
    from v4flash_backend.engine.engine import Engine
    from v4flash_backend.engine.runner import LocalRunner
    from v4flash_backend.group.server import Server
    from v4flash_backend.settings import Settings

    assert auth.is_loopback("127.0.0.1") and auth.is_loopback("::1") and auth.is_loopback("localhost")
    assert not any(auth.is_loopback(h) for h in ("0.0.0.0", "", "::", "10.1.2.3"))
    engine = Engine(LocalRunner(tiny_model, 2, 64), Settings(max_num_seqs=1, max_model_len=64, spec_mode="off"))
    with pytest.raises(auth.AuthError, match="refusing to listen on '0.0.0.0' without a shared secret"):
        Server(engine, "0.0.0.0", 0, {}, threading.Event())
    s = Server(engine, "0.0.0.0", 0, {}, threading.Event(), secret=SECRET)  # with one it listens
    s.close()


def test_the_worker_refuses_a_non_loopback_host_without_a_secret_before_loading(golden_dir, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in (auth.SECRET_ENV, auth.SECRET_FILE_ENV)}
    env["PYTHONPATH"] = str(SRC)
    cmd = [sys.executable, "-m", "v4flash_backend.group.worker", "--checkpoint", str(golden_dir),
           "--host", "0.0.0.0", "--port-file", str(tmp_path / "p.json")]
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "refusing to listen on '0.0.0.0' without a shared secret" in r.stderr, r.stderr
    assert "loaded shard" not in r.stderr and not (tmp_path / "p.json").exists()
    assert time.monotonic() - t0 < 60
