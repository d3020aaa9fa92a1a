"""The `v4flash` model's parameters (config.pbtxt) and where its checkpoint comes from.

Every parameter is a string in config.pbtxt (``parameters { key: "k" value: {
string_value: "v" } }``); `ServingSettings.from_model_config` turns them into typed
fields and names the offending key when one does not parse.

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
from dataclasses import dataclass, field
from pathlib import Path

from .params import model_parameters, param_bool, resolve_path, sibling_parameter

CHECKPOINT_ENV = "V4FLASH_CHECKPOINT_DIR"
# Both relative to the directory that holds the model repository (the repo root).
EMBEDDED_CHECKPOINT = "models/v4flash-tiny"
GOLDEN_CHECKPOINT = "../shared/golden/v41-tiny"

OPS_BACKENDS = ("torch", "nki", "nki-sim")
LAUNCHERS = ("torchrun", "inprocess")


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


def _int(params: dict[str, str], key: str, default: int, low: int | None = None) -> int:
    raw = params.get(key, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"parameter {key!r} must be an integer, got {raw!r}") from None
    if low is not None and value < low:
        raise ValueError(f"parameter {key!r} must be >= {low}, got {value}")
    return value


def _float(params: dict[str, str], key: str, default: float) -> float:
    raw = params.get(key, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"parameter {key!r} must be a number, got {raw!r}") from None
    if not value > 0:
        raise ValueError(f"parameter {key!r} must be > 0, got {value}")
    return value


def _choice(params: dict[str, str], key: str, default: str, choices: tuple[str, ...]) -> str:
    value = params.get(key, "").strip() or default
    if value not in choices:
        raise ValueError(f"parameter {key!r} must be one of {', '.join(choices)}, got {value!r}")
    return value


@dataclass
class ServingSettings:
    """Typed view of the v4flash model parameters (defaults = the CPU demo)."""

    checkpoint_dir: Path
    checkpoint_source: str = ""  # how checkpoint_dir was chosen (for the log)
    world_size: int = 1  # ranks of the torchrun group (64 on trn2.48xlarge)
    ops_backend: str = "torch"  # torch | nki | nki-sim
    numerics: str = ""  # "" = the ops default (exact on CPU)
    max_num_seqs: int = 8  # KV slots = requests decoded together
    max_model_len: int = 1024  # prompt + generated tokens per request
    dspark: bool = True  # DSpark speculative decoding on/off
    prefill_chunk: int = 256
    default_max_tokens: int = 64  # when a request gives no max_tokens
    launcher: str = "torchrun"  # torchrun (rank group) | inprocess (W = 1, no subprocess)
    rank_group_address: str = ""  # host:port of an externally started group ("" = launch one)
    startup_timeout_s: float = 900.0
    sps_path: str = ""  # DSpark steps/s table cache ("" = profile at every start)
    tokenizer_file: Path | None = None  # for text_input; None = checkpoint's tokenizer.json
    add_special_tokens: bool = True
    skip_special_tokens: bool = True
    stats_interval_s: float = 0.5  # how often the KV-slot gauge is refreshed
    extra: dict[str, str] = field(default_factory=dict)  # parameters this class does not know

    KNOWN = (
        "checkpoint_dir", "world_size", "ops_backend", "numerics", "max_num_seqs", "max_model_len",
        "dspark", "prefill_chunk", "default_max_tokens", "launcher", "rank_group_address",
        "startup_timeout_s", "sps_path", "tokenizer_dir", "add_special_tokens",
        "skip_special_tokens", "stats_interval_s",
    )

    @property
    def spec_mode(self) -> str:
        """The engine's spec_mode for the dspark switch."""
        return "dspark" if self.dspark else "off"

    @classmethod
    def from_model_config(cls, model_config: dict, model_dir: str | Path) -> "ServingSettings":
        """Parse ``json.loads(args["model_config"])``; ``model_dir`` is ``args["model_repository"]``."""
        p = model_parameters(model_config)
        ckpt, source = resolve_checkpoint_dir(p.get("checkpoint_dir", ""), model_dir)
        tokenizer = None
        if p.get("tokenizer_dir", "").strip():
            tokenizer = resolve_path(p["tokenizer_dir"], model_dir)
            if tokenizer.is_dir():
                tokenizer = tokenizer / "tokenizer.json"
        s = cls(
            checkpoint_dir=ckpt,
            checkpoint_source=source,
            world_size=_int(p, "world_size", 1, low=1),
            ops_backend=_choice(p, "ops_backend", "torch", OPS_BACKENDS),
            numerics=p.get("numerics", "").strip(),
            max_num_seqs=_int(p, "max_num_seqs", 8, low=1),
            max_model_len=_int(p, "max_model_len", 1024, low=2),
            dspark=param_bool(p, "dspark", True),
            prefill_chunk=_int(p, "prefill_chunk", 256, low=1),
            default_max_tokens=_int(p, "default_max_tokens", 64, low=1),
            launcher=_choice(p, "launcher", "torchrun", LAUNCHERS),
            rank_group_address=p.get("rank_group_address", "").strip(),
            startup_timeout_s=_float(p, "startup_timeout_s", 900.0),
            sps_path=str(resolve_path(p["sps_path"], model_dir)) if p.get("sps_path", "").strip() else "",
            tokenizer_file=tokenizer,
            add_special_tokens=param_bool(p, "add_special_tokens", True),
            skip_special_tokens=param_bool(p, "skip_special_tokens", True),
            stats_interval_s=_float(p, "stats_interval_s", 0.5),
            extra={k: v for k, v in p.items() if k not in cls.KNOWN},
        )
        if s.launcher == "inprocess" and s.world_size != 1:
            raise ValueError("parameter 'launcher' inprocess runs one rank: set world_size to 1")
        return s

    @property
    def tokenizer_path(self) -> Path:
        return self.tokenizer_file or self.checkpoint_dir / "tokenizer.json"
