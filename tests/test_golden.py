"""golden-check against the official reference's outputs, plus negative controls proving that the
per-layer replay catches real bugs (the README's injected-bug table)."""

import re
import subprocess
import sys

import pytest
import torch

from v4flash_backend import ops
from v4flash_backend.checks import golden
from v4flash_backend.ops import torch_ops

FINAL = re.compile(r"^golden: cases=(\d+) steps=(\d+) layers_ok=(\d+)/(\d+) max_layer_err=\S+ "
                   r"min_logit_cosine=(\S+) top1_agree=(\d+)/(\d+) max_row_err=(\S+) "
                   r"rows_over_0.002=(\d+)/(\d+) max_premix=(\S+)$")


def test_golden_check_cli_passes(golden_dir, repo_root=None):
    r = subprocess.run([sys.executable, "-m", "v4flash_backend", "golden-check", str(golden_dir)],
                       capture_output=True, text=True, timeout=900)
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    m = FINAL.match(lines[-1])
    assert m, lines[-1]
    cases, steps, ok, total = map(int, m.groups()[:4])
    assert cases == 4 and steps == 48 and ok == total == 10
    # the figures the README quotes for the torch backend: every replayed row bit-exact
    assert (m.group(8), m.group(9), m.group(10), m.group(11)) == ("0", "0", "1230", "0")
    # and the end-to-end logits (prefill, the decode loop, DSpark) as the reference's: the per-layer
    # replay starts from position 0, so only these see a cache read one position off in decode
    # (measured: cosine 0.9579, top-1 294/306 with the window span shifted by one)
    assert m.group(5) == "1.0000" and m.group(6) == m.group(7) == "306"


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


def test_replay_is_exact_on_the_reference(fx_model):
    fx, m = fx_model
    rep = _replay(fx, m)
    assert not rep.failures and rep.layers_ok == 10 and rep.max_layer_err == 0.0


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


def test_replay_lines_report_max_and_rows_over_the_strict_tolerance(fx_model, monkeypatch):
    """Per-layer replay lines carry the max row error and the rows above 2e-3, not only the medians (a layer
    whose worst rows are far off must not print 0); a dropped sink shows in both."""
    fx, m = fx_model
    rep = _replay(fx, m)
    lines = [ln for ln in rep.lines if "replay:" in ln and "head" not in ln]
    assert len(lines) == 10 and all(" max 0.0e+00/0.0e+00/0.0e+00 rows>0.002 0/123 " in ln for ln in lines)
    assert rep.max_row_err == 0 and rep.rows_over == 0 and rep.rows_total == 1230 and rep.max_premix == 0
    real = torch_ops.sparse_attn
    monkeypatch.setattr(torch_ops, "sparse_attn",
                        lambda q, kv, sink, idx, sc: real(q, kv, torch.full_like(sink, -torch.inf), idx, sc))
    bad = _replay(fx, m)
    assert bad.max_row_err > 1e-2 and bad.rows_over > 0.5 * bad.rows_total
