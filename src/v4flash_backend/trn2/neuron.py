"""The Neuron (trn2) launch path of the static decode step.

- `NeuronSettings` / `neuron_env` / `apply_env` (from `trn2.launch`, torch-free): the Neuron view of
  `Settings` (LNC, compiler flags, compile cache, dist backend, core pinning) and the environment of
  one rank of a Neuron launch; `group.rank_entry` applies it to every rank before torch loads.
- `compile_step`: torch.compile(fullgraph=True, dynamic=False) through a checking backend that
  rejects a graph with a host sync left in it (`static_step.graph_host_syncs`) and then hands the
  graph to the Neuron backend (`neuron` = torch-neuronx / TorchNeuron, or `neuron_libtorch` =
  libtorch-neuronx-lite, which takes the flags as `compiler_args`).
- `StaticGraphs`: one compiled verify graph and one DSpark graph per bucket, `warm_up()` compiles all
  buckets at start (progress bar on stderr; a warm cache makes this a load), and counts executions.
- `StaticRunner`: the engine's runner (`runner.LocalRunner` interface) on top of them: decode steps
  go through the bucket graphs, anything else (prefill chunks, mixed steps) through the eager forward.

Every Neuron-only import (torch_neuronx, libtorch_neuronx_lite) happens inside `import_neuron()`, on
this path only; with `backend="eager"` (what the CPU tests use) everything up to the backend call runs
without them.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

import torch

from v4flash_backend import ops
from v4flash_backend.engine.precision import loop_dtype
from v4flash_backend.engine.runner import LocalRunner

from .launch import NeuronSettings, apply_env, neuron_env  # noqa: F401 - the Neuron launch (settings -> env)
from .static_step import (
    BoundarySpy,
    Bucket,
    HostSyncCounter,
    StaticDecoder,
    bucket_sizes,
    graph_host_syncs,
    pick_bucket,
)

COMPILER_ARGS = NeuronSettings().compiler_args  # the default neuronx-cc flags (trn2.launch builds them)
NEURON_BACKENDS = {"neuron": "torch_neuronx", "neuron_libtorch": "libtorch_neuronx_lite"}


class HostSyncInGraph(RuntimeError):
    """A graph of the static step still reads device values on the host."""


def import_neuron(s: NeuronSettings):
    """Import the package that registers `s.backend` with torch.compile (Neuron images only)."""
    mod = NEURON_BACKENDS.get(s.backend)
    if mod is None:
        return None
    import importlib

    try:
        return importlib.import_module(mod)
    except ImportError as e:
        raise RuntimeError(f"torch.compile backend {s.backend!r} needs {mod} from the Neuron pip repository "
                           "(see requirements-neuron.txt and docker/Dockerfile.neuron)") from e


@dataclass
class CompileStats:
    graphs: int = 0  # graphs handed to the backend (one per bucket and entry point)
    seconds: float = 0.0
    collectives: list = field(default_factory=list)  # per compiled graph: {op: count} of traced collectives


def _check_cc_flags(s: NeuronSettings) -> None:
    """Backend neuron takes no compiler_args: neuronx-cc gets its flags from NEURON_CC_FLAGS only, which
    group.rank_entry sets. Compiling without them would drop --lnc / --auto-cast=none / the fp8 flag, so
    every flag of `s` must be there (flags added by others may be too) and no other LNC degree."""
    import shlex

    from v4flash_backend.settings import flag_lnc

    have = os.environ.get("NEURON_CC_FLAGS", "")
    missing = [a for a in s.compiler_args if a not in shlex.split(have)]
    if missing or flag_lnc(have) != s.lnc:
        raise RuntimeError(f"NEURON_CC_FLAGS {have!r} lacks {missing} or names another LNC than {s.lnc}: start "
                           "the rank through group.rank_entry (or trn2.launch.apply_env before torch loads)")


def compile_step(fn, s: NeuronSettings, stats: CompileStats | None = None):
    """torch.compile(fn) as one graph for the Neuron backend of `s`, refusing host syncs."""
    import torch._dynamo

    ops.backend_module()  # resolve the ops backend now: the graph must not trace an import
    if s.backend == "none":  # no compilation: the static step runs op by op (CPU tests, projection)
        return fn
    import_neuron(s)
    if s.backend == "neuron":
        _check_cc_flags(s)
    inner = torch._dynamo.lookup_backend(s.backend)
    kwargs = {"options": {"compiler_args": list(s.compiler_args)}} if s.backend == "neuron_libtorch" else {}
    stats = stats if stats is not None else CompileStats()

    def checked(gm, example_inputs):
        syncs = graph_host_syncs(gm)
        if syncs:
            raise HostSyncInGraph(f"host syncs in a static graph: {syncs}")
        from v4flash_backend.parallel.collectives import graph_collectives

        traced["collectives"] = graph_collectives(gm)
        stats.collectives.append(traced["collectives"])
        t0 = time.perf_counter()
        out = inner(gm, example_inputs, **kwargs)
        stats.graphs += 1
        stats.seconds += time.perf_counter() - t0
        return out

    traced: dict = {}
    compiled = torch.compile(fn, backend=checked, fullgraph=True, dynamic=False)

    def run(*args):
        return compiled(*args)

    run.traced = traced  # {"collectives": {op: count}} of the captured graph, once compiled
    return run


def decode_buckets(max_num_seqs: int, max_model_len: int, rows: int, min_ctx: int = 256) -> list[Bucket]:
    """Buckets: sequences and context bounds in powers of two (up to the limits), `rows` per sequence."""
    return [Bucket(S, rows, L) for S in bucket_sizes(max_num_seqs)
            for L in bucket_sizes(max_model_len, min(min_ctx, max_model_len))]


MAX_PREFILL_ROWS = 4096  # the port's prompt segment


def prefill_buckets(prefill_rows: int, max_model_len: int) -> list[Bucket]:
    """The prefill graphs' buckets: one sequence's chunk of up to `prefill_rows` rows (<= 4096, and never more
    than the context), padded into the next power-of-two row count from 16, x the context bounds of the
    decode buckets."""
    prefill_rows = min(prefill_rows, MAX_PREFILL_ROWS, max_model_len)
    return [Bucket(1, q, L) for q in bucket_sizes(prefill_rows, min(16, prefill_rows))
            for L in bucket_sizes(max_model_len, min(256, max_model_len))]


def startup_graphs(settings, dspark: bool = True) -> int:
    """The graphs a rank of a static server (decode_graph static) compiles at start, as
    `worker.build_runner` warms them: per decode bucket the verify round graph, its logit-processing
    variant (warm_processed) and the bare verify graph; per sequence bucket the draft round graph
    (and variant) when the checkpoint drafts; the plain-decode round graphs (and variants) when the
    server may step aside or does not draft; one prefill graph per row x context bucket. With the
    defaults (8 sequences, 1024 tokens, 256-token chunks, DSpark): 12 + 12 + 12 + 4 + 4 + 15 = 59."""
    variants = 2 if settings.warm_processed else 1
    decode = decode_buckets(settings.max_num_seqs, settings.max_model_len, 1)
    drafting = dspark and settings.spec_mode != "off"
    n = len(decode) * variants + len(decode)  # verify rounds (+ processed) and bare verify graphs
    if drafting:
        n += len({b.seqs for b in decode}) * variants
    if settings.dspark_adaptive or not drafting:
        n += len(decode) * variants
    return n + len(prefill_buckets(settings.prefill_chunk, settings.max_model_len))


class _Progress:
    def __init__(self, total: int, out, width: int = 24):
        self.total, self.out, self.width, self.t0 = total, out, width, time.perf_counter()

    def show(self, done: int, what: str) -> None:
        if self.out is None:
            return
        fill = self.width * done // max(self.total, 1)
        self.out.write(f"\r[neuron warm-up] [{'#' * fill}{'.' * (self.width - fill)}] {done}/{self.total} "
                       f"{what} {time.perf_counter() - self.t0:.1f}s")
        if done == self.total:
            self.out.write("\n")
        self.out.flush()


@dataclass
class StaticGraphs:
    """Compiled verify (and DSpark) graphs per bucket over one StaticDecoder."""

    decoder: StaticDecoder
    buckets: list[Bucket]
    settings: NeuronSettings = field(default_factory=NeuronSettings)
    stats: CompileStats = field(default_factory=CompileStats)
    blocks: object = None  # static_round.BlockState: the served round graphs (None: bare verify/draft)
    executions: int = 0  # graph executions (verify + draft calls)
    _verify: dict = field(default_factory=dict)
    _draft: dict = field(default_factory=dict)
    _rverify: dict = field(default_factory=dict)
    _rdraft: dict = field(default_factory=dict)

    # ---- the served decode round (static_round) -----------------------------------------------------
    def round_verify_graph(self, b: Bucket, processed: bool = False):
        """Graph 1 of bucket b; processed: the variant with min_tokens, penalties and log-probs."""
        if (b, processed) not in self._rverify:
            from .static_round import verify_round

            dec, blk = self.decoder, self.blocks
            if processed:
                def fn(slot, start, n, pending, temperature, top_k, top_p, seed, rnd, budget, stop_ids, n_out,
                       min_tokens, frequency, presence):
                    return verify_round(dec, blk, b.ctx, slot, start, n, pending, temperature, top_k, top_p, seed,
                                        rnd, budget, stop_ids, _proc(n_out, min_tokens, frequency, presence, stop_ids))
            else:
                def fn(slot, start, n, pending, temperature, top_k, top_p, seed, rnd, budget, stop_ids):
                    return verify_round(dec, blk, b.ctx, slot, start, n, pending, temperature, top_k, top_p, seed,
                                        rnd, budget, stop_ids)
            self._rverify[(b, processed)] = compile_step(fn, self.settings, self.stats)
        return self._rverify[(b, processed)]

    def round_draft_graph(self, b: Bucket, mode: str, fixed_len: int, processed: bool = False):
        key = (b.seqs, b.rows, mode, fixed_len if mode == "fixed" else 0, processed)
        if key not in self._rdraft:
            from .static_round import draft_round

            dec, blk = self.decoder, self.blocks
            if processed:
                def fn(*a):
                    *a, n_out, min_tokens, frequency, presence, stop_ids, lp = a
                    return draft_round(dec, blk, mode, fixed_len, *a,
                                       proc=_proc(n_out, min_tokens, frequency, presence, stop_ids), extra=lp)
            else:
                def fn(*a):
                    return draft_round(dec, blk, mode, fixed_len, *a)
            self._rdraft[key] = compile_step(fn, self.settings, self.stats)
        return self._rdraft[key]

    def _ran(self, graph) -> None:
        """Count one graph execution and the collectives traced into it (counting stays outside
        the graph: the compile backend listed them, `Collectives.count_traced` books them)."""
        self.executions += 1
        counts = getattr(graph, "traced", {}).get("collectives")
        comm = getattr(getattr(self.decoder, "m", None), "comm", None)
        if counts and hasattr(comm, "coll"):
            comm.coll.count_traced(counts)

    def round(self, b: Bucket, mode: str, fixed_len: int, x: dict) -> torch.Tensor:
        """One decode round: graph 1, then (with DSpark) graph 2; returns the [S, 2G+5] read-back.
        mode off (no DSpark, or a round that steps aside): graph 1 alone, whose own read-back has
        next ell 0 -- no ring writes, no draft stages."""
        processed = "n_out" in x  # the processed variant (static_round: min_tokens, penalties, log-probs)
        proc = [x[k] for k in PROC_INPUTS] if processed else []
        g1 = self.round_verify_graph(b, processed)
        tokens_out, committed, accepted, stopped, taps, *lp, alone = g1(
            x["slot"], x["start"], x["n"], x["pending"], x["temperature"], x["top_k"], x["top_p"], x["seed"],
            x["rnd"], x["budget"], x["stop_ids"], *proc)
        self._ran(g1)
        if mode == "off":
            return alone
        g2 = self.round_draft_graph(b, mode, fixed_len, processed)
        extra = proc + [x["stop_ids"]] + lp if processed else []
        out = g2(taps, committed, tokens_out, accepted, stopped, x["slot"], x["start"], x["n"], x["temperature"],
                 x["top_k"], x["top_p"], x["seed"], x["rnd"], x["budget"], x["len_left"], x["sps_t"],
                 x["t_draft"], x["cal"], x["fixed_ell"], *extra)
        self._ran(g2)
        return out

    def verify_graph(self, b: Bucket):
        if b not in self._verify:
            dec = self.decoder
            self._verify[b] = compile_step(lambda tokens, slot, start, n: dec.verify(tokens, slot, start, n, b.ctx),
                                           self.settings, self.stats)
        return self._verify[b]

    def draft_graph(self, b: Bucket):
        key = (b.seqs, b.rows)  # the draft graph does not depend on the context bound
        if key not in self._draft:
            self._draft[key] = compile_step(self.decoder.draft, self.settings, self.stats)
        return self._draft[key]

    def verify(self, b: Bucket, tokens, slot, start, n):
        self.executions += 1
        return self.verify_graph(b)(tokens, slot, start, n)

    def draft(self, b: Bucket, taps, commit, slot, start, anchor):
        self.executions += 1
        return self.draft_graph(b)(taps, commit, slot, start, anchor)

    def round_padding(self, b: Bucket, stop_width: int, processed: bool = False) -> dict:
        """Inputs of a round of padding sequences only (scratch slot, no valid row): it changes no
        real slot's state, so it compiles the round graphs at start."""
        S, z, fd = b.seqs, torch.zeros(b.seqs, dtype=torch.long), loop_dtype()
        proc = dict(n_out=z.clone(), min_tokens=z.clone(), frequency=torch.zeros(S, dtype=fd),
                    presence=torch.zeros(S, dtype=fd)) if processed else {}
        x = proc | dict(slot=torch.full((S,), self.decoder.scratch, dtype=torch.long), start=z, n=z.clone(),
                        pending=z.clone(), temperature=torch.zeros(S, dtype=fd), top_k=z.clone(),
                        top_p=torch.ones(S, dtype=fd), seed=z.clone(), rnd=z.clone(), budget=z.clone(),
                        len_left=z.clone(), stop_ids=torch.full((S, stop_width), -1, dtype=torch.long),
                        sps_t=pad_sps(None), **adaptive_inputs(S, self.decoder.max_rows - 1))
        return to_device(x, self.decoder.device)

    def warm_up(self, progress=sys.stderr, mode: str | None = None, fixed_len: int = 0,
                stop_width: int = 8, processed: bool = True) -> float:
        """Compile (or load from the cache) every bucket's graphs by running them on padding plans,
        which leave the state untouched. With `blocks` (the served runner) these are the round
        graphs of spec mode `mode`. Returns the seconds it took."""
        dec = self.decoder
        bar = _Progress(len(self.buckets), progress)
        t0 = time.perf_counter()
        bar.show(0, "")
        if self.blocks is not None and self.buckets and self.settings.backend != "none":
            # one uncompiled padding round first fills the host-side caches of the ops backend and
            # of DistComm (dequantized weights): traced before that, the graphs would capture the
            # cache fills and be re-traced once serving has filled them
            b = self.buckets[0]
            none = NeuronSettings(backend="none")
            StaticGraphs(dec, [b], none, blocks=self.blocks).round(b, mode or "off", fixed_len,
                                                                  self.round_padding(b, stop_width))
        for i, b in enumerate(self.buckets):
            if self.blocks is not None:
                for proc in (False, True)[:1 + processed]:  # the plain and the logit-processing variant
                    self.round(b, mode or "off", fixed_len, self.round_padding(b, stop_width, proc))
                bar.show(i + 1, str(b))
                continue
            tokens, slot, start, n = dec.padding_plan(b.seqs, b.rows)
            _, taps = self.verify_graph(b)(tokens, slot, start, n)
            if dec.drafter is not None and taps is not None:
                self.draft_graph(b)(taps, n, slot, start, tokens[:, 0])
            bar.show(i + 1, str(b))
        return time.perf_counter() - t0


