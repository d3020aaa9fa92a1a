"""DeepSeek-V4.1's chat encoding, the subset a text chat needs: system, user and assistant turns
(with an assistant's `reasoning_content`), chat and thinking mode, the reasoning-effort line.

Why code and not a Jinja template: the V4 / V4.1 releases ship no `chat_template` in
tokenizer_config.json; they document the format and give a Python reference implementation
(`encoding/encoding_dsv4.py` with fixtures in `encoding/tests/`, V4.1's its successor), which is
what SGLang (`python/sglang/srt/entrypoints/openai/encoding_dsv4.py`, `encoding_dsv41.py`: "Adapted
from the DeepSeek-V4.1 release reference implementation") and vLLM (`--tokenizer-mode deepseek_v4`)
run instead of `apply_chat_template`. The rules need look-ahead and state a template expresses
badly: the reasoning of every assistant turn before the last user turn is dropped (only the current
turn's thinking is kept), the generation header depends on what follows each message, consecutive
user turns (and tool results) merge into one, and tool calls are encoded in DSML with JSON typing
of each argument. Tool calls, tool results, tasks, images and `latest_reminder` are not supported
by this server (the request is refused before rendering), so they are not implemented here.

The format (from that documentation; written here, not copied):

    <｜begin▁of▁sentence｜>                        once, at the start
    <｜System｜>{effort}{system}                    the first message: a system turn, or only the
                                                    effort line when the first turn is a user's
    <｜User｜>{user}                                consecutive user turns joined by a blank line
    <｜Assistant｜></think> | <think>                after the last user turn of a block: chat mode
                                                    closes thinking at once, thinking mode opens it
    {reasoning}</think>{content}<｜end▁of▁sentence｜>  an assistant turn; "{reasoning}</think>" only
                                                    in thinking mode and only after the last user turn
    <｜System｜>{system}                            a later system turn (then counts as a user turn)

{effort} is "Reasoning Effort: {1-100} (range 1-100, the higher the value, the more thorough the
reasoning)\\n\\n" in thinking mode only, low / high / xhigh / max = 25 / 50 / 75 / 100, default high.
"""

from __future__ import annotations

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
SYSTEM = "<｜System｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"
EFFORTS = {"low": 25, "high": 50, "xhigh": 75, "max": 100}
DEFAULT_EFFORT = "high"
# what a tokenizer must hold for this encoding to apply (`chat_templates.select`)
SPECIAL_TOKENS = (BOS, EOS, USER, ASSISTANT)


class EncodingError(ValueError):
    """A conversation this encoding cannot express (answered 400)."""


def effort_budget(effort) -> int:
    if effort is None:
        effort = DEFAULT_EFFORT
    if isinstance(effort, bool) or not (isinstance(effort, int) and 1 <= effort <= 100 or effort in EFFORTS):
        raise EncodingError(f"reasoning_effort must be one of {', '.join(EFFORTS)} or an integer in [1, 100], "
                            f"got {effort!r}")
    return EFFORTS[effort] if isinstance(effort, str) else effort


def _merge_users(messages: list[dict]) -> list[dict]:
    """Consecutive user turns as one (their texts joined by a blank line, as the reference joins the
    blocks of one user turn)."""
    out: list[dict] = []
    for m in messages:
        if m["role"] == "user" and out and out[-1]["role"] == "user":
            out[-1] = dict(out[-1], content=out[-1]["content"] + "\n\n" + m["content"])
        else:
            out.append(dict(m))
    return out


def encode(messages: list[dict], thinking: bool = False, reasoning_effort=None, drop_thinking: bool = True) -> str:
    """The prompt text of a conversation ending where the assistant is to answer. ``messages``:
    dicts with role system / user / assistant, content (str) and, for assistant turns, optional
    reasoning_content. OpenAI's `developer` role is read as `system`."""
    msgs = _merge_users([dict(m, role="system" if m["role"] == "developer" else m["role"]) for m in messages])
    for m in msgs:
        if m["role"] not in ("system", "user", "assistant"):
            raise EncodingError(f"role {m['role']!r} is not supported by the DeepSeek-V4.1 encoding")
    if msgs[-1]["role"] == "assistant":
        raise EncodingError("the last message must be a user or system turn (the assistant answers it)")
    # the last turn the assistant answers: a user turn or a system turn after the first message
    last_user = max((i for i, m in enumerate(msgs) if m["role"] == "user" or (m["role"] == "system" and i > 0)),
                    default=-1)
    effort = f"Reasoning Effort: {effort_budget(reasoning_effort)} (range 1-100, the higher the value, " \
             "the more thorough the reasoning)\n\n" if thinking else ""
    out = [BOS]
    for i, m in enumerate(msgs):
        role, content = m["role"], m.get("content") or ""
        if i == 0 and (effort or role == "system"):
            out.append(SYSTEM + effort)
        if role == "system":
            out.append((SYSTEM if i > 0 else "") + content)
        elif role == "user":
            out.append(USER + content)
        else:
            keep = thinking and (not drop_thinking or i > last_user)
            out.append(((m.get("reasoning_content") or "") + END_THINK if keep else "") + content + EOS)
        following = msgs[i + 1]["role"] if i + 1 < len(msgs) else None
        if following in (None, "assistant") and (role == "user" or (role == "system" and i > 0)):
            opens = thinking and (not drop_thinking or i >= last_user)
            out.append(ASSISTANT + (THINK if opens else END_THINK))
    return "".join(out)
