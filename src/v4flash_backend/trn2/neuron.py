"""The Neuron (trn2) launch path of the static decode step, by name: this module re-exports the
modules it was split into, so `from v4flash_backend.trn2.neuron import X` keeps working.

- `launch`: `NeuronSettings` / `neuron_env` / `apply_env` (torch-free), the Neuron view of `Settings`
  and the environment of one rank of a Neuron launch.
- `compiler`: `compile_step` (torch.compile through a backend that refuses host syncs, then Neuron).
- `graphs`: the buckets and `StaticGraphs` (compiled graphs per bucket, warm-up).
- `static_runner`: `StaticRunner` (the engine's runner over those graphs; it runs on CPU in the
  tests) and `place_resident`.
- `round_plan`: the typed round plan and read-back (`RoundPlan`, `RoundResult`).
"""

from __future__ import annotations

# the names importable from here before the split (group.build, checks, tests, perf import them)
from .compiler import (  # noqa: F401
    COMPILER_ARGS,
    NEURON_BACKENDS,
    CompileStats,
    HostSyncInGraph,
    compile_step,
    import_neuron,
)
from .graphs import (  # noqa: F401
    MAX_PREFILL_ROWS,
    PROC_INPUTS,
    StaticGraphs,
    decode_buckets,
    prefill_buckets,
    startup_graphs,
    to_device,
)
from .launch import NeuronSettings, apply_env, neuron_env  # noqa: F401 - the Neuron launch (settings -> env)
from .round_plan import SPS_WIDTH, RoundPlan, adaptive_inputs, pad_sps  # noqa: F401
from .static_runner import StaticRunner, place_resident  # noqa: F401
from .static_step import Bucket  # noqa: F401
