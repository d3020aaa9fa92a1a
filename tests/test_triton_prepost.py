"""The preprocessing / postprocessing models and the v4flash_text ensemble wiring,
served by the real tritonserver (scripts/setup_triton.sh) on loopback.

The temporary model repository holds:
  - preprocessing, postprocessing: the repository's config.pbtxt (parameters
    adjusted) and model.py (symlinked, so it finds the repository's src/);
  - v4flash_text: the repository's ensemble config, unchanged;
  - v4flash: a test double that only ECHOES the prompt ids back in chunks with the
    I/O of the real engine model (decoupled, context_ids = last <= 8 ids before the
    chunk). It generates nothing; it exists so the ensemble's wiring, response
    pairing and final flush are checked against a real server.
The server is started through scripts/run_tritonserver.sh, on free ports.
"""

import http.client
import json
import os
import random
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tokenizers import Tokenizer
from tritonclient.utils import InferenceServerException

from _triton import free_ports, stop, wait_ready
from v4flash_backend.serving.prepost import CHECKPOINT_ENV, find_tokenizer

REPO = Path(__file__).resolve().parents[1]
GOLDEN_TOKENIZER = REPO.parent / "shared/golden/v41-tiny/tokenizer.json"
if not GOLDEN_TOKENIZER.is_file():
    GOLDEN_TOKENIZER = Path("/work/shared/golden/v41-tiny/tokenizer.json")
CONTEXT_IDS = 8
READY_TIMEOUT_S = 180  # three python stubs importing numpy/tokenizers on a busy 2-core box

# Texts whose tokens split multi-byte characters (see tests/test_detok.py).
TEXTS = ["你好世界", "😀👍🏽 emoji", " héllo wörld", "東京、данные 🙂→∑", "plain ascii text"]

ECHO_MODEL = r'''
# Test double for the engine: echoes input_ids back as output_ids in chunks of
# 1, 2, 3, 1, 2, 3, ... ids (stream=true) or in one response (stream=false).
# ignore_eos=true sends the FINAL flag as a separate empty response.
import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _opt(request, name, default):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return default if t is None else t.as_numpy().reshape(-1)[0]


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            ids = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy().reshape(-1)
            stream = bool(_opt(request, "stream", False))
            separate_final = bool(_opt(request, "ignore_eos", False))
            bounds, pos, size = [0], 0, 1
            while pos < len(ids):
                pos = min(len(ids), pos + (size if stream else len(ids)))
                bounds.append(pos)
                size = size % 3 + 1
            for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
                last = b == len(ids)
                out = [
                    pb_utils.Tensor("output_ids", ids[a:b].astype(np.int32)),
                    pb_utils.Tensor("context_ids", ids[max(0, a - 8):a].astype(np.int32)),
                    pb_utils.Tensor("finish_reason", np.array([b"stop" if last else b""], dtype=object)),
                    pb_utils.Tensor("num_input_tokens", np.array([len(ids)], dtype=np.uint32)),
                    pb_utils.Tensor("num_output_tokens", np.array([b - a], dtype=np.uint32)),
                    pb_utils.Tensor("num_drafted_tokens", np.array([0], dtype=np.uint32)),
                    pb_utils.Tensor("num_accepted_tokens", np.array([0], dtype=np.uint32)),
                    pb_utils.Tensor("text_trim", np.array([0], dtype=np.uint32)),
                    pb_utils.Tensor("logprobs", np.array([b"null"], dtype=object)),
                    pb_utils.Tensor("cumulative_logprob", np.array([0.0], dtype=np.float32)),
                ]
                flags = FINAL if (last and not separate_final) else 0
                sender.send(pb_utils.InferenceResponse(out), flags=flags)
            if separate_final:
                sender.send(flags=FINAL)
        return None
'''

def _echo_config() -> str:
    """The real v4flash I/O (serving.triton_io, which tests/test_serving.py holds config.pbtxt to),
    so the ensemble's mapping is checked against what the engine model declares."""
    from v4flash_backend.serving import triton_io

    def tensors(items):
        return ",\n".join('  { name: "%s", data_type: %s, dims: [ %s ]%s }'
                           % (t[0], t[1], ", ".join(map(str, t[2])), ", optional: true" if t[3:] and t[3] else "")
                           for t in items)

    inputs = [t for t in triton_io.INPUTS if t[0] != "text_input"]
    return (f'name: "v4flash"\nbackend: "python"\nmax_batch_size: 0\nmodel_transaction_policy {{ decoupled: true }}\n'
            f"input [\n{tensors(inputs)}\n]\n"
            f"output [\n{tensors(t for t in triton_io.OUTPUTS if t[0] != 'text_output')}\n]\n"
            'instance_group [ { count: 1, kind: KIND_CPU } ]\n'
            'parameters { key: "checkpoint_dir", value: { string_value: "../ckpt" } }\n')



