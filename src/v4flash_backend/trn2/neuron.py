"""The Neuron (trn2) launch path of the static decode step.

- `NeuronSettings` / `neuron_env`: the compiler flags the port needed (`--auto-cast=none`, the fp8
  e4m3fn-as-e4m3 tensorizer flag -- trn2's PE has no e4m3fn -- `-O1`, `--lnc=2`, transformer model
  type), LNC=2 (64 logical cores on a trn2.48xlarge), the NEFF / HLO compile caches, the `neuron`
  torch.distributed backend and the `nki` ops backend with 'reference' numerics (no fp64 on a
  NeuronCore). `apply_env` only fills what the environment does not already set.
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
from v4flash_backend.engine.runner import LocalRunner

from .static_step import (
    Bucket,
    StaticDecoder,
    bucket_sizes,
    graph_host_syncs,
    pick_bucket,
)

# neuronx-cc arguments of the served graphs (the port's set; see module docstring)
COMPILER_ARGS = (
    "--target=trn2",
    "--lnc=2",
    "--model-type=transformer",
    "-O1",
    "--auto-cast=none",
    "--enable-fast-loading-neuron-binaries",
    "--internal-hlo2tensorizer-options=--experimental-unsafe-fp8e4m3fn-as-fp8e4m3",
)
NEURON_BACKENDS = {"neuron": "torch_neuronx", "neuron_libtorch": "libtorch_neuronx_lite"}


class HostSyncInGraph(RuntimeError):
    """A graph of the static step still reads device values on the host."""


@dataclass
class NeuronSettings:
    lnc: int = 2
    backend: str = "neuron"  # torch.compile backend: neuron | neuron_libtorch | (CPU) eager | none (no compile)
    compiler_args: tuple[str, ...] = COMPILER_ARGS
    cache_dir: str = "/var/cache/v4flash/neuron"
    dist_backend: str = "neuron"
    pin_core: bool = False  # set NEURON_RT_VISIBLE_CORES to the local rank (one logical core per process)

    @classmethod
    def from_env(cls, env=None) -> "NeuronSettings":
        env = os.environ if env is None else env
        s = cls()
        if env.get("V4FLASH_NEURON_BACKEND"):
            s.backend = env["V4FLASH_NEURON_BACKEND"]
        if env.get("V4FLASH_NEURON_CACHE"):
            s.cache_dir = env["V4FLASH_NEURON_CACHE"]
        if env.get("NEURON_LOGICAL_NC_CONFIG"):
            s.lnc = int(env["NEURON_LOGICAL_NC_CONFIG"])
        if env.get("NEURON_CC_FLAGS"):  # an explicit flag string replaces ours
            import shlex

            s.compiler_args = tuple(shlex.split(env["NEURON_CC_FLAGS"]))
        if s.lnc != 2:
            s.compiler_args = tuple(f"--lnc={s.lnc}" if a.startswith("--lnc") else a for a in s.compiler_args)
        return s


def neuron_env(s: NeuronSettings, local_rank: int | None = None) -> dict[str, str]:
    """The environment of one serving rank on a trn2 (set before torch_neuronx is imported)."""
    import shlex

    env = {
        "NEURON_LOGICAL_NC_CONFIG": str(s.lnc),
        "NEURON_RT_VIRTUAL_CORE_SIZE": str(s.lnc),
        "NEURON_PLATFORM_TARGET_OVERRIDE": "trn2",
        "NEURON_CC_FLAGS": " ".join(shlex.quote(a) for a in s.compiler_args),
        # compiled graphs persist across restarts: a warm start loads NEFFs instead of compiling
        "TORCH_NEURONX_NEFF_CACHE_DIR": os.path.join(s.cache_dir, "neff"),
        "TORCH_NEURONX_HLO_CACHE_DIR": os.path.join(s.cache_dir, "hlo"),
        "NEURON_COMPILE_CACHE_URL": os.path.join(s.cache_dir, "neuronx-cc"),
        # a graph that fails to compile must fail the start, not run op by op on the host
        "TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION": "1",
        "V4FLASH_OPS": "nki",
        "V4FLASH_NUMERICS": "reference",
        "V4FLASH_DIST_BACKEND": s.dist_backend,
    }
    if s.pin_core and local_rank is not None:
        env["NEURON_RT_VISIBLE_CORES"] = str(local_rank)
    return env


def apply_env(s: NeuronSettings, environ=None, local_rank: int | None = None) -> dict[str, str]:
    """Fill `environ` (default os.environ) with `neuron_env`; values already set win. Returns what
    was added."""
    environ = os.environ if environ is None else environ
    added = {}
    for k, v in neuron_env(s, local_rank).items():
        if k not in environ:
            environ[k] = added[k] = v
    os.makedirs(s.cache_dir, exist_ok=True)
    return added


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


def compile_step(fn, s: NeuronSettings, stats: CompileStats | None = None):
    """torch.compile(fn) as one graph for the Neuron backend of `s`, refusing host syncs."""
    import torch._dynamo

    ops.backend_module()  # resolve the ops backend now: the graph must not trace an import
    if s.backend == "none":  # no compilation: the static step runs op by op (CPU tests, projection)
        return fn
    import_neuron(s)
    inner = torch._dynamo.lookup_backend(s.backend)
    kwargs = {"options": {"compiler_args": list(s.compiler_args)}} if s.backend == "neuron_libtorch" else {}
    stats = stats if stats is not None else CompileStats()

    def checked(gm, example_inputs):
        syncs = graph_host_syncs(gm)
        if syncs:
            raise HostSyncInGraph(f"host syncs in a static graph: {syncs}")
        t0 = time.perf_counter()
        out = inner(gm, example_inputs, **kwargs)
        stats.graphs += 1
        stats.seconds += time.perf_counter() - t0
        return out

    return torch.compile(fn, backend=checked, fullgraph=True, dynamic=False)


def decode_buckets(max_num_seqs: int, max_model_len: int, rows: int, min_ctx: int = 256) -> list[Bucket]:
    """Buckets: sequences and context bounds in powers of two (up to the limits), `rows` per sequence."""
    return [Bucket(S, rows, L) for S in bucket_sizes(max_num_seqs)
            for L in bucket_sizes(max_model_len, min(min_ctx, max_model_len))]


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
    executions: int = 0  # graph executions (verify + draft calls)
    _verify: dict = field(default_factory=dict)
    _draft: dict = field(default_factory=dict)

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

    def warm_up(self, progress=sys.stderr) -> float:
        """Compile (or load from the cache) every bucket's graphs by running them on padding plans,
        which leave the state untouched. Returns the seconds it took."""
        dec = self.decoder
        bar = _Progress(len(self.buckets), progress)
        t0 = time.perf_counter()
        bar.show(0, "")
        for i, b in enumerate(self.buckets):
            tokens, slot, start, n = dec.padding_plan(b.seqs, b.rows)
            _, taps = self.verify_graph(b)(tokens, slot, start, n)
            if dec.drafter is not None and taps is not None:
                self.draft_graph(b)(taps, n, slot, start, tokens[:, 0])
            bar.show(i + 1, str(b))
        return time.perf_counter() - t0


class StaticRunner(LocalRunner):
    """`LocalRunner` whose decode steps run the static graphs of a bucket. A step is static when
    every segment continues a sequence (start > 0) with at most `rows` rows; its logits come back for
    the requested rows exactly as `LocalRunner.forward` returns them. The DSpark call after a
    static step runs the bucket's draft graph when its writes are the leading rows of that step's
    sequences; otherwise both fall back to the eager forward (prefill chunks, mixed steps)."""

    def __init__(self, model, num_slots: int, max_len: int, buckets: list[Bucket] | None = None,
                 settings: NeuronSettings | None = None, margin: int = 8):
        super().__init__(model, num_slots + 1, max_len, margin)  # + the scratch slot
        rows = 1 + (model.cfg.dspark_block_size or 0)
        self.decoder = StaticDecoder(model, self.state, scratch=num_slots, max_rows=rows)
        self.buckets = buckets or decode_buckets(num_slots, max_len, rows)
        self.graphs = StaticGraphs(self.decoder, self.buckets, settings or NeuronSettings())
        self._last = None  # (bucket, plan, taps, seq -> bucket row offset) of the last static step

    def forward(self, tokens, spec, logits_rows, want_taps):
        rows = self.buckets[0].rows
        if not spec or any(start == 0 or n > rows or n == 0 for _, start, n in spec):
            self._last = None
            return super().forward(tokens, spec, logits_rows, want_taps)
        try:
            b = pick_bucket(self.buckets, len(spec), max(n for *_, n in spec), max(s + n for _, s, n in spec))
        except ValueError:  # more sequences or context than any bucket: the eager forward
            self._last = None
            return super().forward(tokens, spec, logits_rows, want_taps)
        slot, start, n = ([x[i] for x in spec] + [pad] * (b.seqs - len(spec))
                          for i, pad in ((0, self.decoder.scratch), (1, 0), (2, 0)))
        self.decoder.check_plan(b, slot, start, n)
        flat = torch.zeros(b.seqs, b.rows, dtype=torch.long)
        where, off = [], 0  # bucket row of each flattened input row
        for i, (_, _, k) in enumerate(spec):
            flat[i, :k] = tokens[off:off + k]
            where += range(i * b.rows, i * b.rows + k)
            off += k
        plan = (flat, torch.tensor(slot), torch.tensor(start), torch.tensor(n))
        logits, taps = self.graphs.verify(b, *plan)
        where = torch.tensor(where)
        if isinstance(logits_rows, str):
            pick = {"all": where, "last": torch.tensor([where[sum(x[2] for x in spec[:i + 1]) - 1]
                                                        for i in range(len(spec))]), "none": None}[logits_rows]
        else:
            pick = where[torch.as_tensor(logits_rows, dtype=torch.long)]
        self._last = (b, plan, taps, {s[0]: i for i, s in enumerate(spec)})
        self.last_taps = taps[where] if taps is not None else None
        from v4flash_backend.model.transformer import StepOutput

        return StepOutput(None if pick is None else logits[pick], self.last_taps if want_taps else None, None)

    def dspark(self, writes, items):
        last = self._last
        static = last is not None and items and len(items) == len({s for s, _, _ in items})
        if static:
            b, (flat, slot, start, n), taps, seq_of = last
            commit = torch.zeros(b.seqs, dtype=torch.long)
            anchor = torch.zeros(b.seqs, dtype=torch.long)
            offsets = self.last_taps_offsets(last)
            for s, rows, positions in writes:  # committed rows must be a sequence's leading rows
                i = seq_of.get(s)
                k = len(rows)
                if i is None or k == 0 or rows.tolist() != list(range(offsets[i], offsets[i] + k)) or \
                        int(positions[0]) != int(start[i]):
                    static = False
                    break
                commit[i] = k
            for s, p, a in items if static else ():
                i = seq_of.get(s)
                if i is None or p != int(start[i]) + int(commit[i]) - 1:
                    static = False
                    break
                anchor[i] = a
        if not static:
            self._last = None
            return super().dspark(writes, items)
        # sequences without a draft item still get their ring writes; their draft rows are dropped
        U, hidden, *_ = self.graphs.draft(b, taps, commit, slot, start, anchor)
        keep = torch.tensor([seq_of[s] for s, _, _ in items])
        from v4flash_backend.model.dspark import DraftOutput

        self._last = None
        return DraftOutput(U[keep], hidden[keep])

    @staticmethod
    def last_taps_offsets(last) -> list[int]:
        """Row offset of each sequence in the flattened forward (the engine's row numbering)."""
        _, (_, _, _, n), _, _ = last
        return [int(v) for v in torch.cumsum(n, 0) - n]
