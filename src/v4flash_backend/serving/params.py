"""Model-config parameters and paths for the Triton python models.

Triton hands a python model its config as JSON (``args["model_config"]``), where
``parameters { key: "k" value: { string_value: "v" } }`` becomes
``{"parameters": {"k": {"string_value": "v"}}}``, and its own directory as
``args["model_repository"]`` (e.g. ``<repo>/model_repository/preprocessing``).

Relative paths in parameters are resolved against the model repository root (the
directory holding all model directories), so a repository can be moved as a whole.
"""

from __future__ import annotations

import re
from pathlib import Path

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def model_parameters(model_config: dict) -> dict[str, str]:
    """The ``parameters`` block of a model config as ``{key: string_value}``."""
    return {
        key: str(value.get("string_value", ""))
        for key, value in (model_config.get("parameters") or {}).items()
    }


def param_bool(params: dict[str, str], key: str, default: bool) -> bool:
    """A boolean parameter ("true"/"false", "1"/"0", "yes"/"no", "on"/"off")."""
    raw = params.get(key, "").strip().lower()
    if not raw:
        return default
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"parameter {key!r} must be true or false, got {params[key]!r}")


def resolve_path(value: str, model_dir: str | Path) -> Path:
    """``value`` as an absolute path; relative values are taken from the repository root."""
    path = Path(value).expanduser()
    if not path.is_absolute():
        path = Path(model_dir).resolve().parent / path
    return path.resolve()


# `key: "NAME" value: { string_value: "VALUE" }` inside a text-format config, with
# the optional ':' and ',' the protobuf text format allows. A regex, not a protobuf
# parser: it reads one string parameter of another model's config.pbtxt.
_PARAM_RE = r'key\s*:\s*"{key}"\s*,?\s*value\s*:?\s*\{{\s*string_value\s*:\s*"((?:[^"\\]|\\.)*)"'


def sibling_parameter(model_dir: str | Path, model_name: str, key: str) -> str | None:
    """A string parameter of another model of the same repository, or None.

    Lets the preprocessing model default to the checkpoint the engine model uses
    without repeating the path in two configs.
    """
    config = Path(model_dir).resolve().parent / model_name / "config.pbtxt"
    try:
        text = config.read_text(encoding="utf-8")
    except OSError:
        return None
    # Drop comments first so a commented-out parameter is not picked up.
    text = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    match = re.search(_PARAM_RE.format(key=re.escape(key)), text)
    if match is None:
        return None
    return match.group(1).encode("utf-8").decode("unicode_escape")
