"""Engine events -> the output tensors of `v4flash` responses (numpy, no pb_utils).

Every data response carries all of these, with these types (the v4flash_text ensemble
pairs the i-th outputs of its steps, so none may be missing from any response):

  output_ids          INT32  [n]  ids of this chunk (non-streamed: all; echo: prompt first)
  context_ids         INT32  [k]  the last k <= 8 committed ids before output_ids
  finish_reason       STRING [1]  "" until the last response: stop | length
  num_input_tokens    UINT32 [1]  prompt tokens
  num_cached_tokens   UINT32 [1]  of those, restored from the prefix cache (not prefilled)
  num_output_tokens   UINT32 [1]  generated tokens in this response (vllm_backend: the new part)
  num_drafted_tokens  UINT32 [1]  DSpark draft tokens proposed since the previous response
  num_accepted_tokens UINT32 [1]  of those, accepted by verification
  text_trim           UINT32 [1]  characters to cut from the end of this response's text: non-zero
                                  only in the last response of a request ended by a stop string
                                  (the stop string and the rest of the id that completed it)
  logprobs            STRING [1]  vllm_backend's JSON per id of this response, "null" unless the
                                  request set return_logprobs
  cumulative_logprob  FP32   [1]  sum of the log-probs of the ids sent so far (0 unless log-probs
                                  were asked for: return_logprobs, return_cumulative_logprob or
                                  sampling_parameters.logprobs)
  text_output         STRING [1]  only when the request came as text_input: this chunk's text

The speculative counts are per-response deltas like num_output_tokens, so summing a
stream's responses gives the request's totals in both modes.

Engine events are dicts (the rank-group protocol): {"event": "chunk", "token_ids",
"context_ids", "finish_reason" (None while streaming), "num_prompt_tokens", "num_cached_tokens",
"num_output_tokens", "drafted", "accepted"} with cumulative counts, or {"event": "error",
"code", "message"}.
"""

from __future__ import annotations

import json

import numpy as np

from v4flash_backend.request import GenerateRequest, RequestError

from .detok import CONTEXT_IDS, StreamDetokenizer
from .stop import StopMatcher

OUTPUT_NAMES = ("output_ids", "context_ids", "finish_reason", "num_input_tokens", "num_cached_tokens",
                "num_output_tokens",
                "num_drafted_tokens", "num_accepted_tokens", "text_trim", "logprobs", "cumulative_logprob")


def _u32(value: int) -> np.ndarray:
    return np.array([value], dtype=np.uint32)


def _string(text: str) -> np.ndarray:
    return np.array([text.encode("utf-8")], dtype=np.object_)


class ResponseBuilder:
    """Per-request state between engine events and responses.

    ``on_chunk(event)`` returns (outputs to send now or None, finish_reason): non-streamed requests
    send one response, at the end; a stop-string request holds back the ids that might begin a
    stop string, and ends with finish_reason "stop" as soon as one occurs, before the engine does
    (``stopped_early``: the caller cancels the engine request).
    """

    def __init__(self, req: GenerateRequest, detok: StreamDetokenizer | None = None):
        self.req = req
        self.detok = detok if req.prompt_text is not None else None  # text_output only for text_input
        self._pieces = detok  # decoded_token of the logprobs output
        self.tokens: list[int] = []  # all generated ids so far
        self.logprobs: list = []  # per generated id, when the engine computed them
        self._sent_drafted = 0
        self._sent_accepted = 0
        self._unsent_from = 0  # first id of self.tokens not yet sent (non-streamed: all)
        self.stopped_early = False
        self.stop = None
        if req.stop:
            if detok is None:
                raise RequestError("stop strings need the model's tokenizer (none is loaded)")
            self.stop = StopMatcher(detok, req.stop, req.min_tokens)

    def on_chunk(self, ev: dict) -> tuple[dict | None, str]:
        new = [int(t) for t in ev.get("token_ids") or ()]
        self.tokens += new
        if ev.get("logprobs"):
            self.logprobs += ev["logprobs"]
        reason = ev.get("finish_reason") or ""
        release = len(self.tokens)
        trim = 0
        if self.stop is not None:
            match = self.stop.push(new)
            if match is not None:
                release, trim = match.num_tokens, match.trim
                self.stopped_early = not reason
                reason = "stop"
            elif not reason:
                release = self.stop.releasable()
        if not reason and (not self.req.stream or release == self._unsent_from):
            return None, ""  # nothing to send yet (not streamed, or every new id is held back)
        out_ids = self.tokens[self._unsent_from:release]
        if self.req.stream:
            # the last committed ids before out_ids (prompt ids for the first chunk): what the
            # stateless detokenization needs, also when held-back ids regroup the engine's chunks
            context = (self.req.prompt + self.tokens[:self._unsent_from])[-CONTEXT_IDS:]
        else:
            # Everything goes out at once: the context is the prompt's tail, or nothing
            # when the prompt itself leads output_ids.
            context = [] if self.req.echo else self.req.prompt[-CONTEXT_IDS:]
        lps = self.logprobs[self._unsent_from:release]
        self._unsent_from = release
        drafted, accepted = int(ev.get("drafted", 0)), int(ev.get("accepted", 0))
        out = {
            "output_ids": np.array((self.req.prompt if self.req.echo else []) + out_ids, dtype=np.int32),
            "context_ids": np.array(context, dtype=np.int32),
            "finish_reason": _string(reason),
            "num_input_tokens": _u32(len(self.req.prompt)),
            "num_cached_tokens": _u32(int(ev.get("num_cached_tokens", 0))),
            "num_output_tokens": _u32(len(out_ids)),
            "num_drafted_tokens": _u32(max(0, drafted - self._sent_drafted)),
            "num_accepted_tokens": _u32(max(0, accepted - self._sent_accepted)),
            "text_trim": _u32(trim),
            "logprobs": _string(self._logprobs_json(out_ids, lps)),
            "cumulative_logprob": np.array([sum(x[0] for x in self.logprobs[:release])], dtype=np.float32),
        }
        self._sent_drafted, self._sent_accepted = max(drafted, self._sent_drafted), max(accepted, self._sent_accepted)
        if self.detok is not None:
            # The same exact stateless rule as the ensemble's postprocessing step: the
            # text of out_ids after their context, holding back an unfinished character
            # until the final response, less the stop string at the end.
            text_context = self.req.prompt[-CONTEXT_IDS:] if not self.req.stream else context
            text = self.detok.delta(text_context, out_ids, final=bool(reason))
            text = text[:len(text) - trim] if trim else text
            if self.req.echo:
                text = self.req.prompt_text + text
            out["text_output"] = _string(text)
        return out, reason

    def _logprobs_json(self, ids: list[int], lps: list) -> str:
        """vllm_backend's `logprobs` output (utils/request.py, create_response): per generated id
        of this response {token_id: {"logprob", "rank", "decoded_token"}} for the id itself and its
        top alternatives; "null" when the request did not ask for them."""
        if not self.req.return_logprobs or len(lps) != len(ids):
            return "null"
        out = []
        for t, (lp, rank, alts) in zip(ids, lps):
            d = {str(t): {"logprob": lp, "rank": rank, "decoded_token": self._piece(t)}}
            for a_rank, (a, alp) in enumerate(alts, 1):
                d.setdefault(str(a), {"logprob": alp, "rank": a_rank, "decoded_token": self._piece(a)})
            out.append(d)
        return json.dumps(out)

    def _piece(self, t: int) -> str:
        return self._pieces.decode([t]) if self._pieces is not None else ""
