"""Chat prompts as the checkpoints' own formats render them (openai_api/chat_templates.py, dsv41.py).

The expected prompts are written out by hand from the formats' documentation (the embedded model's
card, DeepSeek-V4's encoding README and V4.1's reference as SGLang carries it: dsv41.py's
docstring), not produced by the code under test. During development dsv41.encode was also compared
with a transcription of SGLang's encoding_dsv41.py text path on 3000 random conversations x 16
settings (identical); that reference is not vendored here.
"""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from _triton import REPO
from v4flash_backend.openai_api import dsv41
from v4flash_backend.openai_api.chat_templates import DeepSeekV41, JinjaTemplate, select
from v4flash_backend.openai_api.errors import APIError

TINY = REPO / "models" / "v4flash-tiny"
GOLDEN = REPO.parent / "shared" / "golden" / "v41-tiny"
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"

CONVERSATION = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "Sort a list.\nKeep it short."},
    {"role": "assistant", "content": "def f(x):\n    return sorted(x)", "reasoning_content": "Use sorted."},
    {"role": "user", "content": "Now reverse it."},
]


def test_the_embedded_model_renders_a_multi_turn_conversation_as_python_comments():
    r = select(TINY)
    assert isinstance(r, JinjaTemplate) and "tokenizer_config.json" in r.name
    got = r.render([{k: v for k, v in m.items() if k != "reasoning_content"} for m in CONVERSATION], {})
    assert got == (BOS + "# system: You write Python.\n"
                   "# user: Sort a list.\n"
                   "# Keep it short.\n"
                   "def f(x):\n"
                   "    return sorted(x)\n"
                   "# user: Now reverse it.\n")
    # Triton tokenizes it without adding special tokens: the text's own BOS is the one BOS
    tok = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    ids = tok.encode(got, add_special_tokens=False).ids
    assert ids[0] == 0 and ids.count(0) == 1
    assert tok.encode(got).ids[:2] == [0, 0]  # what the default (add_special_tokens true) would have sent


def test_deepseek_v41_multi_turn_in_chat_and_thinking_mode():
    chat = dsv41.encode(CONVERSATION)
    assert chat == (BOS + "<｜System｜>You write Python."
                    "<｜User｜>Sort a list.\nKeep it short.<｜Assistant｜></think>"
                    "def f(x):\n    return sorted(x)" + EOS +
                    "<｜User｜>Now reverse it.<｜Assistant｜></think>")
    effort = "Reasoning Effort: 50 (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
    thinking = dsv41.encode(CONVERSATION, thinking=True)
    # the earlier turn's reasoning is dropped; the answer opens a thinking block
    assert thinking == (BOS + "<｜System｜>" + effort + "You write Python."
                        "<｜User｜>Sort a list.\nKeep it short.<｜Assistant｜></think>"
                        "def f(x):\n    return sorted(x)" + EOS +
                        "<｜User｜>Now reverse it.<｜Assistant｜><think>")
    kept = dsv41.encode(CONVERSATION, thinking=True, drop_thinking=False, reasoning_effort="max")
    assert "<｜Assistant｜><think>Use sorted.</think>def f(x)" in kept and "Reasoning Effort: 100 " in kept
    # no system turn: the effort line still opens with the system token; consecutive users merge
    assert dsv41.encode([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], thinking=True,
                        reasoning_effort=7) == (BOS + "<｜System｜>" + effort.replace("50", "7")
                                               + "<｜User｜>a\n\nb<｜Assistant｜><think>")
    # a system turn later in the conversation is answered like a user turn
    assert dsv41.encode([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                         {"role": "developer", "content": "c"}]) == (
        BOS + "<｜User｜>a<｜Assistant｜></think>b" + EOS + "<｜System｜>c<｜Assistant｜></think>")


def test_deepseek_v41_refusals_are_400s_naming_the_field():
    r = DeepSeekV41()
    with pytest.raises(APIError) as e:
        r.render([{"role": "user", "content": "a"}], {"thinking": True}, reasoning_effort="medium")
    assert e.value.status == 400 and e.value.param == "reasoning_effort" and "low, high, xhigh, max" in e.value.message
    with pytest.raises(APIError, match="last message must be a user"):
        r.render([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], {})
    with pytest.raises(APIError) as e:
        r.render([{"role": "user", "content": "a"}], {"enable_thinkin": True})
    assert e.value.param == "chat_template_kwargs" and "enable_thinkin" in e.value.message
    assert r.render([{"role": "user", "content": "a"}], {"enable_thinking": True}).endswith("<｜Assistant｜><think>")


def test_selection_follows_the_checkpoint(tmp_path):
    assert select(GOLDEN) is None  # no template, not DeepSeek's tokenizer: chat is refused
    # DeepSeek-V4.1's tokenizer without a template: its encoding
    ds = tmp_path / "ds"
    ds.mkdir()
    added = [{"id": i, "content": t, "special": True} for i, t in enumerate(dsv41.SPECIAL_TOKENS)]
    (ds / "tokenizer.json").write_text(json.dumps({"added_tokens": added}))
    assert isinstance(select(ds), DeepSeekV41)
    # a template file wins over tokenizer_config.json, which wins over the DeepSeek tokens
    (ds / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"content": "<s>"}, "chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ bos_token }}D"}]}))
    assert select(ds).render([], {}) == "<s>D"
    (ds / "chat_template.jinja").write_text("F{{ messages | length }}")
    assert select(ds).render([{"role": "user", "content": "x"}], {}) == "F1"
    assert isinstance(select(ds, "deepseek-v4.1"), DeepSeekV41)


def test_jinja_rendering_follows_transformers():
    """trim_blocks / lstrip_blocks, tojson without HTML escaping, raise_exception, loop controls, the
    generation block, add_generation_prompt true and chat_template_kwargs as variables."""
    src = ("{% for m in messages %}\n"
           "    {% if m.role == 'system' %}{{ raise_exception('no system turns') }}{% endif %}\n"
           "    {% if loop.index > 2 %}{% break %}{% endif %}\n"
           "{% generation %}[{{ m.content | tojson }}]{% endgeneration %}\n"
           "{% endfor %}\n"
           "{% if add_generation_prompt %}{{ eos_token }}{{ flavour }}{% endif %}")
    t = JinjaTemplate(src, {"eos_token": "</s>"}, "test")
    msgs = [{"role": "user", "content": "<a & b>"}, {"role": "user", "content": "é"}, {"role": "user", "content": "x"}]
    # (without trim_blocks / lstrip_blocks the newlines after each block tag and the indentation stay)
    assert t.render(msgs, {"flavour": "!"}) == '["<a & b>"]["é"]</s>!'
    with pytest.raises(APIError) as e:
        t.render([{"role": "system", "content": "s"}], {})
    assert e.value.status == 400 and "no system turns" in e.value.message and e.value.param == "messages"
