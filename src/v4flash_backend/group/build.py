"""One way to build an engine: `build_engine(settings)` for every place that runs one.

- in this process (`cli.generate_in_process`, `serving.engine_inprocess.InProcessEngine`): the ops
  backend set, the checkpoint loaded, the runner a W = 1 rank would build (`build_runner`), the
  `Engine` on it; settings that only a rank group honours are refused (`InProcessRefused`), never
  ignored;
- rank 0 of a rank group (`worker`): every rank builds its own runner with `build_runner`, rank 0
  passes its `PlanRunner` over them as `runner`.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable

from v4flash_backend.engine.engine import STOP_WIDTH, Engine
from v4flash_backend.settings import Settings


class InProcessRefused(ValueError):
    """A setting an in-process engine (one rank, no process group) cannot honour."""


def in_process_refusals(settings: Settings) -> list[str]:
    """Why `settings` cannot run as one in-process rank (empty: it can)."""
    why = []
    if settings.world_size != 1:
        why.append(f"world_size={settings.world_size} needs a rank group of that many ranks (launcher torchrun, "
                   "or `generate --world-size`); in process the engine is one rank")
    if settings.pipeline_parallel != 1:
        why.append(f"pipeline_parallel={settings.pipeline_parallel} splits the layers over a rank group's stages "
                   "(launcher torchrun, or `generate --pipeline-parallel`)")
    if settings.sequence_parallel:
        why.append("sequence_parallel splits prefill rows across a rank group's attention group; in process "
                   "there is none (launcher torchrun, or `generate --world-size`)")
    return why


def _log(rank: int, msg: str) -> None:
    print(f"[v4flash rank {rank}] {msg}", file=sys.stderr, flush=True)


def build_runner(model, settings: Settings, rank: int = 0, progress=sys.stderr, capture=None, helper: bool = False):
    """This rank's runner: decode_graph static -> the static round graphs (compiled with
    graph_backend, every bucket at start -- or loaded from compiled_artifacts -- or in the background
    with graph_warmup background: trn2.warmup), eager -> the op-by-op LocalRunner. Every rank builds
    the same kind, so the ranks meet in the same collectives. capture: the compile command's
    (`group.aot`): the graphs are traced and handed to it, nothing runs. helper: the compile helper
    process of a background compile (trn2/compile_helper.py): its BackgroundWarmup, not started."""
    from v4flash_backend.engine.runner import LocalRunner

    if settings.decode_graph_mode != "static":
        return LocalRunner(model, settings.max_num_seqs + 1, settings.max_model_len,  # +1: the SPS scratch slot
                           count_host_syncs=settings.count_host_syncs)
    from v4flash_backend.trn2.launch import NeuronSettings
    from v4flash_backend.trn2.static_runner import StaticRunner

    ns = NeuronSettings.from_settings(settings)  # compile backend and flags: the settings' Neuron view
    background = settings.graph_warmup_mode == "background" and ns.backend != "none"
    # the scratch slot of the static graphs doubles as the SPS scratch slot (slots are reset before use)
    # a background compile (the CPU default) takes one context bound per sequence count: every context
    # bound its own graphs made 83 graphs for the defaults, hours of a 2-core machine (trn2.warmup)
    runner = StaticRunner(model, settings.max_num_seqs, settings.max_model_len, settings=ns,
                          prefill_rows=settings.prefill_chunk,
                          count_host_syncs=settings.count_host_syncs or not background, ctx_buckets=not background)
    device = settings.resident_device
    if settings.ops_backend == "nki":  # weights and caches on the rank's NeuronCore, once; no per-call copies
        import torch_neuronx  # noqa: F401 - registers the neuron device (Neuron images only)

        from v4flash_backend.ops import nki_ops

        device = device or nki_ops.DEVICE
        os.environ["V4FLASH_NKI_STRICT"] = "1"
    if device and device != "cpu":  # the NeuronCore, or a GPU standing in for one (checks/standin.py)
        from v4flash_backend.trn2.static_runner import place_resident

        _log(rank, f"placed {place_resident(runner, device)} tensors on the {device} device")
    mode = settings.spec_mode if model.cfg.dspark_block_size else "off"
    nodraft = settings.dspark_adaptive or mode == "off"  # rounds that neither verify nor draft: 1 row a sequence
    if background and ns.backend == "inductor" and not _cxx():
        _log(rank, "no C++ compiler (g++, c++, clang++ or $CXX) for graph_backend inductor: the static graphs are "
                   "not compiled and eager steps serve (install g++, or set decode_graph eager)")
        runner.ready = set()  # nothing will be warm
        return runner
    if background:
        from v4flash_backend.trn2.warmup import BackgroundWarmup

        # inductor's graphs compile in a helper process first (no GIL shared with the steps, no pause hook)
        # and load from its cache here
        runner.warming = BackgroundWarmup(
            runner, mode, settings.fixed_len, STOP_WIDTH, settings.warm_processed, nodraft,
            log=lambda msg: _log(rank, ("compile helper: " if helper else "") + msg),
            helper_settings=settings.to_json() if ns.backend == "inductor" and not helper else None)
        if helper:
            return runner
        runner.warming.start()
        _log(rank, f"static decode graphs ({ns.backend}): compiling {len(runner.warming.jobs)} graph sets in the "
                   "background (the smallest bucket's rounds, the largest's plain-decode round; the rest as "
                   "traffic needs them"
                   f"{'; a helper process compiles each first' if runner.warming.helper else ''}); eager "
                   "steps serve until a set is warm")
        return runner
    source = capture if capture is not None else artifact_source(settings, model, ns)
    if source is not None:
        runner.set_artifacts(source)
    if ns.backend == "none":  # the graphs run op by op: nothing to compile or load
        return runner
    from v4flash_backend.trn2 import startup

    t = startup.warm_up(runner, mode, settings.fixed_len, STOP_WIDTH, settings.warm_processed, nodraft,
                        coll=None if capture is not None else getattr(model.comm, "coll", None),
                        warmup_timeout_s=settings.warmup_timeout_s,
                        collective_timeout_s=settings.collective_timeout_s,
                        progress=progress if rank == 0 else None, execute=capture is None)
    if capture is None:
        _log(rank, f"static decode graphs ({ns.backend}): {len(runner.buckets)} buckets, {t['compiled']} graphs "
                   f"compiled and {t['loaded']} loaded ({t['traced']} traced) in {t['compile_s']:.1f} s, first run in "
                   f"{t['run_s']:.1f} s")
    return runner


def artifact_source(settings: Settings, model, ns):
    """The compiled artifacts this rank loads its graphs from (`trn2.artifacts`), checked against
    this server before anything is traced; None without compiled_artifacts."""
    if not settings.compiled_artifacts:
        return None
    from v4flash_backend.parallel.collectives import group_roles
    from v4flash_backend.trn2.artifacts import ArtifactError, ArtifactSource, ArtifactStore, expectations

    if ns.backend == "none":
        raise ArtifactError("compiled_artifacts needs a graph_backend that compiles (none runs the graphs op by op)")
    coll = getattr(model.comm, "coll", None)
    store = ArtifactStore.open(settings.compiled_artifacts)
    store.check(expectations(model.cfg, ns, coll.size("world") if coll is not None else 1, settings))
    return ArtifactSource(store, group_roles(coll) if coll is not None else {}, settings.compile_on_miss)


def _cxx() -> str | None:
    """The C++ compiler inductor would use, if there is one."""
    import shutil

    return next((p for p in (os.environ.get("CXX"), "g++", "c++", "clang++") if p and shutil.which(p)), None)


def build_engine(settings: Settings, runner=None, *, model=None, progress=sys.stderr,
                 clock: Callable[[], float] = time.perf_counter) -> Engine:
    """The `Engine` the settings describe. runner None: this process is the whole engine -- the
    settings are checked (`InProcessRefused` lists every setting it cannot honour), the ops backend
    and numerics set, `model` (default: the checkpoint, loaded) wrapped in `build_runner`'s runner.
    runner given: rank 0 of a rank group, whose `PlanRunner` drives every rank's runner. `clock`
    times the step-cost profile."""
    if runner is None:
        why = in_process_refusals(settings)
        if why:
            raise InProcessRefused("cannot run in process: " + "; ".join(why))
        from v4flash_backend import ops

        ops.set_backend(settings.ops_backend)
        if settings.numerics:
            ops.set_numerics(settings.numerics)
        if model is None:
            from v4flash_backend.model.loading import load_model

            model = load_model(settings.checkpoint_dir)
        runner = build_runner(model, settings, progress=progress)
    return Engine(runner, settings, clock=clock)
