"""golden-check against the official reference's outputs, plus negative controls proving that the
per-layer replay catches real bugs (the README's injected-bug table).

Two levels (checks/gemm_probe.py): where this machine's fp32 GEMM reproduces the reference's own bits
(the fixture's head GEMMs, decided by `gemm_level`, printed at the end of the run by conftest), every
replayed row is held bit-exact and the end-to-end logits at cosine 1; elsewhere (an Intel Xeon, whose
MKL takes other kernels than the generic path the reference ran on; the suite's second GEMM order) the
fixture README's strict criteria. The negative controls fail at both levels; the one-ulp control is the
bit level's and says so where the level is strict.
"""

import re
import subprocess
import sys

import pytest
import torch

from v4flash_backend import ops
from v4flash_backend.checks import golden
from v4flash_backend.model import geometry
from v4flash_backend.ops import torch_ops

pytestmark = pytest.mark.numerics

FINAL = re.compile(r"^golden: cases=(\d+) steps=(\d+) layers_ok=(\d+)/(\d+) max_layer_err=\S+ "
                   r"min_logit_cosine=(\S+) top1_agree=(\d+)/(\d+) max_row_err=(\S+) "
                   r"rows_over_0.002=(\d+)/(\d+) max_premix=(\S+)$")


LEVEL = re.compile(r"^golden-level: level=(\w+) decode_rows_over_0.002=(\d+)/(\d+) decode_max_row_err=(\S+) "
                   r"\(gemm-probe: reference_bits=(\d+)/(\d+) level=(\w+) ")


def test_golden_check_cli_passes(golden_dir):
    r = subprocess.run([sys.executable, "-m", "v4flash_backend", "golden-check", str(golden_dir)],
                       capture_output=True, text=True, timeout=900)
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    m = FINAL.match(lines[-1])
    assert m, lines[-1]
    cases, steps, ok, total = map(int, m.groups()[:4])
    assert cases == 4 and steps == 48 and ok == total == 10
    lv = LEVEL.match(lines[-2])
    assert lv, lines[-2]
    # the command's level is its own probe's (in its process: MKL's kernels also depend on the thread
    # count, so this process's `gemm_level` may differ from it)
    assert lv.group(1) == lv.group(7), lines[-2]
    # the teacher-forced decode replay: 10 layers x 12 steps, none above the strict 2e-3 (every order
    # measured: max 6.8e-4 on MKL's Intel path, 0 under split-K)
    assert (lv.group(2), lv.group(3)) == ("0", "120"), lines[-2]
    if lv.group(1) == "bits":
        # the figures the README quotes for the torch backend: every replayed row bit-exact
        assert (m.group(8), m.group(9), m.group(10), m.group(11)) == ("0", "0", "1230", "0")
        # and the end-to-end logits (prefill, the decode loop, DSpark) as the reference's
        assert m.group(5) == "1.0000" and m.group(6) == m.group(7) == "306"
    else:
        # strict: no replayed row above 2e-3 (the criterion allows 5 % a layer; every order measured has
        # none: max 3.0e-4), the pre-mix within 1e-4; the end-to-end logits only above the sanity bound
        # (0.85): order-only changes move whole cases there (fixture README 6.3; min cosine 0.973 on an
        # Intel Xeon)
        assert int(m.group(10)) == 1230 and m.group(9) == "0" and float(m.group(8)) <= golden.STRICT_ROW_TOL
        assert float(m.group(11)) <= golden.PREMIX_TOL and float(m.group(5)) >= golden.E2E_MIN_COS


@pytest.fixture(scope="module")
def fx_model(golden_dir):
    fx = golden.GoldenFixture(golden_dir)
    ops.set_numerics("reference")
    return fx, golden.build_model(fx)


def _replay(fx, m):
    ops.set_numerics("reference")
    rep = golden.Report()
    golden.replay_layers(fx, m, rep, "case0")
    return rep


def test_replay_passes_at_the_machines_level(fx_model, gemm_level):
    fx, m = fx_model
    rep = _replay(fx, m)
    assert not rep.failures and rep.layers_ok == 10, gemm_level.line()
    if gemm_level.level == "bits":
        assert rep.max_layer_err == 0.0 and rep.max_row_err == 0.0
    else:
        assert rep.rows_over == 0 and rep.max_premix <= golden.PREMIX_TOL


def test_replay_catches_dropped_sink(fx_model, monkeypatch):
    fx, m = fx_model
    real = torch_ops.sparse_attn
    monkeypatch.setattr(torch_ops, "sparse_attn",
                        lambda q, kv, sink, idx, sc: real(q, kv, torch.full_like(sink, -torch.inf), idx, sc))
    assert _replay(fx, m).layers_ok < 10


def test_replay_catches_wrong_norm_eps(fx_model, monkeypatch):
    fx, m = fx_model
    monkeypatch.setattr(m.cfg, "norm_eps", 1e-6)
    assert _replay(fx, m).layers_ok < 10


def test_replay_catches_missing_route_scale(fx_model, monkeypatch):
    fx, m = fx_model
    monkeypatch.setattr(m.cfg, "route_scale", 1.0)
    assert _replay(fx, m).layers_ok < 10


def test_replay_catches_skipped_index_fp4(fx_model, monkeypatch):
    fx, m = fx_model
    from v4flash_backend.formats import quant
    from v4flash_backend.model import attention as model_attention

    real = quant.fp4_qdq
    monkeypatch.setattr(model_attention.quant, "fp4_qdq",
                        lambda x, block, fmt: x if fmt == "ue8m0" else real(x, block, fmt))
    assert _replay(fx, m).layers_ok < 10


