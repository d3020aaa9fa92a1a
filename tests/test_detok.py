"""Stateless streaming detokenization (serving/detok.py) against the real tokenizer.

The reference is always ``tokenizer.decode`` of the whole id sequence from the
``tokenizers`` package; the property under test is that the chunk deltas, each
computed from only its new ids and the last CONTEXT_IDS ids before it, concatenate
to exactly that text, and that every partial concatenation is a prefix of it (the
stream never shows a character it later has to take back).
"""

import itertools
import random
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from v4flash_backend.serving.detok import CONTEXT_IDS, StreamDetokenizer
from v4flash_backend.serving.prepost import Postprocessor

GOLDEN_TOKENIZER = Path(__file__).resolve().parents[2] / "shared/golden/v41-tiny/tokenizer.json"
if not GOLDEN_TOKENIZER.is_file():  # checkouts where shared/ is not beside the repo
    GOLDEN_TOKENIZER = Path("/work/shared/golden/v41-tiny/tokenizer.json")

# Multi-byte text the tiny byte-level BPE splits inside characters: CJK and kana fall
# back to one token per byte, emoji split as F0 9F | xx | xx, Latin-1 letters appear
# both merged ("é") and split ("\xc3" | "\xb6"), and some merges span a character
# boundary (b"\xb1\xe4" ends one CJK character and starts the next).
TEXTS = [
    "你好世界",
    "日本語のテキスト",
    "😀👍🏽 emoji",
    " héllo wörld",
    "中文 mixed ASCII 汉字",
    "東京、данные 🙂→∑",  # merges that end one character and start the next
    " 東京данные 🙂→ ∑x",
    "Crème Brûlée—Résumé",
    "a😀b 🏽東京x",
]

SPECIAL_EOS = 1  # <｜end▁of▁sentence｜>


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_file(str(GOLDEN_TOKENIZER))


@pytest.fixture(scope="module")
def detok(tokenizer):
    return StreamDetokenizer(tokenizer, skip_special_tokens=True)


def stream(detok, ids, cuts, prompt=()):
    """Chunk deltas for ``ids`` cut at ``cuts``, each with the engine's context rule."""
    history = list(prompt)
    bounds = [0, *cuts, len(ids)]
    out = []
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        context = history[-CONTEXT_IDS:]
        new = ids[a:b]
        out.append(detok.delta(context, new, final=(k == len(bounds) - 2)))
        history.extend(new)
    return out


def assert_streams_exactly(detok, ids, cuts, expected, prompt=()):
    chunks = stream(detok, ids, cuts, prompt)
    assert "".join(chunks) == expected, (cuts, chunks)
    partial = ""
    for chunk in chunks:
        partial += chunk
        assert expected.startswith(partial), (cuts, chunks)


def test_texts_really_split_characters(tokenizer):
    """Guards the test data: each text has a token boundary inside a character."""
    for text in TEXTS:
        ids = tokenizer.encode(text).ids
        inside = [
            k for k in range(1, len(ids))
            if "\ufffd" in tokenizer.decode(ids[:k]) and "\ufffd" not in text
        ]
        assert inside, text


def test_byte_table_matches_tokenizer_decode(tokenizer):
    rng = random.Random(1234)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    for skip in (True, False):
        d = StreamDetokenizer(tokenizer, skip_special_tokens=skip)
        assert d.byte_level
        saw_invalid = saw_special = False
        for _ in range(400):
            ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 24))]
            expected = tokenizer.decode(ids, skip_special_tokens=skip)
            assert d.decode(ids) == expected, ids
            saw_invalid |= "\ufffd" in expected
            saw_special |= "｜" in expected
        assert saw_invalid  # random byte tokens make invalid UTF-8: the lossy paths ran
        assert saw_special == (not skip)


@pytest.mark.parametrize("text", TEXTS)
def test_every_split_streams_exactly(tokenizer, detok, text):
    ids = tokenizer.encode(text).ids
    expected = tokenizer.decode(ids)
    assert expected == text
    n = len(ids)
    splits = [()]
    splits += [(c,) for c in range(1, n)]  # every 2-chunk split
    splits += list(itertools.combinations(range(1, n), 2))  # every 3-chunk split
    splits.append(tuple(range(1, n)))  # one token per chunk
    rng = random.Random(text)
    for _ in range(200):  # random chunkings, like speculative decoding's 1..6 ids per step
        splits.append(tuple(sorted(rng.sample(range(1, n), rng.randrange(1, n)))))
    for cuts in splits:
        assert_streams_exactly(detok, ids, list(cuts), expected)


def test_naive_per_chunk_decode_breaks(tokenizer):
    """Negative control: decoding each chunk alone (no context, no hold-back) garbles
    the same streams, so the test above can tell the difference."""
    ids = tokenizer.encode("你好世界").ids
    chunks = [tokenizer.decode(ids[k:k + 1]) for k in range(len(ids))]
    assert "".join(chunks) != "你好世界"


def test_prompt_tail_as_first_context(tokenizer, detok):
    prompt = tokenizer.encode("用户: 东京 in 日本? ").ids
    for text in TEXTS:
        ids = tokenizer.encode(text).ids
        for cuts in [(), *[(c,) for c in range(1, len(ids))], tuple(range(1, len(ids)))]:
            assert_streams_exactly(detok, ids, list(cuts), text, prompt=prompt)


