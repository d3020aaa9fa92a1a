"""What counting host syncs costs the eager forward (LocalRunner count_host_syncs on vs off), or, with
--grad-modes, what autograd's bookkeeping costs it (LocalRunner's inference mode off vs on).

    .venv/bin/python perf/eager_overhead.py [--checkpoint DIR] [--rounds 5] [--calls 5] [--seqs 1,8] [--grad-modes]

A decode forward of S sequences x 1 row at a context of 60 tokens, the two runners on the same
model and the same cached context, timed in interleaved rounds (counted, uncounted, uncounted,
counted, ...): per S it prints the median milliseconds per forward with the spread (min-max of
the round medians) and
    eager-overhead: seqs=<S> counted_ms=<a> uncounted_ms=<b> share=<1 - b/a>
(--grad-modes: `eager-grad-mode: seqs=<S> grad_ms=<a> inference_ms=<b> speedup=<a/b>`)

The counted forward is the one `generate --step-report` runs; besides the counter it keeps the
Sinkhorn loop in torch (the numpy loop of a few rows stays out of a torch-function mode,
`ops/torch_ops._numpy_sinkhorn`), so `share` holds that difference too.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from v4flash_backend import ops  # noqa: E402
from v4flash_backend.engine.runner import LocalRunner  # noqa: E402
from v4flash_backend.model.loading import load_model  # noqa: E402


class GradRunner(LocalRunner):
    """LocalRunner with autograd's bookkeeping left on (no inference mode): what it was before."""

    def _inference(self):
        return contextlib.nullcontext()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=REPO / "models" / "v4flash-tiny")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=5, help="forwards per mode and round")
    ap.add_argument("--seqs", default="1,8")
    ap.add_argument("--context", type=int, default=60)
    ap.add_argument("--grad-modes", action="store_true", help="inference mode off vs on (uncounted both)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    ops.set_numerics("exact")
    model = load_model(args.checkpoint)
    seqs = [int(s) for s in args.seqs.split(",")]
    S_max, ctx = max(seqs), args.context
    g = torch.Generator().manual_seed(0)
    context = [torch.randint(3, model.cfg.vocab_size - 2, (ctx,), generator=g) for _ in range(S_max)]
    runners = {}
    for count in (True, False):
        # --grad-modes: the True runner is the one without inference mode (autograd's bookkeeping on)
        r = (GradRunner if args.grad_modes and count else LocalRunner)(
            model, S_max + 1, ctx + 16, count_host_syncs=count and not args.grad_modes)
        for s in range(S_max):
            r.forward(context[s], [(s, 0, ctx)], torch.tensor([ctx - 1]), True)
        runners[count] = r
    tok = torch.randint(3, model.cfg.vocab_size - 2, (S_max,), generator=g)

    def forward(r, S):  # the same decode forward again (position ctx overwritten each time)
        t0 = time.perf_counter()
        r.forward(tok[:S], [(s, ctx, 1) for s in range(S)], torch.arange(S), True)
        return time.perf_counter() - t0

    print(f"checkpoint {args.checkpoint}; context {ctx}; {args.rounds} interleaved rounds x {args.calls} forwards")
    for S in seqs:
        for r in runners.values():
            forward(r, S)  # warm-up
        per = {True: [], False: []}
        for rnd in range(args.rounds):
            for count in ((True, False) if rnd % 2 == 0 else (False, True)):
                per[count].append(statistics.median(forward(runners[count], S) for _ in range(args.calls)))
        a, b = (1000 * statistics.median(per[c]) for c in (True, False))
        names = ("grad", "inference") if args.grad_modes else ("counted", "uncounted")
        for c, name in zip((True, False), names):
            v = [1000 * x for x in per[c]]
            print(f"  seqs={S} {name:>9}: {statistics.median(v):6.1f} ms [{min(v):.1f}-{max(v):.1f}]")
        if args.grad_modes:
            print(f"eager-grad-mode: seqs={S} grad_ms={a:.1f} inference_ms={b:.1f} speedup={a / b:.2f}", flush=True)
        else:
            print(f"eager-overhead: seqs={S} counted_ms={a:.1f} uncounted_ms={b:.1f} share={1 - b / a:.2f}",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
