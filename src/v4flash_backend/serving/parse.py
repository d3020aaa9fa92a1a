"""Parsing one `v4flash` request (numpy inputs -> `GenerateRequest`): typed inputs and JSON are
parsed and converted here; the values are then checked by the engine's own rules
(`engine.validation`), so a bad request gets the engine's message without a round trip.

Inputs (config.pbtxt of model_repository/v4flash, declared in serving/triton_io.py; exactly one
of the first two):
  input_ids INT32 [-1] | text_input STRING [1]
  stream BOOL [1], exclude_input_in_output BOOL [1], sampling_parameters STRING [1] (JSON)
  max_tokens INT32 [1], temperature FP32 [1], top_p FP32 [1], top_k INT32 [1],
  seed UINT64 [1], stop_token_ids INT32 [-1], ignore_eos BOOL [1], min_tokens INT32 [1]
  stop_words STRING [-1], frequency_penalty / presence_penalty FP32 [1]: TRT-LLM's names
  return_{finish_reason,cumulative_logprob,logprobs,num_input_tokens,num_output_tokens} BOOL [1]
  add_special_tokens BOOL [1]: text_input tokenized with / without BOS (absent: the model's setting)

Sampling values come from, highest priority first: the typed inputs, the
``sampling_parameters`` JSON object (vllm_backend's name and format), then the request
parameters (what HTTP ``generate`` makes of unknown keys; only the sampling keys below
are read from there, other request parameters are not ours to judge).

``exclude_input_in_output`` follows vllm_backend (utils/request.py): absent, the prompt is
echoed in non-streamed output only; false while streaming is an error.

Every problem raises `RequestError` (v4flash_backend.request) with code INVALID_ARG and a message that names the
input and the value; nothing here talks to the engine (engine.validation is torch-free).
"""

from __future__ import annotations

import json
import math
from typing import Callable

import numpy as np

from v4flash_backend.engine.validation import check_prompt, check_sampling
from v4flash_backend.request import GenerateRequest, invalid
from v4flash_backend.settings import default_of


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
# vllm_backend (utils/vllm_backend_utils.py, TritonSamplingParams.from_dict) converts every value
# by the field's type, so clients send numbers as JSON strings (genai-perf's vllm mode sends
# {"max_tokens": "64", "min_tokens": "64"}): a string is converted the same way here, and a value
# that does not convert is an INVALID_ARG naming the key. Booleans are parsed as words ("false" is
# false; Python's bool("false") in vllm_backend would be true).
def _json_int(value, name):
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            raise invalid(f"{name} must be an integer, got {value!r}") from None
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or (isinstance(value, float) and not (math.isfinite(value) and value.is_integer()))):
        raise invalid(f"{name} must be an integer, got {value!r}")
    return int(value)


def _json_float(value, name):
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise invalid(f"{name} must be a number, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise invalid(f"{name} must be a number, got {value!r}")
    return float(value)


_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}


def _json_bool(value, name):
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    if not isinstance(value, bool):
        raise invalid(f"{name} must be true or false, got {value!r}")
    return value


def _json_list(value, name):
    if isinstance(value, str):  # a list sent as its JSON text, like every other value
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise invalid(f"{name} must be a list, got {value!r}") from None
    if not isinstance(value, list):
        raise invalid(f"{name} must be a list, got {value!r}")
    return value


def _json_ids(value, name):
    return [_json_int(v, name) for v in _json_list(value, name)]


