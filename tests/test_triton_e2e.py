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
import re
import shutil
import socket
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tokenizers import Tokenizer

from _triton import start_serve, stop, wait_ready
from v4flash_backend.client import GenerateError, generate

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO.parent / "shared" / "golden" / "v41-tiny"
READY_TIMEOUT_S = 240  # tritonserver + 3 stubs + torchrun + model load + DSpark profile, 2 busy cores
MAX_MODEL_LEN = 64
SLOTS = 4
PROMPT_IDS = [0, 17, 250, 33, 901, 12]
PROMPT_TEXT = "Once upon a time"
N = 8  # max_tokens of most requests
ADMIN_KEY = "test-admin-key-0123456789abcdef"


def _set_param(config: str, key: str, value: str) -> str:
    """config with parameter key set to value: rewritten where config.pbtxt states it, else added
    (the repository's config states only what differs from the defaults)."""
    out, n = re.subn(r'(key: "%s", value: \{ string_value: )"[^"]*"' % re.escape(key), r'\1"%s"' % value, config)
    assert n <= 1, f"parameter {key} given {n} times in config.pbtxt"
    return out if n else config + f'parameters {{ key: "{key}", value: {{ string_value: "{value}" }} }}\n'


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
    # every DSpark step drafts (no stepping aside on a timed profile): the draft counts these tests read
    # in the metrics and the responses are then never vacuously 0 (stepping aside is the engine tests')
    config += 'parameters { key: "dspark_adaptive", value: { string_value: "false" } }\n'
    (repo / "v4flash" / "config.pbtxt").write_text(config)
    shutil.copytree(REPO / "model_repository/v4flash_text", repo / "v4flash_text")
    (repo / "trtllm_request" / "1").mkdir(parents=True)
    (repo / "trtllm_request" / "1" / "model.py").symlink_to(REPO / "model_repository/trtllm_request/1/model.py")
    shutil.copy(REPO / "model_repository/trtllm_request/config.pbtxt", repo / "trtllm_request")
    shutil.copytree(REPO / "model_repository/v4flash_trtllm", repo / "v4flash_trtllm")
    return repo


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not (REPO / ".triton/backends/python/triton_python_backend_stub").exists():
        pytest.fail("tritonserver is not set up: run `make triton` (scripts/setup_triton.sh)")
    root = tmp_path_factory.mktemp("triton_e2e")
    repo = _build_repository(root)
    log_path = root / "tritonserver.log"
    # the administrative protocols behind a key (serve.sh's opt-in): every test of this module
    # then shows that inference, streaming, health, metadata, statistics and metrics are unaffected
    key_file = root / "admin.key"
    key_file.write_text(ADMIN_KEY + "\n")
    key_file.chmod(0o600)
    # the rank group has its own session, stopped by the v4flash model's finalize()
    proc, server = start_serve(repo, log_path, V4FLASH_RESTRICT_ADMIN="1", V4FLASH_ADMIN_KEY_FILE=str(key_file))
    try:
        wait_ready(proc, server["http_port"], log_path, READY_TIMEOUT_S, tail=6000)
        yield server
    finally:
        stop(proc, 60)
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
            reason = re.search(r'(?:reason|kind)="(\w+)"', name)
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
    # a client that names the prompt `prompt`: an error, not an empty answer (issue 31)
    ("v4flash_text", {"prompt": "hi", "max_tokens": 3}, "[INVALID_ARG] preprocessing: text_input is required"),
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
    assert (after["v4flash:requests_finished_total[cancelled]"]
            == before["v4flash:requests_finished_total[cancelled]"] + 1)
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


def _status(server, method, path, headers=None, body=None):
    host, port = server["http"].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request(method, path, body, headers or {})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, data


def _listening_addresses(port: int) -> set[str]:
    """The local addresses with a listening TCP socket on `port` (/proc/net/tcp and tcp6)."""
    import ipaddress

    found = set()
    for table, size in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if state != "0A" or int(p, 16) != port:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(addr)
            raw = b"".join(raw[k:k + 4][::-1] for k in range(0, size, 4))  # each 32-bit word is host order
            ip = ipaddress.ip_address(raw)
            found.add(str(getattr(ip, "ipv4_mapped", None) or ip))  # gRPC binds ::ffff:127.0.0.1
    return found


