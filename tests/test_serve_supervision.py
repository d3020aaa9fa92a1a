"""scripts/serve.sh supervises tritonserver: a server killed with SIGKILL (as a crash would end
it) is started again and serves, the crashed server's rank group is gone within seconds (its
ranks watch the Triton stub that launched them), a stream in flight at the crash ends with an
error instead of hanging, and SIGTERM stops the script without another restart. Slow: two
server start-ups (~1-2 min on 2 busy cores)."""

import os
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from _triton import start_serve, stop, wait_ready
from test_soak import _load_soak
from v4flash_backend.group.rank_group import process_start_time

REPO = Path(__file__).resolve().parents[1]


def _group_pids(soak, http_port) -> list[int]:
    """torchrun and the ranks under the tritonserver serving http_port: torchrun's command line names
    the rank entry (`group.rank_entry`), a rank's the worker it replaced itself with."""
    procs = soak._procs()
    mods = ("v4flash_backend.group.worker", "v4flash_backend.group.rank_entry")
    return sorted(p for p in soak.server_tree(http_port) if any(m in procs[p][1] for m in mods))


def _wait(pred, timeout_s: float, step: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(step)
    return pred()


@pytest.mark.slow
def test_serve_sh_restarts_a_crashed_tritonserver_whose_rank_group_dies_with_it(tmp_path):
    if not (REPO / ".triton/backends/python/triton_python_backend_stub").exists():
        pytest.fail("tritonserver is not set up: run `make triton` (scripts/setup_triton.sh)")
    soak_mod = _load_soak()
    repo = soak_mod.build_repository(tmp_path)
    log_path = tmp_path / "serve.log"
    proc, server = start_serve(repo, log_path, SERVE_MAX_RESTARTS="2")
    http, grpc = server["http_port"], int(server["grpc"].rsplit(":", 1)[1])
    s = soak_mod.Soak(SimpleNamespace(seed=0, grpc_port=grpc, http_port=http, request_timeout_s=60.0))
    probe = dict(input_ids=[0, 5], stream=False, max_tokens=1)
    old_group = []
    try:
        wait_ready(proc, http, log_path, 240)
        [server] = [p for p in soak_mod.server_tree(http) if "tritonserver" in soak_mod._procs()[p][1].split(" ")[0]]
        old_group = _group_pids(soak_mod, http)
        assert len(old_group) == 2  # torchrun and the rank (W = 1)
        old_stubs = [p for p in soak_mod.server_tree(http) if p != server and p not in old_group]
        assert len(old_stubs) == 3  # the python backend's stubs of the three python models
        # a long stream in flight when the server dies
        long = soak_mod.Rec("long", "grpc", "v4flash")
        t = threading.Thread(target=s.grpc, args=(long, dict(input_ids=[0, 5, 6], stream=True, max_tokens=200,
                                                                 ignore_eos=True)))
        t.start()
        assert _wait(lambda: long.ids, 60, 0.05), "the stream did not start"
        os.kill(server, signal.SIGKILL)
        t_kill = time.monotonic()
        _wait(lambda: all(process_start_time(p) is None for p in old_group), 10)
        left = [p for p in old_group if process_start_time(p) is not None]
        assert not left, f"the crashed server's rank group outlived it: {left}"
        gone_s = time.monotonic() - t_kill
        t.join(30)
        assert long.status == "error" and long.finals == 1, (long.status, long.message)
        assert _wait(lambda: "restarting in 1 s (restart 1 of at most 2)" in log_path.read_text(), 30)
        wait_ready(proc, http, log_path, 240)
        new_server = [p for p in soak_mod.server_tree(http)
                      if "tritonserver" in soak_mod._procs()[p][1].split(" ")[0]]
        assert new_server and new_server != [server]
        assert set(_group_pids(soak_mod, http)).isdisjoint(old_group)
        assert all(process_start_time(p) is None for p in old_stubs)  # none left hanging
        served = s.grpc(soak_mod.Rec("probe", "grpc", "v4flash"), probe)
        assert served.status == "ok" and served.finish_reason == "length", served.message
        print(f"old group gone {gone_s:.1f} s after the kill; the stream in flight ended with: {long.message}")
    finally:
        stop(proc, 90)
        for p in old_group:
            if process_start_time(p) is not None:
                os.kill(p, signal.SIGKILL)
    text = log_path.read_text()
    assert proc.returncode == 0, text[-3000:]
    assert text.count("restarting in") == 1  # SIGTERM stopped it: no second restart
    assert "died of signal 9" in text
