"""The static graphs compiled ahead of time: the directory the compile command writes
(`python -m v4flash_backend compile`, `group.aot`) and every rank of a server loads from
(`compiled_artifacts`), graph by graph, by graph key (`trn2.graph_key`).

    manifest.json     what was compiled: the key -> artifact table, the start-up graphs of a rank
                      (names, in warm-up order), the compiler (backend, flags, SDK versions), the
                      world size, the model config and the settings it was compiled for, and per
                      graph name its binding (`trn2.binding`, `trn2.express.record`: its key, where
                      each input comes from, the result's structure, the inputs' specs)
    graphs/<key>.py   one graph's torch.fx Python source and imports (what the CPU stand-in `eager`
                      runs; what the Neuron route hands its backend), collectives naming their group
                      by role
    neff/             the Neuron route's artifacts: TorchNeuron's persistent NEFF cache
                      (TORCH_NEURONX_NEFF_CACHE_DIR), filled by the compile, read by the server

A server refuses artifacts that are stale (another world size, backend, compiler flags, model,
torch or graph-shaping setting) or whose files are gone, naming them, before it traces anything
(`ArtifactStore.check`). A graph with a binding is then loaded by its name (entry point and bucket)
and called without dynamo (`ArtifactSource.bind`): the manifest's checks stand in for dynamo's
guards, and each bound input's shape, stride and dtype are checked against the recorded ones. A
graph without one is traced and looked up by its key: one the manifest lacks is compiled when
`compile_on_miss` is set and refused, by name, otherwise (`ArtifactSource.resolve`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

MANIFEST = "manifest.json"
FORMAT = 2  # 2: the graphs' bindings (a rank loads without tracing)
NEFF_DIR = "neff"


class ArtifactError(RuntimeError):
    """Artifacts a server cannot start from (stale or missing; the message names them)."""


def versions() -> dict[str, str]:
    """The compiler stack a graph was compiled with: torch, and the Neuron packages where installed; and
    the code that traced it (`source_digest`): a bound graph is loaded without a trace, so nothing else
    would notice that the model's code changed since the compile."""
    from importlib import metadata

    out = {}
    for dist in ("torch", "torch-neuronx", "neuronx-cc", "libtorch-neuronx-lite", "nki"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    out["v4flash-source"] = source_digest()
    return out


@functools.cache
def source_digest() -> str:
    """A hash of the Python source of the packages whose code a graph is traced from (v4flash_backend,
    and nki_sim, which runs the kernels on the CPU stand-in): any edit there makes artifacts stale.
    Comments and docstrings count too (a cheap, conservative rule: a stale refusal costs a recompile,
    a stale load would serve another program). Computed once per process (~150 files)."""
    import nki_sim
    import v4flash_backend

    h = hashlib.sha256()
    for pkg in (v4flash_backend, nki_sim):
        root = Path(pkg.__file__).parent
        for f in sorted(root.rglob("*.py")):
            h.update(str(f.relative_to(root.parent)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def config_digest(cfg) -> str:
    from dataclasses import asdict

    return hashlib.sha256(json.dumps(asdict(cfg), sort_keys=True, default=str).encode()).hexdigest()[:16]


# The settings that choose a rank's graphs or are traced into them as constants (buckets, variants,
# spec mode, kernels, numerics, the split of the world): a bound graph is not guarded by dynamo, so a
# server whose value differs from the compile's is refused at start, naming the setting.
GRAPH_SETTINGS = ("max_num_seqs", "max_model_len", "prefill_chunk", "warm_processed", "spec_mode", "fixed_len",
                  "dspark_adaptive", "ops_backend", "numerics", "pipeline_parallel", "sequence_parallel")


def graph_settings(settings) -> dict:
    """`settings`' values of GRAPH_SETTINGS (a Settings or the manifest's dict), numerics as a rank
    resolves an empty one on the nki ops (reference, as group.aot.compile_settings does)."""
    from dataclasses import asdict

    d = asdict(settings) if not isinstance(settings, dict) else settings
    out = {k: d.get(k) for k in GRAPH_SETTINGS}
    if not out["numerics"] and out["ops_backend"] == "nki":
        out["numerics"] = "reference"
    return out


def expectations(cfg, ns, world: int, settings=None) -> dict:
    """What artifacts must have been compiled for, for a server of model `cfg`, compile settings `ns`
    (trn2.launch.NeuronSettings), `world` ranks and `settings`: the manifest's fields a server checks."""
    from .graph_key import key_flags

    out = {"backend": ns.backend, "flags": list(key_flags(ns)), "world_size": world,
           "model_config": config_digest(cfg), "versions": versions()}
    if settings is not None:
        out["graph_settings"] = graph_settings(settings)
    return out


@dataclass
class Manifest:
    backend: str
    flags: list
    world_size: int
    model_config: str  # config_digest
    versions: dict = field(default_factory=dict)
    settings: dict = field(default_factory=dict)
    graphs: dict = field(default_factory=dict)  # key -> {"name", "artifact" (relative path or null), "seconds"}
    per_rank: list = field(default_factory=list)  # [[name, key]] in warm-up order
    bindings: dict = field(default_factory=dict)  # name -> binding (trn2.express.record, with its "key")
    key_version: int = 0
    format: int = FORMAT

    def to_json(self) -> str:
        from dataclasses import asdict

        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        return cls(**json.loads(text))


class ArtifactStore:
    """A compiled-artifacts directory (see the module docstring)."""

    def __init__(self, path, manifest: Manifest | None = None):
        self.path = Path(path)
        self.manifest = manifest

    @classmethod
    def open(cls, path) -> "ArtifactStore":
        p = Path(path) / MANIFEST
        if not p.exists():
            raise ArtifactError(f"compiled_artifacts {str(path)!r} has no {MANIFEST}: run `python -m v4flash_backend "
                                "compile ... --out <that directory>` first (docker/README.md)")
        return cls(path, Manifest.from_json(p.read_text()))

    def save(self) -> None:
        """Write the manifest atomically (a compile interrupted between two graphs leaves a valid one)."""
        self.path.mkdir(parents=True, exist_ok=True)
        tmp = self.path / (MANIFEST + ".tmp")
        tmp.write_text(self.manifest.to_json())
        os.replace(tmp, self.path / MANIFEST)

    # ---- what a server checks before it traces ---------------------------------------------------------
    def problems(self, expect: dict) -> list[str]:
        """Why this server cannot start from these artifacts (empty: it can). `expect`: the server's
        backend, flags, world_size, model_config and versions, compared with the manifest's; and every
        graph's artifact file must be there."""
        from .graph_key import KEY_VERSION

        m = self.manifest
        out = []
        if m.format != FORMAT or m.key_version != KEY_VERSION:
            out.append(f"manifest format {m.format} / graph keys v{m.key_version}, this server reads {FORMAT} / "
                       f"v{KEY_VERSION}")
        for what in ("backend", "flags", "world_size", "model_config", "versions"):
            have, want = getattr(m, what), expect.get(what)
            if what in expect and have != want:
                out.append(f"{what}: compiled for {have!r}, this server has {want!r}")
        have = graph_settings(m.settings)
        for k, want in expect.get("graph_settings", {}).items():
            if have[k] != want:
                out.append(f"setting {k}: compiled for {have[k]!r}, this server has {want!r}")
        for key, g in sorted(m.graphs.items(), key=lambda kv: kv[1]["name"]):
            if g.get("artifact") and not (self.path / g["artifact"]).exists():
                out.append(f"graph {g['name']!r}: its artifact {g['artifact']} (key {key}) is missing")
        return out

    def check(self, expect: dict) -> None:
        bad = self.problems(expect)
        if bad:
            raise ArtifactError(f"the compiled artifacts in {self.path} are stale or incomplete (rerun `python -m "
                                "v4flash_backend compile`, or set compile_on_miss): " + "; ".join(bad))

    # ---- one graph ---------------------------------------------------------------------------------------
    def has(self, key: str) -> bool:
        g = self.manifest.graphs.get(key)
        return g is not None and (not g.get("artifact") or (self.path / g["artifact"]).exists())

    def write_graph(self, key: str, gm, roles: dict) -> str:
        """The stand-in's artifact of `gm`: its Python source with the imports it needs, the group names
        of its collectives replaced by their roles. Returns its path relative to the directory."""
        rel = f"graphs/{key}.py"
        text = graph_source(gm, {name: "@" + role for name, role in roles.items()})
        (self.path / "graphs").mkdir(parents=True, exist_ok=True)
        tmp = self.path / (rel + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.path / rel)
        return rel

    def load_graph(self, key: str, roles: dict):
        """The callable of graph `key` on this rank: its source compiled by Python, each role a
        collective names bound to this rank's group of that role."""
        text = (self.path / self.manifest.graphs[key]["artifact"]).read_text()
        for name, role in roles.items():
            text = text.replace(repr("@" + role), repr(name))
        return graph_from_source(text)

    def load_bound(self, key: str, roles: dict, rec: dict):
        """The callable of bound graph `key`: the source itself (the CPU stand-ins), or on the Neuron
        route the source handed to the backend as a GraphModule with fake inputs of the recorded specs,
        which finds its NEFF in the cache the compile filled (never run: no device here)."""
        fn = self.load_graph(key, roles)
        if not self.manifest.graphs[key].get("neff"):
            return fn
        import torch
        from torch._subclasses import FakeTensorMode

        gm = torch.fx.symbolic_trace(type("SourceGraph", (torch.nn.Module,), {"forward": fn.forward})())
        with FakeTensorMode(allow_non_fake_inputs=True):
            ins = [torch.empty_strided(s[0], s[1], dtype=getattr(torch, s[2]), device=s[3]) for s in rec["inputs"]]
        return torch._dynamo.lookup_backend(self.manifest.backend)(gm, ins)


def _is_collective(node) -> bool:
    return node.op == "call_function" and "_c10d_functional" in str(node.target)


def graph_source(gm, rename: dict) -> str:
    """`gm` as Python: an import block and `forward(self, *inputs)` (torch.fx's own code generation),
    with `rename` applied to the string arguments of its collectives. A graph holding attributes
    (get_attr, submodules) is refused: its source alone would not be the program."""
    from torch.fx.graph_module import _format_import_block
    from torch.package import sys_importer

    held = [n.target for n in gm.graph.nodes if n.op in ("get_attr", "call_module")]
    if held:
        raise ArtifactError(f"a graph holding attributes {held[:3]} cannot be written as source")
    swapped = []
    for n in gm.graph.nodes:
        if _is_collective(n):
            new = tuple(rename.get(a, a) if isinstance(a, str) else a for a in n.args)
            if new != n.args:
                swapped.append((n, n.args))
                n.args = new
    try:
        code = gm.graph.python_code(root_module="self")
    finally:
        for n, args in swapped:
            n.args = args
    return "# v4flash compiled graph (torch.fx source)\n" + _format_import_block(code.globals, sys_importer) + \
        "\n" + code.src


def graph_from_source(text: str):
    from torch.fx.graph_module import _forward_from_src

    if "torch.ops.v4flash." in text:  # the NKI kernels as custom ops: registered for the active ops backend
        from v4flash_backend.ops import kernel_ops

        kernel_ops.ensure()

    forward = _forward_from_src(text, {})

    def run(*args):
        return forward(None, *args)

    run.forward = forward  # forward(self, *inputs): the source as a module's method (the Neuron route)
    return run


@dataclass
class ArtifactSource:
    """What `compile_step` asks for each graph it traces, on a server with compiled_artifacts: the
    artifact of its key (loaded: `loaded` counts them), else a compile (compile_on_miss; `missed`) or
    an `ArtifactError` naming the graph."""

    store: ArtifactStore
    roles: dict  # {process-group name: role} of this rank (parallel.collectives.group_roles)
    compile_on_miss: bool = True
    loaded: int = 0
    missed: list = field(default_factory=list)
    seconds: float = 0.0
    bound: int = 0  # of `loaded`: bound by name and called without dynamo (`bind`)

    def bind(self, name: str, fn, express, wrap) -> dict | None:
        """Graph `name`'s artifact bound as the express call of `express` (a `trn2.express.Express` of
        the traced function `fn`) on this process's objects, wrapped by `wrap(graph, binding)`: no
        trace. Returns the binding, or None where the manifest has none for `name` (the caller then
        traces it and looks it up by key). A binding that does not fit this server (an input that is
        gone or has another shape) is refused naming the graph and the input, or, with
        compile_on_miss, left to the trace."""
        from .binding import scope_of

        rec = self.store.manifest.bindings.get(name)
        if rec is None or not self.store.has(rec["key"]) or not self.store.manifest.graphs[rec["key"]].get("artifact"):
            return None
        t0 = time.perf_counter()
        try:
            express.bind(rec, scope_of(fn), wrap(self.store.load_bound(rec["key"], self.roles, rec), rec))
        except LookupError as e:
            if not self.compile_on_miss:
                raise ArtifactError(f"graph {name!r} (key {rec['key']}) in {self.store.path} does not bind on this "
                                    f"server: {e}; rerun `python -m v4flash_backend compile` with this server's "
                                    "settings, or set compile_on_miss") from e
            self.missed.append(name)
            return None
        self.loaded += 1
        self.bound += 1
        self.seconds += time.perf_counter() - t0
        return rec

    def resolve(self, name: str, key: str, compile_fn, gm=None, example_inputs=None):
        """The compiled callable of graph `name` (key `key`); compile_fn() compiles it."""
        if self.store.has(key):
            t0 = time.perf_counter()
            g = self.store.manifest.graphs[key]
            # the Neuron route: the backend finds the NEFF in the persistent cache the compile filled
            out = self.store.load_graph(key, self.roles) if g.get("artifact") and not g.get("neff") else compile_fn()
            self.loaded += 1
            self.seconds += time.perf_counter() - t0
            return out
        if not self.compile_on_miss:
            raise ArtifactError(f"graph {name!r} (key {key}) is not among the compiled artifacts in {self.store.path} "
                                f"(compiled for {len(self.store.manifest.graphs)} graphs): rerun `python -m "
                                "v4flash_backend compile` with this server's settings, or set compile_on_miss")
        self.missed.append(name)
        return compile_fn()
