"""DSpark vs plain decoding vs fixed-length speculation, measured side by side in one run.

Same checkpoint, same prompts, same engine; for each (batch, temperature) the three modes run
back to back and the ratios are printed (the machine is noisy: compare ratios, not absolutes).

    python perf/bench_dspark.py [--checkpoint DIR] [--max-tokens N] [--batches 1,8] [--temps 0,1]

Ends with: dspark: batch=1 temp=0 plain_tok_s=A dspark_tok_s=B speedup=X tau=T
"""

from __future__ import annotations

import argparse
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

PROMPTS = [
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class Config:\n    def __init__(self, path):\n        self.path = path\n",
    "    def __repr__(self):\n        return ",
    "for i in range(len(items)):\n    if items[i] is None:\n",
    "def _check_arg(name, value):\n    if not isinstance(value, str):\n        raise TypeError(",
    "try:\n    import threading\nexcept ImportError:\n",
    "    @property\n    def name(self):\n",
    "        with open(filename, 'rb') as f:\n",
]


def default_checkpoint() -> Path:
    tiny = REPO / "models" / "v4flash-tiny"
    return tiny if (tiny / "config.json").exists() else REPO.parent / "shared" / "golden" / "v41-tiny"


def heldout_prompts(tok, n: int, length: int = 64) -> list[list[int]] | None:
    """Prompts cut from the embedded model's held-out corpus files (never trained on), or None
    when the corpus is not available (another checkpoint's tokenizer is fine too)."""
    try:
        from v4flash_backend.training.corpus import load_corpus
    except ImportError:
        return None
    try:
        _, held = load_corpus()
    except Exception:
        return None
    ids = [t for f in held for t in tok.encode(f.text, add_special_tokens=False).ids]
    if len(ids) < n * length * 2:
        return None
    step = (len(ids) - length) // n
    return [[0] + ids[i * step + 7:i * step + 7 + length] for i in range(n)]


def prompts_for(ckpt: Path, model, n: int) -> list[list[int]]:
    cfg = model.cfg
    tok_path = ckpt / "tokenizer.json"
    if tok_path.exists() and (ckpt / "MODEL_CARD.md").exists():
        from tokenizers import Tokenizer

        held = heldout_prompts(Tokenizer.from_file(str(tok_path)), max(n, 6))
        if held is not None:
            return held[:n]
    if tok_path.exists():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tok_path))
        ids = [[cfg.bos_token_id] + tok.encode(p, add_special_tokens=False).ids for p in PROMPTS]
    else:
        g = torch.Generator().manual_seed(0)
        ids = [[cfg.bos_token_id] + torch.randint(3, cfg.vocab_size - 2, (24,), generator=g).tolist() for _ in PROMPTS]
    return [ids[i % len(ids)] for i in range(n)]


def run(model, mode: str, prompts, max_tokens: int, temp: float, sps) -> dict:
    runner = LocalRunner(model, len(prompts) + 1, max(len(p) for p in prompts) + max_tokens + 16)
    eng = Engine(runner, Settings(max_num_seqs=len(prompts), max_model_len=runner.state.max_len - 8,
                                      spec_mode=mode))
    if mode == "dspark":
        eng.sps = sps
    outs = {}
    reqs = []
    for i, p in enumerate(prompts):
        r = GenerateRequest(prompt=p, max_tokens=max_tokens, temperature=temp, seed=1000 + i, ignore_eos=True)
        outs[r.id] = []
        r.callback = outs[r.id].append
        reqs.append(r)
    t0 = time.perf_counter()
    for r in reqs:
        eng.submit(r)
    while not all(v and v[-1].final for v in outs.values()):
        eng.step()
    dt = time.perf_counter() - t0
    st = eng.stats()
    toks = {rid: [t for e in ev for t in e.token_ids] for rid, ev in outs.items()}
    return dict(tok_s=st["output_tokens"] / dt, tau=st["tau"], steps=st["steps"], acc=st["accept_rate_at"],
                tokens=[toks[r.id] for r in reqs], seconds=dt)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=None)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--temps", default="0,1")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    ops.set_numerics("exact")
    ckpt = args.checkpoint or default_checkpoint()
    model = load_model(ckpt)
    print(f"checkpoint {ckpt}  (dim {model.cfg.dim}, {model.cfg.n_layers} layers, vocab {model.cfg.vocab_size})")
    batches = [int(b) for b in args.batches.split(",")]
    temps = [float(t) for t in args.temps.split(",")]
    # profile SPS(B) once, up to the largest batch's verify size, and share it across runs
    prof = Engine(LocalRunner(model, max(batches) + 1, 512),
                  Settings(max_num_seqs=max(batches), max_model_len=500, spec_mode="dspark"))
    sps = prof.ensure_sps()
    print(f"SPS table (steps/s of a B-token forward): {sps}")
    final = None
    print(f"{'batch':>5} {'temp':>4} {'mode':>7} {'tok/s':>8} {'ratio':>6} {'tau':>5} {'steps':>5}  accept rate by position")
    for b in batches:
        prompts = prompts_for(ckpt, model, b)
        for t in temps:
            res = {m: run(model, m, prompts, args.max_tokens, t, sps) for m in ("off", "dspark", "fixed")}
            base = res["off"]["tok_s"]
            for m in ("off", "dspark", "fixed"):
                r = res[m]
                acc = " ".join(f"{a:.2f}" for a in r["acc"]) if m != "off" else "-"
                name = {"off": "plain", "dspark": "dspark", "fixed": "fixed-5"}[m]
                print(f"{b:>5} {t:>4g} {name:>7} {r['tok_s']:8.1f} {r['tok_s'] / base:6.2f} {r['tau']:5.2f} "
                      f"{r['steps']:>5}  {acc}")
            if t == 0:
                same = res["dspark"]["tokens"] == res["off"]["tokens"] == res["fixed"]["tokens"]
                print(f"      greedy outputs identical across modes: {same}")
            if b == 1 and t == 0:
                final = (f"dspark: batch=1 temp=0 plain_tok_s={base:.1f} dspark_tok_s={res['dspark']['tok_s']:.1f} "
                         f"speedup={res['dspark']['tok_s'] / base:.2f} tau={res['dspark']['tau']:.2f}")
    if final:
        print(final)
    return 0


if __name__ == "__main__":
    sys.exit(main())
