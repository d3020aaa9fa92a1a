"""Acceptance of a checkpoint's DSpark stages alone: fixed-5 speculation at T = 0 (every draft
verified, so neither the confidence head nor the schedule enters), timing-free.

    .venv/bin/python perf/draft_acceptance.py [--checkpoint DIR] [--num-prompts 96]
                                              [--prompts FILE ...] [--batch 8] [--max-tokens 48]

Prompts: --num-prompts cut from the held-out corpus (as perf/bench_dspark.py cuts them), then each
--prompts FILE (a JSON list of strings). Under the exact numerics a request's tokens and accepted
lengths do not depend on the batch, so the batch only sets the wall time. Per prompt set it prints
    acceptance: prompts=<name> n=<N> tau=<t>
Used to compare two builds of the stages (MODEL_CARD.md, "Why more DSpark data").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "perf"))
sys.path.insert(0, str(REPO / "src"))

import bench_dspark as bd  # noqa: E402

from v4flash_backend import ops  # noqa: E402
from v4flash_backend.model.loading import load_model  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=None)
    ap.add_argument("--num-prompts", type=int, default=96, help="held-out prompts (0: none)")
    ap.add_argument("--prompts", type=Path, action="append", default=[], help="JSON list of prompt strings")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    ops.set_numerics("exact")
    ck = a.checkpoint or bd.default_checkpoint()
    bd.CKPT[0] = ck
    model = load_model(ck)
    if not model.cfg.dspark_block_size:
        raise SystemExit(f"{ck} has no DSpark stages")
    sets = ([("heldout", None)] if a.num_prompts > 0 else []) + [(str(p), p) for p in a.prompts]
    for name, path in sets:
        prompts, desc = bd.load_prompts(ck, model, a.num_prompts, path)
        if path is None and "held-out" not in desc:  # bench_dspark falls back to random prompts
            raise SystemExit(f"{ck}: no held-out corpus prompts ({desc}); it needs MODEL_CARD.md and tokenizer.json")
        # no step cost: fixed speculation verifies every draft and never reads one, so nothing is
        # profiled (the engine profiles only for spec_mode dspark, where stepping aside applies too)
        r = bd.run(model, "fixed", prompts, a.batch, a.max_tokens, 0.0, None, 0, adaptive=False)
        print(f"acceptance: prompts={name} n={len(prompts)} tau={r['tau']:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
