"""`python -m v4flash_backend trn2-check`: the static graphs as a NeuronCore would take them.

For rank R of a W-rank group, without real weights and without a process group (release.py's
`ShapeCollectives`), the rank's `trn2.static_runner.StaticRunner` is built from fake tensors
(`torch._subclasses.FakeTensorMode`: shapes, dtypes and devices, no memory): every weight shard
(from the checkpoint's headers, or from the config's tensor specs), cache, draft block and table is
placed on a fake accelerator device (`FAKE_DEVICE`: cuda, or meta on a CPU-only torch) by the served path's own
`place_resident`, and no default device is set. Every static graph serving compiles for that rank --
per decode bucket the round verify graph, the round draft graph and the plain (no-draft) round
graph, each in the plain and the logit-processing variant, the bare verify forward; per prefill row
bucket the prefill forward -- is captured as an FX graph with `make_fx` under that mode, with the
round inputs the host builds (`round_padding`, moved to the device once as `round_inputs` does).

Per graph:
- device_clean: tracing raised no device mismatch (FakeTensorMode raises when a CPU tensor meets a
  device tensor; 0-dim CPU scalars are allowed, as on a device) and every node's value is on the
  fake device (a CPU tensor made inside the step fails even if it never meets a device tensor);
- dtype_ok: `dtype_problems` -- no float64 / complex128 value anywhere, and 64-bit integers only
  where neuronx-cc keeps them exact (the rule and the documentation it rests on are there);
- host reads: `.item()` / `.tolist()` / data-dependent ops seen while tracing (HostSyncCounter, the
  captured `_local_scalar_dense` / nonzero nodes, FakeTensorMode's data-dependent exceptions);
- kernel nodes: FX nodes whose op is in the `v4flash` namespace (each NKI kernel is a torch custom
  op there), counted over the graphs one decode step runs (round verify + round draft of the first
  decode bucket; the plain round graph where the checkpoint has no DSpark).

rank_agnostic: the same graphs traced for one other rank of the world (R + W/2: another attention
group, other experts, vocabulary and Engram rows) have the same graph keys (`trn2.graph_key`, with
the launch's compiler flags), graph by graph: one compile serves every rank. `graph_keys` is the
hash of the sorted key set (the same for every R of a rank-agnostic world).

neuron_env: the launch environment `trn2.launch.neuron_env` builds for this rank carries the LNC,
--auto-cast=none and the fp8 flag in NEURON_CC_FLAGS, NEURON_LOGICAL_NC_CONFIG = the LNC, a per-rank
NEURON_RT_VISIBLE_CORES and a compile cache directory.

The last line is `trn2-check: graphs=<N> device_clean=<n>/<N> dtype_ok=<n>/<N>
kernel_nodes_per_step=<K> host_reads=<H> neuron_env=<ok|...> graph_keys=<hash> rank_agnostic=<yes|no>`
(one line).
"""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from v4flash_backend import ops
from v4flash_backend.config import ModelConfig
from v4flash_backend.ops import kernel_ops
from v4flash_backend.parallel.spec_reader import SpecReader
from v4flash_backend.trn2.graph_key import canonical, first_difference, graph_key, key_flags, keys_digest
from v4flash_backend.trn2.launch import FP8_FLAG, NeuronSettings

from .command import run_check, standalone
from .dtypes import _flat, _op_name, _tensors, _val, dtype_problems

# The fake accelerator: `cuda` where this torch is built with CUDA; on a CPU-only build, Python
# indexing of a fake cuda tensor asks for CUDA's device guard and fails, so `meta` stands in there --
# also not the CPU, and FakeTensorMode raises alike when a CPU tensor meets it. (release-check's
# meta trace hides CPU factories with set_default_device("meta"); here no default device is set.)
FAKE_DEVICE = torch.device("cuda", 0) if torch.backends.cuda.is_built() else torch.device("meta")

# the dtype rule (no float64; int64 values that may pass 2^31): `dtypes.dtype_problems`, documented there
_HOST_READ_OPS = {"_local_scalar_dense", "item", "nonzero", "nonzero_static", "masked_select", "unique",
                  "_unique2", "unique_consecutive", "unique_dim", "bincount", "argwhere"}


def off_device(gm, device=FAKE_DEVICE) -> list[str]:
    """Nodes whose value is a tensor with at least one dimension not on `device`."""
    dev = torch.device(device).type
    out = []
    for node in gm.graph.nodes:
        for v in _tensors(_val(node)):
            if v.dim() and v.device.type != dev:
                out.append(f"{node.name} ({_op_name(node.target) if node.op == 'call_function' else node.op}) "
                           f"on {v.device}")
                break
    return out


