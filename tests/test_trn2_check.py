"""`trn2-check` (checks/trn2.py): the static graphs traced on fake device tensors.

- The graph checks themselves, on small functions: a CPU factory inside a graph fails device_clean
  (whether or not it meets a device tensor; a 0-dim CPU scalar is allowed), a float64 value or a
  64-bit hash product fails the dtype rule (the product passes with --native-int64=enabled unless
  it feeds a scatter), `.item()` counts as a host read, a kernel op counts as a kernel node.
- The launch environment: a complete one passes, a dropped compiler flag fails.
- The tiny checkpoint's rank 0 of W = 2 with the served path's own runner on fake tensors: the
  forward and prefill graphs are device-clean with kernel nodes and no host reads; a deliberate CPU
  `torch.zeros` inside the step and a float64 op inside it each fail it.
- Rank-agnostic graphs: at W = 4 (two attention groups, other experts / vocabulary / Engram rows)
  rank 1's graphs have rank 3's keys; a deliberate rank constant in the step (a Python int of the
  rank's layout) makes trn2-check print rank_agnostic=no, name the graph and the node, and fail.
- Every graph of the rank, the final line as the issue asks, from the command line with the served
  flags as they are (--native-int64=enabled among them; slow).
"""

import re

import pytest
import torch
from torch._subclasses import FakeTensorMode

from v4flash_backend.checks import trn2

TINY = "models/v4flash-tiny"


def _trace(fn, *shapes, dtype=torch.float32, native=False):
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        args = [torch.empty(s, dtype=dtype, device=trn2.FAKE_DEVICE) for s in shapes]
    return trn2.trace("t", fn, args, mode, native)


def test_device_check_catches_cpu_factories_and_allows_scalars():
    clean = _trace(lambda x: x + torch.arange(4, device=x.device) + torch.tensor(2.0), (3, 4))
    assert clean.device_clean and not clean.error and clean.nodes > 0
    met = _trace(lambda x: x + torch.zeros(3, 4), (3, 4))  # a CPU tensor meets the device tensor
    assert not met.device_clean and "device mismatch" in met.error
    made = _trace(lambda x: (x * 2, torch.zeros(3)), (3, 4))  # made on the CPU, never meets one
    assert not made.device_clean and any("cpu" in d for d in made.off_device)


def test_dtype_rule():
    assert _trace(lambda x: x * 2, (4,)).dtype_ok
    f64 = _trace(lambda x: x.double().sum().float(), (4,))
    assert not f64.dtype_ok and any("float64" in d for d in f64.dtype_bad)

    def hashed(x):  # noise-style multiply-xorshift on int64 ids: products reach 2^62
        return ((x ^ (x >> 15)) * 0x2C1B3C6D) & ((1 << 31) - 1)

    assert not _trace(hashed, (4,), dtype=torch.int64).dtype_ok  # int32 downcast would wrap
    assert _trace(hashed, (4,), dtype=torch.int64, native=True).dtype_ok  # native int64 keeps it
    # positions times a small ratio stay below 2^31: fine either way
    assert _trace(lambda p: p * 4 + 1, (4,), dtype=torch.int64).dtype_ok

    def wide_into_scatter(x):  # a wide value stored by a scatter (no native integer datapath)
        buf = torch.zeros(8, dtype=torch.int64, device=x.device)
        return buf.index_put((x % 8,), x * 0x5BD1E995)

    bad = _trace(wide_into_scatter, (4,), dtype=torch.int64, native=True)
    assert not bad.dtype_ok and any("index_put" in d for d in bad.dtype_bad)
    narrowed = _trace(lambda x: torch.zeros(8, dtype=torch.int64, device=x.device).index_put(
        (x % 8,), (x * 0x5BD1E995) % 1000003), (4,), dtype=torch.int64, native=True)
    assert narrowed.dtype_ok


