"""The v4flash model's serving layer without a server: parameters and checkpoint lookup,
request parsing and validation, response building, the request loop (FINAL always sent,
errors, cancellation, metrics), and the Triton I/O declaration against config.pbtxt.

The request loop runs against a scripted backend (events chosen by the test) and, once,
against the real engine in process on the golden tiny checkpoint.
"""

import json
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from v4flash_backend.request import GenerateRequest, RequestError
from v4flash_backend.serving import triton_io
from v4flash_backend.serving.detok import StreamDetokenizer
from v4flash_backend.serving.metrics import ServingMetrics
from v4flash_backend.serving.parse import RequestParser
from v4flash_backend.serving.response import OUTPUT_NAMES, ResponseBuilder
from v4flash_backend.serving.service import GenerateService
from v4flash_backend.serving.triton_settings import (
    CHECKPOINT_ENV,
    default_checkpoint_dir,
    load_settings,
    resolve_checkpoint_dir,
    tokenizer_path,
)
from v4flash_backend.settings import Settings

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO.parent / "shared" / "golden" / "v41-tiny"
V = 1024


def i32(*v):
    return np.array(v, dtype=np.int32)


def parser(max_model_len=32, tokenize=None):
    return RequestParser(V, max_model_len, default_max_tokens=16, tokenize=tokenize)


def bad(inputs, match, parameters=None, p=None):
    with pytest.raises(RequestError, match=match) as info:
        (p or parser()).parse(inputs, parameters)
    assert info.value.code == "INVALID_ARG"


