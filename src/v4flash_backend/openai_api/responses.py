"""OpenAI response objects from the `v4flash` model's chunks: usage, log-probs, the non-streamed
bodies and the streamed chunks of both endpoints (plain dicts: the JSON the client reads).

`usage` is OpenAI's (prompt, completion and total tokens; `prompt_tokens_details.cached_tokens`: the
prompt tokens the prefix cache restored) with one documented extension, `usage.dspark`:
``{"drafted_tokens", "accepted_tokens"}``, the DSpark draft tokens verified for this request and how
many of them verification accepted (the model's num_drafted_tokens / num_accepted_tokens summed).

Log-probs come from the model's `logprobs` output (vllm_backend's JSON: per generated token
``{id: {"logprob", "rank", "decoded_token"}}`` for the token and its top alternatives, after
temperature / top-k / top-p). `bytes` is the UTF-8 of the token's own decoded text (a token that
ends inside a multi-byte character decodes to U+FFFD there).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from .triton import Chunk


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class Tally:
    """A request's counts as its chunks arrive."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    finish_reason: str | None = None
    text: list[str] = field(default_factory=list)

    def add(self, c: Chunk) -> None:
        self.prompt_tokens = c.prompt_tokens or self.prompt_tokens
        self.cached_tokens = max(self.cached_tokens, c.cached_tokens)
        self.completion_tokens += c.completion_tokens
        self.drafted += c.drafted
        self.accepted += c.accepted
        self.text.append(c.text)
        if c.finish_reason:
            self.finish_reason = c.finish_reason

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
                "dspark": {"drafted_tokens": self.drafted, "accepted_tokens": self.accepted}}


def _entries(chunk: Chunk) -> list[tuple[int, dict, list[dict]]]:
    """Per generated token of the chunk: (id, its entry, the entries by rank)."""
    out = []
    for tok, d in zip(chunk.token_ids, chunk.logprobs or ()):
        ranked = sorted(d.values(), key=lambda e: e["rank"])
        out.append((tok, d.get(str(tok)) or ranked[0], ranked))
    return out


def _piece(entry: dict) -> dict:
    text = entry.get("decoded_token", "")
    return {"token": text, "logprob": entry["logprob"], "bytes": list(text.encode("utf-8"))}


def chat_logprobs(chunk: Chunk, top: int) -> list[dict]:
    """`choices[].logprobs.content` items of a chat response for the chunk's tokens."""
    return [dict(_piece(e), top_logprobs=[_piece(a) for a in ranked if a["rank"] <= top])
            for _, e, ranked in _entries(chunk)]


class CompletionLogprobs:
    """The legacy `logprobs` object of /v1/completions: tokens, token_logprobs, top_logprobs,
    text_offset (character offsets of the tokens in the choice's text)."""

    def __init__(self, top: int):
        self.top, self.offset = top, 0

    def of(self, chunk: Chunk) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for _, e, ranked in _entries(chunk):
            token = e.get("decoded_token", "")
            out["tokens"].append(token)
            out["token_logprobs"].append(e["logprob"])
            top = {a.get("decoded_token", ""): a["logprob"] for a in ranked if a["rank"] <= self.top}
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(token)
        return out

    @staticmethod
    def join(parts: list[dict]) -> dict:
        return {k: [v for p in parts for v in p[k]] for k in ("tokens", "token_logprobs", "top_logprobs",
                                                               "text_offset")}


class Stream:
    """The `data:` events of one streamed response (`chat.completion.chunk` or `text_completion`)."""

    def __init__(self, chat: bool, model: str, include_usage: bool, continuous_usage: bool):
        self.chat, self.model = chat, model
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self.include_usage, self.continuous_usage = include_usage, continuous_usage

    def _event(self, choices: list, usage: dict | None = None) -> dict:
        out = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": choices}
        if self.include_usage:
            out["usage"] = usage  # null in every chunk but the last (OpenAI), or each (continuous_usage_stats)
        return out

    def role(self) -> dict:
        return self._event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}])

    def delta(self, chunk: Chunk, tally: Tally, logprobs) -> dict:
        reason = chunk.finish_reason or None
        if self.chat:
            choice = {"index": 0, "delta": {"content": chunk.text} if chunk.text else {},
                      "logprobs": {"content": logprobs} if logprobs is not None else None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": chunk.text, "logprobs": logprobs, "finish_reason": reason}
        return self._event([choice], tally.usage() if self.continuous_usage else None)

    def usage(self, tally: Tally) -> dict:
        return self._event([], tally.usage())


def chat_body(model: str, tally: Tally, logprobs: list | None) -> dict:
    return {"id": new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(tally.text)},
                         "logprobs": {"content": logprobs} if logprobs is not None else None,
                         "finish_reason": tally.finish_reason}],
            "usage": tally.usage()}


def completion_body(model: str, tally: Tally, logprobs: dict | None) -> dict:
    return {"id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": "".join(tally.text), "logprobs": logprobs,
                         "finish_reason": tally.finish_reason}],
            "usage": tally.usage()}
