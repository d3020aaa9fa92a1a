"""What the engine's online calibration costs once a server's window is full, and what the local
refit gives up against the whole grid.

    .venv/bin/python perf/calibration_cost.py [--window 2048] [--gamma 5] [--rounds 5]

Blocks are synthetic (the head's logits ~ N(0, 1.5^2), draft k accepted given the earlier ones with
p = sigmoid(1.5 z + 0.5), all drafts verified): the cost depends on the window's size, not on the
model. Interleaved over --rounds, medians [min-max] of:
  - a refit over the whole (T, b) grid (what every refit did before) and a local refit around the
    fitted point (`OnlineCalibrator.refit` between its full_every-th);
  - the window stacked and reduced once (what the per-step acceptance estimate did before) and
    the running counts that replace it (`acceptance_rates`);
then the amortised cost per observed block at the engine's defaults (refit_every 64, full_every 16),
before and after, and the window's conditional ECE at position 0 under either fit. Lines:
    calcost: op=<name> ms=<median> [<min>-<max>]
    calcost: per_block_ms before=<x> after=<y>
    calcost: ece_pos0 full=<x> local=<y>
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from v4flash_backend.engine import calibration as C  # noqa: E402


def filled(window: int, gamma: int, seed: int) -> C.OnlineCalibrator:
    oc = C.OnlineCalibrator(C.Calibration(gamma), window=window, refit_every=10**9)
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(window, gamma, generator=g, dtype=torch.float64) * 1.5
    ok = torch.rand(window, gamma, generator=g, dtype=torch.float64) < torch.sigmoid(1.5 * z + 0.5)
    acc = torch.cumprod(ok.long(), 1).sum(1)
    for i in range(window):
        oc.observe("greedy", z[i], gamma, int(acc[i]))
    return oc


def stacked_rates(oc: C.OnlineCalibrator, reg: str) -> list:
    """The per-step estimate as it was computed before: the window stacked, masked and reduced."""
    _, adm, acc = oc.observations(reg)
    out = []
    for k in range(oc.cal.gamma):
        rows = (adm > k) & (acc >= k)
        out.append(float((acc[rows] > k).double().mean()) if int(rows.sum()) >= 8 else None)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--gamma", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    oc = filled(a.window, a.gamma, 0)
    logits, adm, acc = oc.observations("greedy")
    full = C.fit_conditional(logits, adm, acc, a.gamma, [C.IDENTITY] * a.gamma)
    ops = {
        "refit_full_grid": lambda: C.fit_conditional(logits, adm, acc, a.gamma, full),
        "refit_local": lambda: C.fit_conditional(logits, adm, acc, a.gamma, full, local=True),
        "rates_stacked_window": lambda: stacked_rates(oc, "greedy"),
        "rates_running_counts": lambda: oc.acceptance_rates("greedy"),
    }
    times: dict[str, list] = {k: [] for k in ops}
    for _ in range(a.rounds):
        for name, fn in ops.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"window {a.window} blocks of {a.gamma} drafts; {a.rounds} interleaved rounds")
    for k, v in times.items():
        print(f"calcost: op={k} ms={med[k]:.3f} [{min(v):.3f}-{max(v):.3f}]")
    dflt = C.OnlineCalibrator(C.Calibration(a.gamma))  # the engine's refit schedule, not a copy of it
    every, full_every = dflt.refit_every, dflt.full_every
    before = med["refit_full_grid"] / every + med["rates_stacked_window"]
    after = ((med["refit_full_grid"] + (full_every - 1) * med["refit_local"]) / full_every / every
             + med["rates_running_counts"])
    # per block at batch 1 (one block and one estimate a step); at batch B the refit share is B times
    print(f"calcost: per_block_ms before={before:.3f} after={after:.3f}")
    rows = adm > 0  # position 0 is verified in every admitted block
    lab = (acc[rows] > 0).double()
    local = C.fit_conditional(logits, adm, acc, a.gamma, [(full[0][0] * 1.3, full[0][1] + 0.4)] * a.gamma, local=True)
    e_full = C.ece(C.scaled(logits[rows, :1], full[:1]).reshape(-1), lab)
    e_local = C.ece(C.scaled(logits[rows, :1], local[:1]).reshape(-1), lab)
    print(f"calcost: ece_pos0 full={e_full * 100:.2f}% local={e_local * 100:.2f}% "
          f"(local refit started 1.3x in T and +0.4 in b off the full fit)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
