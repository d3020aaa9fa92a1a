"""The values of a setting: parsing a config.pbtxt string or a flag into a field's type and checking
it (type, choices, bounds) -- the part of the settings schema (`settings.Settings`, where every field
is declared) that does not depend on which fields there are; and reading the LNC degree out of a
neuronx-cc flag string, which `Settings` checks against neuron_lnc (and `trn2.launch` builds with)."""

from __future__ import annotations

import math
import shlex

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}

_PY_TYPES = {"int": int, "float": float, "str": str, "bool": bool}
_LNC_FLAGS = ("--lnc", "-lnc", "--logical-nc-config")  # neuronx-cc's spellings of the LNC option


def flag_lnc(flags: str, name: str = "flags") -> int | None:
    """The LNC degree a neuronx-cc flag string names (`--lnc=2`, `--lnc 2`, `--logical-nc-config 2`),
    or None when it names none."""
    words = shlex.split(flags)
    found = None
    for i, w in enumerate(words):
        key, eq, value = w.partition("=")
        if key not in _LNC_FLAGS:
            continue
        if not eq:
            value = words[i + 1] if i + 1 < len(words) else ""
        try:
            found = int(value)
        except ValueError:
            raise ValueError(f"setting {name!r}: {key} needs an integer, got {value!r}") from None
    return found


def _parse_bool(key: str, raw) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"setting {key!r} must be true or false, got {raw!r}")


def _parse(f, raw: str):
    """A config.pbtxt string value as the field's type (range checks happen in _coerce)."""
    kind = _PY_TYPES[str(f.type)]
    text = raw.strip()
    if kind is bool:
        return _parse_bool(f.name, text)
    if kind is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"setting {f.name!r} must be an integer, got {raw!r}") from None
    if kind is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"setting {f.name!r} must be a number, got {raw!r}") from None
    return text


def _coerce(f, value):
    """Type and range check of one field's value (from Python, JSON or parsed text)."""
    kind = _PY_TYPES[str(f.type)]
    m = f.metadata
    if kind is bool:
        if not isinstance(value, bool):
            raise ValueError(f"setting {f.name!r} must be true or false, got {value!r}")
    elif kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"setting {f.name!r} must be an integer, got {value!r}")
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"setting {f.name!r} must be a number, got {value!r}")
        value = float(value)
    else:
        if not isinstance(value, str):
            value = str(value)  # a Path
    if m["choices"] and value not in m["choices"]:
        raise ValueError(f"setting {f.name!r} must be one of {', '.join(c or repr(c) for c in m['choices'])}, "
                         f"got {value!r}")
    if m["low"] is not None and value < m["low"]:
        raise ValueError(f"setting {f.name!r} must be >= {m['low']}, got {value}")
    if m["positive"] and not value > 0:
        raise ValueError(f"setting {f.name!r} must be > 0, got {value}")
    return value