def kernel_nodes(gm) -> int:
    return sum(kernel_ops.kernel_nodes(gm).values())


def graph_host_reads(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and _op_name(n.target) in _HOST_READ_OPS)


def _where(e: BaseException) -> str:
    """file:line of the innermost project frame of an exception's traceback (where the step did it)."""
    import traceback

    frames = [f for f in traceback.extract_tb(e.__traceback__) if "v4flash_backend" in f.filename
              and not f.filename.endswith(("checks/trn2.py", "device_boundary.py"))]
    if not frames:
        return "?"
    f = frames[-1]
    return f"{f.filename.split('src/')[-1]}:{f.lineno}"


# ---- tracing ----------------------------------------------------------------------------------------
@dataclass
class GraphCheck:
    name: str
    nodes: int = 0
    kernel_nodes: int = 0
    off_device: list = field(default_factory=list)
    dtype_bad: list = field(default_factory=list)
    host_reads: int = 0
    error: str = ""
    seconds: float = 0.0
    outputs: tuple = ()  # the graph's outputs (fake), inputs of the next graph of the round
    step: bool = False  # one of the graphs a decode step runs
    key: str = ""  # trn2.graph_key of the captured graph (with the launch's compiler flags)
    canon: str = ""  # what the key hashes (to name the first difference between two ranks' graphs)

    @property
    def device_clean(self) -> bool:
        return not self.error and not self.off_device

    @property
    def dtype_ok(self) -> bool:
        return not self.error and not self.dtype_bad

    def line(self) -> str:
        s = (f"graph {self.name}: nodes={self.nodes} kernel_nodes={self.kernel_nodes} "
             f"device={'clean' if self.device_clean else 'DIRTY'} dtype={'ok' if self.dtype_ok else 'BAD'} "
             f"host_reads={self.host_reads} {self.seconds:.1f}s")
        if self.error:
            s += f" error: {self.error}"
        for what in (self.off_device[:3], self.dtype_bad[:3]):
            if what:
                s += " | " + "; ".join(what)
        return s


def trace(name: str, fn, args, mode, native_int64: bool, flags=()) -> GraphCheck:
    """Capture fn(*args) with make_fx under the fake mode `mode`, check the graph and key it."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        FakeTensorDeviceMismatchError,
    )
    from torch.fx.experimental.proxy_tensor import make_fx

    from v4flash_backend.engine.device_boundary import HostSyncCounter

    res = GraphCheck(name)
    t0 = time.perf_counter()
    if torch.get_default_device().type != "cpu":
        raise RuntimeError("trn2-check traces with no default device set")
    try:
        with mode, HostSyncCounter() as hs:
            gm = make_fx(fn, tracing_mode="real")(*args)
    except FakeTensorDeviceMismatchError as e:
        res.error = f"device mismatch at {_where(e)}: {str(e).splitlines()[0][:200]}"
        res.host_reads = hs.total
    except (DataDependentOutputException, DynamicOutputShapeException) as e:
        res.error = f"host read at {_where(e)}: {type(e).__name__}"
        res.host_reads = max(1, hs.total)
    except Exception as e:  # any other failure to capture the graph fails both checks
        res.error = f"{type(e).__name__} at {_where(e)}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        res.host_reads = hs.total
    else:
        res.nodes = len(gm.graph.nodes)
        res.kernel_nodes = kernel_nodes(gm)
        res.off_device = off_device(gm)
        res.dtype_bad = dtype_problems(gm, native_int64)
        res.host_reads = max(hs.total, graph_host_reads(gm))
        out = [n for n in gm.graph.nodes if n.op == "output"][0]
        res.outputs = tuple(_val(a) for a in _flat(out.args[0]))
        res.canon = canonical(gm, args, flags)
        res.key = graph_key(gm, args, flags)
    res.seconds = time.perf_counter() - t0
    return res


# ---- the rank's runner, on fake tensors -----------------------------------------------------------------
@dataclass
class RankPlan:
    """What one rank serves: the model config, its layout, the runner's limits."""

    cfg: ModelConfig
    world: int
    rank: int
    max_num_seqs: int
    max_model_len: int
    prefill_chunk: int
    buckets: str = "smallest"  # all | corners | smallest (release.select_buckets)
    reader: object = None
    tokenizer: Path | None = None


