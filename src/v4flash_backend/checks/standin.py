"""`device-standin`: the served static decode path on a stand-in accelerator (an NVIDIA GPU), checked
at the device boundary the way a NeuronCore would meet it.

No Trainium exists where this project is developed; a lent GPU is the closest real accelerator. This
command builds the engine `make serve` builds with `decode_graph static` and the torch ops, its weights
and caches placed on the device once (`resident_device`, the same `place_resident` as a Neuron rank),
and serves a batch of requests greedy and seeded. Every graph call of a step (the decode round graphs,
the prefill and forward graphs) runs with `torch.cuda.set_sync_debug_mode("error")`, so any host sync
inside a step raises, and under the profiler, whose trace gives every host<->device copy with its
bytes. It then serves the same requests on the CPU with the eager decode path and compares the ids.

The final line (other tools read it), one line:
`device-standin: device=<d> graph_backend=<b> steps=<n> rounds=<r> syncs_in_steps=<s>
h2d_bytes_in_steps=<x> d2h_bytes_in_steps=<y> resident_moves=<m> plan_h2d_bytes_per_round=<p>
readback_d2h_bytes_per_round=<q> same_tokens=<yes|no>`. The CPU reference loads the step-cost table
a CPU static engine profiled, as the device run does, so both admit the same drafts (a seeded run's
ids depend on admission). On a CPU (`--device cpu`, the test) the sync guard is the host-sync
counter and the byte counts are not measured ("-").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from contextlib import nullcontext

import torch

PROMPTS = ("def add(a, b):", "import os\n\ndef list_files(path):", "class Stack:\n    def __init__(self):",
           "for i in range(10):")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--checkpoint", default="models/v4flash-tiny")
    ap.add_argument("--device", default="cuda", help="where the static path's weights and caches live")
    ap.add_argument("--graph-backend", default="none", choices=("none", "eager"),
                    help="the static graphs op by op (none: every op a device launch) or traced by dynamo (eager)")
    ap.add_argument("--prompts", type=int, default=4, help="requests served at once (<= %d)" % len(PROMPTS))
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--out", default="", help="directory for the JSON report and the profiler trace")


def _settings(args, static: bool, sps_path: str):
    from v4flash_backend.settings import Settings

    return Settings(checkpoint_dir=args.checkpoint, ops_backend="torch", numerics="exact",
                    decode_graph="static" if static else "eager",
                    graph_backend=args.graph_backend if static else "",
                    resident_device=args.device if static else "", max_num_seqs=args.prompts,
                    max_model_len=256, prefill_chunk=64, sps_path=sps_path,
                    step_cost_online=False)  # admission from the shared table alone, not each run's timings


def _prompts(args) -> list[list[int]]:
    from tokenizers import Tokenizer

    from v4flash_backend.config import ModelConfig

    tok = Tokenizer.from_file(os.path.join(args.checkpoint, "tokenizer.json"))
    bos = ModelConfig.from_json(args.checkpoint).bos_token_id
    return [[bos] + tok.encode(p, add_special_tokens=False).ids for p in PROMPTS[:args.prompts]]


def _serve(engine, prompts, max_tokens: int, temperature: float) -> list[list[int]]:
    """All prompts at once (one batch), to completion; the ids of each."""
    from v4flash_backend.request import GenerateRequest

    out = [[] for _ in prompts]
    errors = []

    def collect(i):
        def cb(e):
            out[i].extend(e.token_ids)
            if e.error is not None:
                errors.append(f"request {i}: {e.error_code}: {e.error}")
        return cb

    for i, p in enumerate(prompts):
        seed = 7 + i if temperature > 0 else None
        engine.submit(GenerateRequest(prompt=p, max_tokens=max_tokens, temperature=temperature, seed=seed,
                                      ignore_eos=True, callback=collect(i)))
    while engine.has_work():
        engine.step()
    if errors:
        raise RuntimeError("; ".join(errors))
    return out


class StepGuard:
    """Wraps every graph call of a step: no host sync may happen inside (cuda: the sync debug mode
    raises; cpu: the host-sync counter counts), and each call is a profiler span so the trace can
    tell a step's copies from the plan upload and the read-back between steps."""

    SPAN = "v4flash.step"

    def __init__(self, device: str):
        self.cuda = torch.device(device).type == "cuda"
        self.calls = {"round": 0, "forward": 0}
        self.syncs = 0

    def wrap(self, fn, kind: str):
        from v4flash_backend.engine.device_boundary import HostSyncCounter

        def call(*a, **k):
            if self.cuda:
                torch.cuda.synchronize()  # what was queued before belongs to the host side
            counter = nullcontext() if self.cuda else HostSyncCounter()
            with torch.profiler.record_function(self.SPAN):
                if self.cuda:
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    with counter:
                        out = fn(*a, **k)
                finally:
                    if self.cuda:
                        torch.cuda.set_sync_debug_mode(0)
            if self.cuda:
                torch.cuda.synchronize()
            else:
                self.syncs += counter.total
            self.calls[kind] += 1
            return out
        return call

    ROUND = "v4flash.decode_round"  # a whole decode round: plan upload, graph calls, read-back

    def install(self, runner) -> None:
        for g in (runner.graphs, runner.ngraphs, runner.pgraphs):
            if g is not None:
                g.round = self.wrap(g.round, "round")
                g.verify = self.wrap(g.verify, "forward")
        decode_round = runner.decode_round

        def round_io(plan):
            with torch.profiler.record_function(self.ROUND):
                return decode_round(plan)
        runner.decode_round = round_io


