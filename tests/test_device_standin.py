"""`device-standin` (checks/standin.py): the served static path on a stand-in accelerator. The GPU run
itself needs a lent GPU (docs/performance.md has its line); here the parts that decide its verdict:
the trace accounting, and the same run on the CPU, where a host sync inside a step must fail it."""

import argparse

import pytest

from v4flash_backend.checks import standin

STEP, ROUND = standin.StepGuard.SPAN, standin.StepGuard.ROUND


def _span(name, ts, dur):
    return {"cat": "user_annotation", "name": name, "ts": ts, "dur": dur}


def _copy(ts, corr, kind, nbytes):
    """A runtime memcpy call at ts and its GPU activity (same correlation id)."""
    return [{"cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": ts, "args": {"correlation": corr}},
            {"cat": "gpu_memcpy", "name": f"Memcpy {kind} (Pageable -> Device)", "ts": ts + 500,
             "args": {"correlation": corr, "bytes": nbytes}}]


def test_trace_accounting_places_each_copy_by_its_runtime_call():
    # a decode round [100, 200] holding one graph call [120, 150]; an eager step's copies outside
    ev = [_span(ROUND, 100, 100), _span(STEP, 120, 30)]
    ev += _copy(110, 1, "HtoD", 96)  # the plan upload: in the round, before the graph call
    ev += _copy(130, 2, "DtoD", 4096)  # inside the graph call
    ev += _copy(190, 3, "DtoH", 480)  # the round's read-back
    ev += _copy(300, 4, "DtoH", 16384)  # an eager step's logits
    ev += _copy(305, 5, "HtoD", 64)
    ev.append({"cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 140, "args": {}})
    ev.append({"cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 195, "args": {}})  # after the step
    cp = standin.copies_from_trace(ev, STEP, ROUND)
    assert cp["step"] == {"DtoD": 4096}
    assert cp["round"] == {"HtoD": 96, "DtoH": 480}
    assert cp["eager"] == {"DtoH": 16384, "HtoD": 64}
    assert cp["syncs_in_steps"] == 1


def _args(tmp_path, prompts=2, tokens=6):
    ap = argparse.ArgumentParser()
    standin.add_arguments(ap)
    return ap.parse_args(["--device", "cpu", "--prompts", str(prompts), "--max-tokens", str(tokens),
                          "--out", str(tmp_path)])


@pytest.mark.slow
def test_standin_on_cpu_serves_the_static_path_with_the_eager_ids(tmp_path):
    ok, final, report = standin.run(_args(tmp_path), log=lambda s: None)
    assert ok, final
    assert "same_tokens=yes" in final and "syncs_in_steps=0" in final and "resident_moves=0" in final
    assert report["calls"]["round"] > 0 and report["calls"]["forward"] > 0  # rounds and prefill graphs ran
    assert report["got"]["0.8"] == report["expected"]["0.8"]  # seeded sampling too, two requests at once


@pytest.mark.slow
def test_a_host_read_inside_a_step_fails_the_standin(tmp_path, monkeypatch):
    from v4flash_backend.trn2 import static_round

    real = static_round.verify_round

    def leaky(dec, blk, ctx, slot, *a, **k):
        int(slot.sum())  # a deliberate device-to-host read inside the round graph
        return real(dec, blk, ctx, slot, *a, **k)

    monkeypatch.setattr(static_round, "verify_round", leaky)
    ok, final, _ = standin.run(_args(tmp_path, prompts=1, tokens=4), log=lambda s: None)
    assert not ok and "syncs_in_steps=0" not in final, final
