"""The `v4flash` model's parameters (config.pbtxt) and where its checkpoint comes from.

Every parameter is a string in config.pbtxt (``parameters { key: "k" value: {
string_value: "v" } }``); `load_settings` parses them with the one schema
(`v4flash_backend.settings.Settings`, which names the offending key when one does not
parse) and resolves the checkpoint and the other path settings.

Checkpoint lookup (`resolve_checkpoint_dir`), first match wins:
  1. the ``checkpoint_dir`` parameter, when non-empty (relative paths start at the model
     repository root); it must exist, a typo is an error rather than a silent fallback;
  2. the environment variable ``V4FLASH_CHECKPOINT_DIR``;
  3. the embedded default (`default_checkpoint_dir`): ``models/v4flash-tiny`` beside the
     model repository (the small model trained for the out-of-the-box demo) when it
     exists, else the golden tiny checkpoint ``../shared/golden/v41-tiny`` (random
     weights: it serves and streams, but its text is noise). The fallback is logged.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

from v4flash_backend.settings import Settings

from .params import model_parameters, resolve_path, sibling_parameter

CHECKPOINT_ENV = "V4FLASH_CHECKPOINT_DIR"
# Both relative to the directory that holds the model repository (the repo root).
EMBEDDED_CHECKPOINT = "models/v4flash-tiny"
GOLDEN_CHECKPOINT = "../shared/golden/v41-tiny"

def default_checkpoint_dir(model_repository: str | Path) -> tuple[Path, str]:
    """(path, why) of the embedded default checkpoint for a model repository root.

    ``models/v4flash-tiny`` beside the repository if it holds a config.json, else the
    golden tiny checkpoint. ``why`` says which one and is meant for the log.
    """
    root = Path(model_repository).resolve().parent
    embedded = root / EMBEDDED_CHECKPOINT
    if (embedded / "config.json").is_file():
        return embedded, f"embedded default {embedded}"
    golden = (root / GOLDEN_CHECKPOINT).resolve()
    return golden, (f"{embedded} does not exist (yet); falling back to the golden tiny "
                    f"checkpoint {golden} (random weights: the text it generates is noise)")


def resolve_checkpoint_dir(value: str, model_dir: str | Path) -> tuple[Path, str]:
    """(checkpoint directory, how it was chosen) for a ``checkpoint_dir`` parameter value.

    ``model_dir`` is the model's own directory (``args["model_repository"]``). Raises
    FileNotFoundError naming what was tried when the chosen directory has no config.json.
    """
    if value.strip():
        path, why = resolve_path(value, model_dir), "parameter checkpoint_dir"
    elif os.environ.get(CHECKPOINT_ENV):
        path, why = resolve_path(os.environ[CHECKPOINT_ENV], model_dir), f"${CHECKPOINT_ENV}"
    else:
        path, why = default_checkpoint_dir(Path(model_dir).resolve().parent)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"checkpoint directory {path} (from {why}) has no config.json")
    return path, why


def repository_checkpoint_dir(model_repository: str | Path, model_name: str = "v4flash") -> tuple[Path, str]:
    """(path, why) of the checkpoint the engine model of a repository serves: its config.pbtxt's
    checkpoint_dir parameter, then the environment, then the embedded default. For the
    pre/postprocessing models (their tokenizer) and scripts/serve.sh."""
    model_dir = Path(model_repository) / model_name
    return resolve_checkpoint_dir(sibling_parameter(model_dir, model_name, "checkpoint_dir") or "", model_dir)


class LoadedSettings(NamedTuple):
    settings: Settings  # checkpoint_dir and the other path settings absolute
    checkpoint_source: str  # how checkpoint_dir was chosen (for the log)
    unknown: dict[str, str]  # parameters the schema does not know (logged, not an error)


def load_settings(model_config: dict, model_dir: str | Path) -> LoadedSettings:
    """Parse ``json.loads(args["model_config"])``; ``model_dir`` is ``args["model_repository"]``."""
    params = model_parameters(model_config)
    settings, unknown = Settings.from_params(params, lambda v: resolve_path(v, model_dir))
    ckpt, source = resolve_checkpoint_dir(params.get("checkpoint_dir", ""), model_dir)
    return LoadedSettings(settings.replace(checkpoint_dir=str(ckpt)), source, unknown)


def tokenizer_path(settings: Settings) -> Path:
    """The tokenizer.json text_input uses: the tokenizer_dir setting (a file or its directory),
    else the checkpoint's."""
    if settings.tokenizer_dir:
        path = Path(settings.tokenizer_dir)
        return path / "tokenizer.json" if path.is_dir() else path
    return Path(settings.checkpoint_dir) / "tokenizer.json"
