"""Instructions per second of the NKI CPU simulator (nki_sim) on the kernels the golden check runs most.

The simulator's cost on the golden shapes is its per-instruction Python overhead on small tiles, not the
NumPy math, so this times whole kernel launches at those shapes (v41-tiny: dim 128, hc 4, 20 Sinkhorn
iterations; decode T=1 and a 41-token prefill) and divides by the instructions the cost ledger counted
(compute instructions + DMA transfers). Times are process CPU seconds, less disturbed by other work on a
shared machine than wall time. The inputs are fixed (seeded), so two runs execute the same instruction
stream, and `digest` (a hash of every output's bytes) must not change when only the speed does.
`--src DIR` times another copy of the sources (e.g. an export of the previous commit), so old and new can
be run alternately.

    .venv/bin/python perf/nki_sim_speed.py [--reps N] [--src DIR]
"""

import argparse
import hashlib
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
_SRC = sys.argv[sys.argv.index("--src") + 1] if "--src" in sys.argv else str(ROOT / "src")
sys.path.insert(0, _SRC)  # before the imports below
os.environ.setdefault("V4FLASH_NKI", "sim")

import ml_dtypes  # noqa: E402

from nki_sim import _runtime as R  # noqa: E402
from v4flash_backend.kernels import hc, linear  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)


def _cases():
    rng = np.random.default_rng(0)
    hcm, dim, iters = 4, 128, 20
    mix = (2 + hcm) * hcm
    fn = (rng.standard_normal((mix, hcm * dim)) * 0.02).astype(np.float32)
    scale = np.array([0.5, 0.7, 0.9], np.float32)
    base = (rng.standard_normal(mix) * 0.1).astype(np.float32)
    cases = []
    for t in (1, 41):
        x = rng.standard_normal((t, hcm * dim)).astype(BF16)
        cases.append((f"hc_mixes T={t}", hc.hc_mixes_kernel,
                      (x, fn, scale, base), dict(hc=hcm, iters=iters, hc_eps=1e-6, norm_eps=1e-20)))
    w = (rng.standard_normal((512, dim)) * 0.05).astype(BF16)
    for t in (1, 41):
        x = rng.standard_normal((t, dim)).astype(BF16)
        cases.append((f"linear_bf16 T={t} N=512", linear.linear_bf16_kernel, (x, w), {}))
    return cases


def _instructions():
    cost = R.last_cost
    return sum(cost.instructions().values()) + sum(g.dma_transfers for g in cost.ledgers)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5, help="launches per case (the median is reported)")
    ap.add_argument("--src", help="the source tree to time (default: this checkout's src)")
    args = ap.parse_args(argv)
    total_n, total_s = 0, 0.0
    digest = hashlib.sha256()
    for name, kernel, arrays, static in _cases():
        out = kernel(*arrays, **static)  # warm-up: imports, torch's first calls
        for o in out if isinstance(out, tuple) else (out,):
            digest.update(np.ascontiguousarray(o).tobytes())
        times = []
        for _ in range(args.reps):
            t0 = time.process_time()
            kernel(*arrays, **static)
            times.append(time.process_time() - t0)
        n = _instructions()
        med = statistics.median(times)
        total_n, total_s = total_n + n, total_s + med
        print(f"{name:26s} {n:6d} instructions  {med * 1e3:8.1f} ms  {n / med:9.0f} instr/s")
    print(f"nki-sim-speed: instr_per_s={total_n / total_s:.0f} (all cases, medians of {args.reps} launches, "
          f"CPU time) digest={digest.hexdigest()[:16]} src={_SRC}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
