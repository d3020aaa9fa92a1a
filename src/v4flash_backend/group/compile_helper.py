"""The compile helper process of a background-compiling server: `python -m v4flash_backend.group.compile_helper`,
spawned by trn2.compile_helper.CompileHelper, whose docstring says why and the protocol."""

from __future__ import annotations

import os
import sys
import threading

from v4flash_backend.trn2.compile_helper import decode, encode
from v4flash_backend.trn2.warmup import NICE  # below the server's serving thread, as its compile thread


def main() -> int:
    """The helper process (trn2/compile_helper.py)."""
    from v4flash_backend.settings import Settings

    settings = Settings.from_json(sys.stdin.readline())
    try:
        os.nice(NICE)
    except OSError:
        pass
    import torch

    from v4flash_backend import ops
    from v4flash_backend.group.build import build_runner
    from v4flash_backend.model.loading import load_model

    torch.set_num_threads(settings.threads)
    ops.set_backend(settings.ops_backend)
    if settings.numerics:
        ops.set_numerics(settings.numerics)
    def report(line: str) -> None:  # (this thread alone writes stdout)
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    runner = build_runner(load_model(settings.checkpoint_dir), settings, helper=True)
    warming = runner.warming

    def read_wants() -> None:
        for line in sys.stdin:
            word, _, rest = line.strip().partition(" ")
            if word == "want":
                warming.want(decode(rest))
        os._exit(0)  # the server closed the pipe (stopped, or died): nothing left to compile for

    threading.Thread(target=read_wants, daemon=True).start()
    warming.run_here(lambda key, err: report(f"done {encode(key)}" if err is None
                                             else f"failed {encode(key)} {type(err).__name__}: {err}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