PROC_INPUTS = ("n_out", "min_tokens", "frequency", "presence")  # the processed round's extra inputs


def _proc(n_out, min_tokens, frequency, presence, stop_ids) -> dict:
    return dict(n_out=n_out, min_tokens=min_tokens, frequency=frequency, presence=presence, stop_ids=stop_ids)


SPS_WIDTH = 16  # SPS table entries a round takes (padded with its last entry: same lookups)


def adaptive_inputs(S: int, G: int, plan: dict | None = None) -> dict:
    """The draft graph's dspark_adaptive inputs for a bucket of S rows (static_round.draft_round):
    t_draft [S+1] `loop_dtype()` (draft seconds by live rows; zeros: the forward's table alone), cal
    [S, G, 2] `loop_dtype()` ((T_k, b_k) per row; T = 0: the raw head), fixed_ell [S] (-1: admission;
    a probe: 1). From a round plan's `t_draft` / `cal` / `fixed_ell` (padding rows: the last value,
    the raw head, -1). Host tensors: `round_inputs` / `round_padding` move the plan to the device."""
    plan = plan or {}
    fd = loop_dtype()
    td = list(plan.get("t_draft") or [0.0])
    td = td[:S + 1] + [td[-1]] * (S + 1 - len(td))
    cal = torch.zeros(S, G, 2, dtype=fd)
    if plan.get("cal") is not None and len(plan["cal"]):
        c = torch.as_tensor(plan["cal"], dtype=fd).reshape(-1, G, 2)
        cal[:c.shape[0]] = c
    fe = list(plan.get("fixed_ell") or [])
    return dict(t_draft=torch.tensor(td, dtype=fd), cal=cal,
                fixed_ell=torch.tensor(fe + [-1] * (S - len(fe)), dtype=torch.long))


