"""What a stepped-aside DSpark round costs over a plain one on the compiled path: the engine's host
work around the round, apart from the round itself.

    .venv/bin/python perf/aside_cost.py [--rounds 3] [--batch 1] [--temp 1] [--num-prompts 16]
                                        [--prompts FILE] [--max-tokens 48] [--backend inductor]

One StaticRunner (perf/bench_dspark.py's `--fast` runner: the same graphs, loaded from inductor's
cache when it has them) serves two engines, plain decoding (spec_mode off) and DSpark, over the same
prompts in groups of `--batch`, the two interleaved group by group in an order that alternates, for
`--rounds` rounds. Every decode step is timed whole, and the runner's `decode_round` apart; a step's
host work is the difference (what the engine does around the round: the plan, the commit, and for
DSpark its decision and the step-cost learner). DSpark's steps count only where it stepped aside:
its decision was to, no request verified a draft and none was drafted (a probe and the step verifying it are left out:
the probes' budget prices them, engine/adaptive.py). At T = 1 on the embedded model DSpark steps
aside nearly throughout. Prints per mode

    aside-cost: batch=<B> temp=<T> mode=plain|dspark steps=<n> host_us=<median> [<q1>-<q3>]
                round_us=<median> [<q1>-<q3>] host_s=<total> round_s=<total>

and then the difference of the host medians, and as a share of plain's median round:

    aside-extra: batch=<B> temp=<T> host_us=<dspark - plain> share_of_round=<x>

--backend eager runs the rounds op by op (no compile: a quick check of the tool, not a figure).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "perf"))

import bench_dspark as bd  # noqa: E402

from v4flash_backend import ops  # noqa: E402
from v4flash_backend.engine.engine import Engine  # noqa: E402
from v4flash_backend.model.loading import load_model  # noqa: E402
from v4flash_backend.request import GenerateRequest  # noqa: E402
from v4flash_backend.settings import Settings  # noqa: E402

MODES = ("off", "dspark")
NAMES = {"off": "plain", "dspark": "dspark"}


class RoundClock:
    """Wraps a runner's decode_round: the seconds of the rounds since `reset`."""

    def __init__(self, runner):
        self.seconds, self._round = 0.0, runner.decode_round
        runner.decode_round = self

    def reset(self) -> None:
        self.seconds = 0.0

    def __call__(self, plan):
        t0 = time.perf_counter()
        try:
            return self._round(plan)
        finally:
            self.seconds += time.perf_counter() - t0


def group(eng: Engine, clock: RoundClock, prompts, tag: str, max_tokens: int, temp: float, seed: int,
          host: list, rounds: list) -> None:
    """One group of concurrent requests to the end; the host and round seconds of its decode steps
    in which no request verified or drafted a draft (DSpark's: those it decided to step aside)."""
    done: list = []
    for i, p in enumerate(prompts):
        eng.submit(GenerateRequest(prompt=p, max_tokens=max_tokens, temperature=temp, seed=seed + i,
                                   ignore_eos=True, id=f"{tag}-{i}", callback=lambda e: e.final and done.append(1)))
    while len(done) < len(prompts):
        decode = bool(eng.running) and not any(s.prefilling or s.ell for s in eng.running)
        drafted = eng.totals["drafted"]
        clock.reset()
        t0 = time.perf_counter()
        eng.step()
        seconds = time.perf_counter() - t0
        aside = not eng.spec or eng._kind == "aside"  # (the step's decision: engine/seq.py KIND_OF)
        if decode and aside and clock.seconds > 0 and eng.totals["drafted"] == drafted:
            host.append(seconds - clock.seconds)
            rounds.append(clock.seconds)


def quartiles(x: list[float]) -> str:
    if len(x) < 2:
        return "nan [nan-nan]"
    q = statistics.quantiles(x, n=4)
    return f"{1e6 * statistics.median(x):.1f} [{1e6 * q[0]:.1f}-{1e6 * q[2]:.1f}]"


def main(argv=None) -> int:
    ap = bd.prompt_args(__doc__)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--temp", type=float, default=1.0)
    ap.add_argument("--backend", default="inductor", choices=("inductor", "eager"))
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.batch < 1:
        ap.error("--rounds and --batch must be >= 1")
    torch.set_num_threads(1)
    ops.set_numerics("exact")
    ckpt = args.checkpoint or bd.default_checkpoint()
    bd.CKPT[0] = ckpt
    model = load_model(ckpt)
    prompts, source = bd.load_prompts(ckpt, model, args.num_prompts, args.prompts)
    max_len = bd.fast_max_len(prompts, args.max_tokens)
    runner, secs, graphs = bd.fast_runner(model, args.batch, max_len, args.backend)
    print(f"checkpoint {ckpt}; {source}; batch {args.batch}; temp {args.temp:g}; {args.rounds} interleaved rounds; "
          f"graphs={graphs} load_s={secs:.1f} backend={args.backend}", flush=True)
    clock = RoundClock(runner)
    engines = {m: Engine(runner, Settings(max_num_seqs=args.batch, max_model_len=max_len - 8, spec_mode=m,
                                          checkpoint_dir=str(ckpt), prefix_cache_bytes=0)) for m in MODES}
    cost = engines["dspark"].ensure_cost()  # (profiled on the runner's graphs; plain decoding reads none)
    engines["off"].cost = cost
    host = {m: [] for m in MODES}
    rounds = {m: [] for m in MODES}
    for rnd in range(args.rounds):
        for gi, g0 in enumerate(range(0, len(prompts), args.batch)):
            order = MODES if (gi + rnd) % 2 == 0 else MODES[::-1]
            for m in order:
                group(engines[m], clock, prompts[g0:g0 + args.batch], f"{m}{rnd}-{g0}", args.max_tokens,
                      args.temp, 1000 * rnd + g0, host[m], rounds[m])
    for m in MODES:
        print(f"aside-cost: batch={args.batch} temp={args.temp:g} mode={NAMES[m]} steps={len(host[m])} "
              f"host_us={quartiles(host[m])} round_us={quartiles(rounds[m])} "
              f"host_s={sum(host[m]):.3f} round_s={sum(rounds[m]):.3f}")
    if all(len(host[m]) >= 2 for m in MODES):
        extra = statistics.median(host["dspark"]) - statistics.median(host["off"])
        print(f"aside-extra: batch={args.batch} temp={args.temp:g} host_us={1e6 * extra:.1f} "
              f"share_of_round={extra / statistics.median(rounds['off']):.4f}")
    print(f"dspark totals: {engines['dspark'].totals}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