def test_host_reads_and_kernel_nodes_are_counted():
    from v4flash_backend import ops

    r = _trace(lambda x: x * x.sum().item(), (4,))
    assert r.host_reads >= 1 and r.error
    ops.set_backend("nki-sim")
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        x = torch.empty(2, 128, dtype=torch.bfloat16, device=trn2.FAKE_DEVICE)
        w = torch.empty(128, dtype=torch.bfloat16, device=trn2.FAKE_DEVICE)
    k = trn2.trace("rms", lambda x, w: ops.rms_norm(x, w, 1e-6), [x, w], mode, False)
    assert k.kernel_nodes == 1 and k.device_clean and k.host_reads == 0


def test_launch_env_check():
    from v4flash_backend.trn2.compiler import COMPILER_ARGS
    from v4flash_backend.trn2.launch import NeuronSettings, neuron_env

    full = {"NEURON_CC_FLAGS": " ".join(COMPILER_ARGS), "NEURON_LOGICAL_NC_CONFIG": "2",
            "NEURON_RT_VISIBLE_CORES": "3", "NEURON_COMPILE_CACHE_URL": "/c"}
    assert trn2.env_problems(full, 2, 3) == []
    assert trn2.env_problems(dict(full, NEURON_LOGICAL_NC_CONFIG="1"), 2, 3) == ["NEURON_LOGICAL_NC_CONFIG=2"]
    # the env builder itself, with one flag dropped from the settings: the check names it
    for drop, name in (("--auto-cast=none", "auto-cast"), ("--lnc=2", "--lnc=2"),
                       (COMPILER_ARGS[-1], "fp8e4m3fn")):
        s = NeuronSettings(compiler_args=tuple(a for a in COMPILER_ARGS if a != drop))
        env, lnc, local = trn2.rank_env(64, 5, s)
        assert env == neuron_env(s, local) and local == 5
        assert any(name in p for p in trn2.env_problems(env, lnc, local)), drop


def _forward_only(name):
    return name.startswith(("forward", "prefill"))


def test_tiny_forward_graphs_are_device_clean_with_kernels():
    ok, final, graphs = trn2.trn2_check(TINY, None, 2, 0, processed=False, log=None, select=_forward_only)
    assert [g.name for g in graphs] == ["forward S=1 Q=6 ctx=256", "prefill S=1 Q=16 ctx=256"]
    for g in graphs:
        assert g.device_clean, g.line()
        assert g.kernel_nodes > 0 and g.host_reads == 0, g.line()


def test_a_cpu_factory_in_the_step_fails_device_clean(monkeypatch):
    from v4flash_backend.model import attention

    orig = attention.join_slots

    def cpu_join(widx, cidx, width):  # the mistake the issue found: an index made on the CPU
        return orig(widx, cidx, width) + torch.zeros(widx.shape[-1] + cidx.shape[-1], dtype=torch.long)

    monkeypatch.setattr(attention, "join_slots", cpu_join)
    _, _, graphs = trn2.trn2_check(TINY, None, 2, 0, processed=False, log=None,
                                   select=lambda n: n.startswith("forward"))
    (g,) = [g for g in graphs if g.name.startswith("forward")]
    assert not g.device_clean and "device mismatch" in g.error and "model/attention.py" in g.error


def test_a_float64_op_in_the_step_fails_dtype_ok(monkeypatch):
    from v4flash_backend.model import transformer

    orig = transformer.stream_mean
    monkeypatch.setattr(transformer, "stream_mean", lambda h: orig(h.double()).to(h.dtype))
    _, _, graphs = trn2.trn2_check(TINY, None, 2, 0, processed=False, log=None,
                                   select=lambda n: n.startswith("forward"))
    (g,) = [g for g in graphs if g.name.startswith("forward")]
    assert g.device_clean
    assert any("float64" in d for d in g.dtype_bad)
    monkeypatch.setattr(transformer, "stream_mean", orig)
    _, _, graphs = trn2.trn2_check(TINY, None, 2, 0, processed=False, log=None,
                                   select=lambda n: n.startswith("forward"))
    (g,) = [g for g in graphs if g.name.startswith("forward")]
    assert not any("float64" in d for d in g.dtype_bad)  # the forward itself has none


