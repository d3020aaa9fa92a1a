"""End to end: the real tritonserver (scripts/serve.sh, the script behind `make serve`) on
loopback, serving the repository's v4flash model (a torchrun rank group of one rank, the
engine with DSpark on, the golden tiny checkpoint) and the v4flash_text ensemble.

One server for the whole module, on free ports, from a temporary model repository that
holds the repository's own model.py files (symlinked) and configs, with the v4flash
parameters made small (4 KV slots, max_model_len 64). Greedy decoding throughout: the
engine's greedy output does not depend on batching (exact numerics) nor on DSpark
(lossless), so outputs of different paths and of concurrent requests must be identical.
"""

import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tokenizers import Tokenizer

from v4flash_backend.client import GenerateError, generate

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO.parent / "shared" / "golden" / "v41-tiny"
READY_TIMEOUT_S = 240  # tritonserver + 3 stubs + torchrun + model load + DSpark profile, 2 busy cores
MAX_MODEL_LEN = 64
SLOTS = 4
PROMPT_IDS = [0, 17, 250, 33, 901, 12]
PROMPT_TEXT = "Once upon a time"
N = 8  # max_tokens of most requests


def _free_ports(n):
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _set_param(config: str, key: str, value: str) -> str:
    out, n = re.subn(r'(key: "%s", value: \{ string_value: )"[^"]*"' % re.escape(key), r'\1"%s"' % value, config)
    assert n == 1, f"parameter {key} not in config.pbtxt"
    return out


def _build_repository(root: Path) -> Path:
    repo = root / "repo"
    for name in ("preprocessing", "postprocessing", "v4flash"):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").symlink_to(REPO / "model_repository" / name / "1" / "model.py")
        if name != "v4flash":
            shutil.copy(REPO / "model_repository" / name / "config.pbtxt", repo / name)
    config = (REPO / "model_repository/v4flash/config.pbtxt").read_text()
    for key, value in (("checkpoint_dir", str(GOLDEN)), ("max_num_seqs", str(SLOTS)),
                       ("max_model_len", str(MAX_MODEL_LEN)), ("default_max_tokens", str(N))):
        config = _set_param(config, key, value)
    config += 'parameters { key: "stats_interval_s", value: { string_value: "0.2" } }\n'
    (repo / "v4flash" / "config.pbtxt").write_text(config)
    shutil.copytree(REPO / "model_repository/v4flash_text", repo / "v4flash_text")
    return repo


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not (REPO / ".triton/backends/python/triton_python_backend_stub").exists():
        pytest.fail("tritonserver is not set up: run `make triton` (scripts/setup_triton.sh)")
    root = tmp_path_factory.mktemp("triton_e2e")
    repo = _build_repository(root)
    http_port, grpc_port, metrics_port = _free_ports(3)
    env = dict(os.environ, MODEL_REPOSITORY=str(repo), HTTP_PORT=str(http_port), GRPC_PORT=str(grpc_port),
               METRICS_PORT=str(metrics_port))
    env.pop("V4FLASH_CHECKPOINT_DIR", None)
    log_path = root / "tritonserver.log"
    with open(log_path, "wb") as log:
        # serve.sh execs run_tritonserver.sh, which execs tritonserver: proc.pid is the server,
        # in its own session with its stubs (the rank group has its own session, stopped by
        # the v4flash model's finalize()).
        proc = subprocess.Popen(["bash", str(REPO / "scripts/serve.sh")], env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        url = f"http://127.0.0.1:{http_port}/v2/health/ready"
        while True:
            if proc.poll() is not None:
                pytest.fail(f"tritonserver exited ({proc.returncode}):\n{log_path.read_text()[-6000:]}")
            try:
                if urllib.request.urlopen(url, timeout=2).status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"tritonserver not ready in {READY_TIMEOUT_S}s:\n{log_path.read_text()[-6000:]}")
            time.sleep(0.25)
        yield {"http": f"127.0.0.1:{http_port}", "grpc": f"127.0.0.1:{grpc_port}",
               "metrics": f"http://127.0.0.1:{metrics_port}/metrics", "log": log_path}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log_text = log_path.read_text()
    assert "successfully unloaded 'v4flash'" in log_text, log_text[-3000:]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_file(str(GOLDEN / "tokenizer.json"))


# ---- helpers ------------------------------------------------------------------------------------
def _grpc(server, **kw):
    kw.setdefault("ignore_eos", True)
    return list(generate(url=server["grpc"], timeout_s=120, **kw))


def _concurrently(*calls):
    """Run the calls on threads at once (the engine batches them); their results in order."""
    results = [None] * len(calls)

    def run(k):
        try:
            results[k] = calls[k]()
        except Exception as exc:  # re-raised in the test thread
            results[k] = exc

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    for r in results:
        if isinstance(r, Exception):
            raise r
    return results


