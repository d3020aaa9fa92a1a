"""What the release-shaped checks' commands (`release-check`, `trn2-check`) share: running a check
with its progress on stdout and its final line last, and being run as a module."""

from __future__ import annotations

import argparse
import sys

import torch

from v4flash_backend.settings import env_setting


def run_check(check, *args, **kwargs) -> int:
    """`check(*args, log=..., **kwargs)` -> (ok, final line, ...) with torch threads from
    $V4FLASH_THREADS, else the threads setting's default, each progress line flushed as it comes and
    the final line printed last; the exit code is 0 when ok."""
    torch.set_num_threads(env_setting("threads"))
    ok, final = check(*args, log=lambda s: print(s, flush=True), **kwargs)[:2]
    print(final, flush=True)
    return 0 if ok else 1


def standalone(prog: str, add_arguments, main) -> None:
    """`python -m v4flash_backend.checks.<check>`: the same flags as the subcommand."""
    ap = argparse.ArgumentParser(prog=prog)
    add_arguments(ap)
    sys.exit(main(ap.parse_args()))
