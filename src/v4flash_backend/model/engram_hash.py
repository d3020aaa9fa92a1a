"""Engram n-gram hashing for DeepSeek-V4.1-Flash.

Turns token ids into the row indices of the Engram embedding tables (one table per Engram layer).
The rules follow the official V4.1 ``inference/engram.py`` as restated in
the project notes beside the repository (../shared/notes/v41_architecture.md section 3, "Engram
hash") and ../shared/golden/v41-tiny/README.md section 3:

* tokens are first mapped onto a *compressed* vocabulary (tokens that normalise alike share an id);
* position t is hashed with the compressed ids of t, t-1, ..., t-(max_ngram-1) ("slots");
  a slot before the start of the sequence or on a dead token (image span) blocks itself and every
  older slot, which then take the pad token's compressed id;
* rolling = XOR_i slot_i * multiplier_i; after adding slot n-1 the value is the n-gram hash,
  reduced modulo one prime per (layer, order, head) and shifted by that bucket range's offset.

The hasher is stateless: the caller keeps a per-sequence *history* of compressed ids indexed by
absolute position. Writing a position overwrites whatever was there, so rolling back rejected
speculative tokens costs nothing (the next write simply replaces them).
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np
import torch

# A history entry that blocks look-back: dead tokens (image spans) and never-written slots.
DEAD = -1


# ---------------------------------------------------------------------------------------------
# Compressed token map
# ---------------------------------------------------------------------------------------------


def _raw_tokenizer(tokenizer):
    """Accept a `tokenizers.Tokenizer`, a path to tokenizer.json, or a HF tokenizer wrapper."""
    import tokenizers

    if isinstance(tokenizer, (str, os.PathLike)):
        return tokenizers.Tokenizer.from_file(os.fspath(tokenizer))
    # transformers' fast tokenizers wrap the Rust tokenizer; the reference decodes with the raw one
    # (no clean_up_tokenization_spaces), so unwrap it.
    return getattr(tokenizer, "backend_tokenizer", tokenizer)


def build_compressed_token_map(tokenizer) -> tuple[list[int], int]:
    """Return (lookup, compressed_vocab_size): lookup[token_id] = compressed id.

    Every id (added tokens included) is decoded alone. Texts that are a partial UTF-8 sequence
    (contain U+FFFD) are keyed by their raw token string, since normalising the replacement char
    would merge unrelated byte tokens. Otherwise the key is the normalised text; compressed ids
    are handed out in order of first appearance of a key.
    """
    from tokenizers import Regex, normalizers

    tok = _raw_tokenizer(tokenizer)
    # Stage 1: unicode folding and whitespace collapse.
    fold = normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        ]
    )
    # Stage 2: strip. A text that is exactly one space is exempt (the reference protects it with a
    # private-use sentinel), otherwise every whitespace token would collapse to "" and then fall
    # back to its raw text, giving different keys for " " and "  ".
    strip = normalizers.Strip()

    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    key_to_id: dict[str, int] = {}
    lookup: list[int] = []
    for token_id in range(vocab_size):
        text = tok.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tok.id_to_token(token_id)
        else:
            folded = fold.normalize_str(text)
            key = folded if folded == " " else strip.normalize_str(folded)
            if not key:
                key = text
        lookup.append(key_to_id.setdefault(key, len(key_to_id)))
    return lookup, len(key_to_id)


# ---------------------------------------------------------------------------------------------
# Hash parameters
# ---------------------------------------------------------------------------------------------


def hash_multipliers(layer_ids: Sequence[int], max_ngram_size: int, compressed_vocab_size: int) -> torch.Tensor:
    """[n_layers, max_ngram_size] int64 odd multipliers, one RNG stream per layer id.

    The bound keeps compressed_id * multiplier below 2**63 (no int64 overflow in the hash).
    """
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
    rows = []
    for layer_id in layer_ids:
        draws = np.random.default_rng(10007 * int(layer_id)).integers(0, bound, size=max_ngram_size, dtype=np.int64)
        rows.append(draws * 2 + 1)
    return torch.from_numpy(np.stack(rows).astype(np.int64)).reshape(len(layer_ids), max_ngram_size)


def bucket_primes(n_layers: int, max_ngram_size: int, n_heads: int, engram_vocab_size: int) -> list[list[list[int]]]:
    """primes[layer][order - 2][head]: bucket moduli, each prime used once across all layers.

    Within a (layer, order) the heads take successive primes above engram_vocab_size - 1; the
    search restarts there for every (layer, order) and skips primes already handed out.
    """
    from sympy import nextprime

    used: set[int] = set()
    primes = []
    for _ in range(n_layers):
        per_order = []
        for _ in range(max_ngram_size - 1):
            heads, current = [], engram_vocab_size - 1
            for _ in range(n_heads):
                current = nextprime(current)
                while current in used:
                    current = nextprime(current)
                used.add(current)
                heads.append(int(current))
            per_order.append(heads)
        primes.append(per_order)
    return primes


def bucket_offsets(primes: list[list[list[int]]]) -> torch.Tensor:
    """[n_layers, (max_ngram-1)*heads]: exclusive cumulative sum of a layer's primes, (order, head) order."""
    rows = []
    for layer in primes:
        flat = [p for order in layer for p in order]
        rows.append([sum(flat[:i]) for i in range(len(flat))])
    return torch.tensor(rows, dtype=torch.int64)


