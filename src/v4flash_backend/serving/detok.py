"""Stateless, exact streaming detokenization for the ensemble's postprocessing step.

The engine streams token chunks. Each chunk carries its new ids plus ``context_ids``:
the last <= ``CONTEXT_IDS`` committed ids before the chunk (prompt ids for the first
chunk, or none). The postprocessing model keeps no state between chunks, yet the
concatenation of its text deltas must equal ``tokenizer.decode(all generated ids)``
exactly, including multi-byte characters (CJK, emoji) whose bytes are split across
tokens and chunks. Known stateless postprocessors decode every chunk on its own and
stream U+FFFD instead (triton-inference-server/tensorrtllm_backend issues 192 and 493).

Rule: a chunk emits ``decode(context + new)`` minus ``decode(context)``, where both
decodes leave out a trailing *incomplete* UTF-8 character (a lead byte plus fewer
continuation bytes than it announces), unless the chunk is the final one, which
flushes everything the way a full ``decode`` would (an incomplete tail becomes
U+FFFD). The bytes a chunk held back are emitted by the next chunk, because they are
the tail of that chunk's context.

Byte-level BPE (``tokenizers`` ``ByteLevel`` decoder: GPT-2, DeepSeek): every id maps to
a fixed byte string and ``decode`` is ``bytes.decode('utf-8', 'replace')`` of their
concatenation (Rust's ``from_utf8_lossy`` and Python's 'replace' handler both follow
Unicode's "maximal subpart" practice). So the rule is run on bytes with Python's
incremental UTF-8 decoder: feed the context bytes, discard that text, and the text
for the new bytes is exactly the delta; the decoder itself holds back the pending
bytes of an unfinished character (at most 3). Invalid bytes before them are emitted
at once as U+FFFD, so a run of invalid bytes is never held back.

Limit: exactness needs the context to reach back to the first held-back byte.
There are at most 3 of them, so they start in one of the last 3 ids that produced
bytes; with 8 ids of context the rule is exact unless more than 5 of the last 8 ids
decode to nothing (special tokens skipped by ``skip_special_tokens``) right after an
unfinished character. Then the orphaned continuation bytes decode to U+FFFD: the
stream shows "\ufffd" instead of that one character, and goes on exactly from the
next character boundary (tests/test_detok.py::test_context_limit).

Other decoders (SentencePiece-style ``ByteFallback``/``Metaspace`` chains) fall back
to the same rule on strings, with "complete" meaning: the text of the longest prefix
of whole tokens that does not end in U+FFFD (vLLM's incremental detokenizer also
treats a trailing U+FFFD as unfinished). Valid text streams exactly. Invalid byte
runs are not exact there: a genuine run of U+FFFD (invalid bytes, or the literal
character) is held back as well, and ByteFallback rewrites a whole byte run as
U+FFFD when any byte of it is invalid, which no stream can take back.
"""

from __future__ import annotations

import codecs
from typing import Iterable, Sequence

from tokenizers import Tokenizer, decoders

# The number of committed ids before a chunk that the engine sends as context_ids.
CONTEXT_IDS = 8

_REPLACEMENT = "\ufffd"


def _byte_level_chars() -> dict[str, int]:
    """Char -> byte map of byte-level BPE vocabularies (GPT-2's ``bytes_to_unicode``).

    Printable Latin-1 bytes stand for themselves; the other 68 bytes are shifted to
    U+0100.. in increasing byte order, so every vocabulary string is printable.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\u00a1"), ord("\u00ac") + 1),
        *range(ord("\u00ae"), ord("\u00ff") + 1),
    ]
    table = {chr(b): b for b in printable}
    kept = set(printable)
    shifted = 0
    for b in range(256):
        if b not in kept:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


def _ids_list(ids: Iterable[int]) -> list[int]:
    # numpy arrays, lists and tuples alike; int() so numpy scalars index lists.
    return [int(i) for i in ids]


class StreamDetokenizer:
    """Decodes token chunks statelessly; see the module docstring for the rule.

    ``decode(ids)`` equals ``tokenizer.decode(ids, skip_special_tokens)``;
    ``delta(context_ids, new_ids, final)`` is the text one chunk adds to the stream.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._id_bytes = (
            self._byte_table(tokenizer, skip_special_tokens)
            if isinstance(tokenizer.decoder, decoders.ByteLevel)
            else None
        )

    @property
    def byte_level(self) -> bool:
        """True when the exact byte path is used (ByteLevel decoder)."""
        return self._id_bytes is not None

    @staticmethod
    def _byte_table(tokenizer: Tokenizer, skip_special_tokens: bool) -> list[bytes]:
        chars = _byte_level_chars()
        special = {
            i for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special
        }
        table = []
        for i in range(tokenizer.get_vocab_size(with_added_tokens=True)):
            token = tokenizer.id_to_token(i)
            if token is None or (skip_special_tokens and i in special):
                table.append(b"")  # decode() drops unknown ids and skipped specials
                continue
            try:
                table.append(bytes(chars[c] for c in token))
            except KeyError:
                # Tokens outside the byte alphabet (added tokens such as
                # "<｜end▁of▁sentence｜>") decode to their own UTF-8 text.
                table.append(token.encode("utf-8"))
        return table

    def _bytes(self, ids: Sequence[int]) -> bytes:
        table = self._id_bytes
        n = len(table)
        out = []
        for i in ids:
            if not 0 <= i < n:
                raise ValueError(f"token id {i} is outside the vocabulary [0, {n})")
            out.append(table[i])
        return b"".join(out)

    def decode(self, ids: Iterable[int]) -> str:
        """The full text of ``ids``."""
        ids = _ids_list(ids)
        if self._id_bytes is None:
            return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
        return self._bytes(ids).decode("utf-8", "replace")

    def delta(self, context_ids: Iterable[int], new_ids: Iterable[int], final: bool) -> str:
        """Text added by a chunk of ``new_ids`` that follows ``context_ids``.

        ``final`` marks the last chunk of the stream: it also emits a trailing
        unfinished character (as U+FFFD, as a full decode would).
        """
        context, new = _ids_list(context_ids), _ids_list(new_ids)
        if self._id_bytes is not None:
            decoder = codecs.getincrementaldecoder("utf-8")("replace")
            decoder.decode(self._bytes(context), final=False)  # leaves the held-back tail pending
            return decoder.decode(self._bytes(new), final=final)
        return self._string_delta(context, new, final)

    def _string_delta(self, context: list[int], new: list[int], final: bool) -> str:
        before = self._stable_text(context)
        after = self._decode_str(context + new) if final else self._stable_text(context + new)
        # Exact when the decoder is prefix-stable on whole characters (decode of a
        # stable prefix is a prefix of every longer decode). A decoder whose text for
        # earlier tokens changes when more follow cannot be streamed exactly without
        # state, and text already sent stays sent, so the delta is taken by length.
        return after[len(before):]

    def _decode_str(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _stable_text(self, ids: list[int]) -> str:
        """Text of the longest id prefix whose decode does not end in U+FFFD.

        Backs off whole tokens rather than trimming characters: a ByteFallback
        decoder turns a whole run of byte tokens into U+FFFD (one per byte) while
        any of it is unfinished, so text it showed for earlier tokens can turn into
        U+FFFD once an unfinished character follows.
        """
        for end in range(len(ids), 0, -1):
            text = self._decode_str(ids[:end])
            if not text.endswith(_REPLACEMENT):
                return text
        return ""