def _http(server, path, body):
    host, port = server["http"].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, data


def _sse(server, model, body):
    status, data = _http(server, f"/v2/models/{model}/generate_stream", dict(body, stream=True))
    assert status == 200, data
    events = [json.loads(line[len(b"data: "):]) for line in data.splitlines() if line.startswith(b"data: ")]
    assert events and all("error" not in e for e in events), events
    return events


def _whole(server, model, body):
    status, data = _http(server, f"/v2/models/{model}/generate", dict(body, stream=False))
    assert status == 200, data
    return json.loads(data)


def _ids(v):
    return v if isinstance(v, list) else [v]  # HTTP JSON flattens a one-element tensor


def _metrics(server):
    text = urllib.request.urlopen(server["metrics"], timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("v4flash:"):
            name, value = line.rsplit(" ", 1)
            reason = re.search(r'reason="(\w+)"', name)
            name = name.split("{")[0] + (f"[{reason.group(1)}]" if reason else "")
            if "_bucket" not in name:
                values[name] = float(value)
    return values


@pytest.fixture(scope="module")
def reference(server):
    """Greedy ids of PROMPT_IDS, and of PROMPT_TEXT through the preprocessing tokenizer."""
    chunks = _grpc(server, model="v4flash", input_ids=PROMPT_IDS, stream=False, max_tokens=N,
                   exclude_input_in_output=True)
    return {"ids": chunks[0].output_ids}


# ---- streaming paths ----------------------------------------------------------------------------
def test_v4flash_ids_streamed_equals_whole_over_grpc(server, reference):
    streamed, whole, echoed = _concurrently(
        lambda: _grpc(server, model="v4flash", input_ids=PROMPT_IDS, max_tokens=N),
        lambda: _grpc(server, model="v4flash", input_ids=PROMPT_IDS, stream=False, max_tokens=N,
                      exclude_input_in_output=True),
        lambda: _grpc(server, model="v4flash", input_ids=PROMPT_IDS, stream=False, max_tokens=N))
    ids = [t for c in streamed for t in c.output_ids]
    assert len(ids) == N and ids == reference["ids"]
    assert len(whole) == 1 and whole[0].output_ids == ids
    assert echoed[0].output_ids == PROMPT_IDS + ids  # non-streamed output echoes the prompt by default
    assert [c.finish_reason for c in streamed] == [""] * (len(streamed) - 1) + ["length"]
    assert sum(c.num_output_tokens for c in streamed) == N == whole[0].num_output_tokens
    assert all(c.num_input_tokens == len(PROMPT_IDS) for c in streamed)
    drafted = sum(c.num_drafted_tokens for c in streamed)
    accepted = sum(c.num_accepted_tokens for c in streamed)
    assert drafted > 0 and 0 <= accepted <= drafted  # DSpark is on; deltas add up to totals
    assert whole[0].num_drafted_tokens > 0


def test_text_streams_over_grpc_equal_the_non_streamed_text(server, tokenizer):
    """v4flash (text_input) and the v4flash_text ensemble, streamed and not: one text."""
    kw = dict(prompt=PROMPT_TEXT, max_tokens=N)
    direct_s, direct_w, ens_s, ens_w = _concurrently(
        lambda: _grpc(server, model="v4flash", **kw),
        lambda: _grpc(server, model="v4flash", stream=False, exclude_input_in_output=True, **kw),
        lambda: _grpc(server, model="v4flash_text", **kw),
        lambda: _grpc(server, model="v4flash_text", stream=False, exclude_input_in_output=True, **kw))
    ids = [t for c in direct_s for t in c.output_ids]
    text = "".join(c.text for c in direct_s)
    assert len(ids) == N and text == tokenizer.decode(ids)
    # chunk boundaries follow DSpark acceptance, which the batch-wide admission makes depend on
    # the concurrent requests: compare tokens and text, not the number of chunks
    assert len(direct_s) > 1 and len(ens_s) > 1
    assert direct_w[0].text == text and [t for c in ens_s for t in c.output_ids] == ids
    assert "".join(c.text for c in ens_s) == text == ens_w[0].text
    # Without exclude_input_in_output the non-streamed text starts with the prompt.
    echoed = _grpc(server, model="v4flash", stream=False, prompt=PROMPT_TEXT, max_tokens=2)
    assert echoed[0].text.startswith(PROMPT_TEXT) and len(echoed[0].text) > len(PROMPT_TEXT)


def test_http_sse_streams_equal_the_non_streamed_text(server, reference):
    body_text = {"text_input": PROMPT_TEXT, "max_tokens": N, "ignore_eos": True}
    body_ids = {"input_ids": PROMPT_IDS, "max_tokens": N, "ignore_eos": True}
    ens_s, ens_w, dir_s, ids_s = _concurrently(
        lambda: _sse(server, "v4flash_text", body_text),
        lambda: _whole(server, "v4flash_text", dict(body_text, exclude_input_in_output=True)),
        lambda: _sse(server, "v4flash", body_text),
        lambda: _sse(server, "v4flash", body_ids))
    text = "".join(e["text_output"] for e in ens_s)
    assert len(ens_s) > 1 and text == ens_w["text_output"] == "".join(e["text_output"] for e in dir_s)
    assert [e["finish_reason"] for e in ens_s][-1] == "length"
    assert [t for e in ids_s for t in _ids(e["output_ids"])] == reference["ids"]
    assert "text_output" not in ids_s[0]  # ids in, ids out


# ---- bad requests -------------------------------------------------------------------------------
BAD_HTTP = [  # (model, body, what the error message must say)
    ("v4flash", {"input_ids": []}, "input_ids is empty"),
    ("v4flash", {"text_input": ""}, "text_input is empty"),
    ("v4flash", {"input_ids": list(range(MAX_MODEL_LEN))}, f"prompt has {MAX_MODEL_LEN} tokens; max_model_len"),
    ("v4flash", {"text_input": "hi", "sampling_parameters": "{max_tokens: 3"}, "sampling_parameters is not valid JSON"),
    ("v4flash", {"input_ids": [1], "max_tokens": 0}, "max_tokens must be > 0"),
    ("v4flash", {"input_ids": [1], "sampling_parameters": '{"max_tokens": -1}'}, "max_tokens must be > 0"),
    ("v4flash", {"input_ids": [1], "temperature": -0.5}, "temperature must be >= 0"),
    ("v4flash", {"input_ids": [1], "top_p": 0.0}, r"top_p must be in (0, 1]"),
    ("v4flash", {"input_ids": [1], "top_p": 1.5}, r"top_p must be in (0, 1]"),
    ("v4flash", {"input_ids": [1, 5000]}, "token id 5000 in the prompt is outside the vocabulary [0, 1024)"),
    ("v4flash", {"input_ids": [1], "text_input": "hi"}, "exactly one of input_ids"),
    ("v4flash", {"max_tokens": 3}, "exactly one of input_ids"),
    ("v4flash_text", {"text_input": "hi", "top_p": 1.5}, r"top_p must be in (0, 1]"),
    ("v4flash", {"input_ids": [1, 2], "max_tokens": MAX_MODEL_LEN - 1}, "[INVALID_ARG] max_tokens 63 does not fit"),
    ("v4flash_text", {"text_input": ""}, "[INVALID_ARG] preprocessing: text_input is empty"),
]


def test_bad_requests_fail_with_invalid_arg_while_a_good_stream_completes(server, reference):
    good_max = N + 4
    good = {}

    def run_good():
        good["chunks"] = _grpc(server, model="v4flash", input_ids=PROMPT_IDS, max_tokens=good_max)

    t = threading.Thread(target=run_good)
    t.start()
    try:
        for model, body, message in BAD_HTTP:
            status, data = _http(server, f"/v2/models/{model}/generate", body)
            # Triton's HTTP status for TRITONSERVER_ERROR_INVALID_ARG is 400.
            assert status == 400, (body, status, data)
            assert message in json.loads(data)["error"], (body, data)
        # gRPC streams carry the message only; Triton itself checks datatypes against the config.
        wrong = grpcclient.InferInput("input_ids", [2], "FP32")
        wrong.set_data_from_numpy(np.array([1.0, 2.0], dtype=np.float32))
        client = grpcclient.InferenceServerClient(server["grpc"])
        errors = []
        client.start_stream(callback=lambda result, error: errors.append(error))
        client.async_stream_infer("v4flash", [wrong])
        deadline = time.monotonic() + 10
        while not errors and time.monotonic() < deadline:
            time.sleep(0.02)
        client.stop_stream()
        # (the core's INVALID_ARG for a datatype that differs from config.pbtxt)
        assert errors and "data-type is 'FP32', but model 'v4flash' expects 'INT32'" in str(errors[0]), errors
        with pytest.raises(GenerateError, match="temperature must be >= 0"):
            _grpc(server, model="v4flash", input_ids=[1], temperature=-1.0)
        with pytest.raises(GenerateError, match="unsupported key.*'max_token'"):
            _grpc(server, model="v4flash_text", prompt="hi", sampling_parameters={"max_token": 3})
        assert t.is_alive(), "the good stream should still be running while the bad requests are answered"
    finally:
        t.join(timeout=120)
    chunks = good["chunks"]
    ids = [x for c in chunks for x in c.output_ids]
    assert len(ids) == good_max and ids[:N] == reference["ids"]  # greedy: a prefix of the same output
    assert chunks[-1].finish_reason == "length"


# ---- cancellation and metrics -------------------------------------------------------------------
def _wait_metrics(server, pred, timeout=15.0):
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(server)
        if pred(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def test_cancelling_a_grpc_stream_frees_its_slot(server):
    before = _wait_metrics(server, lambda m: m["v4flash:requests_in_flight"] == 0)
    long_max = 40
    got = 0
    during = None
    for chunk in generate(input_ids=PROMPT_IDS, url=server["grpc"], model="v4flash", max_tokens=long_max,
                          ignore_eos=True):
        got += chunk.num_output_tokens
        if got >= 2:
            during = _wait_metrics(server, lambda m: m["v4flash:kv_slots_in_use"] >= 1, timeout=5)
            break  # leaving the loop cancels the request (stop_stream(cancel_requests=True))
    assert during["v4flash:kv_slots_in_use"] >= 1 and during["v4flash:requests_in_flight"] == 1
    after = _wait_metrics(server, lambda m: m["v4flash:kv_slots_in_use"] == 0
                          and m["v4flash:requests_in_flight"] == 0
                          and m["v4flash:requests_finished_total[cancelled]"] > before[
                              "v4flash:requests_finished_total[cancelled]"])
    assert after["v4flash:kv_slots_in_use"] == 0 and after["v4flash:requests_in_flight"] == 0
    assert after["v4flash:requests_finished_total[cancelled]"] == before["v4flash:requests_finished_total[cancelled]"] + 1
    generated = after["v4flash:generation_tokens_total"] - before["v4flash:generation_tokens_total"]
    assert 2 <= generated < long_max  # it stopped early
    # The freed slot serves the next request.
    assert sum(c.num_output_tokens for c in _grpc(server, model="v4flash", input_ids=[0, 5], max_tokens=2)) == 2


def test_closing_an_http_sse_stream_cancels_the_request(server):
    """Triton cancels a request whose HTTP connection closes (server src/http_server.cc), and
    the model sees it like a gRPC cancellation. (Through the v4flash_text ensemble, Triton
    2.51 does not pass a cancellation on to a step already running: see docs/serving.md.)"""
    before = _wait_metrics(server, lambda m: m["v4flash:requests_in_flight"] == 0)
    host, port = server["http"].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v2/models/v4flash/generate_stream",
                 json.dumps({"input_ids": PROMPT_IDS, "max_tokens": 40, "ignore_eos": True, "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    events = 0
    while events < 2:
        line = resp.fp.readline()
        assert line, "stream ended early"
        events += line.startswith(b"data: ")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    key = "v4flash:requests_finished_total[cancelled]"
    after = _wait_metrics(server, lambda m: m[key] > before[key] and m["v4flash:kv_slots_in_use"] == 0)
    assert after[key] == before[key] + 1 and after["v4flash:kv_slots_in_use"] == 0
    assert after["v4flash:generation_tokens_total"] - before["v4flash:generation_tokens_total"] < 40


def test_metrics_endpoint_counts_a_request(server):
    before = _wait_metrics(server, lambda m: m["v4flash:requests_in_flight"] == 0)
    chunks = _grpc(server, model="v4flash", input_ids=PROMPT_IDS, max_tokens=6)
    # The slot gauge is refreshed from the engine's stats (on each finish and every 0.2 s).
    after = _wait_metrics(server, lambda m: m["v4flash:requests_in_flight"] == 0 and m["v4flash:kv_slots_in_use"] == 0)

    def delta(name):
        return after[name] - before[name]

    assert delta("v4flash:prompt_tokens_total") == len(PROMPT_IDS)
    assert delta("v4flash:generation_tokens_total") == 6
    assert delta("v4flash:draft_tokens_total") == sum(c.num_drafted_tokens for c in chunks) > 0
    assert delta("v4flash:accepted_draft_tokens_total") == sum(c.num_accepted_tokens for c in chunks)
    assert delta("v4flash:time_to_first_token_seconds_count") == 1
    assert delta("v4flash:inter_token_latency_seconds_count") == 5  # tokens after the first
    itl_mean = delta("v4flash:inter_token_latency_seconds_sum") / 5
    client_itl = (chunks[-1].time - chunks[0].time) / 5
    assert abs(itl_mean - client_itl) < 0.25 * client_itl + 0.05  # same gaps, seen from the two ends
    assert delta("v4flash:e2e_request_latency_seconds_count") == 1
    assert delta("v4flash:requests_finished_total[length]") == 1
    assert after["v4flash:kv_slots_total"] == SLOTS and after["v4flash:kv_slots_in_use"] == 0
