"""The frontend's one link to the running tritonserver: a gRPC bidirectional stream per request to the
`v4flash` model (tritonclient's asyncio API), its responses as `Chunk`s.

Every request streams from Triton (stream=true, exclude_input_in_output=true), also for a
non-streamed OpenAI request (the frontend joins the chunks): one code path, and a client that
disconnects is cancelled the same way. Cancelling (leaving the iteration early, or the task being
cancelled) cancels the gRPC call; Triton passes the cancellation to the `v4flash` model, whose
engine frees the request's KV slot at its next step (docs/serving.md, "Errors"). The model is `v4flash`
itself, not the `v4flash_text` ensemble: Triton 2.51 does not pass a cancellation on to an
ensemble's running step (triton-inference-server/core#263).

`enable_empty_final_response` makes Triton mark the last response (parameter
`triton_final_response`), so the stream's end is known without waiting for the call to close.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import AsyncIterator

import numpy as np

from .errors import APIError, from_backend, unavailable


@dataclass
class GenerateParams:
    """One request to the `v4flash` model."""

    sampling: dict  # the sampling_parameters JSON
    prompt_text: str | None = None
    prompt_ids: list[int] | None = None
    return_logprobs: bool = False
    add_special_tokens: bool | None = None  # None: the model's add_special_tokens setting


@dataclass
class Chunk:
    """One Triton response (counts are this response's, as the model sends them)."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "" until the last: stop | length
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    drafted: int
    accepted: int
    logprobs: list[dict] | None = field(default=None)  # per token: {id: {logprob, rank, decoded_token}}


def build_inputs(p: GenerateParams) -> list:
    import tritonclient.grpc.aio as grpcclient

    def add(name, dtype, arr):
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        inputs.append(t)

    inputs: list = []
    if p.prompt_text is not None:
        add("text_input", "BYTES", np.array([p.prompt_text.encode("utf-8")], dtype=np.object_))
    else:
        add("input_ids", "INT32", np.asarray(p.prompt_ids, dtype=np.int32))
    add("stream", "BOOL", np.array([True]))
    add("exclude_input_in_output", "BOOL", np.array([True]))
    add("sampling_parameters", "BYTES", np.array([json.dumps(p.sampling).encode()], dtype=np.object_))
    if p.return_logprobs:
        add("return_logprobs", "BOOL", np.array([True]))
    if p.add_special_tokens is not None:
        add("add_special_tokens", "BOOL", np.array([p.add_special_tokens]))
    return inputs


def _first(result, name, default=0):
    arr = result.as_numpy(name)
    return default if arr is None or arr.size == 0 else arr.reshape(-1)[0]


def parse_chunk(result) -> Chunk:
    ids = result.as_numpy("output_ids")
    text = _first(result, "text_output", b"")
    lp = _first(result, "logprobs", b"null")
    lp = json.loads(lp.decode() if isinstance(lp, bytes) else lp)
    reason = _first(result, "finish_reason", b"")
    return Chunk(
        text=text.decode("utf-8") if isinstance(text, bytes) else str(text),
        token_ids=[] if ids is None else [int(t) for t in ids.reshape(-1)],
        finish_reason=reason.decode() if isinstance(reason, bytes) else str(reason),
        prompt_tokens=int(_first(result, "num_input_tokens")), cached_tokens=int(_first(result, "num_cached_tokens")),
        completion_tokens=int(_first(result, "num_output_tokens")),
        drafted=int(_first(result, "num_drafted_tokens")), accepted=int(_first(result, "num_accepted_tokens")),
        logprobs=lp)


class TritonBackend:
    """``generate(params)`` yields the Chunks of one request; raises APIError for an error Triton answers
    (`errors.from_backend`) or for a server it cannot reach (503)."""

    def __init__(self, url: str, model: str = "v4flash"):
        self.url, self.model = url, model
        self._client = None

    def _get(self):
        if self._client is None:  # made inside the running event loop (grpc.aio binds to it)
            import tritonclient.grpc.aio as grpcclient

            self._client = grpcclient.InferenceServerClient(self.url)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def ready(self) -> bool:
        try:
            return bool(await self._get().is_model_ready(self.model))
        except Exception:
            return False

    async def generate(self, params: GenerateParams, rename: dict | None = None) -> AsyncIterator[Chunk]:
        import grpc

        inputs = build_inputs(params)

        async def requests():
            yield {"model_name": self.model, "inputs": inputs,
                   "parameters": {"triton_enable_empty_final_response": True}}

        stream = self._get().stream_infer(requests())
        finished = False
        try:
            async for result, error in stream:
                if error is not None:
                    finished = True
                    raise from_backend(str(error), rename)
                response = result.get_response()
                final = "triton_final_response" in response.parameters and \
                    response.parameters["triton_final_response"].bool_param
                finished = finished or final
                if response.outputs:
                    yield parse_chunk(result)
                if final:
                    return
            finished = True
            raise unavailable("Triton closed the stream before the final response")
        except grpc.aio.AioRpcError as exc:
            finished = True
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                raise unavailable(f"Triton at {self.url} is not reachable ({exc.details()})") from None
            raise APIError(502, f"Triton stream failed: {exc.code().name}: {exc.details()}", type="server_error",
                           code="upstream_error") from None
        finally:
            if not finished:  # the caller left early (a client gone, a stop): cancel on the server
                stream.cancel()
