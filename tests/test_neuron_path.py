"""The Neuron launch path (`trn2.launch`, `trn2.compiler`, `trn2.graphs`), exercised on CPU up to the
backend call.

- settings and environment: the port's compiler flags, LNC=2, the compile caches, the nki ops with
  'reference' numerics and the neuron torch.distributed backend, the view built from `Settings`
  (tests/test_neuron_launch.py: the served launch that applies them);
- the Neuron-only packages are imported on that path only (a fresh interpreter that imports the
  package, builds a StaticRunner and runs the engine has none of them loaded), and asking for the
  neuron backend without them fails with an install hint;
- compile_step refuses a graph with a host sync in it;
- warm-up compiles every bucket once (progress bar, no state change), later calls reuse the graphs;
- StaticRunner drives the engine: greedy DSpark generation equals the eager runner's token for token
  with 2 graph executions (verify + draft) per decode step.
"""

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from v4flash_backend import ops
from v4flash_backend.trn2.compiler import compile_step
from v4flash_backend.trn2.graphs import StaticGraphs, decode_buckets
from v4flash_backend.trn2.launch import NeuronSettings, apply_env, neuron_env
from v4flash_backend.trn2.static_runner import StaticRunner
from v4flash_backend.trn2.static_step import Bucket

REPO = Path(__file__).resolve().parents[1]


def test_settings_and_env_carry_the_port_flags(tmp_path):
    s = NeuronSettings(cache_dir=str(tmp_path / "cache"))
    for flag in ("--auto-cast=none", "-O1", "--lnc=2", "--model-type=transformer"):
        assert flag in s.compiler_args
    assert any("--experimental-unsafe-fp8e4m3fn-as-fp8e4m3" in a for a in s.compiler_args)
    env = neuron_env(s, local_rank=3)
    assert env["NEURON_LOGICAL_NC_CONFIG"] == "2" and env["NEURON_RT_VIRTUAL_CORE_SIZE"] == "2"
    assert "--auto-cast=none" in env["NEURON_CC_FLAGS"] and "-O1" in env["NEURON_CC_FLAGS"]
    assert env["TORCH_NEURONX_NEFF_CACHE_DIR"].startswith(str(tmp_path / "cache"))
    assert (env["V4FLASH_OPS"], env["V4FLASH_NUMERICS"], env["V4FLASH_DIST_BACKEND"]) == ("nki", "reference", "neuron")
    assert env["NEURON_RT_VISIBLE_CORES"] == "3"  # pinned by default (Settings.neuron_pin_cores)
    assert "NEURON_RT_VISIBLE_CORES" not in neuron_env(NeuronSettings(pin_core=False), 3)
    assert "NEURON_RT_VISIBLE_CORES" not in neuron_env(s)  # no local rank: nothing to pin
    environ = {"V4FLASH_OPS": "nki-sim"}
    added = apply_env(s, environ)
    assert environ["V4FLASH_OPS"] == "nki-sim" and "V4FLASH_OPS" not in added  # values already set win
    assert environ["NEURON_CC_FLAGS"] == env["NEURON_CC_FLAGS"] and (tmp_path / "cache").is_dir()


def test_the_neuron_view_comes_from_the_settings():
    """NeuronSettings is built from Settings (no schema of its own): the flags follow neuron_lnc, the
    override replaces the built-in set (getting --lnc when it names none), the extra flags are
    appended, and a flag string naming another LNC degree is refused."""
    from v4flash_backend.settings import Settings

    v = NeuronSettings.from_settings(Settings(ops_backend="nki"))
    assert v == NeuronSettings()  # the view's defaults are the schema's
    v = NeuronSettings.from_settings(Settings(
        ops_backend="nki", neuron_lnc=1, neuron_cc_flags_override="-O2 --internal-x='a b'",
        neuron_cc_flags="--verbose=35", neuron_cache_dir="/tmp/c", graph_backend="neuron_libtorch",
        neuron_pin_cores=False))
    assert v.compiler_args == ("--lnc=1", "-O2", "--internal-x=a b", "--verbose=35")
    assert (v.lnc, v.backend, v.cache_dir, v.pin_core) == (1, "neuron_libtorch", "/tmp/c", False)
    assert NeuronSettings(lnc=1).compiler_args == tuple(
        "--lnc=1" if a == "--lnc=2" else a for a in NeuronSettings().compiler_args)
    for bad in (dict(neuron_cc_flags_override="--lnc=1 -O2"), dict(neuron_cc_flags="--logical-nc-config 1"),
                dict(neuron_lnc=1, neuron_cc_flags="--lnc 2")):
        with pytest.raises(ValueError, match="one LNC degree"):
            Settings(ops_backend="nki", **bad)


def test_neuron_backend_without_the_sdk_fails_with_a_hint():
    if any(__import__("importlib").util.find_spec(m) for m in ("torch_neuronx", "libtorch_neuronx_lite")):
        pytest.fail("this CPU test expects no Neuron SDK in the environment")
    for backend in ("neuron", "neuron_libtorch"):
        with pytest.raises(RuntimeError, match="requirements-neuron"):
            compile_step(lambda x: x + 1, NeuronSettings(backend=backend))


