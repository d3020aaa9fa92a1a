"""What a stepped-aside (no-draft) static round should run: the decode bucket's verify graph with
1 + G rows per sequence (ell = 0: one valid row) or a dedicated plain-decode graph of 1 row per
sequence. Times the static verify forward (`StaticDecoder.verify`, op by op: the CPU's
graph_backend none) of S sequences x Q rows for Q = 1 and Q = 1 + G, interleaved over rounds,
medians with the min-max spread, on models/v4flash-tiny.

    PYTHONPATH=src OMP_NUM_THREADS=1 .venv/bin/python perf/nodraft_round_cpu.py --rounds 5

Prints one `nodraft: S=<S> q1_ms=<a> [lo-hi] q<1+G>_ms=<b> [lo-hi] ratio=<b/a>` line per S.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from v4flash_backend import ops  # noqa: E402
from v4flash_backend.model.loading import load_model  # noqa: E402
from v4flash_backend.model.state import ModelState  # noqa: E402
from v4flash_backend.trn2.static_step import StaticDecoder  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=str(ROOT / "models" / "v4flash-tiny"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seqs", default="1,2,4,8")
    ap.add_argument("--ctx", type=int, default=256)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    ops.set_numerics("exact")
    m = load_model(args.checkpoint)
    G = m.cfg.dspark_block_size
    seqs = [int(s) for s in args.seqs.split(",")]
    state = ModelState(m.cfg, max(seqs) + 1, args.ctx, margin=8)
    decs = {q: StaticDecoder(m, state, max_rows=q) for q in (1, 1 + G)}

    def run(q: int, S: int) -> float:
        tokens, slot, start, n = decs[q].padding_plan(S, q)
        t0 = time.perf_counter()
        decs[q].verify(tokens, slot, start, n, args.ctx)
        return time.perf_counter() - t0

    for q in decs:  # warm-up
        for S in seqs:
            run(q, S)
    t = {(q, S): [] for q in decs for S in seqs}
    for r in range(args.rounds):
        order = [(q, S) for S in seqs for q in decs]
        for q, S in (order if r % 2 == 0 else order[::-1]):  # interleaved, alternating order
            t[(q, S)].append(run(q, S))
    for S in seqs:
        a, b = t[(1, S)], t[(1 + G, S)]
        ma, mb = statistics.median(a), statistics.median(b)
        print(f"nodraft: S={S} q1_ms={ma * 1e3:.1f} [{min(a) * 1e3:.1f}-{max(a) * 1e3:.1f}] "
              f"q{1 + G}_ms={mb * 1e3:.1f} [{min(b) * 1e3:.1f}-{max(b) * 1e3:.1f}] ratio={mb / ma:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