def build_runner(plan: RankPlan, mode):
    """The rank's StaticRunner over fake weights and caches, every resident tensor on FAKE_DEVICE."""
    from tokenizers import Tokenizer

    from v4flash_backend.model.engram_hash import EngramHasher
    from v4flash_backend.model.transformer import V41Model
    from v4flash_backend.parallel.comm import DistComm
    from v4flash_backend.parallel.layout import Layout, attention_group_max, load_shard
    from v4flash_backend.trn2.graphs import MAX_PREFILL_ROWS
    from v4flash_backend.trn2.static_runner import StaticRunner, place_resident

    from .release import ShapeCollectives, select_buckets

    # the attention group the worker forms: bounded by what the checkpoint splits by (layout)
    cfg, lay = plan.cfg, Layout(plan.rank, plan.world, attention_group_max(plan.cfg, plan.world))
    hasher = None
    if cfg.engram_layer_ids:  # host tables from the tokenizer (real, small); placed on the device below
        hasher = EngramHasher.from_config(cfg, Tokenizer.from_file(str(plan.tokenizer)))
    rows = 1 + (cfg.dspark_block_size or 0)
    buckets = select_buckets(cfg, plan.max_num_seqs, plan.max_model_len, plan.buckets)
    with mode:
        W = load_shard(plan.reader, cfg, lay)
        model = V41Model(cfg, W, hasher, DistComm(lay, ShapeCollectives(lay), cfg.vocab_size, cfg))
        # every position any decoder addresses: fake tables (values do not matter to the check)
        n_pos = plan.max_model_len + max(rows, min(plan.prefill_chunk, MAX_PREFILL_ROWS), cfg.dspark_block_size) + 1
        for rope in model.ropes.values():
            rope._table = torch.empty(n_pos, rope.freqs.numel(), dtype=torch.complex64)
        runner = StaticRunner(model, plan.max_num_seqs, plan.max_model_len, buckets=buckets,
                              settings=NeuronSettings(backend="none"), prefill_rows=plan.prefill_chunk)
        place_resident(runner, FAKE_DEVICE)
    return runner


def _prefill_selected(runner, which: str):
    """The runner's prefill buckets as release.select_prefill_buckets picks them."""
    from .release import _corners, _smallest

    pb = runner.pgraphs.buckets if runner.pgraphs is not None else []
    if not pb:
        return []
    return pb if which == "all" else _corners(pb) if which == "corners" else _smallest(pb)


def check_graphs(runner, mode, native_int64: bool, processed: bool = True, log=None,
                 prefill: str = "smallest", select=None, flags=()) -> list[GraphCheck]:
    """Trace every static graph of `runner` (see the module docstring); `select(name)`: only those
    (a round's draft graph needs its verify graph)."""
    from v4flash_backend.trn2.graphs import PROC_INPUTS
    from v4flash_backend.trn2.static_step import Bucket

    out: list[GraphCheck] = []

    def run(name, fn, args, step=False):
        if select is not None and not select(name):
            return GraphCheck(name)
        res = trace(name, fn, args, mode, native_int64, flags)
        res.step = step
        out.append(res)
        if log:
            log(res.line())
        return res

    G = runner.G
    mode_name = "dspark" if G else "off"
    sw = 8
    for i, b in enumerate(runner.buckets):
        for proc in (False, True)[:1 + processed]:
            x = runner.graphs.round_padding(b, sw, proc)
            pv = [x[k] for k in PROC_INPUTS] if proc else []
            suffix = " processed" if proc else ""
            v_args = [x[k] for k in ("slot", "start", "n", "pending", "temperature", "top_k", "top_p", "seed", "rnd",
                                     "budget", "stop_ids")] + pv
            first = i == 0 and not proc
            g1 = run(f"round verify {b}{suffix}", runner.graphs.round_verify_graph(b, proc), v_args, step=first)
            d_name = f"round draft {b} {mode_name}{suffix}"
            if G and not g1.outputs and (select is None or select(d_name)):  # counted: it is served
                out.append(GraphCheck(d_name, error="not traced: its round verify graph did not trace", step=first))
                if log:
                    log(out[-1].line())
            if G and g1.outputs:
                tokens_out, committed, accepted, stopped, taps, *lp = g1.outputs[:5 + proc]
                d_args = [taps, committed, tokens_out, accepted, stopped] + [
                    x[k] for k in ("slot", "start", "n", "temperature", "top_k", "top_p", "seed", "rnd", "budget",
                                   "len_left", "sps_t", "t_draft", "cal", "fixed_ell")]
                if proc:
                    d_args += pv + [x["stop_ids"]] + lp
                run(d_name, runner.graphs.round_draft_graph(b, mode_name, 0, proc),
                    d_args, step=first)
            if runner.ngraphs is not None:
                nb = Bucket(b.seqs, 1, b.ctx)
                xn = runner.ngraphs.round_padding(nb, sw, proc)
                n_args = [xn[k] for k in ("slot", "start", "n", "pending", "temperature", "top_k", "top_p", "seed",
                                          "rnd", "budget", "stop_ids")] + ([xn[k] for k in PROC_INPUTS] if proc else [])
                run(f"plain round {nb}{suffix}", runner.ngraphs.round_verify_graph(nb, proc), n_args)
        run(f"forward {b}", runner.graphs.verify_graph(b), list(runner.decoder.padding_plan(b.seqs, b.rows)))
    for pb in _prefill_selected(runner, prefill):
        run(f"prefill {pb}", runner.pgraphs.verify_graph(pb), list(runner.pdecoder.padding_plan(1, pb.rows)))
    return out