def test_invalid_and_truncated_bytes_stream_exactly(tokenizer, detok):
    """Random byte tokens (ids 3..258 are the 256 single bytes) make orphan
    continuation bytes, truncated and overlong sequences; only a genuinely unfinished
    tail is held back, so every chunking still matches the lossy full decode."""
    rng = random.Random(7)
    multibyte = [tokenizer.token_to_id(t) for t in ("ä", "Ã", "æ", "ð", "Ł", "¶")]
    for _ in range(150):
        pool = list(range(3, 259)) + multibyte * 20
        ids = [rng.choice(pool) for _ in range(rng.randrange(1, 16))]
        expected = tokenizer.decode(ids)
        n = len(ids)
        for cuts in [(), tuple(range(1, n))] + [
            tuple(sorted(rng.sample(range(1, n), rng.randrange(0, n)))) for _ in range(10)
        ]:
            assert_streams_exactly(detok, ids, list(cuts), expected)


def test_stream_ending_inside_a_character(tokenizer, detok):
    ids = tokenizer.encode("ab中").ids[:-1]  # ends with 2 of the 3 bytes of 中
    expected = tokenizer.decode(ids)
    assert expected.endswith("\ufffd")
    # Non-final: the unfinished tail is held back.
    assert detok.delta([], ids, final=False) == "ab"
    # A final chunk with no new ids flushes what its context held back.
    assert detok.delta(ids[-CONTEXT_IDS:], [], final=True) == "\ufffd"
    for cuts in [(), (1,), (2,), (1, 2), (1, 2, 3)]:
        assert_streams_exactly(detok, ids, [c for c in cuts if c < len(ids)], expected)


def test_special_tokens_are_skipped_in_the_stream(tokenizer, detok):
    ids = tokenizer.encode("你好 🙂").ids
    ids = ids[:2] + [SPECIAL_EOS] + ids[2:] + [SPECIAL_EOS]
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    assert expected == "你好 🙂"
    for cuts in [*[(c,) for c in range(1, len(ids))], tuple(range(1, len(ids)))]:
        assert_streams_exactly(detok, ids, list(cuts), expected)
    keep = StreamDetokenizer(tokenizer, skip_special_tokens=False)
    full = tokenizer.decode(ids, skip_special_tokens=False)
    assert "<｜end▁of▁sentence｜>" in full
    assert_streams_exactly(keep, ids, list(range(1, len(ids))), full)


def test_context_limit(tokenizer, detok):
    """The documented limit: the context must reach the lead byte of a held-back
    character. With more than CONTEXT_IDS - 3 skipped specials between the lead bytes
    and the rest, one character comes out as U+FFFD; a longer context fixes it."""
    zhong = tokenizer.encode("中").ids  # 3 byte tokens
    assert len(zhong) == 3
    ids = [*zhong[:1], *[SPECIAL_EOS] * CONTEXT_IDS, *zhong[1:], *tokenizer.encode("ok").ids]
    cut = 1 + CONTEXT_IDS  # the second chunk starts with the continuation bytes
    expected = tokenizer.decode(ids)
    assert expected == "中ok"
    got = "".join(stream(detok, ids, [cut]))
    assert got != expected and got.endswith("ok") and "\ufffd" in got
    # The same split is exact when the whole history is the context.
    head, tail = ids[:cut], ids[cut:]
    assert detok.delta([], head, final=False) + detok.delta(head, tail, final=True) == expected


def test_out_of_vocabulary_id_is_an_error(detok):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        detok.delta([], [5, 1024], final=True)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        detok.delta([-1], [5], final=True)


def test_postprocessor_tensors(tokenizer):
    """The numpy layer the postprocessing model.py calls: INT32 ids in, one UTF-8
    string out; a non-empty finish_reason marks the final chunk."""
    post = Postprocessor(tokenizer)
    ids = np.asarray(tokenizer.encode("东京🙂").ids, dtype=np.int32)
    cut = len(ids) - 1
    assert tokenizer.decode(ids[:cut].tolist()).endswith("\ufffd")  # the cut is inside 🙂
    unfinished = np.array([b""], dtype=object)
    first = post.text_output(ids[:cut], np.zeros(0, np.int32), unfinished)
    assert first.dtype == object and first.shape == (1,)
    assert first[0].decode("utf-8") == "东京"
    rest = post.text_output(ids[cut:], ids[:cut][-CONTEXT_IDS:], np.array([b"stop"], dtype=object))
    assert rest[0].decode("utf-8") == "🙂"
    # Without finish_reason a chunk is not final: the unfinished 🙂 stays held back ...
    assert post.text_output(ids[:cut])[0].decode("utf-8") == "东京"
    # ... and with one it is flushed as U+FFFD, as a full decode would show it.
    flushed = post.text_output(ids[:cut], None, np.array([b"length"], dtype=object))
    assert flushed[0].decode("utf-8") == "东京\ufffd"


def _byte_fallback_tokenizer():
    """A SentencePiece-style tokenizer (Metaspace + ByteFallback decoder chain), the
    non-ByteLevel case: unknown characters fall back to <0xNN> byte tokens."""
    vocab = {"<unk>": 0}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "a", "b", "c", "o", "k", "▁a", "▁ok"]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
    ])
    return tok


def test_string_fallback_for_other_decoders():
    tok = _byte_fallback_tokenizer()
    d = StreamDetokenizer(tok)
    assert not d.byte_level
    for text in ["ab 中文 ok", "a 😀 b", "ok 東京"]:
        ids = tok.encode(text).ids
        expected = tok.decode(ids)
        assert expected == text
        assert any(tok.id_to_token(i).startswith("<0x") for i in ids)  # byte fallback used
        n = len(ids)
        for cuts in [(), *[(c,) for c in range(1, n)], tuple(range(1, n))]:
            assert_streams_exactly(d, ids, list(cuts), expected)
