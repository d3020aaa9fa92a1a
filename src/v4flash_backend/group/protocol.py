"""The rank-group socket protocol (rank 0 <-> clients): its one description and the messages' form.

`server.Server` (rank 0) and `rank_group.RankGroup` (the client) build every message they send with
the functions below, so the format lives here only; `engine.seq.Event.to_wire` gives a chunk's
fields (the engine is below this layer and cannot import it), and `auth` owns the handshake lines.
Standard library only: the client runs inside the Triton python-backend stub.

One JSON object per line, UTF-8, over TCP (127.0.0.1 unless --host says otherwise; rank 0 writes the
bound address to --port-file once every rank is ready). Several connections may be open; a request
belongs to the connection that submitted it and is cancelled if that connection closes. Every
connection opens with the server's hello line and, when the group has a shared secret, a
challenge-response (`auth`: HMAC-SHA256 of a per-connection nonce); a client that fails it is refused
and logged. Beyond loopback the server does not start without a secret.
  client -> server
    {"op":"submit","id":ID,"prompt_ids":[int,...],"params":{"max_tokens":int,"temperature":float,
     "top_k":int,"top_p":float,"seed":int|null,"stop_token_ids":[int,...],"ignore_eos":bool,
     "min_tokens":int,"logprobs":int,"frequency_penalty":float,"presence_penalty":float}}
    (request.GenerateRequest's wire fields; "warmup":true beside them marks the server's start-up
    request, whose steps ask the background compile for no graph: trn2.warmup)
    {"op":"cancel","id":ID}
    {"op":"health","tag":T}  {"op":"stats","tag":T}  {"op":"shutdown","tag":T}
  server -> client
    {"id":ID,"event":"chunk","token_ids":[..],"context_ids":[..],"finish_reason":null|"stop"|
     "length"|"cancelled","num_prompt_tokens":n,"num_cached_tokens":n (of those, restored from the
     prefix cache),"num_output_tokens":n,"drafted":n,"accepted":n,
     "logprobs":[[lp,rank,[[id,lp],..]],..] (only when the request asked for log-probs)}
    {"id":ID,"event":"error","code":"INVALID_ARG"|"UNAVAILABLE","message":str}
    {"event":"health"|"stats"|"shutdown","tag":T,...}; a malformed line gets
    {"event":"error","code":"INVALID_ARG","message":..,"tag":T} (with the id when it has one).
  Every request ends with exactly one final message: a chunk with a finish_reason, or an error
  (`is_final`).
"""

from __future__ import annotations

import json

SUBMIT, CANCEL = "submit", "cancel"
CONTROL_OPS = ("health", "stats", "shutdown")  # answered with {"event": op, "tag": T, ...}
INVALID_ARG, UNAVAILABLE = "INVALID_ARG", "UNAVAILABLE"
_ABSENT = object()


def encode(msg: dict) -> bytes:
    """One message as its line on the wire."""
    return (json.dumps(msg, separators=(",", ":")) + "\n").encode()


def submit(request_id, prompt_ids, params: dict | None, warmup: bool = False) -> dict:
    msg = {"op": SUBMIT, "id": request_id, "prompt_ids": [int(t) for t in prompt_ids], "params": params or {}}
    return dict(msg, warmup=True) if warmup else msg


def cancel(request_id) -> dict:
    return {"op": CANCEL, "id": request_id}


def control(op: str, tag) -> dict:
    """health / stats / shutdown, answered by a message with the same tag."""
    return {"op": op, "tag": tag}


def error(code: str, message: str, request_id=_ABSENT, tag=_ABSENT) -> dict:
    """An error message: a request's final one when it has the request's id, a reply when it has a tag."""
    msg = {} if request_id is _ABSENT else {"id": request_id}
    msg.update(event="error", code=code, message=message)
    if tag is not _ABSENT:
        msg["tag"] = tag
    return msg


def is_final(msg: dict) -> bool:
    """The last message of a request: an error, or a chunk with a finish_reason."""
    return msg.get("event") == "error" or msg.get("finish_reason") is not None
