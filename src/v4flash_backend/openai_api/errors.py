"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with the HTTP status
the `openai` client turns into its exception classes (400 BadRequestError, 401 AuthenticationError,
404 NotFoundError, 503 InternalServerError, ...).

Triton answers a bad request with one final error whose message starts with its code
(``[INVALID_ARG] top_p must be in (0, 1], got 1.5``: serving/parse.py and engine/validation.py);
`from_backend` maps the code to a status and names the request field the message is about, in the
OpenAI request's own spelling (``max_completion_tokens`` when the client sent that).
"""

from __future__ import annotations

import re

# Triton's error codes (v4flash_backend.request.CODES, the prefix of every message the model sends)
# -> HTTP status. UNAVAILABLE is the bounded queue (`max_queue_size`) or a rank group being replaced:
# 503, which clients retry. Anything else from the server (a core error without our prefix) is ours.
STATUS = {"INVALID_ARG": 400, "UNAVAILABLE": 503, "CANCELLED": 499, "INTERNAL": 500}
_CODE_RE = re.compile(r"^\[(\w+)\]\s*(.*)$", re.S)

# The first words of an INVALID_ARG message (engine/validation.py, serving/parse.py) -> the field.
_PARAMS = (
    (r"max_tokens", "max_tokens"), (r"temperature", "temperature"), (r"top_p", "top_p"), (r"top_k", "top_k"),
    (r"seed", "seed"), (r"min_tokens", "min_tokens"), (r"stop token id", "stop_token_ids"), (r"stop", "stop"),
    (r"frequency_penalty", "frequency_penalty"), (r"presence_penalty", "presence_penalty"),
    (r"logprobs", "logprobs"), (r"(prompt|text_input|token id \d+ in the prompt|empty prompt)", "prompt"),
)


class APIError(Exception):
    """An error answered in OpenAI's shape (before a stream began: the response; after: the stream's
    last event)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def unavailable(message: str) -> APIError:
    return APIError(503, message, type="server_error", code="unavailable")


def split_code(message: str) -> tuple[str | None, str]:
    """("INVALID_ARG", "top_p must be ...") from "[INVALID_ARG] top_p must be ..."; (None, message) when
    the message carries no code."""
    m = _CODE_RE.match(message.strip())
    return (m.group(1), m.group(2)) if m else (None, message.strip())


def from_backend(message: str, rename: dict[str, str] | None = None) -> APIError:
    """The APIError for an error Triton answered; ``rename`` maps our field names to the request's
    (prompt -> messages for a chat request, max_tokens -> max_completion_tokens)."""
    code, text = split_code(message)
    status = STATUS.get(code or "", 500)
    if status == 400:
        param = next((p for pat, p in _PARAMS if re.match(pat, text)), None)
        if param is not None and rename:
            param = rename.get(param, param)
        return APIError(400, text, param=param, code="invalid_value")
    if status == 503:
        return unavailable(text)
    if "unknown model" in text or "is not ready" in text or "not found" in text:
        return unavailable(f"the model is not loaded in Triton: {text}")  # a server still starting
    return APIError(status, text, type="server_error", code=(code or "internal").lower())
