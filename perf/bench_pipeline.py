"""Decode across 2 pipeline stages: 1 micro-batch per forward vs 2 (stage 0 runs the second while
stage 1 runs the first), interleaved and repeated, over many prompts.

    .venv/bin/python perf/bench_pipeline.py [--checkpoint DIR] [--rounds 3] [--prompts 12]
                                            [--batch 6] [--max-tokens 24] [--micro 1,2]

Each round launches one rank group per micro-batch setting (RankGroup.launch: world_size 2,
pipeline_parallel 2, one rank per stage, eager decode, spec_mode off so every step is one decode
forward of `batch` sequences), in an order that rotates every round, and runs the same prompts in
groups of `batch` concurrent greedy requests. A setting's figure per round is generated tokens
over wall time (launch excluded); the report is the median over rounds and the spread (min-max).
Before the groups it times, in this process (W = 1, one thread), a decode forward of `batch` rows
and of batch / 2 rows (median of 30 after warm-up): a stage's step takes t(B) unsplit and 3 halves
of t(B/2) split across 2 stages, so splitting can only pay when t(B/2) < 2/3 t(B):
    cost: rows=<B> t_full_ms=<a> rows=<B/2> t_half_ms=<b> half_vs_full=<b/a> (split pays below 0.667)
It ends with
    pipeline: stages=2 batch=<B> mb1_tok_s=<x> mb2_tok_s=<y> mb2_vs_mb1=<y/x>
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from v4flash_backend.group.rank_group import RankGroup  # noqa: E402
from v4flash_backend.settings import Settings  # noqa: E402


def prompts(n: int, seed: int = 11) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[0] + torch.randint(3, 1000, (int(torch.randint(8, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def run(settings: Settings, ps, batch: int, max_tokens: int) -> float:
    g = RankGroup.launch(settings)
    try:
        g.submit(ps[0][:4], {"max_tokens": 2, "ignore_eos": True}).result(timeout=300)  # warm-up
        t0, n = time.monotonic(), 0
        for k in range(0, len(ps), batch):
            streams = [g.submit(p, {"max_tokens": max_tokens, "ignore_eos": True}) for p in ps[k:k + batch]]
            for st in streams:
                res = st.result(timeout=600)
                assert res["error"] is None, res
                n += len(res["token_ids"])
        return n / (time.monotonic() - t0)
    finally:
        g.shutdown(timeout=60)


def forward_cost(ckpt: str, batch: int, reps: int = 30) -> tuple[float, float]:
    """Median ms of a decode forward of `batch` and of batch // 2 sequences (W = 1, in process)."""
    from v4flash_backend import ops
    from v4flash_backend.engine.runner import LocalRunner
    from v4flash_backend.model.loading import load_model

    torch.set_num_threads(1)
    ops.set_numerics("exact")
    m = load_model(ckpt)
    out = []
    for rows in (batch, batch // 2):
        r = LocalRunner(m, rows, 128)
        spec = [(s, 0, 16) for s in range(rows)]
        r.forward(torch.randint(3, 1000, (16 * rows,)), spec, "last", False)  # prefill 16 positions
        ts = []
        for k in range(reps + 3):
            t0 = time.perf_counter()
            r.forward(torch.randint(3, 1000, (rows,)), [(s, 16 + k, 1) for s in range(rows)], "last", False)
            ts.append(time.perf_counter() - t0)
        out.append(1000 * statistics.median(ts[3:]))
    return out[0], out[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=str(REPO.parent / "shared" / "golden" / "v41-tiny"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--batch", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--micro", default="1,2")
    args = ap.parse_args(argv)
    micro = [int(x) for x in args.micro.split(",")]
    full, half = forward_cost(args.checkpoint, args.batch)
    print(f"cost: rows={args.batch} t_full_ms={full:.1f} rows={args.batch // 2} t_half_ms={half:.1f} "
          f"half_vs_full={half / full:.3f} (split pays below 0.667)", flush=True)
    ps = prompts(args.prompts)
    res = {m: [] for m in micro}
    for r in range(args.rounds):
        order = micro[r % len(micro):] + micro[: r % len(micro)]
        for m in order:
            s = Settings(checkpoint_dir=args.checkpoint, world_size=2, pipeline_parallel=2, pipeline_micro_batches=m,
                         decode_graph="eager", spec_mode="off", max_num_seqs=args.batch, max_model_len=128,
                         heartbeat_s=1.0, collective_timeout_s=30.0)
            tps = run(s, ps, args.batch, args.max_tokens)
            res[m].append(tps)
            print(f"round {r} micro_batches={m} tok_s={tps:.2f}", flush=True)
    med = {m: statistics.median(v) for m, v in res.items()}
    for m, v in res.items():
        print(f"cell: micro_batches={m} tok_s={med[m]:.2f} (min {min(v):.2f} max {max(v):.2f}, {len(v)} rounds)")
    if 1 in med and 2 in med:
        print(f"pipeline: stages=2 batch={args.batch} mb1_tok_s={med[1]:.2f} mb2_tok_s={med[2]:.2f} "
              f"mb2_vs_mb1={med[2] / med[1]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