_FINAL = re.compile(r"trn2-check: graphs=(\d+) device_clean=(\d+)/(\d+) dtype_ok=(\d+)/(\d+) "
                    r"kernel_nodes_per_step=(\d+) host_reads=(\d+) neuron_env=(\S+) graph_keys=([0-9a-f]{16}) "
                    r"rank_agnostic=(yes|no)")


def _assert_all_ok(final):
    m = _FINAL.fullmatch(final)
    assert m, final
    n, dc, n1, dt, n2, k, hr, env, _, agnostic = m.groups()
    assert int(n) == 8 and dc == n1 == n and dt == n2 == n and int(k) > 0 and hr == "0" and env == "ok", final
    assert agnostic == "yes", final


def test_two_ranks_of_other_attention_groups_trace_the_same_graphs():
    """W = 4 (attention groups of 2): rank 1 against rank 3 -- another group, other experts, vocabulary
    and Engram rows -- and rank 3 against rank 1 print one graph_keys hash."""
    lines = []
    finals = [trn2.trn2_check(TINY, None, 4, r, processed=False, log=lines.append, select=_forward_only)[1]
              for r in (1, 3)]
    assert not [x for x in lines if "not rank-agnostic" in x], lines
    keys = {re.search(r"graph_keys=(\w+)", f).group(1) for f in finals}
    assert len(keys) == 1 and all(f.endswith("rank_agnostic=yes") for f in finals), finals


def test_a_rank_constant_in_a_graph_fails_rank_agnostic(monkeypatch):
    from v4flash_backend.parallel.comm import DistComm

    orig = DistComm.lookups  # the forward's embedding rows travel through it (with Engram's)

    def mistake(self, parts):
        y, *rest = orig(self, parts)
        return [y + self.lay.rank, *rest]

    monkeypatch.setattr(DistComm, "lookups", mistake)
    lines = []
    ok, final, _ = trn2.trn2_check(TINY, None, 2, 0, processed=False, log=lines.append,
                                   select=lambda n: n.startswith("forward"))
    assert not ok and final.endswith("rank_agnostic=no"), final
    diff = [x for x in lines if "not rank-agnostic" in x]
    # the forward graph, at the node that adds the rank: 0 on rank 0, 1 on rank 1
    assert len(diff) == 1 and "graph forward S=1 Q=6 ctx=256" in diff[0] and "aten.add" in diff[0], diff
    monkeypatch.setattr(DistComm, "lookups", orig)
    ok, final, _ = trn2.trn2_check(TINY, None, 2, 0, processed=False, log=None,
                                   select=lambda n: n.startswith("forward"))
    assert final.endswith("rank_agnostic=yes"), final


# The served flags (trn2/launch.py BASE_COMPILER_ARGS) carry --native-int64=enabled: without it the
# Engram hash (63-bit multipliers, model/engram_hash.py) fails dtype_ok in every graph with a target
# forward (2/8 passed before the flag was added).
@pytest.mark.slow
def test_cli_on_the_tiny_checkpoint(capsys):
    from v4flash_backend.cli import main

    """Every graph of the tiny rank with the launch's default flags (--native-int64=enabled among them:
    the Engram hash is 64-bit), the round graphs of a decode step among them."""
    from v4flash_backend.trn2.launch import NeuronSettings

    assert "--native-int64=enabled" in NeuronSettings().compiler_args
    rc = main(["trn2-check", "--checkpoint", TINY, "--world-size", "2"])
    lines = capsys.readouterr().out.strip().splitlines()
    _assert_all_ok(lines[-1])
    graphs = [ln.split(":")[0] for ln in lines if ln.startswith("graph ")]
    assert {"graph round verify S=1 Q=6 ctx=256", "graph round draft S=1 Q=6 ctx=256 dspark"} <= set(graphs), graphs
    assert rc == 0
