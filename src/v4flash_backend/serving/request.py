"""Parsing and validating one `v4flash` request (numpy inputs -> `GenerateRequest`).

Inputs (config.pbtxt of model_repository/v4flash; exactly one of the first two):
  input_ids INT32 [-1] | text_input STRING [1]
  stream BOOL [1], exclude_input_in_output BOOL [1], sampling_parameters STRING [1] (JSON)
  max_tokens INT32 [1], temperature FP32 [1], top_p FP32 [1], top_k INT32 [1],
  seed UINT64 [1], stop_token_ids INT32 [-1], ignore_eos BOOL [1]

Sampling values come from, highest priority first: the typed inputs, the
``sampling_parameters`` JSON object (vllm_backend's name and format), then the request
parameters (what HTTP ``generate`` makes of unknown keys; only the sampling keys below
are read from there, other request parameters are not ours to judge).

``exclude_input_in_output`` follows vllm_backend (utils/request.py): absent, the prompt is
echoed in non-streamed output only; false while streaming is an error.

Every problem raises `RequestError` (v4flash_backend.request) with code INVALID_ARG and a message that names the
input and the value; nothing here talks to the engine.
"""

from __future__ import annotations

import json
import math
from typing import Callable

import numpy as np

from v4flash_backend.request import GenerateRequest, invalid

# Keys accepted in sampling_parameters / request parameters, and the JSON type each takes.
SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos",
                 "min_tokens")
_UINT64_MAX = 2**64 - 1


# ---- typed tensors ---------------------------------------------------------------------------
def _scalar(arr: np.ndarray, name: str):
    flat = np.asarray(arr).reshape(-1)
    if flat.size != 1:
        raise invalid(f"{name} must hold exactly one value, got {flat.size}")
    return flat[0]


def _check_kind(arr: np.ndarray, name: str, kinds: str, what: str) -> np.ndarray:
    # Triton checks datatypes against config.pbtxt before a request reaches the model;
    # this guards direct callers (tests, a config edited by hand).
    arr = np.asarray(arr)
    if arr.dtype.kind not in kinds:
        raise invalid(f"{name} must be {what}, got dtype {arr.dtype}")
    return arr


def _bool_input(arr, name):
    return bool(_scalar(_check_kind(arr, name, "b", "BOOL"), name))


def _int_input(arr, name):
    return int(_scalar(_check_kind(arr, name, "iu", "an integer tensor"), name))


def _float_input(arr, name):
    return float(_scalar(_check_kind(arr, name, "f", "a floating-point tensor"), name))


def _string(arr, name) -> str:
    value = _scalar(np.asarray(arr, dtype=object), name)
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid(f"{name} is not valid UTF-8: {exc}") from None


# ---- JSON values -----------------------------------------------------------------------------
def _json_int(value, name):
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or (isinstance(value, float) and not (math.isfinite(value) and value.is_integer()))):
        raise invalid(f"{name} must be an integer, got {value!r}")
    return int(value)


def _json_float(value, name):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(f"{name} must be a number, got {value!r}")
    return float(value)


def _json_bool(value, name):
    if not isinstance(value, bool):
        raise invalid(f"{name} must be true or false, got {value!r}")
    return value


def _json_ids(value, name):
    if not isinstance(value, list):
        raise invalid(f"{name} must be a list of token ids, got {value!r}")
    return [_json_int(v, name) for v in value]


_JSON_PARSERS = {
    "max_tokens": _json_int, "temperature": _json_float, "top_p": _json_float, "top_k": _json_int,
    "seed": _json_int, "stop_token_ids": _json_ids, "ignore_eos": _json_bool,
    # vLLM's min_tokens, as genai-perf's vllm mode sends it (min_tokens = max_tokens for a fixed
    # output length): supported as 0 and as max_tokens, which is ignore_eos.
    "min_tokens": _json_int,
}
_TENSOR_PARSERS = {
    "max_tokens": _int_input, "temperature": _float_input, "top_p": _float_input, "top_k": _int_input,
    "seed": _int_input, "ignore_eos": _bool_input,
    "stop_token_ids": lambda arr, name: [int(v) for v in _check_kind(arr, name, "iu", "INT32").reshape(-1)],
}