# ---- the launch environment -------------------------------------------------------------------------
TRN2_PHYSICAL_CORES = 128  # a trn2.48xlarge: 16 chips x 8 NeuronCores (LNC=2: 64 logical ones)


def env_problems(env: dict, lnc: int, local_rank: int) -> list[str]:
    """What the rank's launch environment lacks (empty: ok)."""
    flags = shlex.split(env.get("NEURON_CC_FLAGS", ""))
    missing = []
    if not any(f in (f"--lnc={lnc}", f"--logical-nc-config={lnc}") for f in flags) and \
            not any(flags[i] in ("--lnc", "--logical-nc-config", "-lnc") and flags[i + 1] == str(lnc)
                    for i in range(len(flags) - 1)):
        missing.append(f"NEURON_CC_FLAGS:--lnc={lnc}")
    if "--auto-cast=none" not in flags:
        missing.append("NEURON_CC_FLAGS:--auto-cast=none")
    if not any(FP8_FLAG in f for f in flags):
        missing.append("NEURON_CC_FLAGS:fp8e4m3fn-as-fp8e4m3")
    if env.get("NEURON_LOGICAL_NC_CONFIG") != str(lnc):
        missing.append(f"NEURON_LOGICAL_NC_CONFIG={lnc}")
    cores = env.get("NEURON_RT_VISIBLE_CORES", "")
    if not cores:
        missing.append("NEURON_RT_VISIBLE_CORES")
    if not any(env.get(k) for k in ("NEURON_COMPILE_CACHE_URL", "TORCH_NEURONX_NEFF_CACHE_DIR")):
        missing.append("compile cache dir")
    return missing


def native_int64_enabled(env: dict) -> bool:
    flags = shlex.split(env.get("NEURON_CC_FLAGS", ""))
    return "--native-int64=enabled" in flags or any(
        flags[i] == "--native-int64" and flags[i + 1] == "enabled" for i in range(len(flags) - 1))