def test_inductor_compiles_with_eager_precision_casts(monkeypatch):
    """graph_backend inductor compiles with emulate_precision_casts (eager's rounding between fused
    ops; without it the compiled rounds' greedy tokens drifted, perf/bench_decode.py) and the C++
    wrapper; other backends compile without either. The backend is replaced by a recorder: what it
    sees is what inductor would."""
    from torch._inductor import config

    seen = []

    def recorder(gm, example_inputs):
        seen.append((config.emulate_precision_casts, config.cpp_wrapper))
        return gm.forward

    monkeypatch.setattr(torch._dynamo, "lookup_backend", lambda name: recorder)
    # False unless $TORCHINDUCTOR_EMULATE_PRECISION_CASTS=1 / $TORCHINDUCTOR_CPP_WRAPPER=1
    before = (config.emulate_precision_casts, config.cpp_wrapper)
    for backend, want in (("inductor", (True, True)), ("aot_eager", before)):
        torch._dynamo.reset()
        seen.clear()
        out = compile_step(lambda x: x * 2 + 1, NeuronSettings(backend=backend))(torch.ones(3))
        assert torch.equal(out, torch.full((3,), 3.0)) and seen == [want], (backend, seen)
    assert (config.emulate_precision_casts, config.cpp_wrapper) == before  # set only while compiling


def test_inductor_compiles_its_cpp_at_the_level_cxx_opt_names(monkeypatch):
    """trn2.compiler.CXX_OPT is the g++ level of the command line inductor builds for a graph's C++
    while compiling (what keys its C++ cache too), and only then; inductor's own -O3 when it says O3.
    The backend is replaced by a recorder that builds the command line as inductor's CppCodeCache
    does: a torch whose flags come from elsewhere fails here rather than compiling at -O3 unseen."""
    from torch._inductor.codecache import CppCodeCache
    from torch._inductor.cpp_builder import CppBuilder, CppTorchDeviceOptions
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    from v4flash_backend.trn2 import compiler

    def command_line():
        opt = CppTorchDeviceOptions(vec_isa=pick_vec_isa(), device_type="cpu", **CppCodeCache.cpp_compile_command_flags)
        return CppBuilder(name="o", sources="i", BuildOption=opt).get_command_line().split()

    seen = []

    def recorder(gm, example_inputs):
        seen.append([f for f in command_line() if f in ("-O1", "-O2", "-O3")])
        return gm.forward

    monkeypatch.setattr(torch._dynamo, "lookup_backend", lambda name: recorder)
    for level in ("O2", "O3", "O1"):
        monkeypatch.setattr(compiler, "CXX_OPT", level)
        torch._dynamo.reset()
        seen.clear()
        compile_step(lambda x: x * 2 + 1, NeuronSettings(backend="inductor"))(torch.ones(3))
        assert seen == [[f"-{level}"]], (level, seen)
    assert "-O3" in command_line()  # set only while compiling


def test_backend_neuron_compiles_only_with_the_flags_in_its_environment(monkeypatch):
    """Backend neuron reads the compiler flags from NEURON_CC_FLAGS alone: compile_step refuses to
    compile when the environment does not carry this launch's flags."""
    from v4flash_backend.trn2 import compiler

    monkeypatch.setattr(compiler, "import_neuron", lambda s: None)  # no Neuron SDK here
    s = NeuronSettings()
    monkeypatch.delenv("NEURON_CC_FLAGS", raising=False)
    with pytest.raises(RuntimeError, match="NEURON_CC_FLAGS"):
        compile_step(lambda x: x + 1, s)
    monkeypatch.setenv("NEURON_CC_FLAGS", "-O1")  # a flag set without --lnc / --auto-cast=none / fp8
    with pytest.raises(RuntimeError, match="NEURON_CC_FLAGS"):
        compile_step(lambda x: x + 1, s)
    monkeypatch.setenv("NEURON_CC_FLAGS", neuron_env(s)["NEURON_CC_FLAGS"] + " --lnc=1")
    with pytest.raises(RuntimeError, match="NEURON_CC_FLAGS"):
        compile_step(lambda x: x + 1, s)
    monkeypatch.setenv("NEURON_CC_FLAGS", neuron_env(s)["NEURON_CC_FLAGS"] + " --verbose=35")
    with pytest.raises(Exception) as e:  # past the check: dynamo has no 'neuron' backend without the SDK
        compile_step(lambda x: x + 1, s)
    assert "NEURON_CC_FLAGS" not in str(e.value)


def test_one_entry_point_compiles_for_every_bucket():
    """Twelve buckets of one entry point (as the default settings' decode buckets): twelve dynamo cache
    entries of one code object, past dynamo's default recompile limit of 8 (the 9th failed to compile)."""
    def entry(ctx):
        return lambda x: x[:ctx].sum() + ctx  # one code object, a bucket constant closed over

    s = NeuronSettings(backend="eager")
    with torch._dynamo.config.patch(recompile_limit=8):  # torch's default (an earlier compile raised it)
        got = [compile_step(entry(c), s)(torch.ones(16)).item() for c in range(1, 13)]
    assert got == [2.0 * c for c in range(1, 13)]