def copies_from_trace(events: list, step: str, round_io: str) -> dict:
    """Copies of a chrome trace's events by where their runtime call was made: inside a `step`
    span (a graph call: "step"), inside a `round_io` span but not a step (a decode round's plan
    upload and read-back: "round"), or elsewhere (the eager steps' inputs and read-backs: "eager");
    bytes by kind (HtoD, DtoH, DtoD), plus the synchronize calls made inside steps. A copy is
    placed by its runtime call (the CPU side, which the spans enclose) and sized by its GPU
    activity (same correlation id)."""
    def spans(name):
        return sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                      if e.get("cat") == "user_annotation" and e.get("name") == name)

    steps, rounds = spans(step), spans(round_io)
    gpu = {e["args"]["correlation"]: e for e in events
           if e.get("cat") == "gpu_memcpy" and "correlation" in e.get("args", {})}

    def inside(ts, within) -> bool:
        return any(a <= ts <= b for a, b in within)

    out = {"step": {}, "round": {}, "eager": {}, "syncs_in_steps": 0}
    for e in events:
        if e.get("cat") != "cuda_runtime":
            continue
        name = e.get("name", "")
        where = "step" if inside(e["ts"], steps) else "round" if inside(e["ts"], rounds) else "eager"
        if "Synchronize" in name and where == "step":
            out["syncs_in_steps"] += 1
        g = gpu.get(e.get("args", {}).get("correlation"))
        if "Memcpy" in name and g is not None:
            kind = g["name"].split()[1] if len(g["name"].split()) > 1 else g["name"]
            out[where][kind] = out[where].get(kind, 0) + int(g["args"].get("bytes", 0))
    return out


def run(args, log=print):
    """(ok, final line, report dict)."""
    from v4flash_backend.group.build import build_engine

    prompts = _prompts(args)
    tmp = args.out or tempfile.mkdtemp(prefix="v4flash-standin-")
    os.makedirs(tmp, exist_ok=True)
    sps = os.path.join(tmp, "sps.json")  # one step-cost table for both: admission reads it
    if os.path.exists(sps):
        os.remove(sps)
    report = {"device": args.device, "graph_backend": args.graph_backend}
    if torch.device(args.device).type != "cpu":
        # the step-cost table both runs read (a seeded run's ids depend on admission, which reads it),
        # profiled by a static engine on the CPU: a table timed on the stand-in says nothing of a trn2
        t0 = time.perf_counter()
        cpu = argparse.Namespace(**{**vars(args), "device": "cpu"})
        build_engine(_settings(cpu, True, sps), progress=None).warmup()
        log(f"step-cost table profiled on the cpu static path in {time.perf_counter() - t0:.1f} s")
    spy_was = os.environ.get("V4FLASH_BOUNDARY_SPY")
    os.environ["V4FLASH_BOUNDARY_SPY"] = "1"  # decode rounds count resident-tensor moves (restored below)
    try:
        return _device_run(args, prompts, sps, tmp, report, log)
    finally:
        if spy_was is None:
            os.environ.pop("V4FLASH_BOUNDARY_SPY", None)
        else:
            os.environ["V4FLASH_BOUNDARY_SPY"] = spy_was


