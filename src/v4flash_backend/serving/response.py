"""Engine events -> the output tensors of `v4flash` responses (numpy, no pb_utils).

Every data response carries all of these, with these types (the v4flash_text ensemble
pairs the i-th outputs of its steps, so none may be missing from any response):

  output_ids          INT32  [n]  ids of this chunk (non-streamed: all; echo: prompt first)
  context_ids         INT32  [k]  the last k <= 8 committed ids before output_ids
  finish_reason       STRING [1]  "" until the last response: stop | length
  num_input_tokens    UINT32 [1]  prompt tokens
  num_output_tokens   UINT32 [1]  generated tokens in this response (vllm_backend: the new part)
  num_drafted_tokens  UINT32 [1]  DSpark draft tokens proposed since the previous response
  num_accepted_tokens UINT32 [1]  of those, accepted by verification
  text_output         STRING [1]  only when the request came as text_input: this chunk's text

The speculative counts are per-response deltas like num_output_tokens, so summing a
stream's responses gives the request's totals in both modes.

Engine events are dicts (the rank-group protocol): {"event": "chunk", "token_ids",
"context_ids", "finish_reason" (None while streaming), "num_prompt_tokens",
"num_output_tokens", "drafted", "accepted"} with cumulative counts, or {"event": "error",
"code", "message"}.
"""

from __future__ import annotations

import numpy as np

from v4flash_backend.request import GenerateRequest

from .detok import CONTEXT_IDS, StreamDetokenizer

OUTPUT_NAMES = ("output_ids", "context_ids", "finish_reason", "num_input_tokens", "num_output_tokens",
                "num_drafted_tokens", "num_accepted_tokens")


def _u32(value: int) -> np.ndarray:
    return np.array([value], dtype=np.uint32)


def _string(text: str) -> np.ndarray:
    return np.array([text.encode("utf-8")], dtype=np.object_)


class ResponseBuilder:
    """Per-request state between engine events and responses.

    ``on_chunk(event)`` returns the outputs to send now (a dict name -> array) or None
    (non-streamed requests send one response, at the final event).
    """

    def __init__(self, req: GenerateRequest, detok: StreamDetokenizer | None = None):
        self.req = req
        self.detok = detok if req.prompt_text is not None else None
        self.tokens: list[int] = []  # all generated ids so far
        self._sent_drafted = 0
        self._sent_accepted = 0
        self._unsent_from = 0  # first id of self.tokens not yet sent (non-streamed: all)

    def on_chunk(self, ev: dict) -> dict | None:
        new = [int(t) for t in ev.get("token_ids") or ()]
        self.tokens += new
        reason = ev.get("finish_reason") or ""
        if not self.req.stream and not reason:
            return None
        out_ids = self.tokens[self._unsent_from:]
        if self.req.stream:
            context = [int(t) for t in ev.get("context_ids") or ()]
        else:
            # Everything goes out at once: the context is the prompt's tail, or nothing
            # when the prompt itself leads output_ids.
            context = [] if self.req.echo else self.req.prompt[-CONTEXT_IDS:]
        self._unsent_from = len(self.tokens)
        drafted, accepted = int(ev.get("drafted", 0)), int(ev.get("accepted", 0))
        out = {
            "output_ids": np.array((self.req.prompt if self.req.echo else []) + out_ids, dtype=np.int32),
            "context_ids": np.array(context, dtype=np.int32),
            "finish_reason": _string(reason),
            "num_input_tokens": _u32(len(self.req.prompt)),
            "num_output_tokens": _u32(len(out_ids)),
            "num_drafted_tokens": _u32(max(0, drafted - self._sent_drafted)),
            "num_accepted_tokens": _u32(max(0, accepted - self._sent_accepted)),
        }
        self._sent_drafted, self._sent_accepted = max(drafted, self._sent_drafted), max(accepted, self._sent_accepted)
        if self.detok is not None:
            # The same exact stateless rule as the ensemble's postprocessing step: the
            # text of out_ids after their context, holding back an unfinished character
            # until the final response.
            text_context = self.req.prompt[-CONTEXT_IDS:] if not self.req.stream else context
            text = self.detok.delta(text_context, out_ids, final=bool(reason))
            if self.req.echo:
                text = self.req.prompt_text + text
            out["text_output"] = _string(text)
        return out
