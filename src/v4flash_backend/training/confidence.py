"""Retrain the DSpark confidence head alone, on the engine's own drafts:
`python -m v4flash_backend.training.confidence --checkpoint models/v4flash-tiny`.

Why (issue 14): the head trained with the DSpark stages (training/dspark.py) fits c*_k = 1 - 0.5 |p_d - p_t|_1,
the analytic T = 1 acceptance of a teacher-forced draft, on detached inputs for a few hundred steps.
Measured on the engine's blocks its prefix survivals barely rank (AUROC 0.47-0.59): the target it
fits is a soft T = 1 quantity while the engine's greedy acceptance is argmax agreement, and the
teacher-forced rows are not the rows the engine drafts from (its ring, its sampled predecessors).

What this does instead: it runs the engine itself (spec_mode fixed, every draft verified) on prompts
of the TRAIN split (the calibration and the benchmark use held-out files), greedy and sampled (T = 1),
and records for every verified draft k the head's exact input [hidden_k ; W1[x_{k-1}]] (the collapsed
last-stage stream and the Markov embedding of the predecessor, as the engine computes them) with the
outcome "draft k accepted" among blocks whose drafts < k were all accepted (the head's meaning:
c_k = P(x_k accepted | x_<k accepted)). The head is linear (proj [1, D + rank], no bias), so the fit
is a logistic regression: weights shared by all positions, one intercept per position (dropped: the
calibration's per-position shift takes that role), L2-regularised, L-BFGS, float64, deterministic.
The greedy and sampled rows are pooled (one head serves both; the calibration is per regime).

Only `mtp.2.confidence_head.proj.weight` (bf16) is rewritten in model.safetensors; every other
tensor is checked byte-identical before the file is replaced. The command prints the held-out
(by prompt) AUROC per position of the old and the new head. Recalibrate afterwards
(training/calibrate.py): the temperatures belong to the head they were fitted on.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import torch

from v4flash_backend import ops
from v4flash_backend.engine.calibration import auroc
from v4flash_backend.engine.engine import Engine
from v4flash_backend.engine.runner import LocalRunner
from v4flash_backend.model.loading import load_model
from v4flash_backend.request import GenerateRequest
from v4flash_backend.settings import Settings

HEAD = "confidence_head.proj.weight"


class _Recorder(Engine):
    """The engine with every verified block's confidence-head inputs kept (fixed-length drafting)."""

    rows: list

    def _confidence_logits(self, out, block):
        d = self.runner.drafter
        emb = d.markov_embed(block.prev)
        self._feats = torch.cat([out.hidden, emb], dim=-1).float()
        return d.confidence(out.hidden, emb)

    def _draft(self, writes, seqs, decision="draft"):
        self._feats = None
        super()._draft(writes, seqs, decision)
        if self._feats is not None:
            for i, s in enumerate(seqs):
                s.feats = self._feats[i]

    def _account_verify(self, s, n_acc: int) -> None:
        if s.ell and getattr(s, "feats", None) is not None:
            self.rows.append((s.req.id, s.req.temperature, s.feats[: s.ell], int(s.ell), int(n_acc)))
        super()._account_verify(s, n_acc)


def train_prompts(tok, n: int, seed: int, bos: int) -> list[list[int]]:
    """n prompts of 24..48 tokens cut at random places of the TRAIN split's token stream."""
    from .corpus import load_corpus

    train, _ = load_corpus()
    ids = [t for f in train for t in tok.encode(f.text, add_special_tokens=False).ids]
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(24, 49, (n,), generator=g).tolist()
    starts = torch.randint(0, len(ids) - 64, (n,), generator=g).tolist()
    return [[bos] + ids[s:s + k] for s, k in zip(starts, lens)]


def collect(model, prompts, temperature: float, max_tokens: int, batch: int, seed: int) -> list:
    G = model.cfg.dspark_block_size
    runner = LocalRunner(model, batch + 1, max(len(p) for p in prompts) + max_tokens + 16)
    eng = _Recorder(runner, Settings(max_num_seqs=batch, max_model_len=runner.state.max_len - 8, spec_mode="fixed",
                                     fixed_len=G, calibration_online=False, max_queue_size=len(prompts),
                                     queue_timeout_s=1e9))
    eng.rows = []
    done = []
    for i, p in enumerate(prompts):
        eng.submit(GenerateRequest(prompt=p, max_tokens=max_tokens, temperature=temperature, seed=seed + i,
                                   id=f"p{i}", ignore_eos=True,
                                   callback=lambda e, d=done: e.final and d.append(1)))
    while len(done) < len(prompts):
        eng.step()
    return eng.rows


def design(rows, G: int):
    """(X [n, F], position [n], label [n], prompt [n], regime [n]) of the conditional events."""
    X, pos, y, pid, reg = [], [], [], [], []
    for rid, temp, feats, ell, n_acc in rows:
        for k in range(min(ell, n_acc + 1)):  # drafts < k all accepted
            X.append(feats[k])
            pos.append(k)
            y.append(float(n_acc > k))
            pid.append(int(rid[1:]))
            reg.append(int(temp > 0))
    return (torch.stack(X).double(), torch.tensor(pos), torch.tensor(y, dtype=torch.float64), torch.tensor(pid),
            torch.tensor(reg))