def _device_run(args, prompts, sps, tmp, report, log):
    from v4flash_backend.group.build import build_engine

    t0 = time.perf_counter()
    eng = build_engine(_settings(args, True, sps), progress=sys.stderr)
    eng.warmup()
    runner = eng.runner
    log(f"static engine on {args.device}: built and warm in {time.perf_counter() - t0:.1f} s")
    guard = StepGuard(args.device)
    guard.install(runner)
    got, trace = {}, os.path.join(tmp, "trace.json")
    acts = [torch.profiler.ProfilerActivity.CPU]
    if guard.cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=acts) as prof:
        for T in (0.0, 0.8):
            got[T] = _serve(eng, prompts, args.max_tokens, T)
    log(f"static on {args.device}: served in {time.perf_counter() - t0:.1f} s "
        f"({guard.calls['round']} round calls, {guard.calls['forward']} forward graph calls)")
    # the reference after the device run: it loads the step-cost table a static engine profiled
    # (admission reads the table, so both must read the same one; an eager profile has per-R tables
    # the static rounds do not read)
    t0 = time.perf_counter()
    ref = build_engine(_settings(args, False, sps), progress=None)
    ref.warmup()
    expect = {T: _serve(ref, prompts, args.max_tokens, T) for T in (0.0, 0.8)}
    log(f"cpu eager reference: {len(prompts)} requests x 2 temperatures in {time.perf_counter() - t0:.1f} s")
    c = runner.counters
    rounds = guard.calls["round"]
    same = all(got[T] == expect[T] for T in expect)
    report.update(expected={str(k): v for k, v in expect.items()}, got={str(k): v for k, v in got.items()},
                  calls=guard.calls, counters={k: v for k, v in c.items() if isinstance(v, (int, float))})
    h2d_in = d2h_in = plan = back = "-"
    syncs = guard.syncs
    if guard.cuda:
        prof.export_chrome_trace(trace)
        with open(trace) as f:
            cp = copies_from_trace(json.load(f)["traceEvents"], StepGuard.SPAN, StepGuard.ROUND)
        report["copies"] = cp
        syncs += cp["syncs_in_steps"]
        h2d_in, d2h_in = cp["step"].get("HtoD", 0), cp["step"].get("DtoH", 0)
        plan = cp["round"].get("HtoD", 0) // max(rounds, 1)  # one round graph call per decode round
        back = cp["round"].get("DtoH", 0) // max(rounds, 1)
    moves = c.get("boundary_resident_moves", 0)
    for T in expect:
        for i, (a, b) in enumerate(zip(expect[T], got[T])):
            if a != b:
                log(f"T={T} request {i}: cpu eager {a}\n    static {args.device} {b}")
    final = (f"device-standin: device={args.device} graph_backend={args.graph_backend} "
             f"steps={sum(guard.calls.values())} rounds={rounds} syncs_in_steps={syncs} "
             f"h2d_bytes_in_steps={h2d_in} d2h_bytes_in_steps={d2h_in} resident_moves={moves} "
             f"plan_h2d_bytes_per_round={plan} readback_d2h_bytes_per_round={back} "
             f"same_tokens={'yes' if same else 'no'}")
    report["final"] = final
    with open(os.path.join(tmp, "standin.json"), "w") as f:
        json.dump(report, f, indent=1)
    ok = same and syncs == 0 and moves == 0 and rounds > 0 and h2d_in in (0, "-") and d2h_in in (0, "-")
    return ok, final, report


def main(args) -> int:
    from .command import run_check

    return run_check(run, args)


if __name__ == "__main__":
    from .command import standalone

    standalone("python -m v4flash_backend.checks.standin", add_arguments, main)