def test_exact_numerics_pass_the_loose_level(golden_dir):
    ok, final, rep = golden.golden_check(golden_dir, numerics="exact")
    assert ok, rep.failures


@pytest.mark.slow
def test_golden_check_passes_through_the_nki_kernels(golden_dir):
    """Every op family through the NKI kernels run by the CPU simulator (issue 5's bar)."""
    r = subprocess.run([sys.executable, "-m", "v4flash_backend", "golden-check", str(golden_dir), "--ops", "nki-sim"],
                       capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    m = FINAL.match(r.stdout.strip().splitlines()[-1])
    assert m and int(m.group(3)) == int(m.group(4)) == 10
    # the figures the README quotes for nki-sim (deterministic): worst replayed row 3.0e-4, no row above the
    # strict 2e-3 (10 layers x 41 positions x 3 outputs), pre-mix max |d| 6.3e-6 (bound 1e-4)
    assert (m.group(8), m.group(9), m.group(10), m.group(11)) == ("0.000302", "0", "1230", "6.26e-06")


def test_replay_lines_report_max_and_rows_over_the_strict_tolerance(fx_model, monkeypatch, gemm_level):
    """Per-layer replay lines carry the max row error and the rows above 2e-3, not only the medians (a layer
    whose worst rows are far off must not print 0); a dropped sink shows in both."""
    fx, m = fx_model
    rep = _replay(fx, m)
    lines = [ln for ln in rep.lines if "replay:" in ln and "head" not in ln]
    maxes = [re.search(r" max (\S+)/(\S+)/(\S+) rows>0.002 (\d+)/123 ", ln) for ln in lines]
    assert len(lines) == 10 and all(maxes), lines
    worst = max(float(v) for mx in maxes for v in mx.groups()[:3])  # printed with two digits
    assert f"{worst:.1e}" == f"{rep.max_row_err:.1e}" and sum(int(mx.group(4)) for mx in maxes) == rep.rows_over == 0
    assert rep.rows_total == 1230
    if gemm_level.level == "bits":
        assert all(" max 0.0e+00/0.0e+00/0.0e+00 rows>0.002 0/123 " in ln for ln in lines)
        assert rep.max_row_err == 0 and rep.max_premix == 0
    real = torch_ops.sparse_attn
    monkeypatch.setattr(torch_ops, "sparse_attn",
                        lambda q, kv, sink, idx, sc: real(q, kv, torch.full_like(sink, -torch.inf), idx, sc))
    bad = _replay(fx, m)
    assert bad.max_row_err > 1e-2 and bad.rows_over > 0.5 * bad.rows_total


def _window_one_position_off(real):
    """step_geometry with a single-token step's window slots one position late (the oldest row read,
    the newest dropped): a decode-only slip that the prefill replay, which starts at position 0, never
    reaches."""
    def bad(slot, start, n, Q, window, ctx, off=0, host=None):
        g = real(slot, start, n, Q, window, ctx, off, host)
        single = ((n == 1) & (start > 0))[:, None, None]
        g.widx = torch.where(single & (g.widx >= 0), (g.widx - 1).clamp_min(-1), g.widx)
        return g
    return bad


def test_decode_replay_catches_the_window_one_position_off(fx_model, monkeypatch, gemm_level):
    """The teacher-forced decode replay holds every decode row of case0 within the strict 2e-3 at this
    machine's level, and fails every layer with the window span one position off (measured: rows off by
    1e-2 to 1e-1) -- a bug the end-to-end logits let through (cosine 0.9579 against the 0.85 bound)."""
    fx, m = fx_model
    ops.set_numerics("reference")
    rep = golden.Report()
    golden.replay_decode(fx, m, rep, "case0")
    assert not rep.failures and rep.decode_rows == 120 and rep.decode_over == 0, gemm_level.line()
    monkeypatch.setattr(geometry, "step_geometry", _window_one_position_off(geometry.step_geometry))
    bad = golden.Report()
    golden.replay_decode(fx, m, bad, "case0")
    assert len(bad.failures) == 10 and bad.decode_over > 0.9 * bad.decode_rows and bad.decode_max_err > 1e-2


def test_one_ulp_in_one_gemm_fails_the_bit_level(golden_dir, monkeypatch, gemm_level):
    """Where the machine reproduces the reference's GEMM bits, golden-check holds the forward to them: one
    bf16 ulp added to one output of the layers' shared-expert GEMM (linear_fp8 over ffn.shared_experts.w2,
    the only [128, 64] fp8 weight) fails it, though the strict criteria alone pass it (measured on a
    machine at the strict level: max row error 3.0e-4 either way)."""
    if gemm_level.level != "bits":
        pytest.skip(f"the bit level needs a machine that reproduces the reference's GEMM bits; here "
                    f"{gemm_level.line()} (checked at the strict level by the tests above)")
    real = torch_ops.linear_fp8

    def nudged(x, weight, scale, experts=None):
        y = real(x, weight, scale, experts)
        if weight.dim() == 2 and weight.shape[0] == 128 and weight.shape[1] == 64:  # shared expert w2
            y = y.clone()
            y.view(-1)[:1].view(torch.int16).add_(1)  # the next bf16 away from zero
        return y

    ok, _, rep = golden.golden_check(golden_dir)
    assert ok and rep.level == "bits"
    monkeypatch.setattr(torch_ops, "linear_fp8", nudged)
    ok, _, rep = golden.golden_check(golden_dir)
    assert not ok and any(f.startswith("bit level") for f in rep.failures), rep.failures