def test_find_tokenizer_order(tmp_path, monkeypatch):
    """tokenizer_dir parameter > the engine model's checkpoint_dir > $V4FLASH_CHECKPOINT_DIR;
    relative paths start at the repository root; a missing file names what was tried."""
    repo = tmp_path / "repo"
    model_dir = repo / "preprocessing"
    model_dir.mkdir(parents=True)
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "tokenizer.json").write_text("{}")
    (repo / "v4flash").mkdir()
    engine_config = repo / "v4flash" / "config.pbtxt"
    monkeypatch.setenv(CHECKPOINT_ENV, str(tmp_path / "c"))
    assert find_tokenizer({}, model_dir) == tmp_path / "c" / "tokenizer.json"
    engine_config.write_text(
        '# parameters { key: "checkpoint_dir", value: { string_value: "../a" } }\n'
        'parameters {\n  key: "checkpoint_dir"\n  value: { string_value: "../b" }\n}\n'
    )
    assert find_tokenizer({}, model_dir) == tmp_path / "b" / "tokenizer.json"
    assert find_tokenizer({"tokenizer_dir": "../a"}, model_dir) == tmp_path / "a" / "tokenizer.json"
    file_param = {"tokenizer_dir": str(tmp_path / "a" / "tokenizer.json")}
    assert find_tokenizer(file_param, model_dir) == tmp_path / "a" / "tokenizer.json"
    monkeypatch.delenv(CHECKPOINT_ENV)
    engine_config.write_text("")
    with pytest.raises(FileNotFoundError, match="tried: parameter tokenizer_dir"):
        find_tokenizer({"tokenizer_dir": "../missing"}, model_dir)


def _set_param(config: str, key: str, value: str) -> str:
    pattern = r'(key: "%s", value: \{ string_value: )"[^"]*"' % re.escape(key)
    out, n = re.subn(pattern, r'\1"%s"' % value, config)
    assert n == 1, f"parameter {key} not found"
    return out


