"""Byte-level BPE tokenizer of the embedded tiny model, trained with `tokenizers` on the train split.

Id layout follows the DeepSeek convention the serving code assumes: 0 = BOS
`<｜begin▁of▁sentence｜>`, 1 = EOS `<｜end▁of▁sentence｜>`, 2 = PAD `<｜▁pad▁｜>` (also the Engram
pad id), then the 256 byte symbols and the merges; the last two ids are the added special tokens
`<｜deepseek_image｜>` (image_token_id, unused) and `<｜dspark_noise｜>` (dspark_noise_token_id), as in
the golden tiny fixture. `encode(text)` prepends BOS (template post-processor), as DeepSeek's own
tokenizer.json does, so the Triton preprocessing model (add_special_tokens=true) gets the same ids
the model was trained on.
"""

from __future__ import annotations

from pathlib import Path

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
IMAGE, NOISE = "<｜deepseek_image｜>", "<｜dspark_noise｜>"

# The chat template of the embedded model (tokenizer_config.json's `chat_template`, which the OpenAI
# frontend renders as transformers does). The model read only Python source, so a conversation is
# written as Python: BOS, then every non-assistant turn as comment lines "# <role>: <text>" (each
# line of the text commented), every assistant turn as its text (code) on lines of its own; the
# assistant's answer is whatever code follows the last comment, so the generation prompt adds
# nothing. Example (system, user, assistant, user):
#   <BOS># system: You write Python.\n# user: Sort a list.\ndef f(x):\n    return sorted(x)\n# user: Now...\n
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ message['content'] }}\n"
    "{% else %}"
    "# {{ message['role'] }}: {{ message['content'] | replace('\\n', '\\n# ') }}\n"
    "{% endif %}"
    "{% endfor %}"
)


def train_tokenizer(texts, vocab_size: int = 4096):
    """A `tokenizers.Tokenizer` with exactly `vocab_size` ids (BPE ids + 2 added specials).

    The BPE trainer is deterministic for a given input order (ties between equally frequent pairs
    break on the pair itself), so the same texts give the same tokenizer.json."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 2,
        min_frequency=2,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size() != vocab_size - 2:
        raise RuntimeError(f"BPE trainer produced {tok.get_vocab_size()} ids, wanted {vocab_size - 2} "
                           "(corpus too small for this vocabulary)")
    tok.add_special_tokens([IMAGE, NOISE])
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B",
                                                       special_tokens=[(BOS, 0)])
    check_ids(tok, vocab_size)
    return tok


def check_ids(tok, vocab_size: int) -> None:
    """Refuse a tokenizer whose special ids differ from the model's convention."""
    want = {BOS: 0, EOS: 1, PAD: 2, IMAGE: vocab_size - 2, NOISE: vocab_size - 1}
    got = {t: tok.token_to_id(t) for t in want}
    if got != want or tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise RuntimeError(f"special token ids {got} (vocab {tok.get_vocab_size(with_added_tokens=True)}), "
                           f"expected {want} (vocab {vocab_size})")


def save(tok, path: str | Path) -> None:
    tok.save(str(path), pretty=False)


def hf_tokenizer_files(model_max_length: int) -> dict[str, dict]:
    """The files beside tokenizer.json that make the directory a standard Hugging Face tokenizer
    directory (`AutoTokenizer.from_pretrained(dir)`, which genai-perf's --tokenizer calls).

    transformers' AutoTokenizer reads `tokenizer_class` from tokenizer_config.json; without it,
    it falls back to AutoConfig on config.json, which fails on the official DeepSeek inference
    config (no `model_type`). PreTrainedTokenizerFast is the class that wraps a tokenizer.json as
    is (its post-processor adds BOS, as add_special_tokens=true does in preprocessing); the named
    special tokens give bos/eos/pad ids 0 / 1 / 2; `chat_template` is CHAT_TEMPLATE."""
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special,
              "additional_special_tokens": [IMAGE, NOISE], "model_max_length": int(model_max_length),
              "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}
    return {"tokenizer_config.json": config,
            "special_tokens_map.json": {**special, "additional_special_tokens": [IMAGE, NOISE]}}


def write_hf_tokenizer_files(out: str | Path, model_max_length: int) -> None:
    import json

    for name, obj in hf_tokenizer_files(model_max_length).items():
        (Path(out) / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def main(argv=None) -> int:
    import argparse

    from .corpus import load_corpus

    ap = argparse.ArgumentParser(description="train the tiny model's byte-level BPE on the stdlib train split")
    ap.add_argument("--out", required=True, help="tokenizer.json to write")
    ap.add_argument("--vocab", type=int, default=4096)
    a = ap.parse_args(argv)
    train, _ = load_corpus()
    tok = train_tokenizer([f.text for f in train], a.vocab)
    save(tok, a.out)
    print(f"wrote {a.out}: {tok.get_vocab_size(with_added_tokens=True)} ids")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
