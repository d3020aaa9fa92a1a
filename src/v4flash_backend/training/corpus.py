"""The training corpus of the embedded tiny model: the Python standard library's own source files.

Every machine that runs this project has them (they ship with the interpreter; PSF licence), so the
model can be rebuilt offline. Files are split into train and held-out parts BY FILE, from a hash of
the file's path relative to the stdlib root, so the split of a file never depends on which other
files exist (a different Python patch release moves no file between the parts) and is the same on
every run. Test suites, codec tables and generated data modules are left out: they are large, look
little like ordinary code, and would dominate a small corpus.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# path components whose files are not used (tests, codec tables, generated data, vendored packages)
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__",
                           "encodings", "pydoc_data", "lib2to3", "ensurepip", "turtledemo"})
MAX_FILE_BYTES = 400_000  # a handful of huge generated modules would otherwise dominate
HELDOUT_PERCENT = 5
SPLIT_SALT = "v4flash-tiny-split-v1"


@dataclass(frozen=True)
class SourceFile:
    rel: str  # path relative to the stdlib root, '/'-separated
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_files(root: str | Path | None = None) -> list[str]:
    """Sorted relative paths of the usable .py files under `root` (default: this interpreter's stdlib)."""
    root = Path(root) if root is not None else stdlib_root()
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if any(part in EXCLUDED_DIRS for part in rel.parts[:-1]):
            continue
        if rel.name.startswith("test_") or not p.is_file() or p.stat().st_size > MAX_FILE_BYTES:
            continue
        out.append(rel.as_posix())
    return sorted(out)


def is_heldout(rel: str, percent: int = HELDOUT_PERCENT, salt: str = SPLIT_SALT) -> bool:
    """Held-out membership of one file from its relative path alone (stable across machines)."""
    h = hashlib.sha256(f"{salt}:{rel}".encode()).digest()
    return int.from_bytes(h[:8], "little") % 100 < percent


def split_files(rels: list[str], percent: int = HELDOUT_PERCENT) -> tuple[list[str], list[str]]:
    """(train, heldout), each sorted."""
    train = sorted(r for r in rels if not is_heldout(r, percent))
    held = sorted(r for r in rels if is_heldout(r, percent))
    return train, held


def read_files(rels: list[str], root: str | Path | None = None) -> list[SourceFile]:
    root = Path(root) if root is not None else stdlib_root()
    out = []
    for rel in rels:
        text = (root / rel).read_text(encoding="utf-8", errors="replace")
        if text.strip():
            out.append(SourceFile(rel, text))
    return out


def load_corpus(root: str | Path | None = None, percent: int = HELDOUT_PERCENT):
    """(train files, held-out files) as SourceFile lists."""
    train, held = split_files(list_files(root), percent)
    return read_files(train, root), read_files(held, root)


def digest(files: list[SourceFile]) -> str:
    """sha256 over (path, text) of the files, to tell whether two machines trained on the same data."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.rel.encode() + b"\0" + f.text.encode("utf-8", errors="replace") + b"\0")
    return h.hexdigest()
