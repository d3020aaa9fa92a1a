"""The one settings schema: every serving, rank-group and engine setting is declared here once,
with its default, its validation and its doc line.

Everything else is derived from `Settings`:
- config.pbtxt: `Settings.from_params` parses the model's string parameters (every setting is a
  parameter under its own name; `dspark` is kept as the on/off alias of `spec_mode`);
- the worker and CLI flags: `add_arguments` generates `--max-num-seqs`-style flags (plus the
  short legacy spellings listed in `flags`), `from_args` reads them back;
- the rank-group launch: rank 0 and its followers receive the settings as one JSON object
  (`to_json` / `from_json`, the way vllm_backend hands its engine args over);
- the parameter table of docs/settings.md (`markdown_table`; tests/test_settings.py compares the two);
- the Neuron launch (`trn2.launch`): every rank's environment (NEURON_CC_FLAGS, NEURON_LOGICAL_NC_CONFIG,
  NEURON_RT_VISIBLE_CORES, the compile caches) comes from the `neuron_*` fields.

A few settings name an environment variable (`env=`) that overrides them: `with_env_overrides` is the
one place those variables are read (by `group.rank_entry`, before a rank imports torch); `env_setting`
gives one field the same reading for a process started without `Settings` (golden-check, the checks
under torchrun, the test ranks: $V4FLASH_PIPELINE, $V4FLASH_THREADS, $V4FLASH_DIST_BACKEND).

Four variables are read elsewhere, as process defaults below the settings:
- V4FLASH_OPS and V4FLASH_NUMERICS (ops/__init__.py, at import): the op seam's backend and numerics
  for a process that never calls `ops.set_backend` / `ops.set_numerics`; a rank sets the backend
  from ops_backend, and the numerics from numerics when it is non-empty (trn2.launch also sets both
  variables in a Neuron rank's environment);
- V4FLASH_ATTN_GROUP (parallel/collectives.py `init_distributed`): the attention group size, over
  the checkpoint's bound; a test knob (several groups at W = 4), not a setting;
- V4FLASH_CPU_DECODE_GRAPH (`Settings.decode_graph_mode`): what an empty decode_graph means on a
  one-rank CPU server (static, the default: the compiled round graphs; eager: the op-by-op forward).
  Only the default moves, an explicit decode_graph wins: the test suite sets it to eager, so the
  servers of the tests that do not test the compiled path do not compile for minutes on CI's cores.

Adding a setting = adding one field below (see docs/settings.md, "Adding a setting").
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import Any

# a field's value from text, JSON or Python, checked; the LNC degree a flag string names
from .settings_values import _PY_TYPES, _coerce, _parse, _parse_bool, flag_lnc

OPS_BACKENDS = ("torch", "nki", "nki-sim")
LAUNCHERS = ("torchrun", "inprocess")
SPEC_MODES = ("dspark", "fixed", "off")
NUMERICS = ("", "exact", "reference")
DECODE_GRAPHS = ("", "eager", "static")
GRAPH_BACKENDS = ("", "none", "eager", "aot_eager", "inductor", "neuron", "neuron_libtorch")
# the CPU default of decode_graph on one rank: the static round graphs compiled by inductor, compiled in
# the background while eager steps serve (perf/bench_decode.py: 5-6x the eager path's decode tokens/s);
# $V4FLASH_CPU_DECODE_GRAPH moves it (settings module docstring)
CPU_DECODE_GRAPH = "static"
GRAPH_WARMUPS = ("", "start", "background")

def setting(default, doc: str, *, scope: str, choices: tuple | None = None, low: float | None = None,
            positive: bool = False, path: bool = False, flags: tuple[str, ...] = (), env: str = ""):
    """A field of `Settings`. scope: who reads it (serving = the Triton model, group = every rank
    of the rank group, engine = rank 0's engine). path: a filesystem path (relative values start
    at the model repository root when read from config.pbtxt). flags: extra CLI spellings. env: an
    environment variable that overrides the value when set and non-empty (`with_env_overrides`)."""
    return field(default=default, metadata=dict(doc=doc, scope=scope, choices=choices, low=low,
                                                 positive=positive, path=path, flags=flags, env=env))


@dataclass(frozen=True)
class Settings:
    # ---- serving: the Triton model -------------------------------------------------------------
    checkpoint_dir: str = setting(
        "", "checkpoint directory in the official layout; empty: $V4FLASH_CHECKPOINT_DIR, else the "
        "embedded default models/v4flash-tiny", scope="serving", path=True, flags=("--checkpoint",))
    launcher: str = setting(
        "torchrun", "torchrun: the rank group as a child process group; inprocess: the engine on a "
        "thread of the Triton stub (world_size 1)", scope="serving", choices=LAUNCHERS)
    rank_group_address: str = setting(
        "", "host:port of an externally started rank group (multi-node); empty: launch one", scope="serving")
    startup_timeout_s: float = setting(
        900.0, "seconds the rank group may take to load and report ready", scope="serving", positive=True)
    default_max_tokens: int = setting(64, "max_tokens of a request that gives none", scope="serving", low=1)
    tokenizer_dir: str = setting(
        "", "tokenizer.json (or its directory) for text_input; empty: the checkpoint's", scope="serving",
        path=True)
    add_special_tokens: bool = setting(True, "tokenize text_input with BOS", scope="serving")
    skip_special_tokens: bool = setting(True, "leave special tokens out of text_output", scope="serving")
    stats_interval_s: float = setting(
        0.5, "seconds between refreshes of the KV-slot gauge", scope="serving", positive=True)
    # ---- group: every rank ---------------------------------------------------------------------
    world_size: int = setting(1, "ranks of the torchrun group (64 on trn2.48xlarge at LNC=2)", scope="group", low=1)
    pipeline_parallel: int = setting(
        1, "pipeline stages: world_size / pipeline_parallel consecutive ranks per stage (one node each "
        "across nodes), the layers split into contiguous stages; eager decode only", scope="group", low=1,
        env="V4FLASH_PIPELINE")
    pipeline_micro_batches: int = setting(
        1, "with pipeline_parallel > 1: a forward of several sequences runs as this many micro-batches so "
        "stages overlap inside a step (see docs/architecture.md's pipeline section for the measured effect)",
        scope="group", low=1)
    sequence_parallel: bool = setting(
        False, "prefill chunks of at least as many rows as the attention group split their rows across "
        "it for per-token work (wo_b reduce-scatter, all-gathers before attention, MoE and a stage send)",
        scope="group")
    ops_backend: str = setting(
        "torch", "op backend: torch (CPU reference), nki (Neuron devices), nki-sim (NKI kernels on the "
        "CPU simulator)", scope="group", choices=OPS_BACKENDS, flags=("--ops",))
    numerics: str = setting(
        "", "exact (fp64 accumulation: W- and batch-invariant) or reference; empty: $V4FLASH_NUMERICS, "
        "else exact", scope="group", choices=NUMERICS)
    dist_backend: str = setting(
        "", "torch.distributed backend; empty: neuron on a Neuron launch (ops_backend nki), else gloo",
        scope="group", flags=("--backend",), env="V4FLASH_DIST_BACKEND")
    collective_timeout_s: float = setting(
        60.0, "a collective waiting longer than this ends the rank (a dead or hung peer)", scope="group",
        positive=True, flags=("--timeout-s",))
    heartbeat_s: float = setting(
        2.0, "idle plan interval of rank 0 (below half the collective timeout)", scope="group", positive=True)
    plan_size: int = setting(2048, "initial int64 slots of a step plan (grows on demand)", scope="group", low=16)
    threads: int = setting(1, "torch threads per rank", scope="group", low=1, env="V4FLASH_THREADS")
    decode_graph: str = setting(
        "", "decode steps as the static round graphs per bucket (static) or the op-by-op forward (eager); "
        "empty: static when ops_backend is nki; with ops_backend torch on one rank (world_size and "
        "pipeline_parallel 1) static compiled by inductor ($V4FLASH_CPU_DECODE_GRAPH=eager: eager); else eager",
        scope="group", choices=DECODE_GRAPHS)
    graph_backend: str = setting(
        "", "torch.compile backend of the static graphs (none: run them op by op); empty: neuron when "
        "ops_backend is nki, inductor when decode_graph is empty too and resolves to static on the CPU, "
        "else none", scope="group", choices=GRAPH_BACKENDS, env="V4FLASH_NEURON_BACKEND")
    graph_warmup: str = setting(
        "", "when a static server compiles its graphs: start (every bucket before it reports ready) or "
        "background (ready at once: eager steps serve while a thread compiles graph sets that take over as "
        "they get warm -- the smallest decode bucket's plain-decode round, then its drafting round, then the "
        "largest bucket's plain-decode round; the other drafting rounds, the buckets between, "
        "logit-processing rounds, forward and prefill graphs when a step first needs them; one rank only); "
        "empty: background on a one-rank CPU server whose "
        "graph_backend compiles, else start", scope="group",
        choices=GRAPH_WARMUPS)
    resident_device: str = setting(
        "", "where a static server keeps its weights and caches (place_resident, once at load); empty: the "
        "rank's NeuronCore with ops_backend nki, else the CPU; 'cuda' runs the static rounds with the torch "
        "ops on an NVIDIA GPU, the stand-in accelerator of `device-standin` (checks/standin.py)",
        scope="group")
    count_host_syncs: bool = setting(
        False, "eager decode: count the host syncs of every forward (the engine stats' "
        "host_syncs_per_step; a hook on every torch call, 30-40 % of a CPU forward; `generate "
        "--step-report` turns it on); the static path counts its own either way", scope="group")
    warm_processed: bool = setting(
        True, "compile the round graphs' logit-processing variant (min_tokens, penalties, log-probs, top-k / "
        "top-p) at start; false: at its first use", scope="group")
    compiled_artifacts: str = setting(
        "", "directory of the static graphs compiled ahead of time (`python -m v4flash_backend compile`; its "
        "manifest.json): every rank loads its graphs from it by graph key and compiles none; empty: compile at "
        "start", scope="group", path=True, env="V4FLASH_COMPILED_ARTIFACTS")
    compile_on_miss: bool = setting(
        True, "with compiled_artifacts: compile a graph the artifacts lack (true), or refuse to start, naming "
        "it (false: the Neuron image)", scope="group")
    warmup_timeout_s: float = setting(
        3600.0, "a static group's warm-up: how long a rank waits at the control-plane barrier for every rank to "
        "have compiled or loaded its graphs, and the collective timeout while they first run (after it: "
        "collective_timeout_s)", scope="group", positive=True)
    # ---- group, Neuron launch (ops_backend nki): every rank's environment (trn2/launch.py) -------
    neuron_lnc: int = setting(
        2, "logical NeuronCore degree: every rank's NEURON_LOGICAL_NC_CONFIG, neuronx-cc's --lnc and the NKI "
        "kernels' launch grid (they must agree); 2 on trn2: 64 ranks on a trn2.48xlarge", scope="group",
        choices=(1, 2), env="NEURON_LOGICAL_NC_CONFIG")
    neuron_cc_flags: str = setting(
        "", "neuronx-cc flags appended to the built-in set (--lnc, --auto-cast=none, the fp8 e4m3fn-as-e4m3 "
        "flag, -O1, ...) in every rank's NEURON_CC_FLAGS", scope="group")
    neuron_cc_flags_override: str = setting(
        "", "a neuronx-cc flag string that replaces the built-in set (neuron_cc_flags is still appended, "
        "--lnc=neuron_lnc is added when it names none); empty: the built-in set", scope="group",
        env="NEURON_CC_FLAGS")
    neuron_cache_dir: str = setting(
        "/var/cache/v4flash/neuron", "persistent compile cache of a Neuron launch (the NEFF, HLO and neuronx-cc "
        "caches below it): a restart loads the compiled graphs instead of compiling them", scope="group",
        path=True, env="V4FLASH_NEURON_CACHE")
    neuron_pin_cores: bool = setting(
        True, "a Neuron launch shows each rank only its own logical NeuronCore (NEURON_RT_VISIBLE_CORES = "
        "its local rank); false: the runtime's default placement", scope="group")
    # ---- engine: rank 0 ------------------------------------------------------------------------
    max_num_seqs: int = setting(8, "KV slots: requests decoded together", scope="engine", low=1)
    max_model_len: int = setting(1024, "prompt + generated tokens per request", scope="engine", low=2)
    prefill_chunk: int = setting(256, "prompt tokens of one request per step (segmented prefill)",
                                 scope="engine", low=1)
    step_token_budget: int = setting(1024, "prefill tokens per step across requests", scope="engine", low=1)
    spec_mode: str = setting(
        "dspark", "dspark (confidence + admit), fixed (verify fixed_len drafts) or off; config.pbtxt's "
        "dspark true/false is the same switch", scope="engine", choices=SPEC_MODES)
    fixed_len: int = setting(5, "drafts verified per step in spec_mode fixed", scope="engine", low=1)
    sps_path: str = setting(
        "", "the engine's step-cost profile (forward by B tokens, draft stages by R requests): loaded if "
        "present, else profiled and saved; empty: profile at start",
        scope="engine", path=True)
    dspark_adaptive: bool = setting(
        True, "admit with the calibrated confidence head and the whole step's cost, and skip the draft "
        "stages where drafting does not pay (probing every probe_every steps); on eager steps and in the "
        "static rounds alike (same tokens for the same seed); a static server then also compiles the "
        "plain-decode graphs at start", scope="engine")
    probe_every: int = setting(16, "steps between probes (one draft verified) while speculation steps aside (at "
                               "least enough that probes take <= 1 % of plain decoding's time, by the step cost)",
                               scope="engine", low=1)
    probe_max_every: int = setting(
        1024, "the gap between probes doubles after each probe that leaves speculation aside, up to this "
        "many steps (back to probe_every once drafting pays); at most probe_every: no back-off",
        scope="engine", low=1)
    step_cost_online: bool = setting(
        True, "learn the step cost from every measured decode step (the start-up profile is the prior; "
        "per decode path, windowed medians, outliers damped) and guard DSpark's admission against "
        "fixed_len drafting per temperature regime", scope="engine")
    calibration_online: bool = setting(
        True, "keep the DSpark confidence head's calibration current from the acceptances observed "
        "(per temperature regime)", scope="engine")
    calibration_path: str = setting(
        "", "STS calibration (temperature and shift per position) of the confidence head; empty: the "
        "checkpoint's dspark_calibration.json if present", scope="engine", path=True)
    prefix_cache_bytes: int = setting(
        512 << 20, "prefix cache budget in bytes per rank: the state at every prefill chunk's end is kept "
        "(least recently used entries go first) and a request starting with a cached prefix prefills only "
        "the rest, with the same tokens (exact numerics only); 0: off", scope="engine", low=0)
    queue_timeout_s: float = setting(
        120.0, "a request waiting longer than this for a KV slot is failed with UNAVAILABLE",
        scope="engine", low=0.0)
    max_queue_size: int = setting(
        64, "requests that may wait for a KV slot beyond the free ones; one more is refused at once "
        "with UNAVAILABLE (server at capacity) instead of queueing without bound", scope="engine", low=0)
    # ---- deployment: secrets and writable state (issue 34) ----------------------------------------
    group_secret_file: str = setting(
        "", "file (mode 600) holding the rank group's shared secret: the workers require it of every socket "
        "client, the client (rank_group_address) proves it; empty: $V4FLASH_GROUP_SECRET_FILE, else "
        "$V4FLASH_GROUP_SECRET, else none (the socket then only listens on loopback); a launched group "
        "generates its own", scope="group", path=True)
    state_dir: str = setting(
        "", "writable directory for the engine's own files (the step-cost profile when sps_path is empty, "
        "reused by later starts), so the checkpoint and model repository can be mounted read-only; "
        "empty: $V4FLASH_STATE_DIR (the images set it), else nothing is written (the profile is taken at "
        "every start)", scope="engine", path=True)

    def __post_init__(self):
        for f in fields(self):
            object.__setattr__(self, f.name, _coerce(f, getattr(self, f.name)))
        if self.launcher == "inprocess" and self.world_size != 1:
            raise ValueError("setting 'launcher' inprocess runs one rank: set world_size to 1")
        if self.world_size % self.pipeline_parallel:
            raise ValueError(f"setting 'world_size' {self.world_size} must be a multiple of pipeline_parallel "
                             f"{self.pipeline_parallel}")
        if self.graph_warmup == "background" and (self.world_size > 1 or self.pipeline_parallel > 1):
            raise ValueError("setting 'graph_warmup' background compiles beside the serving steps of one rank: "
                             "a rank group of several ranks runs every graph as a collective, so set "
                             "graph_warmup start (or world_size 1)")
        if self.pipeline_parallel > 1 and self.decode_graph_mode == "static":
            raise ValueError("setting 'pipeline_parallel' > 1 runs the eager decode path: set decode_graph eager "
                             "(the static round graphs hold the whole model)")
        if self.resident_device not in ("", "cpu") and self.decode_graph_mode != "static":
            raise ValueError(f"setting 'resident_device' {self.resident_device!r} places the static path's weights "
                             "and caches: set decode_graph static")
        if not self.heartbeat_s < self.collective_timeout_s / 2:
            raise ValueError("setting 'heartbeat_s' must be below half of collective_timeout_s "
                             "(idle followers wait for it)")
        for name in ("neuron_cc_flags_override", "neuron_cc_flags"):
            lnc = flag_lnc(getattr(self, name), name)
            if lnc is not None and lnc != self.neuron_lnc:
                # neuronx-cc and the runtime must use one LNC degree, and the NKI kernels' grid with them
                # (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/compiler/error-codes/EVRF066.html)
                raise ValueError(f"setting {name!r} gives --lnc={lnc} but neuron_lnc is {self.neuron_lnc}: "
                                 "the compiler, the runtime and the kernels must use one LNC degree")

    # ---- derived views --------------------------------------------------------------------------
    @property
    def dspark(self) -> bool:
        return self.spec_mode != "off"

    @property
    def decode_graph_mode(self) -> str:
        """decode_graph with its default resolved (static on Neuron devices)."""
        if self.decode_graph:
            return self.decode_graph
        if self.ops_backend == "nki":
            return "static"
        if self._cpu_default_graph:
            return os.environ.get("V4FLASH_CPU_DECODE_GRAPH", "") or CPU_DECODE_GRAPH
        return "eager"

    @property
    def _cpu_default_graph(self) -> bool:
        """Does an empty decode_graph take the CPU default (the torch ops on one rank)? A CPU rank
        group of several ranks is a development layout: compiling each rank's graphs at start costs
        minutes there, so it keeps the eager path unless asked."""
        return not self.decode_graph and self._one_cpu_rank

    @property
    def _one_cpu_rank(self) -> bool:
        return self.ops_backend == "torch" and self.world_size == 1 and self.pipeline_parallel == 1

    @property
    def graph_warmup_mode(self) -> str:
        """graph_warmup with its default resolved: background on a one-rank CPU server whose graphs
        compile (ready at once), start elsewhere (a Neuron server: its graphs come from the persistent
        cache or compiled_artifacts, and a group's graphs run as collectives)."""
        if self.graph_warmup:
            return self.graph_warmup
        background = (self._one_cpu_rank and self.decode_graph_mode == "static" and self.graph_backend_name != "none"
                      and not self.compiled_artifacts)
        return "background" if background else "start"

    @property
    def sps_file(self) -> str:
        """Where the step-cost profile is loaded from and saved: sps_path, else a file in state_dir
        ($V4FLASH_STATE_DIR when empty) named by what the profile depends on (checkpoint, op and
        graph backends, ranks, slots, mode), else "" (not saved)."""
        import hashlib
        import os

        state_dir = self.state_dir or os.environ.get("V4FLASH_STATE_DIR", "")
        if self.sps_path or not state_dir:
            return self.sps_path

        key = "|".join(map(str, (os.path.realpath(self.checkpoint_dir or "."), self.ops_backend, self.decode_graph_mode,
                                 self.graph_backend_name, self.world_size, self.pipeline_parallel,
                                 self.max_num_seqs, self.spec_mode)))
        return os.path.join(state_dir, f"sps-{hashlib.sha1(key.encode()).hexdigest()[:16]}.json")

    @property
    def graph_backend_name(self) -> str:
        if self.graph_backend:
            return self.graph_backend
        if self.ops_backend == "nki":
            return "neuron"
        # the CPU default path (decode_graph empty, resolved to static) is the compiled one; a static
        # path asked for by name keeps running its graphs op by op unless a backend is named
        return "inductor" if self._cpu_default_graph and self.decode_graph_mode == "static" else "none"

    def replace(self, **changes) -> "Settings":
        return replace(self, **changes)

    def with_env_overrides(self, environ=None) -> "Settings":
        """These settings with every `env=` variable that is set and non-empty in `environ` (default
        os.environ) applied: the one place the documented override variables are read."""
        import os

        environ = os.environ if environ is None else environ
        changes = {f.name: env_setting(f.name, environ) for f in fields(self)
                   if f.metadata["env"] and environ.get(f.metadata["env"], "").strip()}
        return replace(self, **changes) if changes else self

    # ---- config.pbtxt ---------------------------------------------------------------------------
    @classmethod
    def from_params(cls, params: dict[str, str], resolve_path=None) -> tuple["Settings", dict[str, str]]:
        """Settings from config.pbtxt string parameters, and the parameters it does not know.
        Empty values keep the default; `resolve_path(value) -> str` maps path settings."""
        values: dict[str, Any] = {}
        by_name = {f.name: f for f in fields(cls)}
        unknown = {}
        for key, raw in params.items():
            if key == "dspark":  # the on/off spelling of spec_mode
                if raw.strip():
                    values.setdefault("spec_mode", "dspark" if _parse_bool(key, raw) else "off")
                continue
            f = by_name.get(key)
            if f is None:
                unknown[key] = raw
                continue
            if not raw.strip():
                continue
            value = _parse(f, raw)
            if f.metadata["path"] and resolve_path is not None:
                value = str(resolve_path(value))
            values[key] = value
        if "spec_mode" in params and params["spec_mode"].strip():
            values["spec_mode"] = _parse(by_name["spec_mode"], params["spec_mode"])
        return cls(**values), unknown

    # ---- the wire form to the rank group ----------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "Settings":
        obj = json.loads(text)
        if not isinstance(obj, dict):
            raise ValueError("settings JSON must be an object")
        unknown = sorted(set(obj) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown setting(s) {', '.join(unknown)}")
        return cls(**obj)

    # ---- command-line flags ---------------------------------------------------------------------
    @classmethod
    def add_arguments(cls, ap: argparse.ArgumentParser, scopes=("group", "engine"), extra=(), skip=()) -> None:
        """Flags for the settings of `scopes` and the `extra` names, less `skip` (defaults None:
        unset flags keep the base settings' values, see `from_args`)."""
        for f in fields(cls):
            if (f.metadata["scope"] not in scopes and f.name not in extra) or f.name in skip:
                continue
            names = ["--" + f.name.replace("_", "-"), *f.metadata["flags"]]
            # argparse formats help strings with %: the docs' "3 %" must read as text
            doc = f"{f.metadata['doc']} (default {f.default!r})".replace("%", "%%")
            kw: dict[str, Any] = dict(dest=f.name, default=None, help=doc)
            if f.type in ("bool", bool):
                kw["type"] = lambda raw, _k=f.name: _parse_bool(_k, raw)
            else:
                kw["type"] = _PY_TYPES[str(f.type)]
                if f.metadata["choices"]:
                    kw["choices"] = list(f.metadata["choices"])
            ap.add_argument(*names, **kw)

    @classmethod
    def from_args(cls, ns: argparse.Namespace, base: "Settings | None" = None) -> "Settings":
        """`base` (or the defaults) with the flags that were given."""
        given = {f.name: getattr(ns, f.name) for f in fields(cls) if getattr(ns, f.name, None) is not None}
        return replace(base, **given) if base is not None else cls(**given)

    # ---- documentation --------------------------------------------------------------------------
    @classmethod
    def markdown_table(cls) -> str:
        rows = ["| parameter | default | scope | what |", "|---|---|---|---|"]
        for f in fields(cls):
            default = f.default if f.default is not MISSING else ""
            if isinstance(default, bool):
                default = str(default).lower()
            choices = f.metadata["choices"]
            doc = f.metadata["doc"] + (f" ({' / '.join(str(c) for c in choices if c)})" if choices else "")
            if f.metadata["env"]:
                doc += f"; overridden by `${f.metadata['env']}` when set"
            rows.append(f"| `{f.name}` | `{default}` | {f.metadata['scope']} | {doc} |")
        return "\n".join(rows)


def default_of(name: str):
    """The declared default of setting `name`, for a module that needs that one value without a
    `Settings` (so the default is still written once, above)."""
    return Settings.__dataclass_fields__[name].default


def env_setting(name: str, environ=None):
    """Setting `name` as a process started without `Settings` sees it (golden-check and the checks
    under torchrun, the test ranks): its `env=` override when set and non-empty (parsed and checked
    like any value), else its default. The same reading as `with_env_overrides`, for one field, so
    the rest of the environment is not validated where it is not used."""
    import os

    environ = os.environ if environ is None else environ
    f = Settings.__dataclass_fields__[name]
    raw = environ.get(f.metadata["env"], "") if f.metadata["env"] else ""
    return _coerce(f, _parse(f, raw)) if raw.strip() else f.default