def _build_repository(root: Path) -> Path:
    ckpt = root / "ckpt"
    ckpt.mkdir()
    shutil.copy(GOLDEN_TOKENIZER, ckpt / "tokenizer.json")
    repo = root / "repo"
    for name in ("preprocessing", "postprocessing"):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").symlink_to(REPO / "model_repository" / name / "1" / "model.py")
    # preprocessing: explicit tokenizer_dir, relative to the repository root.
    # postprocessing: empty tokenizer_dir -> the v4flash model's checkpoint_dir.
    pre = (REPO / "model_repository/preprocessing/config.pbtxt").read_text()
    (repo / "preprocessing/config.pbtxt").write_text(_set_param(pre, "tokenizer_dir", "../ckpt"))
    shutil.copy(REPO / "model_repository/postprocessing/config.pbtxt", repo / "postprocessing")
    shutil.copytree(REPO / "model_repository/v4flash_text", repo / "v4flash_text")
    (repo / "v4flash" / "1").mkdir(parents=True)
    (repo / "v4flash" / "1" / "model.py").write_text(ECHO_MODEL)
    (repo / "v4flash" / "config.pbtxt").write_text(_echo_config())
    return repo


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not (REPO / ".triton/backends/python/triton_python_backend_stub").exists():
        pytest.fail("tritonserver is not set up: run scripts/setup_triton.sh")
    root = tmp_path_factory.mktemp("triton")
    repo = _build_repository(root)
    http_port, grpc_port, metrics_port = free_ports(3)
    env = dict(os.environ, MODEL_REPOSITORY=str(repo), HTTP_PORT=str(http_port),
               GRPC_PORT=str(grpc_port), METRICS_PORT=str(metrics_port))
    env.pop("V4FLASH_CHECKPOINT_DIR", None)  # the configs alone must find the tokenizer
    log_path = root / "tritonserver.log"
    with open(log_path, "wb") as log:
        # Foreground mode execs tritonserver, so proc.pid is the server; its own
        # session lets the teardown reach the python stubs too.
        proc = subprocess.Popen([str(REPO / "scripts/run_tritonserver.sh")], env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ready(proc, http_port, log_path, READY_TIMEOUT_S, tail=4000)
        yield {"http": f"127.0.0.1:{http_port}", "grpc": f"127.0.0.1:{grpc_port}", "log": log_path}
    finally:
        stop(proc, 40)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_file(str(GOLDEN_TOKENIZER))


def _chunks_of(ids, rng):
    """One id per chunk, then a random chunking (1..4 ids, like speculative steps)."""
    yield [ids[k:k + 1] for k in range(len(ids))], [k for k in range(len(ids))]
    bounds = [0]
    while bounds[-1] < len(ids):
        bounds.append(min(len(ids), bounds[-1] + rng.randint(1, 4)))
    yield [ids[a:b] for a, b in zip(bounds, bounds[1:])], bounds[:-1]


def _module(protocol):
    return httpclient if protocol == "http" else grpcclient


def _client(server, protocol):
    return _module(protocol).InferenceServerClient(server[protocol])


def _preprocess(client, protocol, text_bytes):
    mod = _module(protocol)
    inp = mod.InferInput("text_input", [1], "BYTES")
    inp.set_data_from_numpy(np.array([text_bytes], dtype=object))
    result = client.infer("preprocessing", [inp], outputs=[mod.InferRequestedOutput("input_ids")])
    return result.as_numpy("input_ids")


def _postprocess(client, protocol, new, context, finish_reason):
    mod = _module(protocol)
    inputs = []
    for name, value in (("output_ids", new), ("context_ids", context)):
        t = mod.InferInput(name, [len(value)], "INT32")
        t.set_data_from_numpy(np.asarray(value, dtype=np.int32))
        inputs.append(t)
    fr = mod.InferInput("finish_reason", [1], "BYTES")
    fr.set_data_from_numpy(np.array([finish_reason.encode()], dtype=object))
    inputs.append(fr)
    result = client.infer("postprocessing", inputs, outputs=[mod.InferRequestedOutput("text_output")])
    out = result.as_numpy("text_output")
    assert out.shape == (1,)
    return out[0].decode("utf-8")


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_preprocessing_matches_tokenizer(server, tokenizer, protocol):
    client = _client(server, protocol)
    for text in TEXTS:
        ids = _preprocess(client, protocol, text.encode("utf-8"))
        assert ids.dtype == np.int32
        assert ids.tolist() == tokenizer.encode(text).ids


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_preprocessing_rejects_bad_text(server, protocol):
    client = _client(server, protocol)
    with pytest.raises(InferenceServerException, match="not valid UTF-8"):
        _preprocess(client, protocol, b"\xff\xfe broken")
    with pytest.raises(InferenceServerException, match="empty"):
        _preprocess(client, protocol, b"")
    # The model keeps serving after bad requests.
    assert _preprocess(client, protocol, b"ok").size > 0


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_postprocessing_deltas_concatenate_exactly(server, tokenizer, protocol):
    client = _client(server, protocol)
    rng = random.Random(protocol)
    for text in TEXTS:
        ids = tokenizer.encode(text).ids
        for chunks, starts in _chunks_of(ids, rng):
            streamed = ""
            for k, (chunk, start) in enumerate(zip(chunks, starts)):
                final = k == len(chunks) - 1
                streamed += _postprocess(client, protocol, chunk,
                                         ids[max(0, start - CONTEXT_IDS):start],
                                         "stop" if final else "")
                assert text.startswith(streamed), (text, streamed)
            assert streamed == text


def _ensemble_stream(server, text, stream=True, separate_final=False):
    """Send one request to v4flash_text over a gRPC stream; all responses in order."""
    responses, done = [], []

    def callback(result, error):
        if error is not None:
            done.append(error)
            return
        params = result.get_response().parameters
        if "triton_final_response" in params and params["triton_final_response"].bool_param:
            done.append(None)
        if result.get_response().outputs:
            responses.append(result)

    client = grpcclient.InferenceServerClient(server["grpc"])
    inputs = []
    for name, value, dtype in (("text_input", np.array([text.encode()], dtype=object), "BYTES"),
                               ("stream", np.array([stream]), "BOOL"),
                               ("ignore_eos", np.array([separate_final]), "BOOL")):
        t = grpcclient.InferInput(name, [1], dtype)
        t.set_data_from_numpy(value)
        inputs.append(t)
    client.start_stream(callback=callback)
    try:
        client.async_stream_infer("v4flash_text", inputs, enable_empty_final_response=True)
        deadline = time.monotonic() + 30
        while not done and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        client.stop_stream()
    assert done == [None], done
    return responses


@pytest.mark.parametrize("separate_final", [False, True])
def test_ensemble_streams_exact_text(server, tokenizer, separate_final):
    for text in TEXTS:
        ids = tokenizer.encode(text).ids
        responses = _ensemble_stream(server, text, separate_final=separate_final)
        # The echo double streams 1, 2, 3, 1, ... ids per response.
        sizes = [r.as_numpy("output_ids").size for r in responses]
        assert sizes[:-1] == [k % 3 + 1 for k in range(len(sizes) - 1)]
        assert 1 <= sizes[-1] <= (len(sizes) - 1) % 3 + 1
        assert sum(sizes) == len(ids)
        pieces = [r.as_numpy("text_output")[0].decode("utf-8") for r in responses]
        assert "".join(pieces) == text
        # output_ids and text_output of each response belong to the same chunk.
        assert [x for r in responses for x in r.as_numpy("output_ids").tolist()] == ids
        reasons = [r.as_numpy("finish_reason")[0].decode() for r in responses]
        assert reasons == [""] * (len(responses) - 1) + ["stop"]
        assert all(r.as_numpy("num_input_tokens")[0] == len(ids) for r in responses)


def test_ensemble_concurrent_streams_stay_separate_and_ordered(server):
    """Chunks of concurrent requests share the one postprocessing instance; each
    request must still get its own chunks, in order."""
    texts = TEXTS * 2
    results = [None] * len(texts)

    def run(k):
        results[k] = "".join(r.as_numpy("text_output")[0].decode("utf-8")
                             for r in _ensemble_stream(server, texts[k]))

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == texts


def test_ensemble_non_streaming(server):
    for text in TEXTS:
        responses = _ensemble_stream(server, text, stream=False)
        assert len(responses) == 1
        assert responses[0].as_numpy("text_output")[0].decode("utf-8") == text


def test_ensemble_generate_stream_over_http(server):
    """HTTP server-sent events: every `data:` line is one response of the ensemble."""
    text = "東京、данные 🙂→∑"
    host, port = server["http"].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = json.dumps({"text_input": text, "stream": True})
    conn.request("POST", "/v2/models/v4flash_text/generate_stream", body,
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    events = [json.loads(line[len(b"data: "):]) for line in resp.read().splitlines()
              if line.startswith(b"data: ")]
    conn.close()
    assert len(events) > 1 and all("error" not in e for e in events)
    assert "".join(e["text_output"] for e in events) == text
    assert events[-1]["finish_reason"] == "stop"


MISSING_TEXT = "text_input is required"


def test_ensemble_without_text_input_is_invalid_arg(server):
    """A client that names the prompt `prompt` (or sends none) gets INVALID_ARG naming text_input,
    over HTTP SSE and a gRPC stream alike, not an empty stream with HTTP 200 (issue 31: Triton's
    count of required inputs let `stream` alone through, and the preprocessing step never ran)."""
    host, port = server["http"].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v2/models/v4flash_text/generate_stream", json.dumps({"prompt": "hi", "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    assert resp.status == 400, (resp.status, data)
    assert "[INVALID_ARG]" in data.decode() and MISSING_TEXT in data.decode(), data

    errors, client = [], grpcclient.InferenceServerClient(server["grpc"])
    stream = grpcclient.InferInput("stream", [1], "BOOL")
    stream.set_data_from_numpy(np.array([True]))
    client.start_stream(callback=lambda result, error: errors.append(error))
    try:
        client.async_stream_infer("v4flash_text", [stream])
        deadline = time.monotonic() + 30
        while not errors and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        client.stop_stream()
    assert errors and errors[0] is not None and MISSING_TEXT in str(errors[0]), errors
    # the ensemble keeps serving
    assert "".join(r.as_numpy("text_output")[0].decode() for r in _ensemble_stream(server, "ok")) == "ok"
