"""Time to first token with the prefix cache on vs off (engine.prefix_cache), on the served engine.

    .venv/bin/python perf/bench_prefix_cache.py [--checkpoint DIR] [--shared 768] [--tail 16]
        [--requests 4] [--turns 3] [--rounds 3] [--max-tokens 8] [--spec-mode off]

Two engines on one model, identical but for prefix_cache_bytes (0: off). Two workloads per round,
run on both engines, the engine order alternating by round (off first in even rounds):
- system: `--requests` prompts of a shared `--shared`-token system block + a distinct `--tail`-token
  tail each (the cache-on engine saw the block once before the first round: steady state);
- conversation: `--turns` turns, each resending the history (system block, earlier user tails and
  the replies) with a new `--tail`-token user tail.
Requests run one at a time (TTFT = submit -> first token, without queueing behind others); the
same prompts and seeds go to both engines, and same_tokens says whether every request's tokens
were equal. Per workload it prints the medians over all rounds and requests, then ends with
    prefix-cache: shared_tokens=<n> ttft_off_ms=<a> ttft_on_ms=<b> ttft_speedup=<a/b> hit_rate=<h> same_tokens=<yes|no>
for the system workload (hit_rate: the cache-on engine's hits / lookups over the measured requests).
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

from v4flash_backend import ops  # noqa: E402
from v4flash_backend.engine.engine import Engine  # noqa: E402
from v4flash_backend.engine.runner import LocalRunner  # noqa: E402
from v4flash_backend.model.loading import load_model  # noqa: E402
from v4flash_backend.request import GenerateRequest  # noqa: E402
from v4flash_backend.settings import Settings  # noqa: E402


def _ids(g: torch.Generator, n: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab - 2, (n,), generator=g).tolist()


def ttft(eng: Engine, prompt: list[int], max_tokens: int, seed: int) -> tuple[float, list[int]]:
    """(seconds from submit to the first token, the request's tokens), run in this thread."""
    first: list[float] = []
    t0 = time.perf_counter()
    ev = eng.run_request(GenerateRequest(prompt=prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0.8,
                                         seed=seed, callback=lambda e: first or (e.token_ids and first.append(
                                             time.perf_counter()))))
    return first[0] - t0, [t for e in ev for t in e.token_ids]


def system_round(eng, system, tails, max_tokens):
    return [ttft(eng, system + t, max_tokens, seed=i) for i, t in enumerate(tails)]


def conversation_round(eng, system, user_tails, max_tokens):
    """Turn k sends the history so far + user tail k; the reply joins the history."""
    out, history = [], list(system)
    for i, tail in enumerate(user_tails):
        dt, toks = ttft(eng, history + tail, max_tokens, seed=100 + i)
        out.append((dt, toks))
        history = history + tail + toks
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=REPO / "models" / "v4flash-tiny")
    ap.add_argument("--shared", type=int, default=768, help="tokens of the shared system block")
    ap.add_argument("--tail", type=int, default=16, help="tokens of each distinct tail / user turn")
    ap.add_argument("--requests", type=int, default=4, help="system-block requests per round")
    ap.add_argument("--turns", type=int, default=3, help="conversation turns per round (0: none)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument("--spec-mode", default="off", choices=("off", "fixed", "dspark"))
    ap.add_argument("--budget-mb", type=int, default=512, help="prefix_cache_bytes of the cache-on engine, MiB")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    ops.set_numerics("exact")
    model = load_model(args.checkpoint)
    V = model.cfg.vocab_size
    max_len = args.shared + args.turns * (args.tail + args.max_tokens) + args.tail + args.max_tokens + 8
    engines = {}
    for on in (False, True):
        st = Settings(max_num_seqs=2, max_model_len=max_len, prefill_chunk=args.prefill_chunk,
                      step_token_budget=max(1024, args.prefill_chunk), spec_mode=args.spec_mode,
                      prefix_cache_bytes=(args.budget_mb << 20) if on else 0)
        engines[on] = Engine(LocalRunner(model, 3, max_len), st)
        engines[on].warmup()
    g = torch.Generator().manual_seed(0)
    system = [0] + _ids(g, args.shared - 1, V)
    for on in (False, True):  # warm-up (not timed): the cache-on engine holds the system block after it
        ttft(engines[on], system + _ids(g, args.tail, V), args.max_tokens, seed=999)
    before = dict(engines[True].prefix.counts)
    times = {w: {False: [], True: []} for w in ("system", "conversation")}
    same = True
    for rnd in range(args.rounds):
        tails = [_ids(g, args.tail, V) for _ in range(args.requests)]
        turns = [_ids(g, args.tail, V) for _ in range(args.turns)]
        toks = {}
        for on in ((False, True) if rnd % 2 == 0 else (True, False)):
            sysr = system_round(engines[on], system, tails, args.max_tokens)
            conv = conversation_round(engines[on], system, turns, args.max_tokens) if args.turns else []
            times["system"][on] += [dt for dt, _ in sysr]
            times["conversation"][on] += [dt for dt, _ in conv]
            toks[on] = [t for _, t in sysr + conv]
        same = same and toks[False] == toks[True]
        print(f"round {rnd}: system off/on {1e3 * statistics.median(times['system'][False][-args.requests:]):.1f}"
              f"/{1e3 * statistics.median(times['system'][True][-args.requests:]):.1f} ms", flush=True)
    after = engines[True].prefix.counts
    hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
    hit_rate = hits / (hits + misses) if hits + misses else 0.0
    st = engines[True].stats()
    print(f"cache: {st['prefix_cache_entries']} entries, {st['prefix_cache_bytes']} bytes, "
          f"{st['prefix_cache_evictions']} evictions; {hits} hits, {misses} misses over the measured requests")
    if args.turns:
        a, b = (1e3 * statistics.median(times["conversation"][on]) for on in (False, True))
        print(f"conversation ({args.turns} turns, history resent): ttft_off_ms={a:.1f} ttft_on_ms={b:.1f} "
              f"ttft_speedup={a / b:.2f}")
    a, b = (1e3 * statistics.median(times["system"][on]) for on in (False, True))
    print(f"prefix-cache: shared_tokens={args.shared} ttft_off_ms={a:.1f} ttft_on_ms={b:.1f} ttft_speedup={a / b:.2f} "
          f"hit_rate={hit_rate:.2f} same_tokens={'yes' if same else 'no'}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
