"""End to end: the OpenAI-compatible API of `make serve` -- scripts/serve.sh with OPENAI_PORT, i.e.
tritonserver and the frontend under scripts/serve_openai.sh -- driven by the official `openai`
client and raw HTTP. One stack for the module: the embedded model (models/v4flash-tiny, its chat
template), 2 KV slots and no queue beyond them (max_queue_size 0: the third concurrent request is
refused with UNAVAILABLE -> 503), max_model_len 128, an API key from a file (mode 600).

DSpark drafts every step (dspark_adaptive off, so the usage's draft counts are never vacuously 0),
and the step cost and the confidence calibration do not learn online: a seeded sampled request
then gives the same tokens twice (with learning on, admission follows timings, docs/dspark.md "A step
cost that learns"). Greedy elsewhere.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import openai
import pytest
from tokenizers import Tokenizer

from _triton import free_ports, start_serve, stop, wait_ready
from test_triton_e2e import _set_param, _wait_metrics
from v4flash_backend.client import generate

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "models" / "v4flash-tiny"
KEY = "openai-test-key-0123456789abcdef"
BOS = "<｜begin▁of▁sentence｜>"
MAX_MODEL_LEN = 128
N = 12
MSGS = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Read a file."}]
RENDERED = BOS + "# system: You write Python.\n# user: Read a file.\n"  # the model card's format


def _repository(root: Path) -> Path:
    repo = root / "repo"
    (repo / "v4flash" / "1").mkdir(parents=True)
    (repo / "v4flash" / "1" / "model.py").symlink_to(REPO / "model_repository" / "v4flash" / "1" / "model.py")
    config = (REPO / "model_repository/v4flash/config.pbtxt").read_text()
    for key, value in (("checkpoint_dir", str(TINY)), ("max_num_seqs", "2"), ("max_queue_size", "0"),
                       ("max_model_len", str(MAX_MODEL_LEN)), ("default_max_tokens", "8"),
                       ("stats_interval_s", "0.2"), ("dspark_adaptive", "false"), ("step_cost_online", "false"),
                       ("calibration_online", "false")):
        config = _set_param(config, key, value)
    (repo / "v4flash" / "config.pbtxt").write_text(config)
    return repo


def _frontend_pids(port: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        try:
            args = (d / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"v4flash_backend.openai_api" in args and str(port).encode() in args:
            out.append(int(d.name))
    return out


def _health(port: int) -> int:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status
    except OSError as exc:
        return getattr(exc, "code", 0)


def _wait(pred, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.1)
    return pred()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    if not (REPO / ".triton/backends/python/triton_python_backend_stub").exists():
        pytest.fail("tritonserver is not set up: run `make triton` (scripts/setup_triton.sh)")
    root = tmp_path_factory.mktemp("openai_e2e")
    key_file = root / "openai.key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    port = free_ports(1)[0]
    log_path = root / "serve.log"
    proc, server = start_serve(_repository(root), log_path, OPENAI_PORT=str(port),
                               V4FLASH_OPENAI_KEY_FILE=str(key_file))
    try:
        wait_ready(proc, server["http_port"], log_path, 240)
        assert _wait(lambda: _health(port) == 200, 60), log_path.read_text()[-3000:]
        yield dict(server, port=port, url=f"http://127.0.0.1:{port}/v1", proc=proc)
    finally:
        # what Ctrl-C in a terminal does: SIGINT to the whole foreground process group
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            stop(proc, 30)
    text = log_path.read_text()
    assert proc.returncode == 0 and "successfully unloaded 'v4flash'" in text, (proc.returncode, text[-3000:])
    assert _frontend_pids(port) == []


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack["url"], api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_file(str(TINY / "tokenizer.json"))


def _raw(stack, method, path, body=None, key=KEY, raw=None):
    conn = http.client.HTTPConnection("127.0.0.1", stack["port"], timeout=120)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    conn.request(method, path, raw if raw is not None else (None if body is None else json.dumps(body)), headers)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, data


def _events(data: bytes) -> list:
    out = [line[6:] for line in data.split(b"\n\n") if line.startswith(b"data: ")]
    return [e.decode() if e == b"[DONE]" else json.loads(e) for e in out]


def test_models_health_and_the_api_key(stack, client):
    assert _health(stack["port"]) == 200  # the probe needs no key
    for key in (None, "wrong-key-0123456789"):
        status, data = _raw(stack, "GET", "/v1/models", key=key)
        assert status == 401 and json.loads(data)["error"]["code"] == "invalid_api_key", data
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=stack["url"], api_key="wrong", max_retries=0).models.list()
    assert [m.id for m in client.models.list()] == ["v4flash"]
    for call in (lambda: client.models.retrieve("gpt-4o"),
                 lambda: client.chat.completions.create(model="gpt-4o", messages=MSGS, max_tokens=2),
                 lambda: client.completions.create(model="gpt-4o", prompt="x", max_tokens=2)):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


def test_streamed_chat_ends_with_usage_and_equals_the_non_streamed_text(stack, client, tokenizer):
    body = {"model": "v4flash", "messages": MSGS, "max_tokens": N, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    status, data = _raw(stack, "POST", "/v1/chat/completions", body)
    ev = _events(data)
    assert status == 200 and ev[-1] == "[DONE]"
    last = ev[-2]  # the last chunk before [DONE] carries the usage
    assert last["choices"] == [] and all(e["usage"] is None for e in ev[:-2])
    usage = last["usage"]
    # the rendered prompt went through Triton's tokenizer without a second BOS
    assert usage["prompt_tokens"] == len(tokenizer.encode(RENDERED, add_special_tokens=False).ids)
    assert usage["completion_tokens"] == N and usage["total_tokens"] == usage["prompt_tokens"] + N
    assert usage["dspark"]["drafted_tokens"] > 0 and 0 <= usage["dspark"]["accepted_tokens"] <= \
        usage["dspark"]["drafted_tokens"]
    streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in ev[:-2])
    assert ev[-3]["choices"][0]["finish_reason"] == "length" and len(ev) > 4  # several content chunks
    # the official client, streamed and not: the same text at T = 0
    chunks = list(client.chat.completions.create(model="v4flash", messages=MSGS, max_tokens=N, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == N and not chunks[-1].choices
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == streamed
    whole = client.chat.completions.create(model="v4flash", messages=MSGS, max_tokens=N, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert whole.choices[0].message.content == streamed and whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (usage["prompt_tokens"], N)
    assert whole.usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again: the prefix cache
    # /v1/completions passes Triton's own text through: the same as a gRPC request for the same prompt
    text = client.completions.create(model="v4flash", prompt="import os\n", max_tokens=N, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    want = "".join(c.text for c in generate("import os\n", url=stack["grpc"], model="v4flash", max_tokens=N,
                                            temperature=0.0, ignore_eos=True, exclude_input_in_output=True))
    assert text == want and len(text) > 0


def test_a_stop_string_ends_the_text_before_it(client):
    kw = dict(model="v4flash", prompt="import os\n", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    stop = full[len(full) // 3:len(full) // 3 + 3]
    want = full[:full.find(stop)]
    kw["stop"] = [stop, "\x00never"]
    whole = client.completions.create(**kw).choices[0]
    assert (whole.text, whole.finish_reason) == (want, "stop"), (stop, full)
    parts = list(client.completions.create(stream=True, **kw))
    assert "".join(p.choices[0].text for p in parts) == want and parts[-1].choices[0].finish_reason == "stop"
    msg = client.chat.completions.create(model="v4flash", messages=MSGS, max_tokens=16, temperature=0, stop="\n")
    assert "\n" not in msg.choices[0].message.content and msg.choices[0].finish_reason == "stop"


def test_a_seeded_request_gives_the_same_text_twice(client):
    kw = dict(model="v4flash", messages=MSGS, max_tokens=N, temperature=1.0, top_p=0.95, seed=1234,
              extra_body={"ignore_eos": True})
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    c = "".join(x.choices[0].delta.content or "" for x in client.chat.completions.create(stream=True, **kw))
    assert a == b == c and len(a) > 0
    greedy = client.chat.completions.create(**dict(kw, temperature=0)).choices[0].message.content
    others = {client.chat.completions.create(**dict(kw, seed=s)).choices[0].message.content for s in (1, 2, 3)}
    assert len(others | {a, greedy}) > 1  # sampling happened: not every seed gives the greedy text


def test_logprobs(client):
    r = client.chat.completions.create(model="v4flash", messages=MSGS, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    for t in content:
        tops = [x.logprob for x in t.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and t.logprob <= 0
        assert (t.token, t.logprob) == (t.top_logprobs[0].token, t.top_logprobs[0].logprob)  # greedy: the top one
        assert bytes(t.bytes) == t.token.encode()
    assert "".join(t.token for t in content) == r.choices[0].message.content  # ASCII code: exact pieces
    parts = list(client.completions.create(model="v4flash", prompt="import os\n", max_tokens=8, temperature=0,
                                           logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    tokens = [t for p in parts for t in p.choices[0].logprobs.tokens]
    offsets = [o for p in parts for o in p.choices[0].logprobs.text_offset]
    assert "".join(tokens) == "".join(p.choices[0].text for p in parts) and len(tokens) == 8
    assert offsets == [len("".join(tokens[:k])) for k in range(8)]
    assert all(len(p) <= 3 for x in parts for p in x.choices[0].logprobs.top_logprobs)


def _slot_metrics(stack):
    return _wait_metrics(stack, lambda m: m["v4flash:requests_in_flight"] == 0 and m["v4flash:kv_slots_in_use"] == 0)


CANCELLED = "v4flash:requests_finished_total[cancelled]"


def test_a_cancelled_stream_frees_its_slot(stack, client):
    before = _slot_metrics(stack)
    stream = client.chat.completions.create(model="v4flash", messages=MSGS, max_tokens=80, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    got = 0
    for c in stream:
        got += bool(c.choices and c.choices[0].delta.content)
        if got >= 2:
            break
    during = _wait_metrics(stack, lambda m: m["v4flash:kv_slots_in_use"] >= 1, timeout=5)
    assert during["v4flash:kv_slots_in_use"] == 1
    stream.close()  # the client goes away
    after = _wait_metrics(stack, lambda m: m["v4flash:kv_slots_in_use"] == 0 and m[CANCELLED] > before[CANCELLED])
    assert after["v4flash:kv_slots_in_use"] == 0 and after[CANCELLED] == before[CANCELLED] + 1
    assert after["v4flash:generation_tokens_total"] - before["v4flash:generation_tokens_total"] < 80
    # a non-streamed request whose client disconnects is cancelled too
    conn = http.client.HTTPConnection("127.0.0.1", stack["port"], timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"model": "v4flash", "prompt": "import os\n",
                                                        "max_tokens": 100, "ignore_eos": True}),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    assert _wait_metrics(stack, lambda m: m["v4flash:kv_slots_in_use"] >= 1, timeout=10)["v4flash:kv_slots_in_use"]
    conn.sock.close()
    conn.close()
    last = _wait_metrics(stack, lambda m: m["v4flash:kv_slots_in_use"] == 0 and m[CANCELLED] > after[CANCELLED])
    assert last[CANCELLED] == after[CANCELLED] + 1
    assert last["v4flash:generation_tokens_total"] - after["v4flash:generation_tokens_total"] < 100
    assert client.completions.create(model="v4flash", prompt="x", max_tokens=2).usage.completion_tokens <= 2


CHAT = {"model": "v4flash", "messages": MSGS, "max_tokens": 2}
COMP = {"model": "v4flash", "prompt": "import os\n", "max_tokens": 2}
LONG = "x = 1\n" * 100  # > max_model_len tokens
BAD = [  # (path, body (a dict) or raw bytes, status, words of the message, param)
    ("/v1/chat/completions", b'{"model": "v4flash", "messages": [', 400, "not valid JSON", None),
    ("/v1/chat/completions", b"[1, 2]", 400, "", None),
    ("/v1/chat/completions", {"messages": MSGS}, 400, "model is required", "model"),
    ("/v1/chat/completions", {"model": "v4flash"}, 400, "messages is required", "messages"),
    ("/v1/chat/completions", dict(CHAT, messages=[]), 400, "messages", "messages"),
    ("/v1/chat/completions", dict(CHAT, max_token=5), 400, "unrecognized request argument: max_token", "max_token"),
    ("/v1/chat/completions", dict(CHAT, temperature=3), 400, "temperature", "temperature"),
    ("/v1/chat/completions", dict(CHAT, top_p=0), 400, "top_p", "top_p"),
    ("/v1/chat/completions", dict(CHAT, max_tokens=0), 400, "max_tokens", "max_tokens"),
    ("/v1/chat/completions", dict(CHAT, n=2), 400, "only n=1", "n"),
    ("/v1/chat/completions", dict(CHAT, logprobs=True, top_logprobs=30), 400, "top_logprobs", "top_logprobs"),
    ("/v1/chat/completions", dict(CHAT, top_logprobs=2), 400, "needs logprobs", None),
    ("/v1/chat/completions", dict(CHAT, messages=[{"role": "robot", "content": "x"}]), 400, "role", "messages"),
    ("/v1/chat/completions", dict(CHAT, tools=[{"type": "function", "function": {"name": "f"}}]), 400,
     "tools are not supported", None),
    ("/v1/chat/completions", dict(CHAT, stop=[str(i) for i in range(17)]), 400, "at most 16 stop strings", "stop"),
    ("/v1/chat/completions", dict(CHAT, seed=-1), 400, "seed", "seed"),
    ("/v1/chat/completions", dict(CHAT, frequency_penalty=3), 400, "frequency_penalty", "frequency_penalty"),
    ("/v1/chat/completions", dict(CHAT, stream_options={"include_usage": True}), 400, "only allowed when stream",
     None),
    # answered by Triton (the engine's own checks), named in the request's spelling
    ("/v1/chat/completions", dict(CHAT, messages=[{"role": "user", "content": LONG}]), 400, "max_model_len",
     "messages"),
    ("/v1/chat/completions", dict(CHAT, max_completion_tokens=200, max_tokens=None), 400, "does not fit",
     "max_completion_tokens"),
    ("/v1/chat/completions", dict(CHAT, min_tokens=5), 400, "min_tokens must be in", "min_tokens"),
    ("/v1/completions", dict(COMP, prompt=[]), 400, "empty", "prompt"),
    ("/v1/completions", dict(COMP, prompt=["a", "b"]), 400, "one prompt per request", "prompt"),
    ("/v1/completions", dict(COMP, prompt=[1, 99999]), 400, "outside the vocabulary", "prompt"),
    ("/v1/completions", dict(COMP, echo=True), 400, "echo is not supported", None),
    ("/v1/completions", dict(COMP, model="nope"), 404, "does not exist", "model"),
    ("/v1/embeddings", dict(COMP), 404, "Not Found", None),
]


def test_bad_requests_get_4xx_openai_errors_and_the_server_goes_on(stack):
    assert len(BAD) >= 20
    for path, body, status, words, param in BAD:
        got, data = _raw(stack, "POST", path, raw=body if isinstance(body, bytes) else None,
                         body=None if isinstance(body, bytes) else body)
        err = json.loads(data)["error"]
        assert got == status and set(err) == {"message", "type", "param", "code"}, (body, got, data)
        assert words in err["message"] and err["param"] == param, (body, err)
        # greedy: at the API's default temperature (1.0) the 2 tokens may be an end of text (an empty
        # reply: seen in a fresh-clone run), which says nothing about the server going on
        good, data = _raw(stack, "POST", "/v1/chat/completions", dict(CHAT, temperature=0))
        assert good == 200 and json.loads(data)["choices"][0]["message"]["content"], (body, data)
    got, data = _raw(stack, "GET", "/v1/chat/completions")
    assert got == 405 and "error" in json.loads(data)


def test_a_full_server_answers_503(stack, client):
    """Both KV slots busy and no queue (max_queue_size 0): Triton's UNAVAILABLE is a 503 in OpenAI's
    shape, before any token; the server serves again once the slots are free."""
    streams = [client.completions.create(model="v4flash", prompt="import os\n", max_tokens=100, stream=True,
                                         extra_body={"ignore_eos": True}) for _ in range(2)]
    try:
        for s in streams:
            next(iter(s))
        full = _wait_metrics(stack, lambda m: m["v4flash:kv_slots_in_use"] == 2, timeout=10)
        assert full["v4flash:kv_slots_in_use"] == 2
        status, data = _raw(stack, "POST", "/v1/chat/completions", dict(CHAT, stream=True))
        err = json.loads(data)["error"]
        assert status == 503 and "server at capacity" in err["message"] and err["code"] == "unavailable", data
        with pytest.raises(openai.InternalServerError) as e:
            client.chat.completions.create(**CHAT)
        assert e.value.status_code == 503
    finally:
        for s in streams:
            s.close()
    _slot_metrics(stack)
    assert client.chat.completions.create(**CHAT).choices[0].message.content


def test_a_dead_frontend_is_started_again(stack, client):
    """serve_openai.sh restarts the frontend (tritonserver keeps running); the module's teardown
    shows Ctrl-C (SIGINT to the process group) stopping both."""
    [pid] = _frontend_pids(stack["port"])
    os.kill(pid, signal.SIGKILL)
    assert _wait(lambda: _frontend_pids(stack["port"]) not in ([], [pid]) and _health(stack["port"]) == 200, 30)
    assert "the OpenAI frontend exited with code 137; restarting it in 1 s" in stack["log"].read_text()
    assert client.chat.completions.create(**CHAT).choices[0].message.content
