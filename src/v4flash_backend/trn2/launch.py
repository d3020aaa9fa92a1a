"""The Neuron launch: what one rank of a trn2 rank group needs in its environment, from `Settings`.

Standard library only: `group.rank_entry` applies it before the rank imports torch, because PyTorch
loads torch_neuronx by itself on `import torch` ("PyTorch loads torch_neuronx automatically when you
import torch", https://awsdocs-neuron.readthedocs-hosted.com/en/latest/torch/reference/api/torch-neuron-module.html),
and the runtime and compiler read these variables from the process environment.

- NEURON_CC_FLAGS: the neuronx-cc flags. The `neuron` torch.compile backend takes no compiler_args;
  "a Neuron framework plugin ... invokes the compiler for you and forwards options through the
  NEURON_CC_FLAGS environment variable"
  (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/compiler/about-neuronx-cc.html).
- NEURON_LOGICAL_NC_CONFIG (and V4FLASH_NKI_GRID, which ops/nki_ops.py `_grid` reads first): one LNC
  degree for the runtime, the compiler's --lnc and the NKI kernels' launch grid; "AWS Neuron currently
  doesn't support setting the compiler flag to a different LNC configuration than the Neuron Runtime
  environment variable"
  (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/general/arch/neuron-features/logical-neuroncore-config.html),
  and a kernel whose LNC differs from neuronx-cc's fails the compile
  (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/compiler/error-codes/EVRF066.html).
- NEURON_RT_VISIBLE_CORES = the local rank: by default the runtime reserves every core for the first
  process; "NEURON_RT_VISIBLE_CORES can be used to control which NeuronCores each process would
  reserve" (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/neuron-runtime/guides/configuration-guide.html).
  torchrun starts the ranks of a node with one environment and LOCAL_RANK set per rank, as the
  TorchNeuron guide's launch does
  (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/torch/guides/torch-distributed.html), so the
  core is picked per process from LOCAL_RANK. At LNC=2 a trn2.48xlarge shows 64 logical cores: ranks
  0..63 of a node take cores 0..63.
- The compile caches (TORCH_NEURONX_NEFF_CACHE_DIR and the HLO / neuronx-cc caches) under
  `neuron_cache_dir`: a restart loads NEFFs instead of compiling
  (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/compiler/about-compiler-artifacts.html).
- TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION=1: a graph that fails to compile fails the start instead
  of running op by op (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/torch/reference/env-vars.html).

`NeuronSettings` is the view of these settings the compile path (`trn2.compiler.compile_step`,
`StaticGraphs`) takes; `NeuronSettings.from_settings` builds it, its defaults are those of `Settings`.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass

from v4flash_backend.settings import Settings
from v4flash_backend.settings_values import flag_lnc

# neuronx-cc arguments of the served graphs (the port's set): trn2 target, transformer model type, -O1,
# no automatic down-casting (the kernels' numerics are fp32 where the reference is), and e4m3fn
# checkpoint bytes read as e4m3 (trn2's engines have no e4m3fn). The --lnc flag is added from neuron_lnc.
# --native-int64=enabled: the Engram n-gram hash is the official reference's 64-bit multiply-xor
# (model/engram_hash.py, 63-bit multipliers); by default neuronx-cc downcasts int64 ops to int32,
# which would change its table rows. The compiler CLI reference lists `--native-int64 <mode>`
# (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/compiler/neuronx-cc/api-reference-guide/index.html)
# and the 2.32 compiler release notes say it runs int64 ops natively without precision loss on trn2.
# checks/trn2.py's dtype rule accepts wide int64 values only with this flag.
BASE_COMPILER_ARGS = (
    "--target=trn2",
    "--model-type=transformer",
    "-O1",
    "--auto-cast=none",
    "--native-int64=enabled",
    "--enable-fast-loading-neuron-binaries",
    "--internal-hlo2tensorizer-options=--experimental-unsafe-fp8e4m3fn-as-fp8e4m3",
)
FP8_FLAG = "--experimental-unsafe-fp8e4m3fn-as-fp8e4m3"


def cc_flags(lnc: int, override: str = "", extra: str = "") -> tuple[str, ...]:
    """The neuronx-cc flags: `override` (or the built-in set) with --lnc=<lnc> when it names none, then
    `extra`. A flag string naming another LNC degree is refused (Settings does the same check)."""
    base = shlex.split(override) if override.strip() else list(BASE_COMPILER_ARGS)
    if flag_lnc(shlex.join(base)) is None:
        base.insert(1 if base and base[0].startswith("--target") else 0, f"--lnc={lnc}")
    args = tuple(base) + tuple(shlex.split(extra))
    named = flag_lnc(shlex.join(args))
    if named != lnc:
        raise ValueError(f"compiler flags give --lnc={named} but the LNC degree is {lnc}")
    return args


_DEFAULTS = Settings(ops_backend="nki")  # the Neuron launch's defaults, from the one schema


@dataclass(frozen=True)
class NeuronSettings:
    """The Neuron view of `Settings`: what the compile path and a rank's environment need."""

    lnc: int = _DEFAULTS.neuron_lnc
    backend: str = _DEFAULTS.graph_backend_name  # torch.compile backend: neuron | neuron_libtorch | eager | none
    compiler_args: tuple[str, ...] | None = None  # None: the built-in set at `lnc`
    cache_dir: str = _DEFAULTS.neuron_cache_dir
    dist_backend: str = "neuron"  # torch.distributed backend of a Neuron launch (Settings.dist_backend empty)
    pin_core: bool = _DEFAULTS.neuron_pin_cores  # NEURON_RT_VISIBLE_CORES = the local rank
    # dynamo's guards on every graph call (True), or once, then the compiled graph directly while the
    # arguments and global state match (trn2.express: what the graphs capture is resident)
    guard_every_call: bool = False
    # the NEFF cache the compile command filled (compiled_artifacts/neff, trn2.artifacts), read instead of
    # neuron_cache_dir's; empty: neuron_cache_dir's
    neff_dir: str = ""

    def __post_init__(self):
        if self.compiler_args is None:
            object.__setattr__(self, "compiler_args", cc_flags(self.lnc))
        else:
            object.__setattr__(self, "compiler_args", tuple(self.compiler_args))

    @classmethod
    def from_settings(cls, s: Settings) -> "NeuronSettings":
        return cls(lnc=s.neuron_lnc, backend=s.graph_backend_name,
                   compiler_args=cc_flags(s.neuron_lnc, s.neuron_cc_flags_override, s.neuron_cc_flags),
                   cache_dir=s.neuron_cache_dir, dist_backend=s.dist_backend or "neuron", pin_core=s.neuron_pin_cores,
                   neff_dir=os.path.join(s.compiled_artifacts, "neff") if s.compiled_artifacts else "")