def pad_sps(sps_t: torch.Tensor | None) -> torch.Tensor:
    """An SPS table [2, n] padded to [2, SPS_WIDTH] (a fixed graph input shape); None: a dummy."""
    fd = loop_dtype()
    if sps_t is None:
        return torch.ones(2, SPS_WIDTH, dtype=fd)
    if sps_t.shape[1] > SPS_WIDTH:
        raise ValueError(f"an SPS table of {sps_t.shape[1]} sizes (at most {SPS_WIDTH})")
    sps_t = sps_t.to(fd)
    pad = sps_t[:, -1:].expand(2, SPS_WIDTH - sps_t.shape[1])
    return torch.cat([sps_t, pad], 1)


def to_device(x: dict, device) -> dict:
    """A round's host-built inputs on the runner's device (a no-op where they already are)."""
    return {k: v.to(device) for k, v in x.items()}


class StaticRunner(LocalRunner):
    """The served static decode path: `LocalRunner` (prefill chunks and mixed steps run the eager
    forward) plus `decode_round`, which runs a decode step as the bucket's two round graphs
    (`static_round`: verify + acceptance + sampling; DSpark rings + draft + Markov drafting +
    confidence + admission) over state that stays where the model is: the KV caches, the DSpark
    rings and the per-slot draft blocks. A round moves in only its plan (int64 / float64 vectors of
    the bucket's S rows, and the SPS table) and moves out one [S, G+5] int64 tensor."""

    decode_graph = "static"
    static_rounds = True

    def __init__(self, model, num_slots: int, max_len: int, buckets: list[Bucket] | None = None,
                 settings: NeuronSettings | None = None, margin: int = 8, prefill_rows: int = 0):
        # + the scratch slot; host syncs counted as before: a static decode round is one graph call
        # (its count is the interface: 0), and the eager forwards of fallback steps are rare
        super().__init__(model, num_slots + 1, max_len, margin, count_host_syncs=True)
        _settle_weights(model)
        settings = settings or NeuronSettings()
        self.G = model.cfg.dspark_block_size or 0
        rows = 1 + self.G
        self.decoder = StaticDecoder(model, self.state, scratch=num_slots, max_rows=rows)
        self.buckets = buckets or decode_buckets(num_slots, max_len, rows)
        from .static_round import BlockState

        self.blocks = BlockState.empty(num_slots + 1, self.G, model.cfg.vocab_size)
        self.graphs = StaticGraphs(self.decoder, self.buckets, settings, blocks=self.blocks)
        # prefill graphs (prefill_rows > 0): one sequence's chunk of up to prefill_rows rows (<= the
        # port's 4096-token segment), padded into the next power-of-two row bucket
        self.pgraphs = None
        if prefill_rows:
            pb = prefill_buckets(prefill_rows, max_len)
            self.pdecoder = StaticDecoder(model, self.state, scratch=num_slots, max_rows=max(b.rows for b in pb),
                                          prefill=True)
            self.pgraphs = StaticGraphs(self.pdecoder, pb, settings)
        # the plain-decode graphs (DSpark checkpoints): one row per sequence, for a round where no
        # sequence verifies a draft and none drafts (stepped aside, or spec_mode off): graph 1 over
        # 1 row instead of 1 + G (perf/nodraft_round_cpu.py: up to ~1.5-2x less at S >= 4 here)
        self.ngraphs = None
        if self.G:
            self.ndecoder = StaticDecoder(model, self.state, scratch=num_slots, max_rows=1)
            self.ngraphs = StaticGraphs(self.ndecoder, [Bucket(b.seqs, 1, b.ctx) for b in self.buckets], settings,
                                        stats=self.graphs.stats, blocks=self.blocks)
        self.counters.update(prefill_graphs=0, forward_graphs=0, eager_forwards=0, plain_decode_rounds=0)

    def warm_up_nodraft(self, progress=None, stop_width: int = 8, processed: bool = True) -> None:
        """Compile every bucket's plain-decode round graph (and its logit-processing variant) on a
        padding plan: the servers that step aside (dspark_adaptive) or do not draft (spec_mode off)."""
        if self.ngraphs is None or self.graphs.settings.backend == "none":
            return
        bar = _Progress(len(self.ngraphs.buckets), progress)
        for i, b in enumerate(self.ngraphs.buckets):
            for proc in (False, True)[:1 + processed]:
                self.ngraphs.round(b, "off", 0, self.ngraphs.round_padding(b, stop_width, proc))
            bar.show(i + 1, f"plain decode {b}")

    def warm_up_prefill(self, progress=None) -> None:
        """Compile every prefill bucket on a padding chunk (it writes nothing), and every decode
        bucket's bare verify graph (the forward of a step's short segments, `forward`)."""
        if self.graphs.settings.backend == "none":
            return
        pb = self.pgraphs.buckets if self.pgraphs is not None else []
        bar = _Progress(len(pb) + len(self.buckets), progress)
        for i, b in enumerate(pb):
            self.pgraphs.verify_graph(b)(*self.pdecoder.padding_plan(1, b.rows))
            bar.show(i + 1, f"prefill {b}")
        for i, b in enumerate(self.buckets):
            self.graphs.verify_graph(b)(*self.decoder.padding_plan(b.seqs, b.rows))
            bar.show(len(pb) + i + 1, f"forward {b}")

    def forward_plan(self, spec):
        """How a step's target forward runs as fixed-shape graphs: (verify bucket or None, the
        segments through it, [(prefill bucket, segment index)]) -- segments of up to 1 + G rows
        (decode rows, short chunks) go together through the decode bucket's verify graph, longer
        ones (prefill chunks) each through the prefill graph of their row bucket. None: no bucket
        holds the step (it runs the eager forward, counted as eager_forwards)."""
        Q = 1 + self.G
        short = [i for i, (_, _, n) in enumerate(spec) if n <= Q]
        long = [i for i, (_, _, n) in enumerate(spec) if n > Q]
        vb, pre = None, []
        try:
            if short:
                vb = pick_bucket(self.buckets, len(short), Q, max(spec[i][1] + spec[i][2] for i in short))
            for i in long:
                if self.pgraphs is None:
                    return None
                _, start, n = spec[i]
                pre.append((pick_bucket(self.pgraphs.buckets, 1, n, start + n), i))
        except ValueError:
            return None
        return vb, short, pre

    def forward(self, tokens, spec, logits_rows, want_taps):
        """Any step's target forward through the graphs of `forward_plan`: a step of several
        sequences' prefill chunks, or a chunk with other sequences' decode rows, is one verify graph
        (all the short segments) plus one prefill graph per long chunk; the logits and DSpark taps
        come back in the step's row order, equal to the eager forward's bit for bit. The SPS
        profile's scratch-slot forwards and steps no bucket holds run the eager forward."""
        plan = None if any(sl == self.decoder.scratch for sl, _, _ in spec) else self.forward_plan(spec)
        if plan is None:
            if not any(sl == self.decoder.scratch for sl, _, _ in spec):
                self.counters["eager_forwards"] += 1
            return super().forward(tokens, spec, logits_rows, want_taps)
        from v4flash_backend.model.transformer import StepOutput

        vb, short, pre = plan
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        offs = [0]
        for _, _, n in spec:
            offs.append(offs[-1] + n)
        logits_parts, taps_parts, src = [], [], [None] * offs[-1]  # src[row] = row of the concatenated outputs
        base, h2d, before = 0, 0, (self.graphs.executions, self.pgraphs.executions if self.pgraphs else 0)
        if vb is not None:
            S, Q = vb.seqs, vb.rows
            tok = torch.zeros(S, Q, dtype=torch.long)
            slot = torch.full((S,), self.decoder.scratch, dtype=torch.long)
            start, n = torch.zeros(S, dtype=torch.long), torch.zeros(S, dtype=torch.long)
            for j, i in enumerate(short):
                sl, a, k = spec[i]
                tok[j, :k] = tokens[offs[i]:offs[i] + k]
                slot[j], start[j], n[j] = sl, a, k
                for r in range(k):
                    src[offs[i] + r] = base + j * Q + r
            self.decoder.check_plan(vb, slot.tolist(), start.tolist(), n.tolist())
            dev = self.decoder.device  # the plan moves in once
            lg, tp = self.graphs.verify(vb, tok.to(dev), slot.to(dev), start.to(dev), n.to(dev))
            logits_parts.append(lg)
            taps_parts.append(tp)
            base += S * Q
            h2d += 8 * (tok.numel() + 3 * S)
        for pb, i in pre:
            sl, a, k = spec[i]
            tok = torch.zeros(1, pb.rows, dtype=torch.long)
            tok[0, :k] = tokens[offs[i]:offs[i] + k]
            dev = self.pdecoder.device
            lg, tp = self.pgraphs.verify(pb, tok.to(dev), *(torch.tensor([v], device=dev) for v in (sl, a, k)))
            for r in range(k):
                src[offs[i] + r] = base + r
            logits_parts.append(lg)
            taps_parts.append(tp)
            base += pb.rows
            h2d += 8 * (pb.rows + 3)
        src = torch.tensor(src, dtype=torch.long, device=self.decoder.device)
        taps = torch.cat(taps_parts)[src] if taps_parts and taps_parts[0] is not None else None
        self.last_taps = taps
        if isinstance(logits_rows, str):
            # the last row of each segment
            last = torch.tensor([o - 1 for o in offs[1:]], dtype=torch.long, device=src.device)
            pick = {"all": src, "last": src[last], "none": None}[logits_rows]
        else:
            pick = src[torch.as_tensor(logits_rows, dtype=torch.long).to(src.device)]
        out = None if pick is None else torch.cat(logits_parts)[pick]
        rows = 0 if pick is None else len(pick)
        graphs = self.graphs.executions - before[0] + ((self.pgraphs.executions - before[1]) if self.pgraphs else 0)
        self._count(out is not None, h2d + 8 * rows, graphs)
        self.counters["prefill_graphs"] += len(pre)
        self.counters["forward_graphs"] += graphs
        return StepOutput(out, taps if want_taps else None, None)

    def resident_tensors(self) -> list[torch.Tensor]:
        """What stays on the device: the weights, every per-slot cache, the draft blocks."""
        st = self.state
        out = list(self.model.W.values())
        for d in (st.window, st.ckv, st.ik, st.pend_kv, st.pend_score, st.dspark):
            out += list(d.values())
        return out + [st.engram_hist, self.blocks.tokens, self.blocks.q, self.blocks.z]

    def round_fits(self, seqs: int, ctx_needed: int) -> bool:
        try:
            pick_bucket(self.buckets, seqs, 1 + self.G, ctx_needed)
        except ValueError:
            return False
        return True

    def load_block(self, slot: int, block) -> None:
        """A draft block drafted on the host (an eager step) into the per-slot state."""
        tokens, _, q, z = block
        self.blocks.tokens[slot] = tokens
        self.blocks.q[slot] = q.float()
        self.blocks.z[slot] = z.float()
        self._count(0, tokens.numel() * 8 + q.numel() * 4 + z.numel() * 4)

    def read_block(self, slot: int):
        """The per-slot draft block for an eager step (a device-to-host read: counted)."""
        self._count(1, 0)
        b = self.blocks
        return b.tokens[slot].clone(), torch.zeros_like(b.tokens[slot]), b.q[slot].clone(), b.z[slot].clone()

    def round_inputs(self, plan: dict):
        """(bucket, inputs) of a round plan, padded to the bucket with padding sequences."""
        S = len(plan["slot"])
        b = pick_bucket(self.buckets, S, 1 + self.G, max(a + 1 + e for a, e in zip(plan["start"], plan["ell"])))
        pad = b.seqs - S
        self.decoder.check_plan(b, plan["slot"], plan["start"], [1 + e for e in plan["ell"]])

        fd = loop_dtype()

        def col(name, fill, dtype=torch.long):
            return torch.tensor(list(plan[name]) + [fill] * pad, dtype=dtype)

        x = dict(slot=col("slot", self.decoder.scratch), start=col("start", 0),
                 n=torch.tensor([1 + e for e in plan["ell"]] + [0] * pad, dtype=torch.long),
                 pending=col("pending", 0), temperature=col("temperature", 0.0, fd),
                 top_k=col("top_k", 0), top_p=col("top_p", 1.0, fd), seed=col("seed", 0),
                 rnd=col("rnd", 0), budget=col("budget", 0), len_left=col("len_left", 0),
                 stop_ids=torch.tensor([list(r) for r in plan["stop_ids"]] + [[-1] * len(plan["stop_ids"][0])] * pad,
                                       dtype=torch.long),
                 sps_t=pad_sps(plan.get("sps")), **adaptive_inputs(b.seqs, self.G, plan))
        if "n_out" in plan:  # the processed variant: min_tokens, penalties, log-probs in the graphs
            x.update(n_out=col("n_out", 0), min_tokens=col("min_tokens", 0),
                     frequency=col("frequency", 0.0, fd), presence=col("presence", 0.0, fd))
        # the plan moves in once, here (the round's only host-to-device copy)
        return b, to_device(x, self.decoder.device)

    def set_counts(self, slot: int, generated) -> None:
        """The slot's generated-token counts (the penalties' input of the processed rounds) from its
        generated ids: after eager steps committed tokens the device counts have not seen."""
        t = torch.as_tensor(list(generated), dtype=torch.long)
        counts = self.blocks.counts
        counts[slot] = torch.bincount(t, minlength=self.cfg.vocab_size).to(counts.dtype).to(counts.device)
        self._count(0, t.numel() * 8)

    def decode_round(self, plan: dict) -> list[list[int]]:
        b, x = self.round_inputs(plan)
        mode = plan["spec_mode"] if self.G else "off"
        # bytes in: the round's inputs (a round without the draft graph does not take its admission inputs)
        h2d = sum(t.numel() * t.element_size() for k, t in x.items()
                  if mode != "off" or k not in ("t_draft", "cal", "fixed_ell"))
        counting = self.graphs.settings.backend == "none"  # op by op: watch for syncs (compiled: refused at compile)
        ctx = HostSyncCounter() if counting else _Null()
        spy = BoundarySpy(self.resident_tensors()) if os.environ.get("V4FLASH_BOUNDARY_SPY") == "1" else _Null()
        graphs, before = self.graphs, self.graphs.executions
        if mode == "off" and self.ngraphs is not None and all(e <= 0 for e in plan["ell"]):
            # nothing to verify, nothing to draft: the bucket's plain-decode graph (1 row per sequence;
            # its read-back has G = 0 columns of drafts and confidences, which the host reads alike)
            graphs, before = self.ngraphs, self.ngraphs.executions
            b = Bucket(b.seqs, 1, b.ctx)
            self.counters["plain_decode_rounds"] += 1
        with spy:
            with ctx:  # host syncs inside the round (the read-back below is not one)
                out = graphs.round(b, mode, int(plan.get("fixed_len", 0)), x)
            rows = out[:len(plan["slot"])].tolist()  # the round's one read-back (committed tokens + counts)
        self._count(ctx.total, h2d, graphs.executions - before)
        if isinstance(spy, BoundarySpy):
            c = self.counters
            c["boundary_resident_moves"] = c.get("boundary_resident_moves", 0) + spy.resident_moves
            c["boundary_reads"] = c.get("boundary_reads", 0) + spy.reads
        self.counters["graphs_compiled"] = self.graphs.stats.graphs
        return rows


