"""A static rank's start-up from compiled artifacts (bound graphs, no dynamo trace) against one that
traces its graphs (what finding each artifact by graph key cost before, and what a rank that compiles
its own graphs still costs), in one process, interleaved, --rounds each.

    .venv/bin/python perf/bench_artifact_load.py [--checkpoint models/v4flash-tiny] [--rounds 3]

It traces one rank's start-up graphs once, as the compile command does (`group.aot.trace`, fake
tensors), writes their sources and bindings as artifacts (the CPU stand-in eager: its compile step
only re-traces the source, so it is skipped here), then builds the one-rank runner of the same
settings alternately from the artifacts and by tracing (graph_backend eager: the trace is the whole
cost), each after `torch._dynamo.reset()`. Prints per mode the median seconds of the compile/load
phase per graph, with min-max, the graphs dynamo traced, and a last line

    artifact-load: graphs=<n> bound_s_per_graph=<median> traced_s_per_graph=<median> ratio=<traced/bound>
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SETTINGS = dict(world_size=1, max_num_seqs=1, max_model_len=64, prefill_chunk=16, warm_processed=False,
                decode_graph="static", graph_backend="eager", dspark_adaptive=False, graph_warmup="start",
                prefix_cache_bytes=0, step_cost_online=False)


def write_artifacts(ckpt: Path, out: Path, settings) -> int:
    from v4flash_backend.config import ModelConfig
    from v4flash_backend.group import aot
    from v4flash_backend.parallel.spec_reader import SpecReader
    from v4flash_backend.trn2.artifacts import ArtifactStore, Manifest, expectations
    from v4flash_backend.trn2.graph_key import KEY_VERSION
    from v4flash_backend.trn2.launch import NeuronSettings

    st = aot.compile_settings(settings)
    cfg = ModelConfig.from_json(ckpt / "config.json")
    cap, _ = aot.trace(st, cfg, SpecReader.from_checkpoint(ckpt), ckpt / "tokenizer.json", log=print)
    exp = expectations(cfg, NeuronSettings.from_settings(st), 1)
    store = ArtifactStore(out, Manifest(**exp, settings=asdict(st), per_rank=cap.order, bindings=cap.bindings,
                                        key_version=KEY_VERSION))
    for k, (name, gm, _) in cap.graphs.items():
        rel = store.write_graph(k, gm, {})
        store.manifest.graphs[k] = {"name": name, "seconds": 0.0, "neff": False, "artifact": rel}
    store.save()
    return len(cap.bindings)


def start(model, settings) -> tuple[float, int, int]:
    """One rank's start-up: (seconds of the compile/load phase, graphs, graphs traced)."""
    from v4flash_backend.group.build import build_runner

    torch._dynamo.reset()
    runner = build_runner(model, settings, 0, progress=None)
    c = runner.counters
    n = c["startup_graphs_loaded"] + c["startup_graphs_compiled"]
    return runner.startup_times["compile_s"], n, c["startup_graphs_traced"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default=str(REPO / "models" / "v4flash-tiny"))
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from v4flash_backend import ops
    from v4flash_backend.engine.dspark_sched import SPSTable
    from v4flash_backend.model.loading import load_model
    from v4flash_backend.settings import Settings

    ckpt = Path(args.checkpoint)
    with tempfile.TemporaryDirectory() as tmp:
        sps = Path(tmp) / "sps.json"
        SPSTable([1, 2, 4, 8, 16], [10.0, 9.8, 9.5, 9.0, 8.0]).save(sps)
        base = Settings(checkpoint_dir=str(ckpt), sps_path=str(sps), **SETTINGS)
        art = Path(tmp) / "compiled"
        bound = write_artifacts(ckpt, art, base)
        ops.set_numerics(base.numerics or "exact")
        model = load_model(ckpt)
        modes = {"bound": base.replace(compiled_artifacts=str(art), compile_on_miss=False), "traced": base}
        per = {m: [] for m in modes}
        for r in range(args.rounds):
            for m in (list(modes) if r % 2 == 0 else list(modes)[::-1]):  # alternate which goes first
                s, n, traced = start(model, modes[m])
                per[m].append(s / n)
                print(f"round {r} {m}: {s:.2f} s for {n} graphs ({traced} traced by dynamo)", flush=True)
        med = {m: statistics.median(v) for m, v in per.items()}
        for m, v in per.items():
            print(f"{m}: median {med[m]:.3f} s a graph (min {min(v):.3f}, max {max(v):.3f}, {len(v)} rounds)")
        print(f"artifact-load: graphs={n} bound={bound} bound_s_per_graph={med['bound']:.3f} "
              f"traced_s_per_graph={med['traced']:.2f} ratio={med['traced'] / med['bound']:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