def cache_dirs(cache_dir: str, neff_dir: str = "") -> dict[str, str]:
    return {"TORCH_NEURONX_NEFF_CACHE_DIR": neff_dir or os.path.join(cache_dir, "neff"),
            "TORCH_NEURONX_HLO_CACHE_DIR": os.path.join(cache_dir, "hlo"),
            "NEURON_COMPILE_CACHE_URL": os.path.join(cache_dir, "neuronx-cc")}


def neuron_env(s: NeuronSettings | Settings, local_rank: int | None = None) -> dict[str, str]:
    """The environment of one rank of a Neuron launch (`s`: the settings or their Neuron view;
    `local_rank`: the rank's index on its node, None: no core pinning)."""
    if isinstance(s, Settings):
        s = NeuronSettings.from_settings(s)
    env = {
        "NEURON_LOGICAL_NC_CONFIG": str(s.lnc),
        "NEURON_RT_VIRTUAL_CORE_SIZE": str(s.lnc),  # the runtime's older name of the same setting
        "V4FLASH_NKI_GRID": str(s.lnc),  # the kernels' launch grid = the LNC degree
        "NEURON_PLATFORM_TARGET_OVERRIDE": "trn2",
        "NEURON_CC_FLAGS": shlex.join(s.compiler_args),
        **cache_dirs(s.cache_dir, s.neff_dir),
        "TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION": "1",
        "V4FLASH_OPS": "nki",
        "V4FLASH_NUMERICS": "reference",  # no fp64 on a NeuronCore
        "V4FLASH_DIST_BACKEND": s.dist_backend,
    }
    if s.pin_core and local_rank is not None:
        env["NEURON_RT_VISIBLE_CORES"] = str(local_rank)
    return env


def rank_environment(settings: Settings, local_rank: int) -> dict[str, str]:
    """What a rank of this launch adds to its environment: `neuron_env` for a Neuron launch
    (ops_backend nki), nothing on the CPU backends."""
    if settings.ops_backend != "nki":
        return {}
    return neuron_env(settings, local_rank)


def apply_env(s: NeuronSettings | Settings, environ=None, local_rank: int | None = None,
              overwrite: bool = False) -> dict[str, str]:
    """Put `neuron_env` into `environ` (default os.environ) and create the cache directories.
    overwrite False: values already set win (a test or a hand-started rank). Returns what was set."""
    environ = os.environ if environ is None else environ
    if isinstance(s, Settings):
        s = NeuronSettings.from_settings(s)
    added = {k: v for k, v in neuron_env(s, local_rank).items() if overwrite or k not in environ}
    environ.update(added)
    for d in cache_dirs(s.cache_dir, s.neff_dir).values():
        os.makedirs(d, exist_ok=True)
    return added


def env_mismatch(settings: Settings, environ, local_rank: int) -> dict[str, tuple[str | None, str]]:
    """{variable: (found, wanted)} where `environ` differs from this rank's environment: a rank that
    was started without `group.rank_entry` (e.g. `torchrun -m v4flash_backend.group.worker` by hand)."""
    return {k: (environ.get(k), v) for k, v in rank_environment(settings, local_rank).items()
            if environ.get(k) != v}
