"""The request bodies of `/v1/completions` and `/v1/chat/completions` (pydantic), and what they become
for Triton: the `sampling_parameters` JSON of the `v4flash` model (serving/parse.py reads it).

Fields are OpenAI's (https://platform.openai.com/docs/api-reference/chat/create), plus vLLM's
extensions `top_k`, `min_tokens`, `ignore_eos`, `stop_token_ids`, `add_special_tokens`,
`chat_template_kwargs` and `stream_options.continuous_usage_stats`. An unknown field is a 400 naming
it (a typo such as `max_token` would otherwise generate the default length silently, OpenAI answers
"Unrecognized request argument" too); fields OpenAI has that this server cannot honour are accepted
only at the value that means "off" (`n` 1, `logit_bias` empty, no `tools`, `echo` false, ...), as
Triton's OpenAI frontend refuses `n` > 1. Ranges are OpenAI's where it states them (temperature
0-2, penalties -2..2, top_logprobs 0-20), else the engine's (engine/validation.py), so a bad value
is answered here with the field's name.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

UINT64 = 2**64
MAX_LOGPROBS = 20  # the engine's MAX_LOGPROBS (OpenAI: top_logprobs <= 20)
MAX_STOP = 16  # the engine's MAX_STOP_STRINGS (OpenAI: 4)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    reasoning_content: str | None = None  # DeepSeek's field for an assistant turn's thinking
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _no_tools(self):
        if self.role == "tool" or self.tool_calls or self.tool_call_id:
            raise ValueError("tool calls and tool messages are not supported by this server")
        return self

    def text(self) -> str:
        """The content as one string (text parts joined by newlines, as vLLM joins them)."""
        if isinstance(self.content, list):
            return "\n".join(p.text for p in self.content)
        return self.content or ""


class _Sampling(_Strict):
    """What both endpoints share."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    seed: int | None = Field(None, ge=0, lt=UINT64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    add_special_tokens: bool | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        return v

    @field_validator("n")
    @classmethod
    def _n(cls, v):
        if v != 1:
            raise ValueError("only n=1 is supported (one choice per request)")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        if v:
            raise ValueError("logit_bias is not supported")
        return v

    @model_validator(mode="after")
    def _stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def sampling(self, max_tokens: int | None, logprobs: int | None) -> dict:
        """The `sampling_parameters` of the Triton request: only what the client set (the server's
        defaults apply otherwise: `default_max_tokens`), temperature defaulting to OpenAI's 1.0."""
        out: dict[str, Any] = {"temperature": 1.0 if self.temperature is None else self.temperature}
        for key in ("top_p", "top_k", "seed"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if max_tokens is not None:
            out["max_tokens"] = max_tokens
        if self.min_tokens:
            out["min_tokens"] = self.min_tokens
        if self.ignore_eos:
            out["ignore_eos"] = True
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if stops:
            out["stop"] = stops
        if self.stop_token_ids:
            out["stop_token_ids"] = self.stop_token_ids
        for key in ("frequency_penalty", "presence_penalty"):
            if getattr(self, key):
                out[key] = getattr(self, key)
        if logprobs is not None:
            out["logprobs"] = logprobs
        return out

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and (self.stream_options.include_usage
                                             or self.stream_options.continuous_usage_stats))

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _unsupported(self):
        if self.echo:
            raise ValueError("echo is not supported")
        if self.best_of not in (None, 1):
            raise ValueError("best_of must be 1")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    def one_prompt(self) -> str | list[int]:
        """The one prompt (text or token ids); several prompts in one request are refused."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ValueError(f"one prompt per request (got {len(p)})")
            p = p[0]
        if not p:
            raise ValueError("the prompt is empty")
        return p


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: dict | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # accepted and ignored: they change nothing in what is generated
    store: bool | None = None
    metadata: dict | None = None
    service_tier: str | None = None

    @model_validator(mode="after")
    def _unsupported(self):
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValueError("give max_completion_tokens or max_tokens, not both")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs to be true")
        if self.tools:
            raise ValueError("tools are not supported by this server")
        if self.tool_choice not in (None, "none", "auto"):
            raise ValueError("tool_choice is not supported by this server")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise ValueError("only response_format {\"type\": \"text\"} is supported")
        return self

    @property
    def max_new(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