def test_the_server_listens_on_loopback_only(server):
    """serve.sh (run_tritonserver.sh) binds HTTP, gRPC and metrics to 127.0.0.1, not tritonserver's
    default 0.0.0.0: nothing is reachable from another host without a proxy in front."""
    for url in (server["http"], server["grpc"], server["metrics"].split("//")[1].split("/")[0]):
        assert _listening_addresses(int(url.rsplit(":", 1)[1])) == {"127.0.0.1"}, url


def test_admin_protocols_need_the_key_and_the_rest_stays_open(server):
    """scripts/triton_restrict.sh through serve.sh: shared-memory, model-repository, trace and
    logging refuse a request without the header v4flash-admin-key (gRPC metadata
    triton-grpc-protocol-v4flash-admin-key) or with a wrong key, on HTTP and gRPC, and serve it with
    the key; health, metadata, model config, statistics, metrics and a
    streamed inference need nothing."""
    from tritonclient.utils import InferenceServerException

    key = {"v4flash-admin-key": ADMIN_KEY}
    wrong = {"v4flash-admin-key": ADMIN_KEY[:-1] + "X"}
    admin_http = [("POST", "/v2/repository/index", "{}"), ("GET", "/v2/systemsharedmemory/status", None),
                  ("GET", "/v2/trace/setting", None), ("GET", "/v2/logging", None)]
    for method, path, body in admin_http:
        for headers in (None, wrong):
            status, data = _status(server, method, path, headers, body)
            assert status == 403 and b"restricted" in data.lower(), (path, headers, status, data)
        status, data = _status(server, method, path, key, body)
        assert status == 200, (path, status, data)
    for path in ("/v2/health/ready", "/v2/models/v4flash", "/v2/models/v4flash/config", "/v2/models/v4flash/stats",
                 "/v2"):
        assert _status(server, "GET", path)[0] == 200, path
    assert urllib.request.urlopen(server["metrics"], timeout=10).status == 200

    # gRPC: tritonserver 2.51 expects the metadata key with its own prefix (its error names it)
    key = {"triton-grpc-protocol-v4flash-admin-key": ADMIN_KEY}
    wrong = {"triton-grpc-protocol-v4flash-admin-key": ADMIN_KEY[:-1] + "X"}
    client = grpcclient.InferenceServerClient(server["grpc"])
    admin_grpc = [lambda **h: client.get_model_repository_index(**h),
                  lambda **h: client.get_system_shared_memory_status(**h),
                  lambda **h: client.get_trace_settings(**h), lambda **h: client.get_log_settings(**h)]
    for call in admin_grpc:
        for headers in ({}, {"headers": wrong}):
            with pytest.raises(InferenceServerException, match="(?i)restricted"):
                call(**headers)
        call(headers=key)
    assert client.is_server_ready() and client.get_model_metadata("v4flash").name == "v4flash"
    assert client.get_inference_statistics("v4flash").model_stats
    chunks = _grpc(server, model="v4flash", input_ids=PROMPT_IDS, max_tokens=4)
    assert len(chunks) > 1 and sum(len(c.output_ids) for c in chunks) == 4  # streamed, no key
    client.close()


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


# ---- real clients: Triton's OpenAI frontend, vllm_backend-style values, stop strings ---------------
# The frontend (triton-inference-server/server python/openai/openai_frontend, engine/utils/triton.py)
# runs Triton in process, so it cannot run here; these tests build exactly the tensors its request
# builders build and read the responses the way its parsers read them.
_OPENAI_EXCLUDES = {"model", "stream", "messages", "prompt", "echo", "store", "metadata", "response_format",
                    "service_tier", "stream_options", "tools", "tool_choice", "parallel_tool_calls", "user",
                    "function_call", "functions", "suffix", "max_completion_tokens", "max_tokens", "logprobs",
                    "top_logprobs", "best_of"}