def table_rows(primes: list[list[list[int]]]) -> list[int]:
    """Rows of each layer's Engram table (= engram_num_embeddings): the sum of its primes."""
    return [sum(p for order in layer for p in order) for layer in primes]


# ---------------------------------------------------------------------------------------------
# Hasher
# ---------------------------------------------------------------------------------------------


class EngramHasher:
    """Vectorised Engram hash with an explicit compressed-id history.

    Shapes: B batch, L new positions, N = max_ngram_size, C = (N-1) * n_heads hash columns.
    Outputs are table row indices [..., n_layers, C] (offsets included), int64.
    """

    DEAD = DEAD

    def __init__(
        self,
        token_map: Sequence[int] | torch.Tensor,
        compressed_vocab_size: int,
        layer_ids: Sequence[int],
        max_ngram_size: int,
        n_heads: int,
        engram_vocab_size: int,
        pad_id: int,
        num_embeddings: Sequence[int] | None = None,
    ):
        if max_ngram_size < 2:
            raise ValueError(f"engram max_ngram_size must be >= 2, got {max_ngram_size}")
        self.token_map = torch.as_tensor(token_map, dtype=torch.int64)
        if self.token_map.numel() and int(self.token_map.max()) >= compressed_vocab_size:
            raise ValueError("token_map holds ids >= compressed_vocab_size")
        self.compressed_vocab_size = int(compressed_vocab_size)
        self.layer_ids = [int(i) for i in layer_ids]
        self.max_ngram_size = int(max_ngram_size)
        self.n_heads = int(n_heads)
        self.pad_compressed_id = int(self.token_map[pad_id])

        self.primes_list = bucket_primes(len(self.layer_ids), self.max_ngram_size, self.n_heads, engram_vocab_size)
        self.num_embeddings = table_rows(self.primes_list)
        if num_embeddings is not None and list(num_embeddings) != self.num_embeddings:
            raise ValueError(
                f"engram_num_embeddings {list(num_embeddings)} != sum of bucket primes {self.num_embeddings}"
            )
        # [n_layers, N-1, heads]
        self.primes = torch.tensor(self.primes_list, dtype=torch.int64).reshape(
            len(self.layer_ids), self.max_ngram_size - 1, self.n_heads
        )
        self.offsets = bucket_offsets(self.primes_list).reshape(len(self.layer_ids), -1)
        self.multipliers = hash_multipliers(self.layer_ids, self.max_ngram_size, self.compressed_vocab_size)

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_tokenizer(
        cls,
        tokenizer,
        *,
        layer_ids: Sequence[int],
        max_ngram_size: int,
        n_heads: int,
        engram_vocab_size: int,
        pad_id: int,
        compressed_vocab_size: int | None = None,
        num_embeddings: Sequence[int] | None = None,
    ) -> "EngramHasher":
        token_map, size = build_compressed_token_map(tokenizer)
        # Every multiplier depends on the compressed vocab size, so a tokenizer mismatch would
        # silently rehash the whole table: refuse it.
        if compressed_vocab_size is not None and size != compressed_vocab_size:
            raise ValueError(
                f"tokenizer gives compressed vocab {size}, config engram_compressed_vocab_size is "
                f"{compressed_vocab_size}: wrong tokenizer for this checkpoint"
            )
        return cls(token_map, size, layer_ids, max_ngram_size, n_heads, engram_vocab_size, pad_id, num_embeddings)

    @classmethod
    def from_config(cls, cfg, tokenizer) -> "EngramHasher":
        """cfg: anything with the engram_* fields of config.json (e.g. ModelConfig)."""
        return cls.from_tokenizer(
            tokenizer,
            layer_ids=cfg.engram_layer_ids,
            max_ngram_size=cfg.engram_max_ngram_size,
            n_heads=cfg.engram_n_heads,
            engram_vocab_size=cfg.engram_vocab_size,
            pad_id=cfg.engram_pad_id,
            compressed_vocab_size=cfg.engram_compressed_vocab_size,
            num_embeddings=cfg.engram_num_embeddings,
        )

    def to(self, device) -> "EngramHasher":
        for name in ("token_map", "primes", "offsets", "multipliers"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    @property
    def n_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def n_cols(self) -> int:
        return (self.max_ngram_size - 1) * self.n_heads

    # -- compressed ids and history --------------------------------------------------------------

    def compress(self, input_ids: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Compressed ids of raw token ids; DEAD where token_mask is False (image-span tokens)."""
        input_ids = torch.as_tensor(input_ids, dtype=torch.int64)
        if input_ids.numel():
            lo, hi = int(input_ids.min()), int(input_ids.max())
            if lo < 0 or hi >= self.token_map.numel():
                # negative ids would silently wrap around in tensor indexing
                raise ValueError(f"token ids must lie in [0, {self.token_map.numel()}), got range [{lo}, {hi}]")
        out = self.token_map[input_ids]
        if token_mask is not None:
            out = torch.where(token_mask.to(torch.bool), out, torch.full_like(out, DEAD))
        return out

    def new_history(self, batch: int, max_len: int, device=None) -> torch.Tensor:
        """An empty [batch, max_len] history. Unwritten entries are DEAD; a correct caller never
        reads them because look-back only reaches positions written earlier."""
        return torch.full((batch, max_len), DEAD, dtype=torch.int64, device=device)

    @staticmethod
    def _positions(start_pos, batch: int, seqlen: int, device) -> torch.Tensor:
        start = torch.as_tensor(start_pos, dtype=torch.int64, device=device).reshape(-1)
        if start.numel() == 1:
            start = start.expand(batch)
        if start.numel() != batch:
            raise ValueError(f"start_pos has {start.numel()} entries for batch {batch}")
        return start[:, None] + torch.arange(seqlen, dtype=torch.int64, device=device)

    def write_history(self, history: torch.Tensor, compressed: torch.Tensor, positions: torch.Tensor) -> None:
        """history[b, positions[b, l]] = compressed[b, l] (in place)."""
        if int(positions.min()) < 0 or int(positions.max()) >= history.shape[-1]:
            raise IndexError(f"positions outside the history buffer of length {history.shape[-1]}")
        history.scatter_(1, positions, compressed)

    # -- hashing --------------------------------------------------------------------------------

    def hash_windows(self, windows: torch.Tensor) -> torch.Tensor:
        """windows [..., N]: windows[..., i] = compressed id at position t - i (negative = blocked:
        before the sequence start or a dead token). Returns [..., n_layers, C] table rows."""
        # A blocked slot blocks every older slot too: an n-gram never spans the sequence start or
        # an image span.
        blocked = (windows < 0).to(torch.int32).cumsum(-1) > 0
        tokens = torch.where(blocked, torch.full_like(windows, self.pad_compressed_id), windows)
        products = tokens.unsqueeze(-2) * self.multipliers  # [..., n_layers, N]
        rolling = products[..., 0]
        cols = []
        for order in range(1, self.max_ngram_size):
            rolling = torch.bitwise_xor(rolling, products[..., order])
            # all operands are non-negative, so % is the mathematical modulo
            cols.append(rolling.unsqueeze(-1) % self.primes[:, order - 1])  # [..., n_layers, heads]
        return torch.cat(cols, dim=-1) + self.offsets

    def hash_history(self, history: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hash ids of `positions` ([B, L] or [L] absolute positions) from a compressed-id
        `history` ([B, T] or [T], indexed by absolute position). Returns [B, L, n_layers, C]
        (or [L, n_layers, C] for 1-D inputs)."""
        squeeze = history.dim() == 1
        if squeeze:
            history = history.unsqueeze(0)
        positions = torch.as_tensor(positions, dtype=torch.int64, device=history.device)
        if positions.dim() == 1:
            positions = positions.unsqueeze(0).expand(history.shape[0], -1)
        batch, seqlen = positions.shape
        idx = positions.unsqueeze(-1) - torch.arange(self.max_ngram_size, device=history.device)  # [B, L, N]
        if seqlen and int(idx.max()) >= history.shape[1]:
            raise IndexError(f"position {int(positions.max())} beyond history length {history.shape[1]}")
        src = history.gather(1, idx.clamp_min(0).reshape(batch, -1)).reshape(batch, seqlen, self.max_ngram_size)
        src = torch.where(idx >= 0, src, torch.full_like(src, DEAD))
        out = self.hash_windows(src)
        return out[0] if squeeze else out

    def hash_tokens(
        self,
        input_ids: torch.Tensor,
        start_pos: int | torch.Tensor = 0,
        history: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hash new raw tokens input_ids [B, S] placed at positions start_pos[b] + s.

        With `history` ([B, T] compressed ids by absolute position) the new compressed ids are
        written into it (in place) and the look-back reads earlier entries: use this for chunked
        prefill, decode (S = 1) and speculative verification (S = draft length). Without a
        history only start_pos == 0 is allowed (nothing older to look back to).
        Returns [B, S, n_layers, C].
        """
        input_ids = torch.as_tensor(input_ids, dtype=torch.int64)
        batch, seqlen = input_ids.shape
        compressed = self.compress(input_ids, token_mask)
        positions = self._positions(start_pos, batch, seqlen, input_ids.device)
        if history is None:
            if seqlen and bool((positions[:, 0] != 0).any()):
                raise ValueError("hash_tokens without a history needs start_pos == 0")
            history = compressed
        else:
            self.write_history(history, compressed, positions)
        return self.hash_history(history, positions)