def test_compile_step_refuses_host_syncs():
    s = NeuronSettings(backend="eager")
    ok = compile_step(lambda x: (x * 2).sum(), s)
    assert ok(torch.ones(3)).item() == 6.0
    bad = compile_step(lambda x: x * x.sum().item(), s)
    with pytest.raises(Exception, match="host syncs"):
        bad(torch.ones(3))


class _FakeDecoder:
    """verify/draft/padding_plan of a StaticDecoder, cheap to compile; records the plans it saw."""

    drafter = object()
    scratch = 7

    def __init__(self):
        self.state = torch.zeros(4)

    def padding_plan(self, seqs, rows):
        z = torch.zeros(seqs, dtype=torch.long)
        return torch.zeros(seqs, rows, dtype=torch.long), torch.full((seqs,), 7), z, z.clone()

    def verify(self, tokens, slot, start, n, ctx):
        return tokens.float().sum(-1) + ctx, tokens.float() * 2

    def draft(self, taps, commit, slot, start, anchor):
        return taps.sum(-1) + commit


def test_warm_up_compiles_each_bucket_once():
    buckets = [Bucket(1, 6, 64), Bucket(2, 6, 64), Bucket(2, 6, 128)]
    g = StaticGraphs(_FakeDecoder(), buckets, NeuronSettings(backend="eager"))
    out = io.StringIO()
    g.warm_up(progress=out)
    # 3 verify graphs (one per bucket) + 2 draft graphs (the context bound does not change it)
    assert g.stats.graphs == 5 and len(g._verify) == 3 and len(g._draft) == 2
    text = out.getvalue()
    assert "3/3" in text and "S=2 Q=6 ctx=128" in text and text.endswith("\n")
    tokens, slot, start, n = g.decoder.padding_plan(2, 6)
    v, _ = g.verify(Bucket(2, 6, 128), tokens + 1, slot, start, n)
    assert torch.equal(v, torch.full((2,), 134.0)) and g.stats.graphs == 5 and g.executions == 1
    assert [b.ctx for b in decode_buckets(3, 1000, 6)] == [256, 512, 1000] * 3


def test_neuron_imports_stay_on_the_neuron_path():
    code = (
        "import sys, torch\n"
        "from v4flash_backend import ops\n"
        "from v4flash_backend.trn2 import static_runner, static_step\n"
        "from v4flash_backend.trn2.graphs import StaticGraphs\n"
        "from v4flash_backend.trn2.launch import NeuronSettings, apply_env\n"
        "ops.set_backend('torch')\n"
        "apply_env(NeuronSettings(cache_dir=sys.argv[1]), environ={})\n"
        "g = StaticGraphs(None, [], NeuronSettings(backend='eager'))\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch_neuronx', 'libtorch_neuronx_lite', 'neuronxcc', 'nki', 'torch_xla'))\n"
        "print('NEURON-MODULES', bad)\n")
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    env.pop("V4FLASH_OPS", None)
    res = subprocess.run([sys.executable, "-c", code, "/tmp/v4flash-neuron-test-cache"], capture_output=True,
                         text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "NEURON-MODULES []" in res.stdout


def test_static_runner_drives_the_engine(tiny_model):
    """Greedy DSpark decoding through the static round graphs (run uncompiled: backend 'none')
    equals the eager runner's tokens exactly ('exact' numerics), with 2 graph executions per decode
    step (verify round + draft round); the prefill step runs the eager forward."""
    from v4flash_backend.engine.engine import Engine
    from v4flash_backend.engine.runner import LocalRunner
    from v4flash_backend.request import GenerateRequest
    from v4flash_backend.settings import Settings

    ops.set_numerics("exact")
    prompt = [0, 17, 230, 5, 99, 41, 8, 300, 12]

    def run(runner):
        eng = Engine(runner, Settings(max_num_seqs=2, max_model_len=64, spec_mode="fixed", fixed_len=5))
        ev = eng.run_request(GenerateRequest(prompt=list(prompt), max_tokens=10, ignore_eos=True))
        return [t for e in ev for t in e.token_ids], eng.totals["steps"], eng.stats()

    want, _, _ = run(LocalRunner(tiny_model, 3, 64))
    sr = StaticRunner(tiny_model, 2, 64, buckets=[Bucket(1, 6, 32), Bucket(1, 6, 64)],
                             settings=NeuronSettings(backend="none"))
    got, steps, st = run(sr)
    assert got == want and len(got) == 10
    decode_steps = steps - 1  # the first step is the prefill (eager)
    assert decode_steps >= 1 and st["static_steps"] == decode_steps
    # + 1: the prefill's first block, drafted by the round's draft graph (round_step._first_blocks_static)
    assert sr.graphs.executions == 2 * decode_steps + 1 and st["graphs_per_step"] == 2
    assert st["first_block_graphs"] == 1
