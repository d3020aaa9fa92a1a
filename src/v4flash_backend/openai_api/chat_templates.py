"""How a chat request becomes prompt text: the checkpoint's own chat format, rendered here, then sent
to Triton as `text_input` with add_special_tokens=false (the rendered text carries its BOS), so the
model's one tokenizer (serving/model_setup.py) tokenizes it.

`select(checkpoint_dir, choice)` picks, for ``choice="auto"``, the first that applies:

1. the checkpoint's Jinja template: `chat_template.jinja`, else `chat_template` in
   tokenizer_config.json (a string, or a list of named templates: "default"), rendered as
   transformers' `apply_chat_template` renders it (`JinjaTemplate`: a sandboxed jinja2 environment
   with trim_blocks and lstrip_blocks, loop controls, its `tojson`, `raise_exception` and
   `strftime_now`, the special tokens of tokenizer_config.json as variables, add_generation_prompt
   true). The embedded model models/v4flash-tiny has one (its MODEL_CARD.md);
2. DeepSeek-V4.1's encoding (`dsv41`), when the tokenizer holds its special tokens: the release
   checkpoint ships no template (dsv41.py says why);
3. none: chat requests are refused (400) and /v1/completions serves raw prompts.

``choice`` may also be "deepseek-v4.1" or the path of a Jinja file (the frontend's --chat-template).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from . import dsv41
from .errors import invalid

SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class _Generation(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` block (it marks assistant tokens for
    training masks); rendering it is rendering its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise(message):
    raise jinja2.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' filter: jinja2's own escapes HTML characters, which a prompt must not have
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class JinjaTemplate:
    def __init__(self, source: str, special: dict[str, str], origin: str):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_Generation, jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.template = env.from_string(source)
        self.special, self.name = special, f"jinja ({origin})"

    def render(self, messages: list[dict], kwargs: dict, reasoning_effort=None) -> str:
        variables = dict(self.special, **kwargs)
        if reasoning_effort is not None:
            variables.setdefault("reasoning_effort", reasoning_effort)
        try:
            return self.template.render(messages=messages, tools=None, documents=None, add_generation_prompt=True,
                                        **variables)
        except jinja2.TemplateError as exc:  # raise_exception() of the template: the request is wrong
            raise invalid(f"the chat template refused the conversation: {exc}", "messages") from None


class DeepSeekV41:
    name = "deepseek-v4.1"
    KWARGS = {"thinking", "enable_thinking", "reasoning_effort", "drop_thinking"}

    def render(self, messages: list[dict], kwargs: dict, reasoning_effort=None) -> str:
        unknown = sorted(set(kwargs) - self.KWARGS)
        if unknown:
            raise invalid(f"chat_template_kwargs {unknown} are not read by the DeepSeek-V4.1 encoding "
                          f"(it reads {sorted(self.KWARGS)})", "chat_template_kwargs")
        thinking = bool(kwargs.get("thinking", kwargs.get("enable_thinking", False)))
        effort = kwargs.get("reasoning_effort", reasoning_effort)
        try:
            return dsv41.encode(messages, thinking=thinking, reasoning_effort=effort,
                                drop_thinking=bool(kwargs.get("drop_thinking", True)))
        except dsv41.EncodingError as exc:
            raise invalid(str(exc), "reasoning_effort" if "reasoning_effort" in str(exc) else "messages") from None


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # an AddedToken written out: {"content": ..., ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _added_tokens(ckpt: Path) -> set[str]:
    return {t.get("content") for t in _read_json(ckpt / "tokenizer.json").get("added_tokens", [])}


def checkpoint_template(ckpt: Path) -> tuple[str, str] | None:
    """(the Jinja source, where it came from) of a checkpoint directory, or None."""
    if (ckpt / "chat_template.jinja").is_file():
        return (ckpt / "chat_template.jinja").read_text(encoding="utf-8"), "chat_template.jinja"
    tmpl = _read_json(ckpt / "tokenizer_config.json").get("chat_template")
    if isinstance(tmpl, list):  # named templates: transformers uses "default"
        tmpl = next((t.get("template") for t in tmpl if t.get("name") == "default"), None)
    return (tmpl, "tokenizer_config.json") if isinstance(tmpl, str) and tmpl else None


def select(checkpoint_dir: str | Path | None, choice: str = "auto"):
    """The renderer a chat request goes through, or None (chat refused)."""
    ckpt = Path(checkpoint_dir) if checkpoint_dir else None
    config = _read_json(ckpt / "tokenizer_config.json") if ckpt else {}
    special = {k: t for k in SPECIAL_NAMES if (t := _token_text(config.get(k))) is not None}
    if choice == "deepseek-v4.1":
        return DeepSeekV41()
    if choice != "auto":
        path = Path(choice)
        return JinjaTemplate(path.read_text(encoding="utf-8"), special, str(path))
    if ckpt is None:
        return None
    found = checkpoint_template(ckpt)
    if found is not None:
        return JinjaTemplate(found[0], special, str(ckpt / found[1]))
    if set(dsv41.SPECIAL_TOKENS) <= _added_tokens(ckpt):
        return DeepSeekV41()
    return None
