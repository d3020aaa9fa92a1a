"""Plain decoding vs DSpark vs fixed-5 speculation, interleaved and repeated, over many prompts.

    .venv/bin/python perf/bench_dspark.py [--checkpoint DIR] [--prompts FILE] [--rounds 3]
                                          [--batches 1,8] [--temps 0,1] [--max-tokens 48] [--oracle] [--fast]

Each (batch, temperature) cell runs the three modes in rounds. In a round every mode runs the same
prompts in groups of `batch` concurrent requests through its own engine (as a server has: its
online calibration and acceptance window carry over from group to group), and the modes are
interleaved group by group: each group runs in plain, dspark and fixed before the next group
starts, in an order that rotates with the group and the round. A burst of load on the shared
machine then hits the modes alike (interleaving whole runs of 15-45 s let one burst land on one
mode: batch 1, T = 1 read 0.88x and 0.97x plain in two sessions). All engines share the step-cost
profile taken once at start. A mode's figure per round is its total generated tokens over the
wall time of its groups; the cell reports the median over rounds and the spread (min-max).

--fast: the compiled path (the static round graphs compiled by inductor: `make serve`'s CPU default
once its background compile is done) instead of the eager one. Per batch one `StaticRunner` with one
decode bucket serves every mode (prefix caching off: the modes share its slots); its graphs (the
DSpark and fixed-5 rounds, the plain-decode round) are compiled before the timed rounds
(`fast-compile:` line), and the step cost is profiled on that batch's graphs, as a server of that
many sequences does (the eager bench profiles once, at the largest batch).

Prompts: by default >= 16 cut from the embedded model's held-out corpus files (never trained on);
--prompts FILE takes a JSON list of strings, tokenized with the checkpoint's tokenizer (BOS first).
Each mode's engines share one step-cost learner, fixed-length guard and online calibration (its
window of verified blocks per regime, which the stepping-aside decision reads) over the whole bench,
per batch with --fast (engine/step_learn.py, engine/fixed_guard.py, engine/calibration.py: a server's
lifetime; a new engine per round re-learned them each round, a start-up a server pays once;
--no-step-cost-online: the profile alone, the calibration still shared). Per cell it prints (on one line)
    cell: batch=<B> temp=<T> plain_tok_s=<x> dspark_tok_s=<y> fixed_tok_s=<z>
          dspark_vs_plain=<y/x> dspark_vs_fixed=<y/z> tau=<t> admitted_median=<l>
(admitted_median: DSpark's median drafts admitted per verified block, probes and stepped-aside steps
left out; nan where it admitted none), then per mode that drafts
    stepcost: batch=<B> temp=<T> mode=<m> model=profile|learned steps=<n> measured_over_model=<r> [q1-q3]
(every decode step's measured seconds over the start-up profile's t_step; and, over the steps taken
once the learned cost had moved off the profile, over the learned cost as it stood before the step),
then per mode where its time went, over all rounds of the cell (steps that prefill -- a drafting
mode's draft its first block there, eagerly -- decode steps that draft nothing, decode steps that
draft: count, total seconds, median milliseconds)
    split: batch=<B> temp=<T> mode=<m> prefill_steps=<n> prefill_s=<s> prefill_ms=<ms>
           undrafted_steps=<n> undrafted_s=<s> undrafted_ms=<ms> drafting_steps=<n> drafting_s=<s> drafting_ms=<ms>
and it ends with
    dspark: batch=1 temp=0 plain_tok_s=A dspark_tok_s=B speedup=X tau=T
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from v4flash_backend import ops  # noqa: E402
from v4flash_backend.engine.engine import Engine  # noqa: E402
from v4flash_backend.engine.fixed_guard import FixedGuard  # noqa: E402
from v4flash_backend.engine.round_plan import STOP_WIDTH  # noqa: E402
from v4flash_backend.engine.runner import LocalRunner  # noqa: E402
from v4flash_backend.engine.step_learn import StepCostLearner  # noqa: E402
from v4flash_backend.model.loading import load_model  # noqa: E402
from v4flash_backend.request import GenerateRequest  # noqa: E402
from v4flash_backend.settings import Settings  # noqa: E402

MODES = ("off", "dspark", "fixed")
CKPT = [None]  # the checkpoint directory (its dspark_calibration.json is loaded by the engine)
NAMES = {"off": "plain", "dspark": "dspark", "fixed": "fixed-5", "oracle": "oracle"}


def default_checkpoint() -> Path:
    tiny = REPO / "models" / "v4flash-tiny"
    return tiny if (tiny / "config.json").exists() else REPO.parent / "shared" / "golden" / "v41-tiny"


TTFT_PROMPT = 256  # perf/bench_decode.py's TTFT prompt (tokens)


def fast_max_len(prompts, max_tokens: int) -> int:
    """The fast path's runner context (its one decode bucket's), the same in both benches, so each
    loads the other's graphs from inductor's cache: the TTFT prompt or the longest request, + 16."""
    return max(TTFT_PROMPT, max(len(p) for p in prompts) + max_tokens) + 16


def static_runner(model, batch: int, max_len: int, backend: str):
    """The fast path's StaticRunner (both benches): `batch` sequences in one decode bucket of the whole
    context, host-sync counting off as make serve's CPU default builds it (group/build.py: the counting
    hook would slow the eager prefill and drafting around the rounds by ~20 %)."""
    from v4flash_backend.trn2.launch import NeuronSettings
    from v4flash_backend.trn2.static_runner import StaticRunner
    from v4flash_backend.trn2.static_step import Bucket

    G = model.cfg.dspark_block_size or 0
    return StaticRunner(model, batch, max_len, buckets=[Bucket(batch, 1 + G, max_len)],
                        settings=NeuronSettings(backend=backend), count_host_syncs=False)


def fast_runner(model, batch: int, max_len: int, backend: str = "inductor"):
    """(StaticRunner, compile seconds, graphs): `static_runner` with every graph the bench's modes run
    compiled (or loaded from inductor's cache)."""
    runner = static_runner(model, batch, max_len, backend)
    t0 = time.perf_counter()
    for mode, fixed_len in (("dspark", 0), ("fixed", Settings().fixed_len)):
        runner.graphs.warm_up(None, mode=mode, fixed_len=fixed_len, stop_width=STOP_WIDTH, processed=False)
    runner.warm_up_nodraft(None, stop_width=STOP_WIDTH, processed=False)
    return runner, time.perf_counter() - t0, runner.graphs.stats.graphs


def heldout_prompts(tok, n: int, length: int = 48) -> list[list[int]] | None:
    """Prompts cut at n evenly spaced places of the held-out corpus files, or None without it."""
    try:
        from v4flash_backend.training.corpus import load_corpus

        _, held = load_corpus()
    except Exception:
        return None
    ids = [t for f in held for t in tok.encode(f.text, add_special_tokens=False).ids]
    if len(ids) < n * length * 2:
        return None
    step = (len(ids) - length) // n
    return [[0] + ids[i * step + 7:i * step + 7 + length] for i in range(n)]


def load_prompts(ckpt: Path, model, n: int, prompts_file: Path | None) -> tuple[list[list[int]], str]:
    cfg = model.cfg
    tok = None
    if (ckpt / "tokenizer.json").exists():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    if prompts_file is not None:
        texts = json.loads(prompts_file.read_text())
        if not isinstance(texts, list) or not all(isinstance(t, str) and t for t in texts):
            raise SystemExit(f"{prompts_file}: expected a JSON list of non-empty strings")
        if tok is None:
            raise SystemExit(f"{ckpt} has no tokenizer.json to tokenize --prompts with")
        return [[cfg.bos_token_id] + tok.encode(t, add_special_tokens=False).ids for t in texts], str(prompts_file)
    if tok is not None and (ckpt / "MODEL_CARD.md").exists():
        held = heldout_prompts(tok, n)
        if held is not None:
            return held, f"{n} held-out corpus prompts"
    g = torch.Generator().manual_seed(0)
    return ([[cfg.bos_token_id] + torch.randint(3, cfg.vocab_size - 2, (24,), generator=g).tolist() for _ in range(n)],
            f"{n} random prompts")


class OracleEngine(Engine):
    """DSpark with a perfect confidence head (greedy only, a bound, not a lossless scheduler): c_k = 1
    exactly when draft k matches the plain greedy continuation (known from a plain run of the same
    prompt), else 0, with the calibration off. Admission, the step cost and stepping aside are the
    engine's own, so this measures what admission could reach with a head that ranks perfectly."""

    reference: dict  # request id -> plain greedy output tokens

    def _draft(self, writes, seqs, decision="draft"):
        self._seqs = seqs
        return super()._draft(writes, seqs, decision)

    def _confidence_logits(self, out, block):
        G = block.tokens.shape[1]
        logits = torch.full((len(self._seqs), G), -30.0)
        for i, s in enumerate(self._seqs):
            ref = self.reference[s.req.id]
            for k in range(G):  # draft k predicts output token n_out + k
                if s.n_out + k >= len(ref) or int(block.tokens[i, k]) != ref[s.n_out + k]:
                    break
                logits[i, k] = 30.0
        return logits


class ModeRun:
    """One mode's run over all prompts in groups of `batch` concurrent requests, through one engine
    (as a server has: its online calibration and acceptance window carry from one group of
    requests to the next); `group(g0)` runs one group, so several modes' runs can be interleaved
    group by group. mode "oracle": OracleEngine with `reference` (plain greedy outputs per prompt);
    `outputs` collects the tokens, `steps` the decode steps' (measured, profile's, learned) seconds,
    `admitted` the drafts admission chose per verified block. `learned`: [StepCostLearner,
    FixedGuard, OnlineCalibrator or None] the mode's engines share (None: each engine's own;
    step_cost_online False: no learner or guard; the calibration slot is filled by the first engine)."""

    def __init__(self, model, mode: str, prompts, batch: int, max_tokens: int, temp: float, cost, seed: int,
                 adaptive: bool = True, reference: list | None = None, outputs: list | None = None,
                 steps: list | None = None, learned: tuple | None = None, online: bool = True,
                 admitted: list | None = None, runner=None, split: dict | None = None):
        self.mode, self.prompts, self.batch, self.max_tokens, self.temp, self.seed = (
            mode, prompts, batch, max_tokens, temp, seed)
        self.split = split  # {prefill | undrafted | drafting: [seconds of each such step]} (SPLIT_KINDS)
        self.cost, self.outputs, self.steps, self.admitted = cost, outputs, steps, admitted
        self.seconds = 0.0
        shared = runner is not None  # --fast: the batch's compiled runner, shared by the modes
        if runner is None:
            runner = LocalRunner(model, batch + 1, max(len(p) for p in prompts) + max_tokens + 16)
        oracle = mode == "oracle"
        self.eng = eng = (OracleEngine if oracle else Engine)(runner, Settings(
            max_num_seqs=batch, max_model_len=runner.state.max_len - 8, spec_mode="dspark" if oracle else mode,
            dspark_adaptive=adaptive, checkpoint_dir=str(CKPT[0]), calibration_online=not oracle,
            step_cost_online=online, **({"prefix_cache_bytes": 0} if shared else {})))
        eng.cost = cost
        if learned is not None:  # the mode's learner, guard and calibration, carried from engine to engine
            eng.learner = learned[0]
            if eng.guard is not None:
                eng.guard = learned[1]
            if eng.calib is not None and not oracle:
                if learned[2] is None:
                    learned[2] = eng.calib
                eng.calib = learned[2]
        if oracle:
            eng.calib.cal.params = {}  # identity: the oracle's 0 / 1 confidences are exact
            eng.reference = {f"p{i}": r for i, r in enumerate(reference)}

    def groups(self) -> range:
        return range(0, len(self.prompts), self.batch)

    def group(self, g0: int) -> None:
        eng, outputs, steps, cost = self.eng, self.outputs, self.steps, self.cost
        done: list = []
        reqs = [GenerateRequest(prompt=p, max_tokens=self.max_tokens, temperature=self.temp, seed=self.seed + g0 + i,
                                ignore_eos=True, id=f"p{g0 + i}",
                                callback=lambda e, d=done, j=g0 + i: (outputs is not None and outputs[j].extend(
                                    e.token_ids), e.final and d.append(1)))
                for i, p in enumerate(self.prompts[g0:g0 + self.batch])]
        t0, books = time.perf_counter(), 0.0
        for r in reqs:
            eng.submit(r)
        while len(done) < len(reqs):
            # decode-only steps: (measured seconds, the profile's and the learned cost's t_step(B, S, R))
            # (a bool: `eng.running` itself is the list the step then fills). This bookkeeping, which
            # only the drafting modes do, is timed and left out of the mode's seconds: a server does not
            # do it (it cost a stepped-aside DSpark step ~1 % of a compiled plain round at batch 1)
            tb = time.perf_counter()
            dec = bool(eng.running) and not any(s.prefilling for s in eng.running) and self.mode != "off"
            B, S = sum(1 + s.ell for s in eng.running), len(eng.running)
            if dec and self.admitted is not None:
                # blocks this step verifies (a stepped-aside request holds none: its ell 0 is no choice)
                self.admitted.extend(s.ell for s in eng.running if s.adm == "admit" and s.draft is not None)
            learned = eng.learned_cost() if dec and steps is not None else None
            # a step with requests still to admit or prefilling prefills (its forward runs their prompts)
            prefill = not eng.running or any(s.prefilling for s in eng.running)
            drafted0, ts = eng.totals["drafted"], time.perf_counter()
            books += ts - tb
            eng.step()
            te = time.perf_counter()
            if self.split is not None:
                kind = "prefill" if prefill else "drafting" if eng.totals["drafted"] > drafted0 else "undrafted"
                self.split.setdefault(kind, []).append(te - ts)
            if dec and steps is not None:
                R = (eng.totals["drafted"] - drafted0) // max(1, eng.gamma)
                steps.append((te - ts, float(cost.t_step(B, S, R)), float(learned.t_step(B, S, R)),
                              learned is not cost))  # the learned cost had moved off the profile
            books += time.perf_counter() - te
        self.seconds += time.perf_counter() - t0 - books

    def result(self) -> dict:
        st = self.eng.stats()
        tokens, acc_v, acc_s = st["output_tokens"], st["verify_rows"], st["accepted"]
        return dict(tok_s=tokens / self.seconds, tau=(acc_s + acc_v) / acc_v if acc_v else 1.0)


def run(model, mode: str, prompts, batch: int, max_tokens: int, temp: float, cost, seed: int,
        adaptive: bool = True, reference: list | None = None, outputs: list | None = None,
        steps: list | None = None, **kw) -> dict:
    """One mode's whole run (ModeRun's groups back to back): {tok_s, tau}."""
    mr = ModeRun(model, mode, prompts, batch, max_tokens, temp, cost, seed, adaptive, reference, outputs, steps, **kw)
    for g0 in mr.groups():
        mr.group(g0)
    return mr.result()


def interleaved_round(model, modes, prompts, batch: int, max_tokens: int, temp: float, cost, seed: int,
                      rnd: int, adaptive: bool = True, reference: list | None = None,
                      outputs: dict | None = None, steps: dict | None = None, learned: dict | None = None,
                      online: bool = True, admitted: dict | None = None, runner=None,
                      split: dict | None = None) -> dict:
    """One round of every mode, interleaved group by group (each group of prompts runs in every mode
    before the next group starts; the order of the modes rotates with the group and the round), so
    a burst of load on the shared machine hits the modes alike instead of one mode's whole run.
    Returns {mode: {tok_s, tau}}. learned: {mode: [StepCostLearner, FixedGuard, OnlineCalibrator | None]}
    carried over rounds (the calibration is the first engine's, then shared)."""
    runs = {m: ModeRun(model, m, prompts, batch, max_tokens, temp, cost, seed, adaptive, reference,
                       (outputs or {}).get(m), (steps or {}).get(m), (learned or {}).get(m), online,
                       (admitted or {}).get(m), runner, (split or {}).get(m)) for m in modes}
    for gi, g0 in enumerate(range(0, len(prompts), batch)):
        k = (rnd + gi) % len(modes)
        for m in modes[k:] + modes[:k]:
            runs[m].group(g0)
    return {m: r.result() for m, r in runs.items()}


SPLIT_KINDS = ("prefill", "undrafted", "drafting")


def split_line(b: int, t: float, mode: str, split: dict) -> str:
    """The `split:` line of one mode in one cell (see the module docstring)."""
    parts = []
    for k in SPLIT_KINDS:
        v = split.get(k, [])
        parts.append(f"{k}_steps={len(v)} {k}_s={sum(v):.3f} {k}_ms={median_or_nan(v) * 1e3:.2f}")
    return f"split: batch={b} temp={t:g} mode={NAMES[mode]} " + " ".join(parts)


def median_or_nan(values: list) -> float:
    return statistics.median(values) if values else float("nan")


def fmt(values: list[float]) -> str:
    return f"{statistics.median(values):7.1f} [{min(values):.1f}-{max(values):.1f}]"


def prompt_args(doc: str) -> argparse.ArgumentParser:
    """A parser with the options of a bench over prompts (this one, perf/aside_cost.py): the
    checkpoint, the prompts, the tokens a request and the rounds."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=None)
    ap.add_argument("--prompts", type=Path, default=None, help="JSON list of prompt strings")
    ap.add_argument("--num-prompts", type=int, default=16, help="held-out prompts when --prompts is not given")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    return ap


def main(argv=None) -> int:
    ap = prompt_args(__doc__)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--temps", default="0,1")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--oracle", action="store_true",
                    help="at T = 0 also run DSpark with a perfect confidence head (OracleEngine): the bound "
                         "admission could reach")
    ap.add_argument("--no-step-cost-online", dest="online", action="store_false",
                    help="admission on the start-up profile alone: no learned step cost, no fixed-length guard")
    ap.add_argument("--fast", action="store_true",
                    help="the compiled static path (inductor), compiled before the timed rounds, instead of eager")
    ap.add_argument("--no-adaptive", dest="adaptive", action="store_false",
                    help="DSpark without dspark_adaptive (raw confidence head, forward-only steps/s, "
                         "no stepping aside)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    torch.set_num_threads(args.threads)
    ops.set_numerics("exact")
    ckpt = args.checkpoint or default_checkpoint()
    CKPT[0] = ckpt
    model = load_model(ckpt)
    prompts, source = load_prompts(ckpt, model, args.num_prompts, args.prompts)
    batches = [int(b) for b in args.batches.split(",")]
    temps = [float(t) for t in args.temps.split(",")]
    print(f"checkpoint {ckpt} (dim {model.cfg.dim}, {model.cfg.n_layers} layers, vocab {model.cfg.vocab_size}); "
          f"{source}; {args.rounds} interleaved rounds; max_tokens {args.max_tokens}; "
          f"dspark_adaptive={args.adaptive}; step_cost_online={args.online}; "
          f"path={'fast (static rounds, inductor)' if args.fast else 'eager'}")
    runners, costs = {}, {}
    if args.fast:
        max_len = fast_max_len(prompts, args.max_tokens)
        for b in batches:
            runners[b], secs, graphs = fast_runner(model, b, max_len)
            print(f"fast-compile: batch={b} graphs={graphs} seconds={secs:.1f}", flush=True)
            costs[b] = Engine(runners[b], Settings(max_num_seqs=b, max_model_len=max_len - 8, spec_mode="dspark",
                                                   dspark_adaptive=True, prefix_cache_bytes=0)).ensure_cost()
            print(f"step cost (batch {b}, the static rounds): {costs[b]}")
    else:
        prof = Engine(LocalRunner(model, max(batches) + 1, 512),
                      Settings(max_num_seqs=max(batches), max_model_len=500, spec_mode="dspark", dspark_adaptive=True))
        costs = dict.fromkeys(batches, prof.ensure_cost())
        print(f"step cost: {costs[batches[0]]}")
    print(f"{'batch':>5} {'temp':>4} {'mode':>7} {'tok/s median [min-max]':>24} {'tau':>5}")
    final = None
    reference = None
    # the learner / guard / calibration of a mode live as long as the bench (a server's lifetime)
    G, F = model.cfg.dspark_block_size or 0, Settings().fixed_len
    learners = lambda: {m: [StepCostLearner(), FixedGuard(F, G), None] for m in MODES + ("oracle",)}  # noqa: E731
    learned = learners()
    if args.oracle and 0.0 in temps:  # plain greedy outputs (exact numerics: independent of the batch)
        reference = [[] for _ in prompts]
        b = max(batches)
        run(model, "off", prompts, b, args.max_tokens, 0.0, costs[b], 0, outputs=reference, runner=runners.get(b))
    for b in batches:
        if args.fast:  # a server per batch (its own graphs and profile): its own learners too
            learned = learners()
        for t in temps:
            modes = MODES + (("oracle",) if reference is not None and t == 0 else ())
            res = {m: [] for m in modes}
            steps: dict[str, list] = {}
            admitted: dict[str, list] = {m: [] for m in modes}
            split: dict[str, dict] = {m: {} for m in modes}
            for rnd in range(args.rounds):
                outs = {"oracle": [[] for _ in prompts]} if "oracle" in modes else {}
                got = interleaved_round(model, modes, prompts, b, args.max_tokens, t, costs[b], 1000 * rnd, rnd,
                                        args.adaptive, reference, outs, {m: steps.setdefault(m, []) for m in modes},
                                        learned, args.online, admitted, runners.get(b), split)
                for m in modes:
                    res[m].append(got[m])
                if outs and outs["oracle"] != reference:
                    raise SystemExit("oracle run's greedy output differs from plain decoding")
            med = {m: statistics.median(r["tok_s"] for r in res[m]) for m in MODES}
            tau = statistics.median(r["tau"] for r in res["dspark"])
            for m in modes:
                print(f"{b:>5} {t:>4g} {NAMES[m]:>7} {fmt([r['tok_s'] for r in res[m]]):>24} "
                      f"{statistics.median(r['tau'] for r in res[m]):5.2f}")
            print(f"cell: batch={b} temp={t:g} plain_tok_s={med['off']:.1f} dspark_tok_s={med['dspark']:.1f} "
                  f"fixed_tok_s={med['fixed']:.1f} dspark_vs_plain={med['dspark'] / med['off']:.2f} "
                  f"dspark_vs_fixed={med['dspark'] / med['fixed']:.2f} tau={tau:.2f} "
                  f"admitted_median={median_or_nan(admitted['dspark']):g}", flush=True)
            for m in ("dspark", "fixed"):  # is the step-cost model admission plans with the step's real cost?
                for i, name in ((1, "profile"), (2, "learned")):  # every step; the steps after learning moved
                    ratio = [r[0] / r[i] for r in steps[m] if r[i] > 0 and (i == 1 or r[3])]
                    if ratio:
                        q = statistics.quantiles(ratio, n=4) if len(ratio) > 1 else ratio * 3
                        print(f"stepcost: batch={b} temp={t:g} mode={NAMES[m]} model={name} steps={len(ratio)} "
                              f"measured_over_model={statistics.median(ratio):.2f} [{q[0]:.2f}-{q[-1]:.2f}]")
            for m in modes:
                print(split_line(b, t, m, split[m]))
            if "oracle" in res:
                mo = statistics.median(r["tok_s"] for r in res["oracle"])
                print(f"oracle: batch={b} temp={t:g} oracle_tok_s={mo:.1f} oracle_vs_plain={mo / med['off']:.2f} "
                      f"oracle_vs_fixed={mo / med['fixed']:.2f} "
                      f"tau={statistics.median(r['tau'] for r in res['oracle']):.2f}", flush=True)
            if b == 1 and t == 0:
                final = (f"dspark: batch=1 temp=0 plain_tok_s={med['off']:.1f} dspark_tok_s={med['dspark']:.1f} "
                         f"speedup={med['dspark'] / med['off']:.2f} tau={tau:.2f}")
    if final:
        print(final)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
