"""The OpenAI frontend's HTTP behaviour against a stand-in for Triton (no server: seconds): the real
application (openai_api/app.py) under uvicorn on a loopback port, driven by the official `openai`
client and raw HTTP, over a backend that plays scripted chunks and errors. What only the real
stack can show (tokens, the engine's slots, Triton's own errors) is in tests/test_openai_e2e.py.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time

import openai
import pytest
import uvicorn

from _triton import REPO, free_ports
from v4flash_backend.openai_api.app import create_app
from v4flash_backend.openai_api.chat_templates import select
from v4flash_backend.openai_api.errors import from_backend
from v4flash_backend.openai_api.responses import CompletionLogprobs, chat_logprobs
from v4flash_backend.openai_api.triton import Chunk

BOS = "<｜begin▁of▁sentence｜>"


def ch(text, ids, reason="", prompt=5, cached=0, drafted=0, accepted=0, logprobs=None):
    return Chunk(text=text, token_ids=ids, finish_reason=reason, prompt_tokens=prompt, cached_tokens=cached,
                 completion_tokens=len(ids), drafted=drafted, accepted=accepted, logprobs=logprobs)


class Err(str):
    """An error message as Triton sends it ("[CODE] text"): raised as triton.TritonBackend raises it."""


class FakeBackend:
    """`script(params)` -> the items one request yields: Chunks, Err (Triton's error), exceptions (raised),
    "hang" (waits until cancelled). Records every request and when its generator was closed."""

    def __init__(self):
        self.script = lambda p: [ch("hi", [7], "stop")]
        self.seen, self.closed = [], []

    async def ready(self):
        return True

    async def close(self):
        pass

    async def generate(self, params, rename=None):
        self.seen.append((params, rename))
        try:
            for item in self.script(params):
                if isinstance(item, Err):
                    raise from_backend(item, rename)
                if isinstance(item, Exception):
                    raise item
                if item == "hang":
                    await asyncio.sleep(3600)
                yield item
                await asyncio.sleep(0)
        finally:
            self.closed.append(time.monotonic())


def _spec_2_4(app):
    """The app as a server advertising ASGI HTTP spec 2.4 sees it: there Starlette's StreamingResponse
    stops listening for the client's disconnect and notices one only when a write fails, at the next
    token (uvicorn 0.55 advertises 2.3); the frontend's EventStream must cancel at once either way."""
    async def wrapped(scope, receive, send):
        if scope["type"] == "http":
            scope = dict(scope, asgi=dict(scope.get("asgi", {}), spec_version="2.4"))
        await app(scope, receive, send)
    return wrapped


def _serve(app):
    port = free_ports(1)[0]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    return server, t, port


@pytest.fixture(scope="module")
def api():
    backend = FakeBackend()
    server, t, port = _serve(_spec_2_4(create_app(backend, select(REPO / "models" / "v4flash-tiny"))))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    yield backend, port, client
    server.should_exit = True
    t.join(10)


@pytest.fixture(autouse=True)
def _reset(request):
    if "api" in request.fixturenames:
        backend = request.getfixturevalue("api")[0]
        backend.script = lambda p: [ch("hi", [7], "stop")]
        backend.seen.clear()
        backend.closed.clear()


def post(port, path, body):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, data


def events(data: bytes) -> list:
    out = [line[len(b"data: "):] for line in data.split(b"\n\n") if line.startswith(b"data: ")]
    return [e.decode() if e == b"[DONE]" else json.loads(e) for e in out]


CHAT = {"model": "v4flash", "messages": [{"role": "user", "content": "hi"}]}


def test_an_error_after_the_stream_began_is_its_last_event_then_done(api):
    backend, port, client = api
    backend.script = lambda p: [ch("ab", [1, 2]), Err("[UNAVAILABLE] rank group connection lost (rank 0)")]
    status, data = post(port, "/v1/chat/completions", dict(CHAT, stream=True))
    ev = events(data)
    assert status == 200 and ev[-1] == "[DONE]"
    assert ev[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert ev[1]["choices"][0]["delta"] == {"content": "ab"}
    assert ev[2]["error"]["message"] == "rank group connection lost (rank 0)"
    assert ev[2]["error"]["code"] == "unavailable"
    assert len(ev) == 4
    # the official client raises on that event, after the text before it
    got = []
    with pytest.raises(openai.APIError, match="rank group connection lost"):
        for c in client.chat.completions.create(model="v4flash", messages=CHAT["messages"], stream=True):
            got.append(c.choices[0].delta.content)
    assert got == ["", "ab"]
    # a failure of the frontend itself mid-stream: the same shape, and the server answers the next request
    backend.script = lambda p: [ch("ab", [1, 2]), RuntimeError("boom")]
    ev = events(post(port, "/v1/completions", {"model": "v4flash", "prompt": "x", "stream": True})[1])
    assert ev[0]["choices"][0]["text"] == "ab" and ev[1]["error"]["type"] == "server_error"
    assert "boom" in ev[1]["error"]["message"] and ev[2] == "[DONE]"
    backend.script = lambda p: [ch("ok", [3], "stop")]
    assert client.completions.create(model="v4flash", prompt="x").choices[0].text == "ok"


def test_errors_before_the_first_token_are_the_http_status(api):
    backend, port, client = api
    backend.script = lambda p: [Err("[UNAVAILABLE] server at capacity: 2 requests waiting")]
    for stream in (False, True):
        status, data = post(port, "/v1/chat/completions", dict(CHAT, stream=stream))
        assert status == 503 and json.loads(data)["error"]["message"].startswith("server at capacity"), data
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model="v4flash", messages=CHAT["messages"])
    assert e.value.status_code == 503
    # Triton's INVALID_ARG: 400, the field in the request's own spelling
    backend.script = lambda p: [Err("[INVALID_ARG] max_tokens 90 does not fit: the prompt has 40 tokens "
                                             "and max_model_len is 128, so at most 88 can be generated")]
    status, data = post(port, "/v1/chat/completions", dict(CHAT, stream=True, max_completion_tokens=90))
    err = json.loads(data)["error"]
    assert status == 400 and err["param"] == "max_completion_tokens" and "does not fit" in err["message"]
    backend.script = lambda p: [Err("[INVALID_ARG] prompt has 130 tokens; max_model_len is 128")]
    assert json.loads(post(port, "/v1/chat/completions", CHAT)[1])["error"]["param"] == "messages"
    assert json.loads(post(port, "/v1/completions", {"model": "v4flash", "prompt": "x"})[1])["error"]["param"] == \
        "prompt"
    backend.script = lambda p: [Err("in ensemble 'x', something broke")]
    assert post(port, "/v1/completions", {"model": "v4flash", "prompt": "x"})[0] == 500


def test_request_fields_reach_triton_as_its_sampling_parameters(api):
    backend, port, client = api
    client.chat.completions.create(
        model="v4flash", messages=[{"role": "system", "content": "S"}, {"role": "user", "content": [
            {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        max_completion_tokens=9, temperature=0.5, top_p=0.9, seed=3, stop=["x", "yz"], presence_penalty=0.25,
        logprobs=True, top_logprobs=2, extra_body={"top_k": 4, "min_tokens": 2, "ignore_eos": True,
                                                   "stop_token_ids": [5]})
    params, rename = backend.seen[-1]
    assert params.sampling == {"temperature": 0.5, "top_p": 0.9, "top_k": 4, "seed": 3, "max_tokens": 9,
                               "min_tokens": 2, "ignore_eos": True, "stop": ["x", "yz"], "stop_token_ids": [5],
                               "presence_penalty": 0.25, "logprobs": 2}
    assert params.prompt_text == BOS + "# system: S\n# user: a\n# b\n" and params.prompt_ids is None
    assert params.add_special_tokens is False and params.return_logprobs
    assert rename["max_tokens"] == "max_completion_tokens" and rename["prompt"] == "messages"
    # completions: token ids go as input_ids; OpenAI's default temperature; the server's tokenization
    client.completions.create(model="v4flash", prompt=[[1, 2, 3]], max_tokens=4)
    params, _ = backend.seen[-1]
    assert params.prompt_ids == [1, 2, 3] and params.prompt_text is None and params.add_special_tokens is None
    assert params.sampling == {"temperature": 1.0, "max_tokens": 4} and not params.return_logprobs


def test_usage_in_streamed_chunks(api):
    backend, port, client = api
    backend.script = lambda p: [ch("a", [1], prompt=4, cached=2, drafted=5, accepted=3),
                                ch("bc", [2, 3], "length", prompt=4, cached=2, drafted=5, accepted=1)]
    ev = events(post(port, "/v1/chat/completions", dict(CHAT, stream=True,
                                                        stream_options={"include_usage": True}))[1])
    assert [e.get("usage", "absent") for e in ev[:-2]] == [None, None, None] and ev[-1] == "[DONE]"
    assert ev[-2]["choices"] == [] and ev[-2]["usage"] == {
        "prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7, "prompt_tokens_details": {"cached_tokens": 2},
        "dspark": {"drafted_tokens": 10, "accepted_tokens": 4}}
    assert ev[-3]["choices"][0]["finish_reason"] == "length"
    ev = events(post(port, "/v1/completions", {"model": "v4flash", "prompt": "p", "stream": True,
                                               "stream_options": {"continuous_usage_stats": True}})[1])
    assert [e["usage"]["completion_tokens"] for e in ev[:-1]] == [1, 3, 3]  # every chunk: the counts so far
    # no stream_options: no usage key in the chunks at all; stream_options without stream: 400
    ev = events(post(port, "/v1/chat/completions", dict(CHAT, stream=True))[1])
    assert all("usage" not in e for e in ev[:-1])
    status, data = post(port, "/v1/chat/completions", dict(CHAT, stream_options={"include_usage": True}))
    assert status == 400 and "only allowed when stream is true" in json.loads(data)["error"]["message"]


def test_a_client_that_disconnects_is_cancelled_at_once(api):
    """No token has to come for the disconnect to be seen: the Triton request (here its stand-in) is
    closed while it waits, streamed or not."""
    backend, port, _ = api
    for stream in (True, False):
        backend.script = lambda p: [ch("a", [1]), "hang"] if stream else ["hang"]
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/v1/chat/completions", json.dumps(dict(CHAT, stream=stream)),
                     {"Content-Type": "application/json"})
        if stream:
            resp = conn.getresponse()
            assert resp.status == 200 and resp.readline().startswith(b"data: ")  # the stream is running
        else:
            time.sleep(0.3)
        backend.closed.clear()
        t0 = time.monotonic()
        conn.sock.close()
        conn.close()
        while not backend.closed and time.monotonic() - t0 < 5:
            time.sleep(0.01)
        assert backend.closed and backend.closed[0] - t0 < 1.0, (stream, backend.closed)


def test_chat_is_refused_without_a_chat_format():
    server, t, port = _serve(create_app(FakeBackend(), None))
    try:
        status, data = post(port, "/v1/chat/completions", CHAT)
        err = json.loads(data)["error"]
        assert status == 400 and err["param"] == "messages" and "no chat template" in err["message"]
        assert post(port, "/v1/completions", {"model": "v4flash", "prompt": "x"})[0] == 200
    finally:
        server.should_exit = True
        t.join(10)


def test_logprobs_in_both_forms():
    """The model's per-token JSON (vllm_backend's) -> OpenAI's chat and legacy completion forms: the
    sampled token first, alternatives by rank, at most the asked number."""
    lps = [{"7": {"logprob": -0.1, "rank": 1, "decoded_token": "de"}, "9": {"logprob": -2.5, "rank": 2,
                                                                            "decoded_token": "é"}},
           {"4": {"logprob": -3.0, "rank": 3, "decoded_token": "f"}, "5": {"logprob": -0.5, "rank": 1,
                                                                          "decoded_token": "g"},
            "6": {"logprob": -1.0, "rank": 2, "decoded_token": "h"}}]
    c = ch("def", [7, 4], logprobs=lps)
    got = chat_logprobs(c, 2)
    assert [(x["token"], x["logprob"], x["bytes"]) for x in got] == [("de", -0.1, [100, 101]), ("f", -3.0, [102])]
    assert [[t["token"] for t in x["top_logprobs"]] for x in got] == [["de", "é"], ["g", "h"]]
    assert [t["bytes"] for t in got[0]["top_logprobs"]] == [[100, 101], [195, 169]]
    assert chat_logprobs(c, 0)[1]["top_logprobs"] == []
    legacy = CompletionLogprobs(1)
    a = legacy.of(c)
    assert a == {"tokens": ["de", "f"], "token_logprobs": [-0.1, -3.0], "top_logprobs": [{"de": -0.1}, {"g": -0.5}],
                 "text_offset": [0, 2]}
    assert legacy.of(ch("x", [7], logprobs=lps[:1]))["text_offset"] == [3]  # offsets continue across chunks