def _json_stop(value, name):
    """vLLM's `stop`: one string or a list of strings."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise invalid(f"{name} must be a string or a list of strings, got {value!r}")
    return value


def _json_one(value, name):
    if _json_int(value, name) != 1:
        raise invalid(f"{name} must be 1 (one sequence per request), got {value!r}")
    return 1


def _json_logit_bias(value, name):
    if value not in ({}, None, "{}"):
        raise invalid(f"{name} is not supported, got {value!r}")
    return None


_JSON_PARSERS = {
    "max_tokens": _json_int, "temperature": _json_float, "top_p": _json_float, "top_k": _json_int,
    "seed": _json_int, "stop_token_ids": _json_ids, "ignore_eos": _json_bool,
    "min_tokens": _json_int, "stop": _json_stop, "logprobs": _json_int,
    # what Triton's OpenAI frontend puts in sampling_parameters for every request (vllm format,
    # engine/utils/triton.py _create_vllm_generate_request: the OpenAI request's non-None fields)
    "n": _json_one, "frequency_penalty": _json_float, "presence_penalty": _json_float,
    "logit_bias": _json_logit_bias,
}
SAMPLING_KEYS = tuple(_JSON_PARSERS)
_TENSOR_PARSERS = {
    "max_tokens": _int_input, "temperature": _float_input, "top_p": _float_input, "top_k": _int_input,
    "seed": _int_input, "ignore_eos": _bool_input, "min_tokens": _int_input,
    "stop_token_ids": lambda arr, name: [int(v) for v in _check_kind(arr, name, "iu", "INT32").reshape(-1)],
    # TRT-LLM format (the OpenAI frontend's _create_trtllm_generate_request): stop_words STRING [-1]
    "stop_words": lambda arr, name: _strings(arr, name),
    "frequency_penalty": _float_input, "presence_penalty": _float_input,
}
# BOOL inputs that only ask for outputs this model always sends (vllm_backend's return_* inputs);
# return_logprobs / return_cumulative_logprob also switch the engine's log-prob computation on.
RETURN_FLAGS = ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens",
                "return_logprobs", "return_cumulative_logprob")


def _strings(arr, name) -> list[str]:
    out = []
    for value in np.asarray(arr, dtype=object).reshape(-1):
        if isinstance(value, str):
            out.append(value)
            continue
        try:
            out.append(bytes(value).decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise invalid(f"{name} is not valid UTF-8: {exc}") from None
    return out


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
    text_input (None: text_input is refused), called as ``tokenize(text)`` (the model's own
    add_special_tokens setting) or, when the request has the add_special_tokens input,
    ``tokenize(text, add_special_tokens)``.
    """

    def __init__(self, vocab_size: int, max_model_len: int, default_max_tokens: int = default_of("default_max_tokens"),
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
            add = _bool_input(inputs["add_special_tokens"], "add_special_tokens") \
                if "add_special_tokens" in inputs else None
            if not prompt_text:
                prompt = []
            else:
                prompt = list(self.tokenize(prompt_text) if add is None else self.tokenize(prompt_text, add))
            if not prompt:
                raise invalid("text_input is empty: the prompt needs at least one token")
        check_prompt(prompt, self.vocab_size, self.max_model_len)

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
                values["stop" if key == "stop_words" else key] = parse(inputs[key], key)
        flags = {k: _bool_input(inputs[k], k) for k in RETURN_FLAGS if k in inputs}
        req = GenerateRequest(prompt=prompt, prompt_text=prompt_text, stream=stream, echo=echo,
                              max_tokens=self.default_max_tokens)
        self._apply_sampling(req, values)
        check_sampling(req, self.vocab_size)  # the engine's own checks, answered here without a round trip
        req.return_logprobs = flags.get("return_logprobs", False)
        if req.logprobs < 0 and (req.return_logprobs or flags.get("return_cumulative_logprob")):
            req.logprobs = 0  # the sampled token's log-prob only
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

    @staticmethod
    def _apply_sampling(req: GenerateRequest, v: dict) -> None:
        """The parsed values onto `req`, converted to the engine's spelling (checked afterwards by
        engine.validation.check_sampling)."""
        for key in ("max_tokens", "temperature", "top_p", "seed", "min_tokens", "frequency_penalty",
                    "presence_penalty", "logprobs"):
            if key in v:
                setattr(req, key, v[key])
        if "top_k" in v:
            req.top_k = 0 if v["top_k"] == -1 else v["top_k"]  # -1 is vLLM's "disabled", 0 the engine's
        if "stop_token_ids" in v:
            req.stop_token_ids = tuple(v["stop_token_ids"])
        if "ignore_eos" in v:
            req.ignore_eos = bool(v["ignore_eos"])
        if "stop" in v:
            req.stop = tuple(t for t in v["stop"] if t)  # an empty string would match everywhere