# ---- settings ---------------------------------------------------------------------------------
def _ckpt(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


def test_checkpoint_lookup_order(tmp_path, monkeypatch):
    """parameter > $V4FLASH_CHECKPOINT_DIR > models/v4flash-tiny > ../shared/golden/v41-tiny,
    each relative to the model repository root; a named directory without config.json is an
    error, not a silent fallback."""
    root = tmp_path / "repo"
    model_dir = root / "model_repository" / "v4flash"
    model_dir.mkdir(parents=True)
    golden = _ckpt(tmp_path / "shared" / "golden" / "v41-tiny")
    monkeypatch.delenv(CHECKPOINT_ENV, raising=False)
    path, why = resolve_checkpoint_dir("", model_dir)
    assert path == golden and "falling back to the golden" in why
    embedded = _ckpt(root / "models" / "v4flash-tiny")
    assert default_checkpoint_dir(root / "model_repository")[0] == embedded
    assert resolve_checkpoint_dir("", model_dir)[0] == embedded
    env = _ckpt(tmp_path / "env")
    monkeypatch.setenv(CHECKPOINT_ENV, str(env))
    assert resolve_checkpoint_dir("", model_dir) == (env, f"${CHECKPOINT_ENV}")
    param = _ckpt(root / "mine")
    assert resolve_checkpoint_dir("../mine", model_dir) == (param, "parameter checkpoint_dir")
    with pytest.raises(FileNotFoundError, match="missing.*parameter checkpoint_dir"):
        resolve_checkpoint_dir("../missing", model_dir)


def _config(**params):
    return {"parameters": {k: {"string_value": v} for k, v in params.items()}}


def test_settings_parse_and_name_bad_parameters(tmp_path):
    ckpt = _ckpt(tmp_path / "ckpt")
    model_dir = tmp_path / "v4flash"
    s = load_settings(_config(checkpoint_dir=str(ckpt), world_size="4", max_num_seqs="2",
                              max_model_len="99", dspark="false", ops_backend="nki-sim"), model_dir).settings
    assert (s.world_size, s.max_num_seqs, s.max_model_len, s.spec_mode, s.ops_backend) == (4, 2, 99, "off", "nki-sim")
    assert tokenizer_path(s) == ckpt / "tokenizer.json"
    for key, value, match in [("world_size", "two", "'world_size' must be an integer"),
                              ("max_num_seqs", "0", "'max_num_seqs' must be >= 1"),
                              ("dspark", "maybe", "'dspark' must be true or false"),
                              ("ops_backend", "cuda", "'ops_backend' must be one of torch, nki, nki-sim"),
                              ("launcher", "ssh", "'launcher' must be one of")]:
        with pytest.raises(ValueError, match=match):
            load_settings(_config(checkpoint_dir=str(ckpt), **{key: value}), model_dir)
    with pytest.raises(ValueError, match="inprocess runs one rank"):
        load_settings(_config(checkpoint_dir=str(ckpt), launcher="inprocess", world_size="2"), model_dir)


# ---- request parsing --------------------------------------------------------------------------
def test_parse_ids_defaults_and_echo_rules():
    r = parser().parse({"input_ids": i32(0, 5, 6)})
    assert r.prompt == [0, 5, 6] and not r.stream and r.echo  # vllm_backend: echo when not streaming
    assert (r.max_tokens, r.temperature, r.top_p, r.top_k, r.seed, r.ignore_eos) == (16, 0.0, 1.0, 0, None, False)
    r = parser().parse({"input_ids": i32(1), "stream": np.array([True])})
    assert r.stream and not r.echo
    r = parser().parse({"input_ids": i32(1), "exclude_input_in_output": np.array([True])})
    assert not r.echo
    bad({"input_ids": i32(1), "stream": np.array([True]), "exclude_input_in_output": np.array([False])},
        "exclude_input_in_output=false is not supported with stream=true")


def test_sampling_priority_typed_over_json_over_request_parameters():
    inputs = {"input_ids": i32(1, 2),
              "sampling_parameters": np.array([json.dumps({"max_tokens": 5, "temperature": 0.5, "top_k": -1,
                                                            "stop_token_ids": [7, 8]}).encode()], dtype=object),
              "temperature": np.array([0.25], dtype=np.float32), "seed": np.array([2**64 - 1], dtype=np.uint64)}
    r = parser().parse(inputs, json.dumps({"max_tokens": 9, "top_p": 0.5, "priority": 3}))
    assert r.max_tokens == 5  # JSON over request parameters
    assert r.temperature == 0.25  # typed over JSON
    assert r.top_p == 0.5  # request parameter when nothing else sets it; "priority" is not ours
    assert r.top_k == 0  # vLLM's -1 (disabled) is the engine's 0
    assert r.seed == 2**64 - 1 and r.stop_token_ids == (7, 8)
    assert r.sampling() == dict(max_tokens=5, temperature=0.25, top_p=0.5, top_k=0, seed=2**64 - 1,
                                stop_token_ids=[7, 8], ignore_eos=False, min_tokens=0, logprobs=-1,
                                frequency_penalty=0.0, presence_penalty=0.0)


@pytest.mark.parametrize("inputs, match", [
    ({}, "exactly one of input_ids .* got neither"),
    ({"input_ids": i32(1), "text_input": np.array([b"x"], dtype=object)}, "exactly one of input_ids .* got both"),
    ({"input_ids": i32()}, "input_ids is empty"),
    ({"input_ids": np.arange(32, dtype=np.int32)}, "prompt has 32 tokens; max_model_len is 32"),
    ({"input_ids": i32(1, 1024)}, r"token id 1024 in the prompt is outside the vocabulary \[0, 1024\)"),
    ({"input_ids": i32(-1)}, "token id -1"),
    ({"input_ids": np.array([1.0], dtype=np.float32)}, "input_ids must be INT32 token ids, got dtype float32"),
    ({"input_ids": i32(1), "max_tokens": i32(0)}, "max_tokens must be > 0, got 0"),
    ({"input_ids": i32(1), "max_tokens": i32(1, 2)}, "max_tokens must hold exactly one value, got 2"),
    ({"input_ids": i32(1), "temperature": np.array([-0.1], dtype=np.float32)}, "temperature must be >= 0"),
    ({"input_ids": i32(1), "temperature": np.array([np.nan], dtype=np.float32)}, "temperature must be >= 0"),
    ({"input_ids": i32(1), "top_p": np.array([0.0], dtype=np.float32)}, r"top_p must be in \(0, 1\], got 0.0"),
    ({"input_ids": i32(1), "top_p": np.array([1.5], dtype=np.float32)}, r"top_p must be in \(0, 1\], got 1.5"),
    ({"input_ids": i32(1), "top_k": i32(-2)}, "top_k must be >= 0"),
    ({"input_ids": i32(1), "stop_token_ids": i32(3, 2000)}, "stop token id 2000 is outside the vocabulary"),
    ({"input_ids": i32(1), "stream": i32(1)}, "stream must be BOOL"),
    ({"input_ids": i32(1), "sampling_parameters": np.array([b"{bad"], dtype=object)},
     "sampling_parameters is not valid JSON"),
    ({"input_ids": i32(1), "sampling_parameters": np.array([b"[1]"], dtype=object)},
     "sampling_parameters must be a JSON object, got list"),
    ({"input_ids": i32(1), "sampling_parameters": np.array([b'{"max_token": 3}'], dtype=object)},
     "unsupported key.*'max_token'"),
    ({"input_ids": i32(1), "sampling_parameters": np.array([b'{"max_tokens": -3}'], dtype=object)},
     "max_tokens must be > 0, got -3"),
    ({"input_ids": i32(1), "sampling_parameters": np.array([b'{"max_tokens": 2.5}'], dtype=object)},
     "sampling_parameters.max_tokens must be an integer"),
    ({"input_ids": i32(1), "sampling_parameters": np.array([b'{"ignore_eos": 1}'], dtype=object)},
     "sampling_parameters.ignore_eos must be true or false"),
    ({"input_ids": i32(1), "sampling_parameters": np.array([b'{"temperature": "hot"}'], dtype=object)},
     "sampling_parameters.temperature must be a number"),
    ({"input_ids": i32(1), "sampling_parameters": np.array([b'{"seed": -1}'], dtype=object)},
     r"seed must be in \[0, 2\*\*64\)"),
])
def test_bad_requests_are_invalid_arg_naming_the_problem(inputs, match):
    bad(inputs, match)


def _parse_json(obj, **inputs):
    # max_model_len 64: room for genai-perf's max_tokens 32 beside the prompt (a max_tokens that does
    # not fit is refused, tested on its own)
    return parser(64).parse({"input_ids": i32(1), "sampling_parameters": np.array([json.dumps(obj).encode()],
                                                                                  dtype=object), **inputs})


def test_sampling_values_as_strings_convert_by_type_as_vllm_backend_does():
    # genai-perf 0.0.16 --backend vllm sends {"max_tokens": "32", "min_tokens": "32"}
    r = _parse_json({"max_tokens": "32", "min_tokens": "32", "temperature": "0.7", "top_p": " 0.9",
                     "top_k": "5", "seed": "11", "ignore_eos": "false", "logprobs": "2"})
    assert (r.max_tokens, r.min_tokens, r.temperature, r.top_p, r.top_k, r.seed) == (32, 32, 0.7, 0.9, 5, 11)
    assert r.ignore_eos is False and r.logprobs == 2  # "false" is false (not Python's bool("false"))
    assert _parse_json({"stop_token_ids": "[3, 4]", "stop": "\n\n"}).stop_token_ids == (3, 4)
    assert _parse_json({"stop": "ab"}).stop == ("ab",) and _parse_json({"stop": ["a", "b"]}).stop == ("a", "b")


@pytest.mark.parametrize("obj,match", [
    ({"max_tokens": "64x"}, "sampling_parameters.max_tokens must be an integer, got '64x'"),
    ({"max_tokens": "6.5"}, "sampling_parameters.max_tokens must be an integer"),
    ({"temperature": "warm"}, "sampling_parameters.temperature must be a number, got 'warm'"),
    ({"temperature": "nan"}, "sampling_parameters.temperature must be a number"),
    ({"ignore_eos": "maybe"}, "sampling_parameters.ignore_eos must be true or false"),
    ({"stop_token_ids": "[3,"}, "sampling_parameters.stop_token_ids must be a list"),
    ({"stop": [1]}, "sampling_parameters.stop must be a string or a list of strings"),
    ({"max_tokens": 7, "min_tokens": 8}, r"min_tokens must be in \[0, max_tokens=7\], got 8"),
    ({"min_tokens": -1}, r"min_tokens must be in \[0, max_tokens=\d+\], got -1"),
    ({"frequency_penalty": 2.5}, r"frequency_penalty must be in \[-2, 2\], got 2.5"),
    ({"presence_penalty": "-3"}, r"presence_penalty must be in \[-2, 2\]"),
    ({"presence_penalty": "lots"}, "presence_penalty must be a number"),
    ({"n": 2}, "n must be 1"),
    ({"logit_bias": {"5": 3}}, "logit_bias is not supported"),
    ({"logprobs": 21}, r"logprobs must be in \[0, 20\]"),
])
def test_sampling_values_that_do_not_convert_are_invalid_arg(obj, match):
    with pytest.raises(RequestError, match=match) as exc:
        _parse_json(obj)
    assert exc.value.code == "INVALID_ARG"


def test_min_tokens_anywhere_from_zero_to_max_tokens():
    for m in (0, 1, 3, 7):
        r = _parse_json({"max_tokens": 7, "min_tokens": m})
        assert r.min_tokens == m and not r.ignore_eos


def test_openai_frontend_defaults_and_return_flags_are_accepted():
    # the OpenAI frontend's vllm format: every non-None field of the OpenAI request (n, penalties 0, ...)
    r = _parse_json({"frequency_penalty": 0.0, "ignore_eos": False, "n": 1, "presence_penalty": 0.0,
                     "temperature": 1.0, "top_p": 1.0, "max_tokens": 16, "logprobs": 1},
                    return_logprobs=np.array([True]), return_num_input_tokens=np.array([True]),
                    return_num_output_tokens=np.array([True]))
    assert r.return_logprobs and r.logprobs == 1 and r.temperature == 1.0
    r = parser().parse({"input_ids": i32(1), "return_cumulative_logprob": np.array([True])})
    assert r.logprobs == 0 and not r.return_logprobs  # log-probs computed for the cumulative sum only
    r = parser().parse({"input_ids": i32(1), "stop_words": np.array([b"\n\n", "ö".encode()], dtype=object),
                        "frequency_penalty": np.array([0.0], dtype=np.float32)})
    assert r.stop == ("\n\n", "ö")
    r = _parse_json({"frequency_penalty": "0.5", "presence_penalty": -1})
    assert (r.frequency_penalty, r.presence_penalty) == (0.5, -1.0)


def test_empty_text_is_refused_even_when_the_tokenizer_adds_bos():
    """Decision: "" is not served as a BOS-only prompt (the tokenizer of the embedded model
    turns "" into [BOS]); a text that tokenizes to BOS + tokens is served as before."""
    p = parser(tokenize=lambda text: [0] + [ord(c) for c in text])
    bad({"text_input": np.array([b""], dtype=object)}, "text_input is empty", p=p)
    assert p.parse({"text_input": np.array([b" "], dtype=object)}).prompt == [0, 32]


def test_add_special_tokens_input_picks_the_tokenization_of_text_input():
    """The add_special_tokens input (the OpenAI frontend sends false for a chat prompt its template
    already began with BOS) reaches the tokenizer; absent, the model's own setting applies."""
    calls = []

    def tokenize(text, add=True):  # the model's setting: with BOS
        calls.append(add)
        return ([0] if add else []) + [ord(c) for c in text]

    p = parser(tokenize=tokenize)
    text = {"text_input": np.array([b"ab"], dtype=object)}
    assert p.parse(text).prompt == [0, 97, 98]
    assert p.parse(dict(text, add_special_tokens=np.array([False]))).prompt == [97, 98]
    assert p.parse(dict(text, add_special_tokens=np.array([True]))).prompt == [0, 97, 98]
    assert calls == [True, False, True]
    bad(dict(text, add_special_tokens=np.array([1], dtype=np.int32)), "add_special_tokens must be BOOL", p=p)


def test_the_ensemble_preprocessing_refuses_empty_text_too():
    """The embedded model's tokenizer makes "" a BOS-only prompt; the v4flash_text ensemble's
    preprocessing step refuses it like the v4flash model does."""
    from v4flash_backend.serving.prepost import Preprocessor

    tok = Tokenizer.from_file(str(REPO / "models" / "v4flash-tiny" / "tokenizer.json"))
    assert tok.encode("").ids == [0]  # what made "" servable before
    pre = Preprocessor(tok, add_special_tokens=True)
    with pytest.raises(ValueError, match="text_input is empty"):
        pre.input_ids(np.array([b""], dtype=object))
    assert pre.input_ids(np.array([b"hi"], dtype=object)).tolist() == tok.encode("hi").ids
    # no text_input at all (a client sending `prompt`): the message names the input to send
    with pytest.raises(ValueError, match="text_input is required.*not prompt"):
        pre.input_ids(None)


def test_max_tokens_beyond_max_model_len_is_refused_and_the_default_is_capped():
    """Decision: an explicit max_tokens that does not fit beside the prompt is INVALID_ARG
    (typed input, sampling_parameters and request parameters alike), one that just fits is
    served; the default max_tokens (16 here) is capped to what fits."""
    p = parser(max_model_len=32)
    prompt = i32(*range(20))  # room for 12
    assert p.parse({"input_ids": prompt, "max_tokens": i32(12)}).max_tokens == 12
    for inputs, params in (({"max_tokens": i32(13)}, None),
                           ({"sampling_parameters": np.array([b'{"max_tokens": 13}'], dtype=object)}, None),
                           ({}, json.dumps({"max_tokens": 13}))):
        bad(dict(inputs, input_ids=prompt), "max_tokens 13 does not fit: the prompt has 20 tokens and "
            "max_model_len is 32, so at most 12 can be generated", parameters=params, p=p)
    assert p.parse({"input_ids": prompt}).max_tokens == 12
    assert p.parse({"input_ids": i32(1, 2)}).max_tokens == 16


def test_text_input_needs_a_tokenizer_and_text():
    bad({"text_input": np.array([b"hi"], dtype=object)}, "text_input is not supported")
    p = parser(tokenize=lambda text: [ord(c) for c in text])
    assert p.parse({"text_input": np.array(["hé".encode()], dtype=object)}).prompt == [104, 233]
    bad({"text_input": np.array([b""], dtype=object)}, "text_input is empty", p=p)
    bad({"text_input": np.array([b"\xff"], dtype=object)}, "text_input is not valid UTF-8", p=p)
    bad({"text_input": np.array([b"a", b"b"], dtype=object)}, "text_input must hold exactly one value", p=p)


# ---- responses ------------------------------------------------------------------------------
def _chunk(ids, ctx, reason=None, drafted=0, accepted=0):
    return {"event": "chunk", "token_ids": ids, "context_ids": ctx, "finish_reason": reason,
            "drafted": drafted, "accepted": accepted}


def test_streamed_responses_carry_every_output_and_deltas():
    b = ResponseBuilder(GenerateRequest(prompt=[0, 9], stream=True))
    outs = [b.on_chunk(_chunk([5], [0, 9]))[0], b.on_chunk(_chunk([6, 7], [0, 9, 5], drafted=5, accepted=1))[0],
            b.on_chunk(_chunk([8], [0, 9, 5, 6, 7], "length", drafted=10, accepted=1))[0]]
    for out in outs:
        assert set(out) == set(OUTPUT_NAMES)  # the ensemble pairs outputs positionally
        assert out["output_ids"].dtype == np.int32 and out["context_ids"].dtype == np.int32
        assert out["num_output_tokens"].dtype == np.uint32 and out["finish_reason"].dtype == object
    assert [o["output_ids"].tolist() for o in outs] == [[5], [6, 7], [8]]
    assert [o["context_ids"].tolist() for o in outs] == [[0, 9], [0, 9, 5], [0, 9, 5, 6, 7]]
    assert [o["finish_reason"][0] for o in outs] == [b"", b"", b"length"]
    assert [int(o["num_output_tokens"][0]) for o in outs] == [1, 2, 1]
    assert [int(o["num_drafted_tokens"][0]) for o in outs] == [0, 5, 5]  # deltas of cumulative 0, 5, 10
    assert [int(o["num_accepted_tokens"][0]) for o in outs] == [0, 1, 0]
    assert all(int(o["num_input_tokens"][0]) == 2 for o in outs)


def test_non_streamed_is_one_response_with_or_without_the_prompt():
    prompt = list(range(1, 12))
    for echo in (False, True):
        b = ResponseBuilder(GenerateRequest(prompt=prompt, stream=False, echo=echo))
        assert b.on_chunk(_chunk([20], prompt[-8:], drafted=3))[0] is None
        out = b.on_chunk(_chunk([21, 22], [0], "stop", drafted=8, accepted=2))[0]
        assert out["output_ids"].tolist() == (prompt if echo else []) + [20, 21, 22]
        assert out["context_ids"].tolist() == ([] if echo else prompt[-8:])
        assert int(out["num_output_tokens"][0]) == 3 and int(out["num_drafted_tokens"][0]) == 8
        assert int(out["num_accepted_tokens"][0]) == 2 and out["finish_reason"][0] == b"stop"


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_file(str(GOLDEN / "tokenizer.json"))


def test_streamed_text_concatenates_to_the_non_streamed_text(tokenizer):
    """Chunks that split multi-byte characters: the streamed text_output deltas add up to the
    non-streamed text_output, which is the tokenizer's decode of all generated ids."""
    detok = StreamDetokenizer(tokenizer)
    prompt_text = "Say:"
    prompt = tokenizer.encode(prompt_text).ids
    gen = tokenizer.encode("东京 😀 é!", add_special_tokens=False).ids
    assert len(gen) >= 6
    cuts = [0, 1, 3, 4, len(gen) - 1, len(gen)]
    req = dict(prompt=prompt, prompt_text=prompt_text)
    s = ResponseBuilder(GenerateRequest(stream=True, **req), detok)
    n = ResponseBuilder(GenerateRequest(stream=False, **req), detok)
    e = ResponseBuilder(GenerateRequest(stream=False, echo=True, **req), detok)
    streamed, seq = [], list(prompt)
    for a, z in zip(cuts, cuts[1:]):
        ev = _chunk(gen[a:z], seq[-8:], "stop" if z == len(gen) else None)
        seq += gen[a:z]
        streamed.append(s.on_chunk(ev)[0]["text_output"][0].decode())
        whole, echoed = n.on_chunk(ev)[0], e.on_chunk(ev)[0]
    assert "".join(streamed) == whole["text_output"][0].decode() == tokenizer.decode(gen)
    assert echoed["text_output"][0].decode() == prompt_text + tokenizer.decode(gen)
    assert "\ufffd" not in "".join(streamed)


# ---- the request loop -----------------------------------------------------------------------
class FakeMetric:
    def __init__(self):
        self.value, self.observed = 0.0, []

    def increment(self, v):
        self.value += v

    def set(self, v):
        self.value = v

    def observe(self, v):
        self.observed.append(v)


class FakeFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

    def __init__(self, name, description, kind):
        self.name, self.kind = name, kind

    def Metric(self, labels, buckets=None):  # noqa: N802 - pb_utils' spelling
        assert (self.kind == "histogram") == (buckets is not None)
        return FakeMetric()


class FakePb:
    MetricFamily = FakeFamily


class ScriptedBackend:
    """Answers each submitted request with the events the test scripted for it."""

    vocab_size = V

    def __init__(self, script=None):
        self.script = script or (lambda req: [])
        self.submitted, self.cancelled, self.callbacks = [], [], {}
        self.slots = 0

    def submit(self, req, rid, on_event):
        self.submitted.append(rid)
        self.callbacks[rid] = on_event
        for ev in self.script(req):
            on_event(ev)

    def cancel(self, rid):
        self.cancelled.append(rid)
        self.callbacks[rid](_chunk([], [], "cancelled"))

    def stats(self):
        return {"slots_in_use": self.slots, "slots_total": 4, "decode_steps": 10, "graphs_per_step": 2.0,
                "host_syncs_per_step": 0.0, "host_to_device_bytes_per_step": 412.0,
                "decode_steps_by_kind": {"draft": 6, "probe": 1, "aside": 3}}

    def close(self):
        pass


class Sink:
    def __init__(self):
        self.sent, self.cancelled = [], False
        self.done = threading.Event()

    def send(self, outputs, error, final):
        self.sent.append((outputs, error, final))
        if final:
            self.done.set()

    def is_cancelled(self):
        return self.cancelled

    def wait(self):
        assert self.done.wait(10), self.sent
        time.sleep(0.05)  # a second FINAL would arrive now
        return self.sent


def wait_until(pred, timeout_s=5.0):
    """Poll pred until it holds (then True) or timeout_s passes (False): the service's sender and
    stats threads update what the tests read, so tests wait for the state, not for a time."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def _service(backend, metrics=None):
    return GenerateService(backend, parser(), None, metrics, log=lambda m: None, poll_s=0.01, stats_interval_s=0.02)


def test_every_request_gets_exactly_one_final():
    script = lambda req: [_chunk([3], [0]), _chunk([4, 5], [0, 3], drafted=5, accepted=1),  # noqa: E731
                          _chunk([6], [0, 3, 4, 5], "stop", drafted=10, accepted=1)]
    svc = _service(ScriptedBackend(script))
    try:
        ok, rejected = Sink(), Sink()
        svc.handle({"input_ids": i32(0), "stream": np.array([True])}, None, ok)
        svc.handle({"input_ids": i32(0), "top_p": np.array([2.0], dtype=np.float32)}, None, rejected)
        sent = ok.wait()
        assert [final for _, _, final in sent] == [False, False, True]
        assert [o["output_ids"].tolist() for o, _, _ in sent] == [[3], [4, 5], [6]]
        assert all(err is None for _, err, _ in sent)
        [(outputs, err, final)] = rejected.wait()
        assert outputs is None and final and err.code == "INVALID_ARG" and "top_p" in err.message
        assert svc.in_flight() == 0
    finally:
        svc.close()


def test_engine_errors_and_cancellation_end_with_final_error():
    backend = ScriptedBackend(lambda req: [] if req.max_tokens == 16 else
                              [_chunk([3], [0]), {"event": "error", "code": "UNAVAILABLE", "message": "rank died"}])
    pb = FakePb()
    metrics = ServingMetrics(pb, "v4flash", "1")
    svc = _service(backend, metrics)
    try:
        failing = Sink()
        svc.handle({"input_ids": i32(0), "stream": np.array([True]), "max_tokens": i32(4)}, None, failing)
        sent = failing.wait()
        assert [final for _, _, final in sent] == [False, True]
        assert sent[-1][1].code == "UNAVAILABLE" and sent[-1][1].message == "rank died"
        # A request the engine holds until the client cancels: the poll notices the cancellation,
        # the backend is told, and the engine's final "cancelled" becomes a CANCELLED error.
        waiting = Sink()
        rid = svc.handle({"input_ids": i32(0), "stream": np.array([True])}, None, waiting)
        assert wait_until(lambda: svc.in_flight() == 1 and metrics.in_flight.value == 1)
        assert not waiting.sent
        waiting.cancelled = True
        [(outputs, err, final)] = waiting.wait()
        assert backend.cancelled == [rid] and final and outputs is None and err.code == "CANCELLED"
        assert svc.in_flight() == 0 and metrics.in_flight.value == 0
        assert metrics.finished["cancelled"].value == 1 and metrics.finished["error"].value == 1
        backend.slots = 3
        assert wait_until(lambda: metrics.slots_in_use.value == 3)  # the next stats refresh
        assert metrics.slots_in_use.value == 3 and metrics.slots_total.value == 4
        assert metrics.graphs_per_step.value == 2.0 and metrics.host_syncs_per_step.value == 0.0
        assert metrics.h2d_bytes_per_step.value == 412.0 and metrics.decode_steps.value == 10
        assert {k: m.value for k, m in metrics.steps_by_kind.items()} == {"draft": 6, "probe": 1, "aside": 3}
        metrics.set_decode({"host_syncs_per_step": None, "decode_steps": 11})  # eager, uncounted
        assert metrics.host_syncs_per_step.value == 0.0 and metrics.decode_steps.value == 11
    finally:
        svc.close()


def test_a_full_engine_queue_is_unavailable_and_counted():
    """The in-process engine refuses in submit (RequestError UNAVAILABLE): the client gets one
    FINAL with that code. The queue gauge and the refusal counter follow the engine's stats,
    across a rank-group restart (its counts start again from 0)."""
    class FullBackend(ScriptedBackend):
        stats_reply = {"waiting": 5, "rejected": 2, "expired": 1}

        def submit(self, req, rid, on_event):
            raise RequestError("server at capacity: 5 requests already waiting", "UNAVAILABLE")

        def stats(self):
            return dict(super().stats(), **self.stats_reply)

    backend = FullBackend()
    m = ServingMetrics(FakePb(), "v4flash", "1")
    svc = _service(backend, m)
    try:
        sink = Sink()
        assert svc.handle({"input_ids": i32(0)}, None, sink) is None
        [(outputs, err, final)] = sink.wait()
        assert final and outputs is None and err.code == "UNAVAILABLE" and "at capacity" in err.message
        assert svc.in_flight() == 0 and m.finished["error"].value == 1
        assert wait_until(lambda: m.rejected.value == 2 and m.waiting.value == 5 and m.expired.value == 1)
        assert m.waiting.value == 5 and m.rejected.value == 2 and m.expired.value == 1
        backend.stats_reply = {"waiting": 0, "rejected": 1, "expired": 1, "restarts": 1}  # a fresh group
        assert wait_until(lambda: m.rejected.value == 3 and m.waiting.value == 0 and m.expired.value == 2)
        assert m.waiting.value == 0 and m.rejected.value == 3 and m.expired.value == 2
    finally:
        svc.close()


def test_metrics_follow_the_tokens_sent():
    script = lambda req: [_chunk([3], [0]), _chunk([4, 5, 6], [0, 3], drafted=5, accepted=2),  # noqa: E731
                          _chunk([7], [0], "length", drafted=10, accepted=2)]
    m = ServingMetrics(FakePb(), "v4flash", "1")
    svc = _service(ScriptedBackend(script), m)
    try:
        t0 = time.monotonic()
        sink = Sink()
        svc.handle({"input_ids": i32(0, 1, 2), "stream": np.array([True])}, None, sink)
        sink.wait()
        elapsed = time.monotonic() - t0
        assert len(m.ttft.observed) == 1 and 0 <= m.ttft.observed[0] <= elapsed
        # 5 tokens: the first is TTFT; a chunk of 3 gives 3 observations of gap/3; the last one 1.
        itl = m.itl.observed
        assert len(itl) == 4 and itl[0] == itl[1] == itl[2] and sum(itl) <= elapsed
        assert m.prompt_tokens.value == 3 and m.generation_tokens.value == 5
        assert m.draft_tokens.value == 10 and m.accepted_tokens.value == 2
        assert m.finished["length"].value == 1 and len(m.e2e.observed) == 1
    finally:
        svc.close()


def test_a_failing_client_still_frees_the_engine_side():
    class BrokenSink(Sink):
        def send(self, outputs, error, final):
            super().send(outputs, error, final)
            raise RuntimeError("stream closed")

    backend = ScriptedBackend(lambda req: [_chunk([3], [0])])  # then the engine keeps going
    svc = _service(backend)
    try:
        sink = BrokenSink()
        rid = svc.handle({"input_ids": i32(0), "stream": np.array([True])}, None, sink)
        sink.wait()
        assert backend.cancelled == [rid] and svc.in_flight() == 0
        assert [final for _, _, final in sink.sent] == [False, True]
    finally:
        svc.close()


class ThreadLog:
    """Records the thread of every call that would reach the python backend's stub."""

    def __init__(self):
        self.threads = set()

    def note(self):
        self.threads.add(threading.current_thread().name)


def test_every_stub_call_runs_on_the_sender_thread():
    """Response sends, cancellation checks and metric updates from every path (a refusal in
    execute, a stream, the stats refresh, close() failing what is left) reach the stub from one
    thread: the 2.51 stub does not serialize concurrent metric updates (service.py's docstring)."""
    log = ThreadLog()

    class LoggedMetric(FakeMetric):
        def increment(self, v):
            log.note()
            super().increment(v)

        def set(self, v):
            log.note()
            super().set(v)

        def observe(self, v):
            log.note()
            super().observe(v)

    class LoggedFamily(FakeFamily):
        def Metric(self, labels, buckets=None):  # noqa: N802
            return LoggedMetric()

    class LoggedPb:
        MetricFamily = LoggedFamily

    class LoggedSink(Sink):
        def send(self, outputs, error, final):
            log.note()
            super().send(outputs, error, final)

        def is_cancelled(self):
            log.note()
            return super().is_cancelled()

    class Stubborn(ScriptedBackend):
        def cancel(self, rid):  # never confirms: close() must fail the request itself
            self.cancelled.append(rid)

    backend = Stubborn(lambda req: [] if req.max_tokens == 16 else [_chunk([3], [0]), _chunk([4], [0], "length")])
    m = ServingMetrics(LoggedPb(), "v4flash", "1")
    svc = _service(backend, m)
    refused, streamed, held = LoggedSink(), LoggedSink(), LoggedSink()
    svc.handle({"input_ids": i32(0), "top_p": np.array([2.0], dtype=np.float32)}, None, refused)
    svc.handle({"input_ids": i32(0), "stream": np.array([True]), "max_tokens": i32(4)}, None, streamed)
    svc.handle({"input_ids": i32(0), "stream": np.array([True])}, None, held)
    refused.wait()
    streamed.wait()
    assert wait_until(lambda: m.slots_total.value == 4)  # a stats refresh has run (close() must not be first)
    finished, slots_total = m.finished, m.slots_total  # close() drops them
    svc.close(drain_s=0.1)
    assert held.sent[-1][1].code == "UNAVAILABLE" and refused.sent[-1][1].code == "INVALID_ARG"
    assert finished["error"].value == 2 and finished["length"].value == 1 and slots_total.value == 4
    assert log.threads == {"v4flash-responses"}
    late = Sink()  # after close: refused at once (answered on this thread, the sender is gone)
    svc.handle({"input_ids": i32(0)}, None, late)
    assert late.sent[-1][1].code == "UNAVAILABLE" and "shutting down" in late.sent[-1][1].message


def test_in_process_engine_streams_what_it_returns_whole(tokenizer):
    """The real engine (golden tiny checkpoint, DSpark off for speed) behind the service:
    streamed ids and text equal the non-streamed ones, in one batch of concurrent requests."""
    from v4flash_backend.serving.model_setup import build_service

    cfg = _config(checkpoint_dir=str(GOLDEN), launcher="inprocess", max_num_seqs="3", max_model_len="48",
                  dspark="false")
    svc = build_service(cfg, str(REPO / "model_repository" / "v4flash"), metric_api=FakePb(), log=lambda m: None)
    try:
        common = {"text_input": np.array(["Once upon a time".encode()], dtype=object),
                  "max_tokens": i32(6), "ignore_eos": np.array([True]), "exclude_input_in_output": np.array([True])}
        sinks = [Sink(), Sink()]
        svc.handle(dict(common, stream=np.array([True])), None, sinks[0])
        svc.handle(dict(common, stream=np.array([False])), None, sinks[1])
        streamed, whole = sinks[0].wait(), sinks[1].wait()
    finally:
        svc.close()
    assert all(err is None for _, err, _ in streamed + whole)
    ids = [t for o, _, _ in streamed for t in o["output_ids"].tolist()]
    assert len(ids) == 6 and ids == whole[0][0]["output_ids"].tolist()
    text = "".join(o["text_output"][0].decode() for o, _, _ in streamed)
    assert text == whole[0][0]["text_output"][0].decode() == tokenizer.decode(ids)


# ---- the rank-group engine client ---------------------------------------------------------------
class FakeGroup:
    """Stands in for rank_group.RankGroup: records launches, submissions and shutdowns."""

    launched = []

    def __init__(self):
        self.alive, self.failure, self.launch_args = True, None, {}
        self.pids, self.log_path, self.info = [123], "group.log", {}
        self.submitted, self.cancelled, self.shut_down = [], [], False

    @classmethod
    def launch(cls, settings, **kw):
        g = cls()
        cls.launched.append((settings, kw, g))
        return g

    def submit(self, prompt, params, request_id=None, callback=None, warmup=False):
        self.submitted.append((prompt, params, request_id, callback, warmup))

        class Done:
            @staticmethod
            def result(timeout=None):
                return {"error": None, "code": None, "token_ids": [1, 2], "finish_reason": "length"}
        return Done()

    def cancel(self, rid):
        self.cancelled.append(rid)

    def stats(self, timeout=None):
        return {"event": "stats", "engine": {"slots_in_use": 2, "slots_total": 4}, "world_size": 1}

    def shutdown(self, timeout=None):
        self.shut_down = True
        self.alive = False


def test_rank_group_engine_launches_warms_up_forwards_and_restarts(monkeypatch):
    from v4flash_backend.serving import engine_rank_group as rgc

    FakeGroup.launched = []
    monkeypatch.setattr(rgc, "RankGroup", FakeGroup)
    settings = Settings(checkpoint_dir=GOLDEN, world_size=2, max_num_seqs=3, max_model_len=77,
                        spec_mode="off", sps_path="/tmp/sps.json")
    logs = []
    backend = rgc.RankGroupEngine(settings, logs.append, watchdog_interval_s=0.02, watch_also=(4242,))
    try:
        assert backend.vocab_size == V  # from the checkpoint's config.json
        [(launched, kw, first)] = FakeGroup.launched
        assert kw == {"watch_also": (4242,)}  # the ranks die with the server too (model.py passes its pid)
        assert (launched.checkpoint_dir, launched.world_size, launched.max_num_seqs, launched.max_model_len) == (
            str(GOLDEN), 2, 3, 77)
        wire = Settings.from_json(launched.to_json())  # what the workers receive
        assert wire.spec_mode == "off" and wire.sps_path == "/tmp/sps.json"
        # the warm-up request, marked as the start-up request (it asks a background compile for nothing)
        assert first.submitted[0][1] == {"max_tokens": 2, "ignore_eos": True} and first.submitted[0][4] is True
        req = GenerateRequest(prompt=[0, 7], max_tokens=5, seed=3, stop_token_ids=(9,))
        backend.submit(req, "r1", print)
        assert first.submitted[1][:3] == ([0, 7], req.sampling(), "r1") and first.submitted[1][4] is False
        assert backend.stats()["slots_in_use"] == 2
        first.alive, first.failure = False, "rank 1 died"  # the group goes down
        assert wait_until(lambda: backend.restarts > 0)
        assert backend.restarts == 1 and len(FakeGroup.launched) == 2 and first.shut_down
        assert FakeGroup.launched[1][1] == {"watch_also": (4242,)}  # a restarted group too
        second = FakeGroup.launched[1][2]
        assert backend.group is second and second.submitted[0][2] == "warmup"
        backend.cancel("r2")
        assert second.cancelled == ["r2"] and any("rank 1 died" in m for m in logs)
    finally:
        backend.close()
    assert FakeGroup.launched[-1][2].shut_down and not backend._watchdog.is_alive()


# ---- Triton I/O declaration -----------------------------------------------------------------
def _pbtxt_tensors(text, section):
    body = re.search(section + r"\s*\[(.*?)\n\]", text, re.S).group(1)
    out = []
    for m in re.finditer(r'\{\s*name:\s*"(\w+)",\s*data_type:\s*(\w+),\s*dims:\s*\[([^\]]*)\](.*?)\}', body):
        out.append((m.group(1), m.group(2), [int(d) for d in m.group(3).split(",")], "optional: true" in m.group(4)))
    return out


def test_config_pbtxt_matches_the_declared_io():
    text = (REPO / "model_repository/v4flash/config.pbtxt").read_text()
    assert _pbtxt_tensors(text, "input") == [tuple(i) for i in triton_io.INPUTS]
    assert [t[:3] for t in _pbtxt_tensors(text, "output")] == [tuple(o) for o in triton_io.OUTPUTS]
    assert "decoupled: true" in text and "max_batch_size: 0" in text and "KIND_MODEL" in text
    # The ensemble reads exactly the outputs every data response carries.
    ensemble = (REPO / "model_repository/v4flash_text/config.pbtxt").read_text()
    step = ensemble[ensemble.index('model_name: "v4flash"'):ensemble.index('model_name: "postprocessing"')]
    assert set(re.findall(r'output_map \{ key: "(\w+)"', step)) == set(OUTPUT_NAMES)
    assert set(re.findall(r'input_map \{ key: "(\w+)"', step)) <= set(triton_io.INPUT_NAMES)


def test_auto_complete_adds_only_what_is_missing():
    class Cfg:
        def __init__(self):
            self.d = {"input": [{"name": "input_ids"}], "output": []}
            self.policy = self.batch = None

        def set_model_transaction_policy(self, p):
            self.policy = p

        def set_max_batch_size(self, n):
            self.batch = n

        def as_dict(self):
            return self.d

        def add_input(self, i):
            self.d["input"].append(i)

        def add_output(self, o):
            self.d["output"].append(o)

    c = triton_io.auto_complete(Cfg())
    assert c.policy == {"decoupled": True} and c.batch == 0
    assert [i["name"] for i in c.d["input"]] == list(triton_io.INPUT_NAMES)
    assert [o["name"] for o in c.d["output"]] == [o[0] for o in triton_io.OUTPUTS]
