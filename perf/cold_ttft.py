"""Time to first token of cold prefills, for comparing two checkouts side by side.

    .venv/bin/python perf/cold_ttft.py --repo DIR [--prompt-len 784] [--requests 6] [--prefix-cache-bytes N]

Runs the engine of the checkout at --repo (its src/ first on the path) on the embedded model, one
thread, spec_mode off, `--requests` distinct random prompts one at a time, and prints
`cold-ttft: repo=<dir> ttft_ms_median=<m> all=<each>`. Run it alternately on two checkouts
(interleaved rounds) to see what a change costs a prefill; --prefix-cache-bytes is passed only
when given (an older checkout has no such setting).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    ap.add_argument("--checkpoint", type=Path, default=Path(__file__).resolve().parents[1] / "models" / "v4flash-tiny")
    ap.add_argument("--prompt-len", type=int, default=784)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--prefix-cache-bytes", type=int, default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(args.repo / "src"))
    import torch

    from v4flash_backend.group.build import build_engine
    from v4flash_backend.request import GenerateRequest
    from v4flash_backend.settings import Settings

    torch.set_num_threads(1)
    extra = {} if args.prefix_cache_bytes is None else {"prefix_cache_bytes": args.prefix_cache_bytes}
    # the eager path (the CPU default compiles its graphs in the background, beside the measurement)
    eng = build_engine(Settings(checkpoint_dir=str(args.checkpoint), decode_graph="eager", spec_mode="off",
                                max_num_seqs=1, max_model_len=args.prompt_len + 16, **extra), progress=None)
    g = torch.Generator().manual_seed(1)
    ttft = []
    for _ in range(args.requests):
        prompt = torch.randint(10, 4000, (args.prompt_len,), generator=g).tolist()
        first: list[float] = []
        t0 = time.perf_counter()
        eng.run_request(GenerateRequest(prompt=prompt, max_tokens=2, callback=lambda e: e.token_ids and not first
                                        and first.append(time.perf_counter())))
        ttft.append((first[0] - t0) * 1e3)
    print(f"cold-ttft: repo={args.repo} ttft_ms_median={statistics.median(ttft):.1f} "
          f"all={','.join(f'{t:.0f}' for t in ttft)}")


if __name__ == "__main__":
    main()
