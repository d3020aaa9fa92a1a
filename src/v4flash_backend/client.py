"""A small streaming client for the v4flash models over Triton's gRPC API.

    from v4flash_backend.client import generate
    for chunk in generate("Hello", url="127.0.0.1:8001", max_tokens=32):
        print(chunk.text, end="", flush=True)

or from a shell:  python -m v4flash_backend.client "Hello" --max-tokens 32

`generate` sends one request on its own gRPC stream (tritonclient allows one stream per
client object, so concurrent calls do not interfere) and yields a `Chunk` per response.
Models: "v4flash" (the default: text or token ids in; ids, and text for text requests, out)
and "v4flash_text" (the ensemble: text in, text out). Leaving the loop early (break, an
exception) cancels the request; on "v4flash" that frees its KV slot at once, while Triton 2.51
does not pass the cancellation on to the running step of the ensemble (docs/serving.md).
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

# Typed optional inputs: name -> (Triton datatype, numpy dtype).
_TYPED = {
    "max_tokens": ("INT32", np.int32), "temperature": ("FP32", np.float32), "top_p": ("FP32", np.float32),
    "top_k": ("INT32", np.int32), "seed": ("UINT64", np.uint64), "ignore_eos": ("BOOL", np.bool_),
    "stop_token_ids": ("INT32", np.int32),
}


class GenerateError(RuntimeError):
    """The server answered the request with an error (message as the server sent it)."""


@dataclass
class Chunk:
    """One streamed response."""

    output_ids: list[int]
    text: str | None  # text_output, when the model sends it
    finish_reason: str  # "" until the last chunk
    num_input_tokens: int
    num_output_tokens: int
    num_drafted_tokens: int
    num_accepted_tokens: int
    num_cached_tokens: int = 0  # prompt tokens the prefix cache restored (not prefilled)
    time: float = field(default_factory=time.monotonic)  # when it arrived (monotonic clock)


def _first(result, name, default=None):
    arr = result.as_numpy(name)
    if arr is None or arr.size == 0:
        return default
    return arr.reshape(-1)[0]


def _chunk(result) -> Chunk:
    ids = result.as_numpy("output_ids")
    text = _first(result, "text_output")
    reason = _first(result, "finish_reason", b"")
    return Chunk(
        output_ids=[] if ids is None else [int(t) for t in ids.reshape(-1)],
        text=None if text is None else text.decode("utf-8"),
        finish_reason=reason.decode("utf-8") if isinstance(reason, bytes) else str(reason),
        num_input_tokens=int(_first(result, "num_input_tokens", 0)),
        num_output_tokens=int(_first(result, "num_output_tokens", 0)),
        num_drafted_tokens=int(_first(result, "num_drafted_tokens", 0)),
        num_accepted_tokens=int(_first(result, "num_accepted_tokens", 0)),
        num_cached_tokens=int(_first(result, "num_cached_tokens", 0)),
    )


def build_inputs(prompt: str | None = None, input_ids: Sequence[int] | None = None, *, stream: bool = True,
                 exclude_input_in_output: bool | None = None, sampling_parameters: dict | None = None,
                 **typed) -> list:
    """The tritonclient.grpc InferInputs of one request (exactly one of prompt / input_ids)."""
    import tritonclient.grpc as grpcclient

    def add(name, dtype, value):
        arr = np.asarray(value)
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        inputs.append(t)

    inputs: list = []
    if (prompt is None) == (input_ids is None):
        raise ValueError("give exactly one of prompt and input_ids")
    if prompt is not None:
        add("text_input", "BYTES", np.array([prompt.encode("utf-8")], dtype=np.object_))
    else:
        add("input_ids", "INT32", np.asarray(list(input_ids), dtype=np.int32))
    add("stream", "BOOL", np.array([stream]))
    if exclude_input_in_output is not None:
        add("exclude_input_in_output", "BOOL", np.array([exclude_input_in_output]))
    if sampling_parameters is not None:
        add("sampling_parameters", "BYTES", np.array([json.dumps(sampling_parameters).encode()], dtype=np.object_))
    for name, value in typed.items():
        if value is None:
            continue
        if name not in _TYPED:
            raise TypeError(f"unknown input {name!r}; typed inputs: {', '.join(_TYPED)}")
        dtype, np_dtype = _TYPED[name]
        shape_value = list(value) if name == "stop_token_ids" else [value]
        add(name, dtype, np.asarray(shape_value, dtype=np_dtype))
    return inputs


def generate(prompt: str | None = None, input_ids: Sequence[int] | None = None, *, url: str = "127.0.0.1:8001",
             model: str = "v4flash", stream: bool = True, exclude_input_in_output: bool | None = None,
             sampling_parameters: dict | None = None, timeout_s: float = 600.0, **typed) -> Iterator[Chunk]:
    """Yield the responses of one request; raises GenerateError if the server answers an error.

    ``typed``: max_tokens, temperature, top_p, top_k, seed, stop_token_ids, ignore_eos.
    """
    import tritonclient.grpc as grpcclient

    inputs = build_inputs(prompt, input_ids, stream=stream, exclude_input_in_output=exclude_input_in_output,
                          sampling_parameters=sampling_parameters, **typed)
    events: queue.Queue = queue.Queue()

    def callback(result, error):
        events.put((result, error, time.monotonic()))

    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=callback)
    finished = False
    try:
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                result, error, t = events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"no final response within {timeout_s} s") from None
            if error is not None:
                finished = True
                raise GenerateError(str(error.message() if hasattr(error, "message") else error))
            response = result.get_response()
            final = "triton_final_response" in response.parameters and \
                response.parameters["triton_final_response"].bool_param
            if response.outputs:
                chunk = _chunk(result)
                chunk.time = t
                if final:
                    finished = True
                yield chunk
            if final:
                finished = True
                return
    finally:
        # Unfinished (the caller stopped early): cancel it on the server, freeing its slot.
        client.stop_stream(cancel_requests=not finished)
        client.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m v4flash_backend.client",
                                 description="stream one generation from a v4flash Triton server (gRPC)")
    ap.add_argument("prompt", nargs="?", help="prompt text (or --input-ids)")
    ap.add_argument("--input-ids", help="token ids, comma separated (model v4flash)")
    ap.add_argument("--url", default="127.0.0.1:8001")
    ap.add_argument("--model", default="v4flash", help="v4flash (default) or v4flash_text (text only)")
    ap.add_argument("--max-tokens", type=int)
    ap.add_argument("--temperature", type=float)
    ap.add_argument("--top-p", type=float)
    ap.add_argument("--top-k", type=int)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--ignore-eos", action="store_true", default=None)
    ap.add_argument("--no-stream", action="store_true", help="one response at the end")
    args = ap.parse_args(argv)
    ids = [int(t) for t in args.input_ids.replace(",", " ").split()] if args.input_ids else None
    if (args.prompt is None) == (ids is None):
        ap.error("give a prompt or --input-ids")
    model = args.model
    t0 = time.monotonic()
    first = last = None
    n = drafted = accepted = 0
    reason = ""
    try:
        for c in generate(args.prompt, ids, url=args.url, model=model, stream=not args.no_stream,
                          exclude_input_in_output=True, max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos):
            sys.stdout.write(c.text if c.text is not None else " ".join(map(str, c.output_ids)) + " ")
            sys.stdout.flush()
            first = first or c.time
            last = c.time
            n += c.num_output_tokens
            drafted += c.num_drafted_tokens
            accepted += c.num_accepted_tokens
            reason = c.finish_reason or reason
    except GenerateError as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    decode = (last - first) if first is not None and last is not None else 0.0
    print(f"\n[finish_reason={reason} tokens={n} ttft_s={(first or t0) - t0:.3f} "
          f"decode_tok_s={(n - 1) / decode if n > 1 and decode > 0 else 0:.1f} drafted={drafted} accepted={accepted}]",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
