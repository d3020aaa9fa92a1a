"""The eager CPU decode path against the compiled one, on the embedded model, interleaved and repeated.

    .venv/bin/python perf/bench_decode.py [--checkpoint DIR] [--fast-backend inductor] [--batches 1,8]
                                          [--specs off,dspark] [--rounds 3] [--num-prompts 16] [--max-tokens 32]
                                          [--temperature 0]

base: the eager path (decode_graph eager: the op-by-op forward, `LocalRunner`; what serves while the
CPU default compiles). fast: the static round graphs (`StaticRunner`, the path a NeuronCore runs; the
CPU default once compiled) compiled by torch.compile backend --fast-backend
(inductor: C++ kernels, the FX graph cache under $TORCHINDUCTOR_CACHE_DIR; none: op by op), with one
decode bucket per batch (every sequence count pads into it), compiled before the timed rounds: their
seconds are printed apart (`fast-compile:`), since a server compiles once, not per request.

Per (batch B, spec) cell, every round runs the same >= 16 prompts in groups of B concurrent requests on
both paths, interleaved group by group (the order flips with the group and the round), greedy (or seeded
at --temperature T: prompt k's request has seed k), one step
cost pinned for both (admission must not differ by timing), prefix caching and step-cost learning off.
Decode tokens/s: the tokens after each request's first over the time from the group's first token to its
last; TTFT: a 256-token prompt (max_tokens 1) per path and round. It prints one line per cell

    decode-speed: batch=<B> spec=<off|dspark> temp=<T> base_tok_s=<x> fast_tok_s=<y> speedup=<y/x> \
                  ttft_base_ms=<a> ttft_fast_ms=<b> same_tokens=<yes|no>

(one line; medians over rounds; the spreads, min-max of the rounds, on the line before it). same_tokens: every
request's tokens equal on both paths in every round.
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
sys.path.insert(0, str(REPO / "perf"))

from bench_dspark import TTFT_PROMPT, default_checkpoint, fast_max_len, load_prompts, static_runner  # noqa: E402

from v4flash_backend import ops  # noqa: E402
from v4flash_backend.engine.dspark_sched import SPSTable  # noqa: E402
from v4flash_backend.engine.engine import STOP_WIDTH, Engine  # noqa: E402
from v4flash_backend.engine.runner import LocalRunner  # noqa: E402
from v4flash_backend.engine.step_cost import StepCost  # noqa: E402
from v4flash_backend.model.loading import load_model  # noqa: E402
from v4flash_backend.request import GenerateRequest  # noqa: E402
from v4flash_backend.settings import Settings  # noqa: E402

# the step cost both paths admit with (pinned: a profiled or learned one would differ between the paths
# and rounds, and so would admission and the tokens)
COST = StepCost(SPSTable([1, 2, 4, 8, 16, 32, 48], [30.0, 29.5, 29.0, 27.0, 24.0, 18.0, 14.0]),
                draft_seconds={1: 0.02, 8: 0.03})


def make_runners(model, batch: int, max_len: int, spec: str, backend: str) -> tuple[dict, float, int]:
    """{"base": LocalRunner, "fast": StaticRunner} for `batch` slots, and the fast path's compile seconds
    and graph count (one decode bucket: `batch` sequences, the runner's whole context)."""
    fast = static_runner(model, batch, max_len, backend)
    t0 = time.perf_counter()
    # the graphs a server of this spec mode compiles (group/build.py, trn2/warmup.py): the verify round
    # and the plain-decode round, and for dspark the draft round. The plain-decode round is every
    # mode's: a DSpark round that steps aside (dspark_adaptive) runs it, and without it such a round
    # fell back to an eager step (dspark at T = 1: 26.8 tok/s at batch 8, below the eager path's 65.3)
    fast.graphs.warm_up(None, mode=spec, stop_width=STOP_WIDTH, processed=False)
    fast.warm_up_nodraft(None, stop_width=STOP_WIDTH, processed=False)
    return {"base": LocalRunner(model, batch + 1, max_len), "fast": fast}, time.perf_counter() - t0, \
        fast.graphs.stats.graphs


def engine(runner, batch: int, max_len: int, spec: str, ckpt: Path) -> Engine:
    eng = Engine(runner, Settings(max_num_seqs=batch, max_model_len=max_len, spec_mode=spec, checkpoint_dir=str(ckpt),
                                  step_cost_online=False, prefix_cache_bytes=0))
    eng.cost = COST
    return eng


def run_group(eng: Engine, prompts, max_tokens: int, first_id: int, temperature: float = 0.0
              ) -> tuple[int, float, list[list[int]]]:
    """B concurrent requests to the end, greedy (temperature 0) or sampled with request k's seed k:
    (decode tokens, decode seconds, each request's tokens)."""
    outs: list[list[int]] = [[] for _ in prompts]
    stamps: list[float] = []
    done: list[int] = []

    def cb(e, j):
        if e.token_ids:
            if not outs[j]:
                stamps.append(time.perf_counter())
            outs[j].extend(e.token_ids)
        if e.final:
            done.append(j)

    for j, p in enumerate(prompts):
        eng.submit(GenerateRequest(prompt=p, max_tokens=max_tokens, temperature=temperature, seed=first_id + j,
                                   ignore_eos=True, id=f"r{first_id + j}", callback=lambda e, j=j: cb(e, j)))
    while len(done) < len(prompts):
        eng.step()
    end = time.perf_counter()
    return sum(len(o) - 1 for o in outs), end - min(stamps), outs


def ttft(eng: Engine, prompt: list[int]) -> float:
    got: list[float] = []
    t0 = time.perf_counter()
    eng.submit(GenerateRequest(prompt=prompt, max_tokens=1, ignore_eos=True, id="ttft",
                               callback=lambda e: e.token_ids and not got and got.append(time.perf_counter())))
    while not got or eng.running or eng.waiting:
        eng.step()
    return got[0] - t0


def spread(v: list[float]) -> str:
    return f"{statistics.median(v):.1f} [{min(v):.1f}-{max(v):.1f}]"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=None)
    ap.add_argument("--fast-backend", default="inductor", help="torch.compile backend of the fast path's graphs")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--specs", default="off,dspark")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else seeded sampling (seed k for "
                    "prompt k: both paths draw the same counter-based noise, so same_tokens holds there too)")
    args = ap.parse_args(argv)
    if args.rounds < 3 or args.num_prompts < 16:
        print("note: fewer than 3 rounds or 16 prompts is a smoke run, not a result", file=sys.stderr)
    torch.set_num_threads(1)
    ops.set_numerics("exact")
    ckpt = args.checkpoint or default_checkpoint()
    model = load_model(ckpt)
    prompts, what = load_prompts(ckpt, model, args.num_prompts, None)
    g = torch.Generator().manual_seed(1)
    long_prompt = [model.cfg.bos_token_id] + torch.randint(3, model.cfg.vocab_size - 2, (TTFT_PROMPT - 1,),
                                                           generator=g).tolist()
    max_len = fast_max_len(prompts, args.max_tokens)
    print(f"checkpoint {ckpt}; {what}; {args.rounds} interleaved rounds; max_tokens {args.max_tokens}; "
          f"fast path: static rounds, backend {args.fast_backend}", flush=True)
    for B in (int(b) for b in args.batches.split(",")):
        for spec in args.specs.split(","):
            runners, secs, graphs = make_runners(model, B, max_len, spec, args.fast_backend)
            print(f"fast-compile: batch={B} spec={spec} backend={args.fast_backend} graphs={graphs} "
                  f"seconds={secs:.1f}", flush=True)
            rate = {p: [] for p in runners}
            first = {p: [] for p in runners}
            same = True
            for rnd in range(args.rounds):
                engines = {p: engine(r, B, max_len, spec, ckpt) for p, r in runners.items()}
                toks = {p: 0 for p in runners}
                secs_ = {p: 0.0 for p in runners}
                for gi, g0 in enumerate(range(0, len(prompts), B)):
                    order = ("base", "fast") if (rnd + gi) % 2 == 0 else ("fast", "base")
                    outs = {}
                    for p in order:
                        n, s, outs[p] = run_group(engines[p], prompts[g0:g0 + B], args.max_tokens, g0,
                                                  args.temperature)
                        toks[p] += n
                        secs_[p] += s
                    same &= outs["base"] == outs["fast"]
                for p in (("base", "fast") if rnd % 2 == 0 else ("fast", "base")):
                    first[p].append(1000 * ttft(engines[p], long_prompt))
                    rate[p].append(toks[p] / secs_[p])
            b, f = (statistics.median(rate[p]) for p in ("base", "fast"))
            tb, tf = (statistics.median(first[p]) for p in ("base", "fast"))
            print(f"  spread: base_tok_s {spread(rate['base'])} fast_tok_s {spread(rate['fast'])} "
                  f"ttft_base_ms {spread(first['base'])} ttft_fast_ms {spread(first['fast'])}")
            print(f"decode-speed: batch={B} spec={spec} temp={args.temperature:g} base_tok_s={b:.1f} "
                  f"fast_tok_s={f:.1f} speedup={f / b:.2f} "
                  f"ttft_base_ms={tb:.1f} ttft_fast_ms={tf:.1f} same_tokens={'yes' if same else 'no'}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
