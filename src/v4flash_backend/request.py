"""The one request type and the one error type, from the Triton parser to the engine.

`GenerateRequest` is what `serving.parse.RequestParser` builds from a Triton request, what the
rank-group client sends to rank 0 (`to_wire` / `from_wire`: the prompt ids and the sampling
fields as one JSON object, type-checked on arrival) and what the engine queues. A new sampling
option is one field here (with `wire=True` when rank 0 needs it) plus its parsing in
`serving.parse` and its use in the engine.

`RequestError` carries the Triton status code of every request failure: INVALID_ARG (the
request is wrong), UNAVAILABLE (the server cannot serve it now), CANCELLED, INTERNAL.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field, fields
from typing import Any, Callable

from v4flash_backend.settings import default_of

CODES = ("INVALID_ARG", "UNAVAILABLE", "CANCELLED", "INTERNAL")


class RequestError(ValueError):
    """A request failure with its Triton error code (one of CODES)."""

    def __init__(self, message: str, code: str = "INVALID_ARG"):
        super().__init__(message)
        self.message = message
        self.code = code


def invalid(message: str) -> RequestError:
    return RequestError(message, "INVALID_ARG")


def _wire(default, kind):
    """A sampling field that travels to rank 0; kind: its JSON type check."""
    return field(default=default, metadata={"wire": kind})


@dataclass
class GenerateRequest:
    """A validated request. Sampling fields travel to rank 0; the serving fields (how to answer)
    stay with the Triton model; the engine fields are set where the request is queued."""

    prompt: list[int]
    # ---- sampling (wire) ----
    max_tokens: int = _wire(default_of("default_max_tokens"), "int")
    temperature: float = _wire(0.0, "float")
    top_k: int = _wire(0, "int")
    top_p: float = _wire(1.0, "float")
    seed: int | None = _wire(None, "seed")
    stop_token_ids: tuple[int, ...] = _wire((), "ids")
    ignore_eos: bool = _wire(False, "bool")
    # vLLM's min_tokens: EOS and stop_token_ids are masked out of the distribution (target and
    # drafts alike) until this many tokens have been generated.
    min_tokens: int = _wire(0, "int")
    # OpenAI / vLLM penalties on the generated tokens so far (logits -= frequency * count +
    # presence * [count > 0]), applied to target and drafts alike (engine.sampling.apply_penalties).
    frequency_penalty: float = _wire(0.0, "float")
    presence_penalty: float = _wire(0.0, "float")
    # Log-probabilities of the generated tokens (vllm_backend's return_logprobs /
    # return_cumulative_logprob): -1 none; n >= 0 the sampled token's plus the n most likely.
    logprobs: int = _wire(-1, "int")
    # ---- serving ----
    prompt_text: str | None = None  # set when the request came as text_input
    # Stop strings (vLLM's `stop`, TRT-LLM's stop_words): matched on the detokenized output by
    # the serving side (serving.stop), which ends the request with finish_reason "stop".
    stop: tuple[str, ...] = ()
    return_logprobs: bool = False  # the `logprobs` output carries JSON, else "null"
    stream: bool = False
    echo: bool = False  # prepend the prompt to the (non-streamed) output
    # ---- engine ----
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    callback: Callable[[Any], None] | None = None  # engine events, from the engine's thread
    arrival: float = field(default_factory=time.monotonic)
    # the server's start-up request (serving.engine_rank_group): not traffic, so its steps ask a
    # background compile for no graph set (trn2.warmup.StepGate.traffic)
    warmup: bool = False

    def __post_init__(self):
        self.stop_token_ids = tuple(self.stop_token_ids)
        self.stop = tuple(self.stop)

    def sampling(self) -> dict:
        """The wire fields as a JSON-ready dict (what rank 0 receives as `params`)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if "wire" in f.metadata}
        out["stop_token_ids"] = list(out["stop_token_ids"])
        return out

    def to_wire(self) -> dict:
        return {"prompt_ids": [int(t) for t in self.prompt], "params": self.sampling()}

    @classmethod
    def from_wire(cls, prompt_ids, params, **engine_fields) -> "GenerateRequest":
        """A request from its wire form; raises RequestError (INVALID_ARG) naming a bad field."""
        if not isinstance(prompt_ids, list) or not all(_is_int(t) for t in prompt_ids):
            raise invalid("prompt_ids must be a list of integers")
        return cls(prompt=list(prompt_ids), **parse_wire_params(params), **engine_fields)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_WIRE_KINDS = {f.name: f.metadata["wire"] for f in fields(GenerateRequest) if "wire" in f.metadata}


def parse_wire_params(p) -> dict:
    """Type-check the `params` object of a wire request into GenerateRequest keyword arguments."""
    if p is None:
        return {}
    if not isinstance(p, dict):
        raise invalid("params must be an object")
    out = {}
    for k, v in p.items():
        kind = _WIRE_KINDS.get(k)
        if kind is None:
            raise invalid(f"unknown sampling parameter {k!r} (known: {', '.join(_WIRE_KINDS)})")
        if kind == "bool":
            ok = isinstance(v, bool)
        elif kind == "int":
            ok = _is_int(v)
        elif kind == "float":
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
            v = float(v) if ok else v
        elif kind == "seed":
            ok = v is None or _is_int(v)
        else:
            ok = isinstance(v, list) and all(_is_int(t) for t in v)
            v = tuple(v) if ok else v
        if not ok:
            raise invalid(f"sampling parameter {k!r} has the wrong type ({type(v).__name__})")
        out[k] = v
    return out