def _move_attrs(obj, device) -> int:
    """Move every tensor attribute (and every tensor value of a dict attribute) of obj; returns
    how many tensors it placed."""
    n = 0
    for name, v in list(vars(obj).items()):
        if isinstance(v, torch.Tensor):
            setattr(obj, name, v.to(device))
            n += 1
        elif isinstance(v, dict) and v and all(isinstance(t, torch.Tensor) for t in v.values()):
            for k in v:
                v[k] = v[k].to(device)
            n += len(v)
    return n


def place_resident(runner: "StaticRunner", device) -> int:
    """Put the rank's weight shard, every per-slot cache (KV rings, compressed KV, index keys,
    compressor pending rows, DSpark rings, Engram history), the draft blocks and the RoPE / Engram
    tables on `device` once, at load (the rank's NeuronCore on trn2; 'cpu' here, where it is a
    no-op). A decode round then moves only its plan in and its committed tokens out. Returns the
    number of tensors placed."""
    W = runner.model.W
    for k in list(W.keys()):
        W[k] = W[k].to(device)
    n = len(W)
    W.meta.pop("stacked", None)  # the stacked experts (W's expert entries are views of them): rebuilt there
    _settle_weights(runner.model)
    n += _move_attrs(runner.state, device) + _move_attrs(runner.blocks, device)
    # every decoder's tables (decode, plain-decode, prefill): each `_TableRope` holds the model
    # Rope's table, so a table shared before the move stays shared (moved once)
    decoders = [getattr(runner, d, None) for d in ("decoder", "ndecoder", "pdecoder")]
    ropes = list(runner.model.ropes.values()) + [r for d in decoders if d is not None for r in d.ropes.values()]
    moved: dict = {}
    for rope in ropes:
        for name, v in list(vars(rope).items()):
            if isinstance(v, torch.Tensor):
                if id(v) not in moved:
                    moved[id(v)] = (v, v.to(device))  # keep v alive: ids stay unique
                    n += 1
                setattr(rope, name, moved[id(v)][1])
    hasher = getattr(runner.model, "hasher", None)
    if hasher is not None and hasattr(hasher, "to"):
        hasher.to(device)
    return n


def _settle_weights(model) -> None:
    """Fill the weight dict's lazy metadata now (expert lists; the stacked expert weights, which
    replace W's per-expert entries by views): the eager forward would otherwise do it on its first
    call and change objects the compiled graphs were traced against (a re-trace while serving)."""
    from v4flash_backend.model.ffn import local_experts, stacked_experts

    prefixes = sorted({k.split(".experts.")[0] for k in model.W if ".experts." in k})
    for p in prefixes:
        local_experts(model.W, p)
        stacked_experts(model.W, p)


class _Null:
    total = 0
    resident_moves = reads = 0

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False
