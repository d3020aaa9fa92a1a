"""Eager vs static decode on the CPU: the engine in this process on models/v4flash-tiny, the same
requests through `LocalRunner` (decode_graph eager) and `StaticRunner` (decode_graph static, the
round graphs run op by op or compiled with --graph-backend), interleaved over rounds, medians with
spread. Decode tokens/s are output tokens after the first over the time from the first token to
the last (the prefill step is eager in both modes).

    PYTHONPATH=src OMP_NUM_THREADS=1 .venv/bin/python perf/decode_graph_cpu.py --rounds 3 --prompts 6

The SPS table is pinned (a profiled one would differ per run and change admission).

    ... perf/decode_graph_cpu.py --adaptive --temperature 1 --rounds 3 --prompts 4

compares instead, on the static runner only, DSpark with and without `dspark_adaptive` (calibrated
admission, stepping aside, probes inside the rounds), with one step cost profiled on the static
runner at start (`Engine.ensure_cost`: the stepped-aside round and the draft graph timed apart)
and shared by both, on models/v4flash-tiny with its shipped calibration.
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
from v4flash_backend.engine.dspark_sched import SPSTable  # noqa: E402
from v4flash_backend.engine.engine import STOP_WIDTH, Engine  # noqa: E402
from v4flash_backend.engine.runner import LocalRunner  # noqa: E402
from v4flash_backend.engine.step_cost import StepCost  # noqa: E402
from v4flash_backend.model.loading import load_model  # noqa: E402
from v4flash_backend.request import GenerateRequest  # noqa: E402
from v4flash_backend.settings import Settings  # noqa: E402
from v4flash_backend.trn2.launch import NeuronSettings  # noqa: E402
from v4flash_backend.trn2.static_runner import StaticRunner  # noqa: E402

SPS = SPSTable([1, 2, 4, 8, 16], [10.0, 9.8, 9.5, 9.0, 8.0])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=str(ROOT / "models" / "v4flash-tiny"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--graph-backend", default="none")
    ap.add_argument("--adaptive", action="store_true", help="static only: dspark_adaptive off vs on")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    ops.set_numerics("exact")
    m = load_model(args.checkpoint)
    L = 160
    sr = StaticRunner(m, 1, L, settings=NeuronSettings(backend=args.graph_backend))
    sr.graphs.warm_up(None, mode="dspark", stop_width=STOP_WIDTH)
    cost = StepCost(SPS)
    if args.adaptive:
        sr.warm_up_nodraft(None, stop_width=STOP_WIDTH)
        runners = {"static": sr, "static-adaptive": sr}
        cost = Engine(sr, Settings(max_num_seqs=1, max_model_len=L)).ensure_cost()
        print(f"step cost (profiled on the static rounds): {cost}")
    else:
        runners = {"eager": LocalRunner(m, 2, L), "static": sr}
    modes = list(runners)
    g = torch.Generator().manual_seed(0)
    prompts = [[0] + torch.randint(3, 4000, (int(n),), generator=g).tolist()
               for n in torch.randint(8, 64, (args.prompts,), generator=g)]
    rates: dict[str, list[float]] = {k: [] for k in runners}
    for r in range(args.rounds):
        for mode in (modes if r % 2 == 0 else modes[::-1]):  # interleaved
            eng = Engine(runners[mode], Settings(max_num_seqs=1, max_model_len=L, checkpoint_dir=args.checkpoint,
                                                 dspark_adaptive=mode.endswith("adaptive")))
            eng.cost = cost
            for i, p in enumerate(prompts):
                times = []
                req = GenerateRequest(prompt=p, max_tokens=args.max_tokens, temperature=args.temperature, seed=i,
                                      ignore_eos=True,
                                      callback=lambda e: times.append((time.perf_counter(), len(e.token_ids))))
                eng.run_request(req)
                firsts = [t for t, n in times if n]
                n_out = sum(n for _, n in times)
                if len(firsts) > 1 and n_out > 1:
                    rates[mode].append((n_out - 1) / (firsts[-1] - firsts[0]))
    for mode, v in rates.items():
        q = statistics.quantiles(v, n=4)
        print(f"{mode}: decode tok/s median {statistics.median(v):.1f} (IQR {q[0]:.1f}-{q[2]:.1f}, n={len(v)})")
    if args.adaptive:
        a, s = statistics.median(rates["static-adaptive"]), statistics.median(rates["static"])
        print(f"adaptive/static: {a / s:.2f} (T = {args.temperature}, graph backend {args.graph_backend})")
        return 0
    e, s = statistics.median(rates["eager"]), statistics.median(rates["static"])
    print(f"static/eager: {s / e:.2f} (graph backend {args.graph_backend}; a loaded 2-core machine)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