# CreateCompletionRequest's fields with their defaults (schemas/openai.py) for a request that sets
# prompt, max_tokens, temperature, seed and stream; model_dump(exclude_none=True) keeps the non-None ones.
_COMPLETION_DEFAULTS = dict(best_of=1, echo=False, frequency_penalty=0, ignore_eos=False, logit_bias=None,
                            logprobs=None, min_tokens=None, n=1, presence_penalty=0, seed=None, stop=None,
                            stream=False, stream_options=None, suffix=None, temperature=1, top_p=1, user=None)


def _vllm_format_inputs(prompt, stream, max_tokens, logprobs=None, **fields):
    """engine/utils/triton.py, _create_vllm_generate_request, for a CreateCompletionRequest."""
    req = dict(_COMPLETION_DEFAULTS, **fields)
    sampling = {k: v for k, v in req.items() if k not in _OPENAI_EXCLUDES and v is not None}
    sampling["max_tokens"] = max_tokens
    if logprobs is not None and logprobs > 0:
        sampling["logprobs"] = logprobs
    echo = req["echo"]
    return {"return_logprobs": np.bool_([logprobs is not None and logprobs > 0]),
            "text_input": np.array([prompt.encode()], dtype=object),
            "stream": np.bool_([stream]),
            "exclude_input_in_output": np.bool_([not echo]),
            "sampling_parameters": np.array([json.dumps(sampling).encode()], dtype=object),
            "return_num_input_tokens": np.bool_([True]),
            "return_num_output_tokens": np.bool_([True])}


_DTYPES = {np.bool_: "BOOL", np.object_: "BYTES", np.int32: "INT32", np.float32: "FP32", np.uint64: "UINT64"}


def _raw_stream(server, model, inputs):
    """All responses of one gRPC stream request as {output name: numpy array}; an error raises."""
    import queue

    client = grpcclient.InferenceServerClient(server["grpc"])
    q = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    tensors = []
    for name, arr in inputs.items():
        t = grpcclient.InferInput(name, list(arr.shape), _DTYPES[arr.dtype.type])
        t.set_data_from_numpy(arr)
        tensors.append(t)
    try:
        client.async_stream_infer(model, tensors, enable_empty_final_response=True)
        out = []
        while True:
            result, error = q.get(timeout=120)
            if error is not None:
                raise error
            resp = result.get_response()
            if resp.outputs:
                out.append({o.name: result.as_numpy(o.name) for o in resp.outputs})
            if resp.parameters["triton_final_response"].bool_param:
                return out
    finally:
        client.stop_stream()
        client.close()


def _frontend_parse(responses):
    """What the frontend takes from each response: _get_output (text_output: exactly one string,
    _to_string), _StreamingUsageAccumulator (num_input_tokens once, num_output_tokens summed; the
    first element of UINT32 tensors) and _get_logprobs_from_response (one JSON string or "null")."""
    text, prompt_tokens, completion_tokens, logprobs = "", None, 0, []
    for r in responses:
        assert r["text_output"].size == 1, r["text_output"]  # _to_string: "Expected to find 1 string"
        text += r["text_output"].reshape(-1)[0].decode("utf-8")
        assert r["num_input_tokens"].dtype == np.uint32 and r["num_output_tokens"].dtype == np.uint32
        prompt_tokens = int(r["num_input_tokens"].reshape(-1)[0]) if prompt_tokens is None else prompt_tokens
        completion_tokens += int(r["num_output_tokens"].reshape(-1)[0])
        lp = r["logprobs"].reshape(-1)[0].decode()
        if lp != "null":
            logprobs += json.loads(lp)
    return text, prompt_tokens, completion_tokens, logprobs