def fit_logistic(X, pos, y, G: int, l2: float, weight=None) -> torch.Tensor:
    """Weights w [F] of P(y) = sigmoid(X w + b_pos) minimising the (weighted) mean log loss + l2 |w|^2
    (float64, L-BFGS)."""
    weight = torch.ones_like(y) if weight is None else weight
    weight = weight / weight.mean()
    F = X.shape[1]
    mu, sd = X.mean(0), X.std(0).clamp_min(1e-6)
    Z = (X - mu) / sd  # standardised for conditioning; mapped back below
    w = torch.zeros(F, dtype=torch.float64, requires_grad=True)
    b = torch.zeros(G, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=1.0, max_iter=500, tolerance_grad=1e-10, tolerance_change=1e-12,
                            history_size=50, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(Z @ w + b[pos], y, weight) + l2 * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return (w / sd).detach()  # X w' = Z w + const: the constant folds into the positions' shifts


def per_position_auroc(score, pos, y, G: int) -> list[float]:
    return [round(auroc(score[pos == k], y[pos == k]), 3) for k in range(G)]


def replace_tensor(path: Path, name: str, value: torch.Tensor) -> dict:
    """Rewrite one tensor of a safetensors file; every other tensor must stay byte-identical."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        names = f.keys()
        tensors = {k: f.get_tensor(k) for k in names}
    before = {k: _digest(t) for k, t in tensors.items() if k != name}
    if tensors[name].shape != value.shape or tensors[name].dtype != value.dtype:
        raise SystemExit(f"{name}: {tuple(value.shape)} {value.dtype} does not match the checkpoint's "
                         f"{tuple(tensors[name].shape)} {tensors[name].dtype}")
    tensors[name] = value.contiguous()
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    with safe_open(str(tmp), "pt") as f:
        names = f.keys()
        after = {k: _digest(f.get_tensor(k)) for k in names if k != name}
    if after != before:
        tmp.unlink()
        raise SystemExit("rewriting the checkpoint changed other tensors; not replaced")
    tmp.chmod(path.stat().st_mode & 0o777)
    tmp.replace(path)
    return {"unchanged_tensors": len(before), "digest_of_unchanged": hashlib.sha256(
        json.dumps(sorted(before.items())).encode()).hexdigest()[:16]}


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m v4flash_backend.training.confidence", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=160, help="train-split prompts per regime")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seed", type=int, default=4321)
    ap.add_argument("--l2", type=float, default=1e-3)
    ap.add_argument("--greedy-weight", type=float, default=0.8,
                    help="share of the log loss on greedy events (the rest on sampled ones)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=Path, default=None, help="cache of the collected rows (loaded when it exists)")
    ap.add_argument("--dry-run", action="store_true", help="report only, do not rewrite the checkpoint")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    ops.set_numerics("exact")
    model = load_model(a.checkpoint)
    cfg = model.cfg
    G = cfg.dspark_block_size
    name = f"mtp.{cfg.n_mtp_layers - 1}.{HEAD}"
    t0 = time.time()
    if a.rows is not None and a.rows.exists():
        rows = torch.load(a.rows)
    else:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(a.checkpoint / "tokenizer.json"))
        prompts = train_prompts(tok, a.prompts, a.seed, cfg.bos_token_id)
        rows = []
        for temp in (0.0, 1.0):
            rows += collect(model, prompts, temp, a.max_tokens, a.batch, a.seed)
            print(f"collected T={temp:g}: {len(rows)} blocks, {time.time() - t0:.0f} s", file=sys.stderr)
        if a.rows is not None:
            torch.save(rows, a.rows)
    X, pos, y, pid, reg = design(rows, G)
    old_w = model.W[name].double().reshape(-1)
    held = pid % 4 == 0  # a quarter of the prompts measure, the rest fit
    # each regime weighs by a.greedy_weight : 1 - a.greedy_weight in total (sampled blocks are many and short)
    n_g, n_s = float((reg == 0).sum()), float((reg == 1).sum())
    wt = torch.where(reg == 0, a.greedy_weight / max(n_g, 1.0), (1 - a.greedy_weight) / max(n_s, 1.0)).double()
    w = fit_logistic(X[~held], pos[~held], y[~held], G, a.l2, wt[~held])
    report = {"blocks": len(rows), "events": len(y), "fit_events": int((~held).sum()), "l2": a.l2,
              "greedy_weight": a.greedy_weight}
    print(f"{'regime':>8} {'head':>4} " + " ".join(f"{'pos ' + str(k + 1):>6}" for k in range(G)))
    for r, rn in ((0, "greedy"), (1, "sampled")):
        m = held & (reg == r)
        for hn, ww in (("old", old_w), ("new", w)):
            au = per_position_auroc(X[m] @ ww, pos[m], y[m], G)
            report[f"auroc_{rn}_{hn}"] = au
            print(f"{rn:>8} {hn:>4} " + " ".join(f"{v:6.3f}" for v in au))
    # refit on every prompt for the stored head (the held-out quarter only measured the recipe)
    w_all = fit_logistic(X, pos, y, G, a.l2, wt)
    value = w_all.to(torch.bfloat16).reshape(1, -1)
    report["seconds"] = round(time.time() - t0, 1)
    print(f"confidence: events={len(y)} heldout_auroc_greedy_new={report['auroc_greedy_new']} "
          f"seconds={report['seconds']}")
    if not a.dry_run:
        report.update(replace_tensor(a.checkpoint / "model.safetensors", name, value))
        (a.checkpoint / "confidence_train.json").write_text(json.dumps(
            {"command": "python -m v4flash_backend.training.confidence " + " ".join(argv or sys.argv[1:]),
             "args": {k: str(v) for k, v in vars(a).items()}, "report": report}, indent=1) + "\n")
        print(f"rewrote {name} in {a.checkpoint / 'model.safetensors'} "
              f"({report['unchanged_tensors']} other tensors byte-identical)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