def rank_env(world: int, rank: int, settings=None) -> tuple[dict, int, int]:
    """(the launch environment of `rank`, its LNC, its local rank) from `trn2.launch.neuron_env`."""
    from v4flash_backend.trn2.launch import neuron_env

    s = settings or NeuronSettings()
    local = rank % (TRN2_PHYSICAL_CORES // max(1, s.lnc))  # logical cores of one trn2.48xlarge
    return neuron_env(s, local), s.lnc, local


# ---- the command -----------------------------------------------------------------------------------------
def trn2_check(checkpoint: str | None, config: str | None, world: int, rank: int, max_num_seqs: int = 8,
               max_model_len: int | None = None, prefill_chunk: int | None = None, buckets: str = "smallest",
               processed: bool = True, log=print, settings=None, ops_backend: str = "nki-sim", select=None):
    """Run the checks for one rank; returns (ok, final line, graph checks)."""
    from torch._subclasses import FakeTensorMode

    from .release import tokenizer_json

    log = log or (lambda s: None)
    if checkpoint:
        cfg = ModelConfig.from_json(Path(checkpoint) / "config.json")
        reader = SpecReader.from_checkpoint(checkpoint)
        tok = Path(checkpoint) / "tokenizer.json"
        max_model_len = max_model_len or 256
    else:
        cfg = ModelConfig.release() if config == "release" else ModelConfig.from_json(config)
        reader = SpecReader.from_config(cfg)
        tok = tokenizer_json() if cfg.engram_layer_ids else None
        max_model_len = max_model_len or 65536
    if prefill_chunk is None:
        from v4flash_backend.settings import Settings

        prefill_chunk = Settings().prefill_chunk
    env, lnc, local = rank_env(world, rank, settings)
    native = native_int64_enabled(env)
    flags = key_flags(settings or NeuronSettings())
    saved = ops.get_backend(), ops.get_numerics()
    ops.set_backend(ops_backend)  # nki-sim: kernel numerics, the kernels as torch custom ops (namespace v4flash)
    ops.set_numerics("reference")
    other = (rank + world // 2) % world  # another attention group, other experts / vocabulary / Engram rows
    try:
        graphs = []
        for r in dict.fromkeys((rank, other)):
            t0 = time.perf_counter()
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            plan = RankPlan(cfg, world, r, max_num_seqs, max_model_len, prefill_chunk, buckets, reader, tok)
            runner = build_runner(plan, mode)
            log(f"runner: rank={r}/{world} buckets={[str(b) for b in runner.buckets]} "
                f"prefill_chunk={prefill_chunk} ({time.perf_counter() - t0:.1f}s)"
                + ("" if r == rank else ": its graph keys against rank " + str(rank)))
            graphs.append(check_graphs(runner, mode, native, processed, log if r == rank else None, buckets, select,
                                       flags))
            del runner
    finally:
        ops.set_backend(saved[0])
        ops.set_numerics(saved[1])
    differ = rank_differences(graphs[0], graphs[-1])
    for line in differ:
        log(f"not rank-agnostic (rank {rank} vs {other}): {line}")
    graphs = graphs[0]
    problems = env_problems(env, lnc, local)
    n = len(graphs)
    dc = sum(g.device_clean for g in graphs)
    dt = sum(g.dtype_ok for g in graphs)
    k = sum(g.kernel_nodes for g in graphs if g.step)
    hr = sum(g.host_reads for g in graphs)
    env_s = "ok" if not problems else "missing:" + ",".join(problems)
    final = (f"trn2-check: graphs={n} device_clean={dc}/{n} dtype_ok={dt}/{n} kernel_nodes_per_step={k} "
             f"host_reads={hr} neuron_env={env_s} graph_keys={keys_digest(g.key for g in graphs)} "
             f"rank_agnostic={'no' if differ else 'yes'}")
    ok = n > 0 and dc == n and dt == n and hr == 0 and not problems and k > 0 and not differ
    return ok, final, graphs


def rank_differences(a: list[GraphCheck], b: list[GraphCheck]) -> list[str]:
    """Where two ranks' graphs differ: by name, the first line of their canonical texts that differs
    (empty: the same graph keys, graph for graph)."""
    out = []
    kb = {g.name: g for g in b}
    for g in a:
        h = kb.get(g.name)
        if h is None or not g.key or g.key != h.key:
            why = "not traced" if h is None or not g.key or not h.key else first_difference(g.canon, h.canon)
            out.append(f"graph {g.name}: {why}")
    return out + [f"graph {name}: only on the other rank" for name in kb.keys() - {g.name for g in a}]


def add_arguments(parser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="checkpoint directory (its headers, config.json, tokenizer.json; no data)")
    src.add_argument("--config", help="config.json (or 'release'): the tensor specs come from the config")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="default: 256 for --checkpoint, 65536 for --config")
    parser.add_argument("--prefill-chunk", type=int, default=None, help="as the served setting (default: its default)")
    parser.add_argument("--buckets", default="smallest", choices=["all", "corners", "smallest"],
                        help="decode buckets traced (release.select_buckets) and prefill row buckets: smallest "
                             "(default: 1 sequence at the shortest context, the fewest prefill rows), corners, all")
    parser.add_argument("--ops", default="nki-sim", choices=["nki-sim", "torch"],
                        help="ops backend traced (nki-sim: the kernels as custom ops, what a trn2 rank runs)")
    parser.add_argument("--no-processed", dest="processed", action="store_false",
                        help="skip the logit-processing variants of the round graphs")


def main(args) -> int:
    return run_check(trn2_check, args.checkpoint, args.config, args.world_size, args.rank, args.max_num_seqs,
                     args.max_model_len, args.prefill_chunk, args.buckets, args.processed, ops_backend=args.ops)


if __name__ == "__main__":
    standalone("python -m v4flash_backend trn2-check", add_arguments, main)
