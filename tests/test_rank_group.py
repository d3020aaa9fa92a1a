"""The rank group end to end: `RankGroup.launch` starts torchrun with 2 ranks (gloo, loopback) on
the golden tiny checkpoint, and the client submits, streams, cancels, checks health, connects a
second time by address, runs the CLI path, shuts down, and sees a killed rank as a failure.

Outputs are compared with the engine run in this process on the same checkpoint: under 'exact'
numerics (the worker's default) the sharded forward is bit-identical to W = 1 and greedy
speculative decoding equals plain greedy decoding, so token sequences must match exactly.
"""

import argparse
import json
import os
import shutil
import signal
import socket
import time

import pytest
import torch

from v4flash_backend import cli
from v4flash_backend.group import rank_group
from v4flash_backend.group.rank_group import RankGroup, RankGroupError
from v4flash_backend.request import parse_wire_params as parse_params
from v4flash_backend.settings import Settings


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(3, 1000, (n - 1,), generator=g).tolist()


def _alone(model, prompt, max_tokens):
    from v4flash_backend.engine.engine import Engine
    from v4flash_backend.engine.runner import LocalRunner
    from v4flash_backend.request import GenerateRequest
    from v4flash_backend.settings import Settings

    eng = Engine(LocalRunner(model, 2, 128), Settings(max_num_seqs=1, max_model_len=128, spec_mode="off"))
    ev = eng.run_request(GenerateRequest(prompt=prompt, max_tokens=max_tokens, ignore_eos=True))
    return [t for e in ev for t in e.token_ids]


def _launch(golden_dir, **kw):
    # 'fixed' speculation drafts every step (the DSpark plans run) without the SPS profiling pass
    settings = Settings(checkpoint_dir=str(golden_dir), world_size=2, max_num_seqs=3, max_model_len=128,
                        spec_mode="fixed", heartbeat_s=1.0, collective_timeout_s=20.0, startup_timeout_s=300.0)
    return RankGroup.launch(settings, **kw)


@pytest.fixture(scope="module")
def group(golden_dir):
    g = _launch(golden_dir)
    yield g
    g.shutdown(timeout=30)


def test_concurrent_greedy_requests_equal_the_in_process_engine(group, tiny_model):
    specs = [(9, 12, 1), (30, 7, 2), (4, 10, 3)]
    streams = [group.submit(_prompt(n, s), {"max_tokens": k, "ignore_eos": True}) for n, k, s in specs]
    for st, (n, k, s) in zip(streams, specs):
        res = st.result(timeout=180)
        assert res["error"] is None and res["finish_reason"] == "length"
        assert res["token_ids"] == _alone(tiny_model, _prompt(n, s), k)
        evs = res["events"]
        assert evs[-1]["num_output_tokens"] == k and evs[-1]["num_prompt_tokens"] == n
        assert evs[0]["context_ids"] == _prompt(n, s)[-8:]
    assert res["events"][-1]["drafted"] > 0  # the DSpark plans ran on both ranks