def parse_sampling_json(text: str) -> dict:
    """The ``sampling_parameters`` object, typed; unknown keys are an error (a typo such as
    "max_token" would otherwise silently generate the default length)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise invalid(f"sampling_parameters is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise invalid(f"sampling_parameters must be a JSON object, got {type(obj).__name__}")
    unknown = sorted(k for k in obj if k not in _JSON_PARSERS)
    if unknown:
        raise invalid(f"sampling_parameters has unsupported key(s) {', '.join(map(repr, unknown))}; "
                      f"supported: {', '.join(SAMPLING_KEYS)}")
    return {k: _JSON_PARSERS[k](v, f"sampling_parameters.{k}") for k, v in obj.items() if v is not None}


def parse_request_parameters(text: str | None) -> dict:
    """Sampling keys among the request parameters (other keys are left alone)."""
    if not text:
        return {}
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return {}  # Triton produced it; nothing the client can fix
    if not isinstance(obj, dict):
        return {}
    return {k: _JSON_PARSERS[k](v, f"parameter {k}") for k, v in obj.items() if k in _JSON_PARSERS}


class RequestParser:
    """Turns the inputs of one request into a validated `GenerateRequest`.

    vocab_size / max_model_len: the served model's limits; tokenize: text -> ids for
    text_input (None: text_input is refused).
    """

    def __init__(self, vocab_size: int, max_model_len: int, default_max_tokens: int = 64,
                 tokenize: Callable[[str], list[int]] | None = None):
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.default_max_tokens = default_max_tokens
        self.tokenize = tokenize

    def parse(self, inputs: dict[str, np.ndarray], parameters: str | None = None) -> GenerateRequest:
        has_ids, has_text = "input_ids" in inputs, "text_input" in inputs
        if has_ids == has_text:
            raise invalid("give exactly one of input_ids (INT32 token ids) and text_input (STRING), got "
                          + ("both" if has_ids else "neither"))
        prompt_text = None
        if has_ids:
            ids = _check_kind(inputs["input_ids"], "input_ids", "iu", "INT32 token ids")
            prompt = [int(v) for v in ids.reshape(-1)]
            if not prompt:
                raise invalid("input_ids is empty: the prompt needs at least one token")
        else:
            if self.tokenize is None:
                raise invalid("text_input is not supported by this model (no tokenizer); send input_ids")
            prompt_text = _string(inputs["text_input"], "text_input")
            # Decided: an empty text is refused (as vLLM does) before tokenization, not served
            # as the BOS-only prompt the tokenizer would make of it.
            prompt = list(self.tokenize(prompt_text)) if prompt_text else []
            if not prompt:
                raise invalid("text_input is empty: the prompt needs at least one token")
        self._check_prompt(prompt)

        stream = _bool_input(inputs["stream"], "stream") if "stream" in inputs else False
        if "exclude_input_in_output" in inputs:
            echo = not _bool_input(inputs["exclude_input_in_output"], "exclude_input_in_output")
        else:
            echo = not stream
        if echo and stream:
            raise invalid("exclude_input_in_output=false is not supported with stream=true "
                          "(the prompt is echoed only in non-streamed output)")

        values = parse_request_parameters(parameters)
        if "sampling_parameters" in inputs:
            values.update(parse_sampling_json(_string(inputs["sampling_parameters"], "sampling_parameters")))
        for key, parse in _TENSOR_PARSERS.items():
            if key in inputs:
                values[key] = parse(inputs[key], key)
        req = GenerateRequest(prompt=prompt, prompt_text=prompt_text, stream=stream, echo=echo,
                              max_tokens=self.default_max_tokens)
        self._apply_sampling(req, values)
        self._fit_max_tokens(req, explicit="max_tokens" in values)
        return req

    def _fit_max_tokens(self, req: GenerateRequest, explicit: bool) -> None:
        """Decided: a max_tokens the client asked for that does not fit in max_model_len beside
        the prompt is refused (vLLM's rule) rather than cut silently; the default
        (default_max_tokens) is capped to what fits, as vLLM does when max_tokens is unset."""
        room = self.max_model_len - len(req.prompt)
        if req.max_tokens <= room:
            return
        if explicit:
            raise invalid(f"max_tokens {req.max_tokens} does not fit: the prompt has {len(req.prompt)} tokens and "
                          f"max_model_len is {self.max_model_len}, so at most {room} can be generated")
        req.max_tokens = room

    def _check_prompt(self, prompt: list[int]) -> None:
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise invalid(f"token id {bad[0]} in the prompt is outside the vocabulary [0, {self.vocab_size})")
        if len(prompt) >= self.max_model_len:
            raise invalid(f"prompt has {len(prompt)} tokens; max_model_len is {self.max_model_len} "
                          "(prompt + at least one generated token must fit)")

    def _apply_sampling(self, req: GenerateRequest, v: dict) -> None:
        if "max_tokens" in v:
            if v["max_tokens"] <= 0:
                raise invalid(f"max_tokens must be > 0, got {v['max_tokens']}")
            req.max_tokens = v["max_tokens"]
        if "temperature" in v:
            t = v["temperature"]
            if not (t >= 0 and math.isfinite(t)):
                raise invalid(f"temperature must be >= 0, got {t}")
            req.temperature = t
        if "top_p" in v:
            p = v["top_p"]
            if not 0 < p <= 1:
                raise invalid(f"top_p must be in (0, 1], got {p}")
            req.top_p = p
        if "top_k" in v:
            k = v["top_k"]
            if k < -1:
                raise invalid(f"top_k must be >= 0 (0 or -1: disabled), got {k}")
            req.top_k = max(k, 0)  # -1 is vLLM's "disabled", 0 the engine's
        if "seed" in v:
            if not 0 <= v["seed"] <= _UINT64_MAX:
                raise invalid(f"seed must be in [0, 2**64), got {v['seed']}")
            req.seed = v["seed"]
        if "stop_token_ids" in v:
            bad = [t for t in v["stop_token_ids"] if not 0 <= t < self.vocab_size]
            if bad:
                raise invalid(f"stop token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
            req.stop_token_ids = tuple(v["stop_token_ids"])
        if "ignore_eos" in v:
            req.ignore_eos = bool(v["ignore_eos"])
        if v.get("min_tokens"):
            if v["min_tokens"] != req.max_tokens:
                raise invalid(f"min_tokens must be 0 or equal to max_tokens ({req.max_tokens}), got "
                              f"{v['min_tokens']}: the engine stops only at EOS, stop ids or max_tokens")
            req.ignore_eos = True