@pytest.mark.parametrize("model", ["v4flash", "v4flash_text"])
@pytest.mark.parametrize("stream", [True, False])
def test_openai_frontend_vllm_format_requests_are_served_and_parsed(server, tokenizer, model, stream):
    # what `--backend vllm` sends for {"prompt": ..., "max_tokens": N, "temperature": 0, "seed": 1,
    # "logprobs": 2, "stream": stream} (a completions request)
    inputs = _vllm_format_inputs(PROMPT_TEXT, stream, N, logprobs=2, temperature=0, seed=1)
    responses = _raw_stream(server, model, inputs)
    text, prompt_tokens, completion_tokens, logprobs = _frontend_parse(responses)
    want = _grpc(server, model="v4flash", prompt=PROMPT_TEXT, max_tokens=N, ignore_eos=False)
    assert text == "".join(c.text for c in want)
    assert prompt_tokens == len(tokenizer.encode(PROMPT_TEXT).ids)
    assert completion_tokens == sum(c.num_output_tokens for c in want)
    assert len(logprobs) == completion_tokens  # one dict per generated token
    ids = [t for c in want for t in c.output_ids]
    for tok_id, d in zip(ids, logprobs):
        # greedy: the chosen token is the most likely (rank 1), the frontend's "selected" entry
        assert d[str(tok_id)]["rank"] == 1 and d[str(tok_id)]["logprob"] <= 0
        assert d[str(tok_id)]["decoded_token"] == tokenizer.decode([tok_id])
        assert 1 <= len(d) <= 2
    assert responses[-1]["finish_reason"].reshape(-1)[0].decode() in ("length", "stop")
    assert len(responses) == 1 or stream


def _trtllm_format_inputs(prompt, stream, max_tokens, stop=None, **fields):
    """engine/utils/triton.py, _create_trtllm_generate_request, for a CreateCompletionRequest (its
    echo_tensor_name is found because the model declares exclude_input_in_output)."""
    req = dict(_COMPLETION_DEFAULTS, **fields)
    inputs = {"text_input": np.array([[prompt.encode()]], dtype=object), "stream": np.bool_([[stream]]),
              "max_tokens": np.int32([[max_tokens]])}
    if stop:
        inputs["stop_words"] = np.array([[s.encode() for s in ([stop] if isinstance(stop, str) else stop)]],
                                        dtype=object)
    if req["top_p"] is not None:
        inputs["top_p"] = np.float32([[req["top_p"]]])
    for k in ("frequency_penalty", "presence_penalty"):
        if req[k] is not None:
            inputs[k] = np.float32([[req[k]]])
    if req["seed"] is not None:
        inputs["seed"] = np.uint64([[req["seed"]]])
    if req["temperature"] is not None:
        inputs["temperature"] = np.float32([[req["temperature"]]])
    if req["echo"] is not None:
        inputs["exclude_input_in_output"] = np.bool_([[not req["echo"]]])
    inputs["return_num_input_tokens"] = np.bool_([[True]])
    inputs["return_num_output_tokens"] = np.bool_([[True]])
    return inputs


