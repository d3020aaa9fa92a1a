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
