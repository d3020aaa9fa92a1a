"""Fit the DSpark confidence head's STS temperatures on held-out text and store them beside the
checkpoint: `python -m v4flash_backend.training.calibrate --checkpoint models/v4flash-tiny`.

Data: prompts cut from the held-out split of the corpus (files the model never trained on), run
through the engine with every draft verified (spec_mode fixed, fixed_len = block size), greedy and
sampled (T = 1), so each block yields its accepted-prefix length. Half of the prompts fit the
temperatures (engine.calibration.fit_sts, per regime), the other half measure them: the command
prints per-position ECE and AUROC of the prefix survivals before and after, on the evaluation half,
and writes dspark_calibration.json (temperatures plus that report) into the checkpoint directory.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from v4flash_backend import ops
from v4flash_backend.engine.calibration import (
    FILE_NAME,
    IDENTITY,
    REGIMES,
    Calibration,
    OnlineCalibrator,
    auroc,
    ece,
    fit_sts,
    prefix_labels,
    survivals,
)
from v4flash_backend.engine.engine import Engine
from v4flash_backend.engine.runner import LocalRunner
from v4flash_backend.model.loading import load_model
from v4flash_backend.request import GenerateRequest
from v4flash_backend.settings import Settings

from .loop import Progress


def heldout_prompt_ids(tok, n: int, length: int, bos: int) -> list[list[int]]:
    from .corpus import load_corpus

    _, held = load_corpus()
    ids = [t for f in held for t in tok.encode(f.text, add_special_tokens=False).ids]
    if len(ids) < n * length:
        raise SystemExit(f"held-out corpus too small for {n} prompts of {length} tokens")
    step = (len(ids) - length) // n
    return [[bos] + ids[i * step:i * step + length] for i in range(n)]


def collect(model, prompts, temperature: float, max_tokens: int, batch: int, seed: int, on_progress=None):
    """(logits [N, G], accepted [N]) of fully verified draft blocks."""
    G = model.cfg.dspark_block_size
    runner = LocalRunner(model, batch + 1, max(len(p) for p in prompts) + max_tokens + 16)
    eng = Engine(runner, Settings(max_num_seqs=batch, max_model_len=runner.state.max_len - 8, spec_mode="fixed",
                                  fixed_len=G, calibration_online=False, max_queue_size=len(prompts),
                                  queue_timeout_s=1e9))
    eng.calib = OnlineCalibrator(eng.calib.cal, window=10**7, enabled=False)  # keep every block, no refits
    done = []
    for i, p in enumerate(prompts):
        eng.submit(GenerateRequest(prompt=p, max_tokens=max_tokens, temperature=temperature, seed=seed + i,
                                   ignore_eos=True, callback=lambda e, d=done: e.final and d.append(1)))
    while len(done) < len(prompts):
        eng.step()
        if on_progress is not None and done:
            on_progress(len(done))
    logits, admitted, accepted = eng.calib.observations("greedy" if temperature <= 0 else "sampled")
    full = admitted == G  # blocks cut by max_tokens verified fewer drafts: their prefix is censored
    return logits[full], accepted[full]


def ece_noise(conf: torch.Tensor, label: torch.Tensor, reps: int = 200, seed: int = 0) -> tuple[float, float]:
    """The sampling noise of a binned ECE measured on these blocks: (the standard deviation of the
    ECE over bootstrap resamples of the blocks, the mean ECE a perfectly calibrated head would show
    on them: labels drawn as Bernoulli(conf), the estimator's own floor at this sample size)."""
    g = torch.Generator().manual_seed(seed)
    conf, label = conf.double().reshape(-1), label.double().reshape(-1)
    n = conf.numel()
    boot = [ece(conf[i], label[i]) for i in torch.randint(n, (reps, n), generator=g)]
    floor = [ece(conf, torch.bernoulli(conf, generator=g)) for _ in range(reps)]
    mean = sum(boot) / reps
    return (sum((b - mean) ** 2 for b in boot) / (reps - 1)) ** 0.5, sum(floor) / reps


def report_lines(name: str, logits, accepted, params) -> tuple[list[str], dict]:
    G = logits.shape[1]
    labels = prefix_labels(accepted, G)
    raw, cal = survivals(logits, [IDENTITY] * G), survivals(logits, params)
    rows, rep = [], {"ece_before": [], "ece_after": [], "ece_after_sd": [], "ece_floor": [], "auroc": [],
                     "blocks": int(len(accepted))}
    for k in range(G):
        e0, e1 = ece(raw[:, k], labels[:, k]), ece(cal[:, k], labels[:, k])
        sd, floor = ece_noise(cal[:, k], labels[:, k], seed=k)
        a = auroc(cal[:, k], labels[:, k])
        rep["ece_before"].append(round(e0, 4))
        rep["ece_after"].append(round(e1, 4))
        rep["ece_after_sd"].append(round(sd, 4))
        rep["ece_floor"].append(round(floor, 4))
        rep["auroc"].append(round(a, 4))
        rows.append(f"{name:>8} {k + 1:>3} {float(labels[:, k].double().mean()):8.3f} {float(raw[:, k].mean()):8.3f} "
                    f"{float(cal[:, k].mean()):8.3f} {e0 * 100:7.2f}% {e1 * 100:7.2f}% {sd * 100:5.2f}% "
                    f"{floor * 100:5.2f}% {a:7.3f}  T={params[k][0]:.3f} b={params[k][1]:+.2f}")
    return rows, rep


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m v4flash_backend.training.calibrate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=48, help="held-out prompts (half fit, half evaluate)")
    ap.add_argument("--sampled-prompts", type=int, default=None,
                    help="held-out prompts of the sampled regime (default: --prompts; a sampled block commits "
                         "~1 token, so the same prompts yield several times the greedy blocks)")
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--objective", choices=("ece", "nll"), default="ece",
                    help="what the per-position search minimises (the report is ECE either way)")
    ap.add_argument("--observations", type=Path, default=None,
                    help="cache of the collected blocks: loaded when it exists (same prompts), else written")
    ap.add_argument("--dry-run", action="store_true", help="print the report, do not write the file")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    ops.set_numerics("exact")
    model = load_model(a.checkpoint)
    G = model.cfg.dspark_block_size
    if not G:
        raise SystemExit(f"{a.checkpoint} has no DSpark stages")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(a.checkpoint / "tokenizer.json"))
    prompts = heldout_prompt_ids(tok, a.prompts, a.prompt_len, model.cfg.bos_token_id)
    n_sampled = a.prompts if a.sampled_prompts is None else min(a.sampled_prompts, a.prompts)
    halves = {"greedy": (prompts[0::2], prompts[1::2]),
              "sampled": (prompts[:n_sampled][0::2], prompts[:n_sampled][1::2])}
    cal = Calibration(G)
    lines = [f"{'regime':>8} {'pos':>3} {'observed':>8} {'raw a_k':>8} {'cal a_k':>8} {'ECE raw':>8} "
             f"{'ECE cal':>8} {'+-sd':>6} {'floor':>6} {'AUROC':>7}"]
    report = {"prompts": a.prompts, "sampled_prompts": n_sampled, "prompt_len": a.prompt_len,
              "max_tokens": a.max_tokens, "seed": a.seed,
              "objective": a.objective}
    t0 = time.time()
    bar = Progress(a.prompts + n_sampled, "calibrate")
    base = 0
    cache = torch.load(a.observations) if a.observations and a.observations.exists() else None
    collected = {}
    for reg, temp in (("greedy", 0.0), ("sampled", 1.0)):  # one progress bar across the four runs
        fit_p, eval_p = halves[reg]
        if cache is not None:
            fl, fa, el, ea = cache[reg]
        else:
            fl, fa = collect(model, fit_p, temp, a.max_tokens, a.batch, a.seed,
                             lambda n, off=base: bar.update(off + n - 1, reg))
            base += len(fit_p)
            el, ea = collect(model, eval_p, temp, a.max_tokens, a.batch, a.seed + 10_000,
                             lambda n, off=base: bar.update(off + n - 1, reg))
            base += len(eval_p)
        collected[reg] = (fl, fa, el, ea)
        cal.params[reg] = fit_sts(fl, fa, objective=a.objective, refine=True)
        rows, rep = report_lines(reg, el, ea, cal.params[reg])
        rep["fit_blocks"] = int(len(fa))
        report[reg] = rep
        lines += rows
    if a.observations and cache is None:
        torch.save(collected, a.observations)
    report["seconds"] = round(time.time() - t0, 1)
    cal.report = report
    print("\n".join(lines))
    worst = max(max(report[r]["ece_after"]) for r in REGIMES)
    at = max(((r, k) for r in REGIMES for k in range(G)), key=lambda rk: report[rk[0]]["ece_after"][rk[1]])
    print(f"calibration: max_ece_after={worst * 100:.2f}% (+-{report[at[0]]['ece_after_sd'][at[1]] * 100:.2f}% "
          f"bootstrap sd, {at[0]} position {at[1] + 1}) blocks_eval="
          f"{report['greedy']['blocks']}+{report['sampled']['blocks']} seconds={report['seconds']}")
    if not a.dry_run:
        cal.save(a.checkpoint / FILE_NAME)
        print(f"wrote {a.checkpoint / FILE_NAME}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