def test_cancel_frees_the_slot(group):
    st = group.submit(_prompt(6, 4), {"max_tokens": 100, "ignore_eos": True})
    it = iter(st)
    first = next(it)
    assert first["event"] == "chunk" and first["token_ids"]
    group.cancel(st.id)
    last = list(it)[-1]
    assert last["finish_reason"] == "cancelled" and last["num_output_tokens"] < 100
    deadline = time.monotonic() + 10
    while group.stats()["engine"]["slots_in_use"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert group.stats()["engine"]["slots_in_use"] == 0


def test_bad_requests_get_invalid_arg_and_the_group_keeps_serving(group, tiny_model):
    cases = [([0, 5000], {"max_tokens": 2}, "vocabulary"), ([0, 5], {"temprature": 1.0}, "unknown"),
             ([0, 5], {"max_tokens": "3"}, "wrong type"), ([], {}, "empty"), ([0, 5], {"max_tokens": 0}, "max_tokens")]
    for prompt, params, text in cases:
        res = group.submit(prompt, params).result(timeout=30)
        assert res["code"] == "INVALID_ARG" and text in res["error"], (params, res)
    h = group.health()
    assert h["ok"] and h["world_size"] == 2 and len(h["pids"]) == 2
    p = _prompt(5, 9)
    assert group.submit(p, {"max_tokens": 3, "ignore_eos": True}).result(60)["token_ids"] == _alone(tiny_model, p, 3)


def test_a_launched_group_has_its_own_secret_off_the_command_line(group):
    """`launch` generates a secret per group: a loopback client without it (another local user) is
    refused and the group serves on; the secret is on no command line (`ps`) and no longer on disk."""
    from v4flash_backend.group.auth import client_handshake

    assert group.secret and len(group.secret) >= 32
    for pid in [group.proc.pid, *group.pids]:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert group.secret not in f.read()
    # the workers read it from a 0600 file in the 0700 work directory, removed once they are up
    assert not os.path.exists(os.path.join(group.workdir, "secret"))
    assert os.stat(group.workdir).st_mode & 0o077 == 0
    with socket.create_connection((group.info["host"], group.info["port"]), timeout=30) as s:
        with pytest.raises(Exception, match="requires a shared secret"):
            client_handshake(s, None)
    with pytest.raises(RankGroupError, match="wrong secret"):
        RankGroup.connect(f"{group.info['host']}:{group.info['port']}", secret=b"x" * 64)
    # the server counts a refusal after telling the client (its handshake thread): wait for the count
    deadline = time.monotonic() + 10
    while (h := group.health())["auth_refused"] < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert h["ok"] and h["auth_refused"] >= 2
    with open(group.log_path) as f:
        assert "wrong secret" in f.read()


def test_raw_protocol_messages(group):
    from v4flash_backend.group.auth import client_handshake

    host, port = group.info["host"], group.info["port"]
    with socket.create_connection((host, port), timeout=30) as s:
        client_handshake(s, group.secret)
        f = s.makefile("rb")

        def send(obj):
            s.sendall((obj if isinstance(obj, str) else json.dumps(obj)).encode() + b"\n")
            return json.loads(f.readline())

        assert send("{not json")["code"] == "INVALID_ARG"
        assert send({"op": "frobnicate", "tag": 1}) == {"event": "error", "code": "INVALID_ARG", "tag": 1,
                                                          "message": "unknown op 'frobnicate'"}
        r = send({"op": "stats", "tag": "s"})
        assert r["tag"] == "s" and r["collectives_total"]["world.all_reduce"]["calls"] > 0
        assert r["plans"]["forward"] > 0 and r["plans"]["dspark"] > 0
        # two requests with the same id on one connection: the second is refused
        s.sendall(b'{"op":"submit","id":7,"prompt_ids":[0,4,5],"params":{"max_tokens":40,"ignore_eos":true}}\n')
        s.sendall(b'{"op":"submit","id":7,"prompt_ids":[0,4,5],"params":{"max_tokens":2}}\n')
        s.sendall(b'{"op":"cancel","id":7}\n')
        msgs = []
        while not (msgs and msgs[-1].get("finish_reason") == "cancelled"):
            msgs.append(json.loads(f.readline()))
        errs = [m for m in msgs if m["event"] == "error"]
        assert len(errs) == 1 and errs[0]["id"] == 7 and "already in flight" in errs[0]["message"]


def test_connect_by_address_and_cli_generate(group, tiny_model, capsys, monkeypatch):
    address = f"{group.info['host']}:{group.info['port']}"
    other = RankGroup.connect(address, secret=group.secret)
    assert other.info["world_size"] == 2 and other.proc is None
    p = _prompt(12, 21)
    assert other.submit(p, {"max_tokens": 4, "ignore_eos": True}).result(60)["token_ids"] == _alone(tiny_model, p, 4)
    with pytest.raises(RankGroupError, match="not launched"):
        other.restart()
    other.close()
    args = argparse.Namespace(prompt_ids=p, prompt=None, checkpoint_dir=None, max_tokens=5, temperature=0.0, top_k=0,
                              top_p=1.0, seed=None, ignore_eos=True, world_size=None, address=address, python=None,
                              ops_backend="torch")
    with pytest.raises(RankGroupError, match="requires a shared secret"):
        cli.generate_via_group(args)  # no secret anywhere
    monkeypatch.setenv("V4FLASH_GROUP_SECRET", group.secret.decode())  # the CLI's --address client reads it
    assert cli.generate_via_group(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "output_ids: " + " ".join(map(str, _alone(tiny_model, p, 5)))
    assert out[-1].startswith("finish_reason=length tokens=5 world_size=2")
    assert group.health()["ok"]  # the CLI's own connection closing does not disturb the group


def test_shutdown_ends_in_flight_requests_and_exits_cleanly(group):
    st = group.submit(_prompt(6, 5), {"max_tokens": 120, "ignore_eos": True})
    next(iter(st))
    code = group.shutdown(timeout=60)
    assert code == 0, rank_group._tail(group.log_path)  # kept after a failure: what the ranks said
    last = list(st)[-1]
    assert (last["event"] == "error" and last["code"] == "UNAVAILABLE") or last["finish_reason"] is not None
    assert not group.health()["ok"] and not group.alive
    late = group.submit([0, 5], {"max_tokens": 1}).result(5)
    assert late["code"] == "UNAVAILABLE"


def test_a_killed_rank_is_reported_within_30_s(golden_dir):
    g = _launch(golden_dir)
    try:
        st = g.submit(_prompt(8, 6), {"max_tokens": 120, "ignore_eos": True})
        it = iter(st)
        next(it)
        t0 = time.monotonic()
        os.kill(g.pids[1], signal.SIGKILL)  # a follower: rank 0 only learns of it through the collectives
        last = list(it)[-1]
        assert last["event"] == "error" and last["code"] == "UNAVAILABLE"
        while g.health(timeout=5)["ok"] and time.monotonic() - t0 < 30:
            time.sleep(0.2)
        assert not g.health()["ok"]
        assert g.proc.wait(timeout=max(1.0, 30 - (time.monotonic() - t0))) != 0
        assert time.monotonic() - t0 < 30
        for pid in g.pids:  # no rank is left behind
            with pytest.raises(ProcessLookupError):
                for _ in range(50):
                    os.kill(pid, 0)
                    time.sleep(0.1)
    finally:
        g.shutdown(timeout=10)
        shutil.rmtree(g.workdir, ignore_errors=True)  # kept by the client after a failure (the log)


def test_worker_python_is_chosen_explicitly(tmp_path, monkeypatch):
    monkeypatch.delenv("V4FLASH_PYTHON", raising=False)
    assert rank_group.project_python() == str(rank_group.REPO_DIR / ".venv" / "bin" / "python")
    with pytest.raises(RankGroupError, match="not executable"):
        rank_group.project_python(str(tmp_path / "nope"))
    monkeypatch.setenv("V4FLASH_PYTHON", str(tmp_path / "missing"))
    with pytest.raises(RankGroupError):
        rank_group.project_python()


def test_parse_params():
    assert parse_params({"max_tokens": 3, "temperature": 1, "top_k": 5, "top_p": 0.5, "seed": None,
                         "stop_token_ids": [1, 2], "ignore_eos": True}) == dict(
        max_tokens=3, temperature=1.0, top_k=5, top_p=0.5, seed=None, stop_token_ids=(1, 2), ignore_eos=True)
    for bad in ({"max_tokens": True}, {"seed": 1.5}, {"stop_token_ids": [1, "2"]}, {"ignore_eos": 1}, {"x": 1}, [1]):
        with pytest.raises(ValueError):
            parse_params(bad)
