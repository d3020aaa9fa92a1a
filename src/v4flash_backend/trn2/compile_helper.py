"""A helper process that compiles a background-compiling server's graph sets into inductor's cache
ahead of the server's own compile thread (trn2.warmup).

Why: the server's compile thread runs with a profile hook that pauses it while a step runs (both
threads share one GIL: warmup.py), and any profile hook makes CPython's interpreter take its slow
path: inductor's Python (tracing, lowering, code generation: most of a graph's ~3 minutes on this
project's 2-core machine) ran 2-3x slower under it. This process has no GIL to share and no hook: it
builds the same runner from the server's settings, compiles the same sets in the same order (the
server's `want`s reach it too) with inductor's FX graph and AOTAutograd caches on
($TORCHINDUCTOR_CACHE_DIR, inherited), at a lower priority than the server. The server's thread
waits for each set here, then compiles it itself from the cache: the dynamo trace and the cache's
load, a fraction of a cold compile, while this process compiles the next set on the other core.

The process runs `group/compile_helper.py`. Protocol (text lines): the server writes the settings'
JSON, then `want <key>` lines; the helper writes `done <key>` or `failed <key> <why>` per set. Keys:
JSON lists `[kind, [seqs, rows, ctx], processed?]` (`encode`). It exits when its stdin closes (the
server stopped or died). A helper that fails or exits leaves the server compiling every set itself,
as without one. $V4FLASH_COMPILE_HELPER=0: no helper.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading


def encode(key: tuple) -> str:
    kind, b, *rest = key
    return json.dumps([kind, [b.seqs, b.rows, b.ctx], *rest], separators=(",", ":"))


def decode(text: str) -> tuple:
    from .static_step import Bucket

    kind, b, *rest = json.loads(text)
    return (kind, Bucket(*b), *rest)


def rss_bytes(pid: int | str = "self") -> int:
    """A process's resident set, this one's by default (/proc/<pid>/statm; 0 where there is none:
    another OS, or a process that exited)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def enabled() -> bool:
    return os.environ.get("V4FLASH_COMPILE_HELPER", "1") != "0"


class CompileHelper:
    """The server's end: the process, and the sets it reported."""

    def __init__(self, proc: subprocess.Popen, log=None):
        self.proc = proc
        self.log = log or (lambda msg: print(f"[v4flash] {msg}", file=sys.stderr, flush=True))
        self.reported: dict[str, bool] = {}  # encoded key -> compiled (True) or failed (False)
        self._cv = threading.Condition()
        self._lock = threading.Lock()  # one writer at a time on the pipe
        self.exited = False
        threading.Thread(target=self._read, name="v4flash-compile-helper-reader", daemon=True).start()

    @classmethod
    def spawn(cls, settings_json: str, log=None) -> "CompileHelper | None":
        try:
            proc = subprocess.Popen([sys.executable, "-m", "v4flash_backend.group.compile_helper"],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
            proc.stdin.write(settings_json + "\n")
            proc.stdin.flush()
        except OSError as e:
            (log or print)(f"no compile helper ({e}): the compile thread compiles every set")
            return None
        return cls(proc, log)

    def _read(self) -> None:
        for line in self.proc.stdout:
            word, _, rest = line.rstrip("\n").partition(" ")
            if word in ("done", "failed"):
                key = rest if word == "done" else rest.partition(" ")[0]
                with self._cv:
                    self.reported[key] = word == "done"
                    self._cv.notify_all()
                if word == "failed":
                    self.log(f"compile helper failed on {rest}")
        code = self.proc.wait()
        with self._cv:
            self.exited = True
            self._cv.notify_all()
        self.log(f"compile helper exited ({code}): the compile thread compiles what is left itself")

    def rss_bytes(self) -> int:
        """The process's resident set (0 once it exited: its pid may be another process's by then)."""
        return 0 if self.exited else rss_bytes(self.proc.pid)

    def want(self, key: tuple) -> None:
        """Compile `key` next (after the set in progress), as the server's queue does."""
        with self._lock:
            try:
                self.proc.stdin.write(f"want {encode(key)}\n")
                self.proc.stdin.flush()
            except (OSError, ValueError):  # exited: the server compiles itself
                pass

    def first_reported(self, keys: list, timeout: float):
        """The first of `keys` the helper has reported (compiled or failed: either way this process
        compiles it now), waiting up to `timeout` seconds for one; None: none yet."""
        codes = [encode(k) for k in keys]
        with self._cv:
            for _ in range(2):
                for k, c in zip(keys, codes):
                    if c in self.reported:
                        return k
                if self.exited:
                    return None
                self._cv.wait(timeout)
        return None

    def close(self) -> None:
        with self._lock:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