def test_trtllm_format_shapes_are_refused_by_v4flash_and_served_by_v4flash_trtllm(server, tokenizer):
    # Triton refuses the [1, 1] tensors for a max_batch_size-0 model with dims [1] before the model
    # sees them; the v4flash_trtllm ensemble declares them and maps them onto v4flash.
    with pytest.raises(Exception, match=r"unexpected shape for input '\w+' for model 'v4flash'"):
        _raw_stream(server, "v4flash", _trtllm_format_inputs(PROMPT_TEXT, True, N, temperature=0, seed=1))
    want = _grpc(server, model="v4flash", prompt=PROMPT_TEXT, max_tokens=N, ignore_eos=False)
    want_text = "".join(c.text for c in want)
    for stream in (True, False):
        responses = _raw_stream(server, "v4flash_trtllm",
                                _trtllm_format_inputs(PROMPT_TEXT, stream, N, temperature=0, seed=1))
        text, prompt_tokens, completion_tokens, _ = _frontend_parse(responses)
        assert text == want_text and completion_tokens == sum(c.num_output_tokens for c in want)
        assert prompt_tokens == len(tokenizer.encode(PROMPT_TEXT).ids)
        assert len(responses) == 1 or stream
    # stop_words [[...]]: the text before the first stop string, finish_reason stop
    stop = want_text[len(want_text) // 2:len(want_text) // 2 + 2]
    responses = _raw_stream(server, "v4flash_trtllm", _trtllm_format_inputs(PROMPT_TEXT, True, N, stop=[stop],
                                                                            temperature=0))
    assert _frontend_parse(responses)[0] == want_text[:want_text.find(stop)]
    assert responses[-1]["finish_reason"].reshape(-1)[0].decode() == "stop"
    # penalties reach the engine (a strong one changes the greedy text); out of range is INVALID_ARG
    responses = _raw_stream(server, "v4flash_trtllm", _trtllm_format_inputs(PROMPT_TEXT, True, N, temperature=0,
                                                                            frequency_penalty=2.0))
    assert _frontend_parse(responses)[2] == N
    with pytest.raises(Exception, match=r"frequency_penalty must be in \[-2, 2\]"):
        _raw_stream(server, "v4flash_trtllm", _trtllm_format_inputs(PROMPT_TEXT, True, N, frequency_penalty=2.5))


def test_sampling_values_as_strings_and_min_tokens_over_the_server(server):
    # genai-perf's vllm mode: {"max_tokens": "5", "min_tokens": "5"} (strings) -> exactly 5 tokens
    sp = lambda obj: np.array([json.dumps(obj).encode()], dtype=object)  # noqa: E731
    out = _raw_stream(server, "v4flash_text", {"text_input": np.array([PROMPT_TEXT.encode()], dtype=object),
                                               "stream": np.bool_([True]),
                                               "exclude_input_in_output": np.bool_([True]),
                                               "sampling_parameters": sp({"max_tokens": "5", "min_tokens": "5"})})
    assert sum(int(r["num_output_tokens"][0]) for r in out) == 5
    with pytest.raises(Exception, match=r"sampling_parameters.max_tokens must be an integer, got 'five'"):
        _raw_stream(server, "v4flash_text", {"text_input": np.array([PROMPT_TEXT.encode()], dtype=object),
                                             "sampling_parameters": sp({"max_tokens": "five"})})


@pytest.mark.parametrize("model", ["v4flash", "v4flash_text"])
def test_stop_strings_stream_exactly_to_the_stop(server, model):
    full = "".join(c.text for c in _grpc(server, model="v4flash", prompt=PROMPT_TEXT, max_tokens=N))
    # a stop string from the middle of the greedy text: 3 characters from a third of the way in
    stop = full[len(full) // 3:len(full) // 3 + 3]
    want = full[:full.find(stop)]
    sp = np.array([json.dumps({"max_tokens": N, "ignore_eos": True, "stop": [stop, "\x00never"]}).encode()],
                  dtype=object)
    for stream in (True, False):
        inputs = {"text_input": np.array([PROMPT_TEXT.encode()], dtype=object), "stream": np.bool_([stream]),
                  "exclude_input_in_output": np.bool_([True]), "sampling_parameters": sp}
        responses = _raw_stream(server, model, inputs)
        texts = [r["text_output"].reshape(-1)[0].decode() for r in responses]
        assert "".join(texts) == want, (stop, texts, full)
        assert responses[-1]["finish_reason"].reshape(-1)[0].decode() == "stop"
        # no response carries any character of the stop string beyond what the text before it has
        assert all(stop not in "".join(texts[:k + 1]) for k in range(len(texts)))
    # TRT-LLM's name for the same thing, as a typed input
    inputs = {"text_input": np.array([PROMPT_TEXT.encode()], dtype=object), "stream": np.bool_([True]),
              "max_tokens": np.int32([N]), "ignore_eos": np.bool_([True]),
              "stop_words": np.array([stop.encode()], dtype=object)}
    responses = _raw_stream(server, model, inputs)
    assert "".join(r["text_output"].reshape(-1)[0].decode() for r in responses) == want
