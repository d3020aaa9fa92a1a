"""One way to build an engine (`group.build.build_engine`), the runner protocol it relies on, and
the step-cost profile's injected clock.

- the CLI, `InProcessEngine` and the worker build through `build_engine`; in process it refuses,
  before loading anything, the settings only a rank group honours, naming each one;
- `InProcessEngine` honours decode_graph static (it ran the eager runner whatever the setting said):
  its decode steps run as static rounds, with the eager engine's tokens;
- every attribute and method the engine modules use on `self.runner` is declared by the `Runner`
  protocol, with no `getattr` probing, and the runners provide them all.
"""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import pytest

from v4flash_backend.engine.runner import LocalRunner, Runner
from v4flash_backend.group.build import InProcessRefused, build_engine
from v4flash_backend.request import GenerateRequest
from v4flash_backend.settings import Settings

REPO = Path(__file__).resolve().parents[1]
ENGINE = REPO / "src" / "v4flash_backend" / "engine"
GOLDEN = REPO.parent / "shared" / "golden" / "v41-tiny"


@pytest.mark.parametrize("kw, named", [
    (dict(world_size=2), "world_size=2"),
    (dict(world_size=2, pipeline_parallel=2), "pipeline_parallel=2"),
    (dict(sequence_parallel=True), "sequence_parallel"),
])
def test_in_process_refuses_what_only_a_rank_group_honours(kw, named, monkeypatch):
    import v4flash_backend.model.loading as loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("loaded a model it then refused"))
    with pytest.raises(InProcessRefused, match=named):
        build_engine(Settings(checkpoint_dir=str(GOLDEN), **kw))


def test_in_process_engine_refuses_and_the_cli_says_why(capsys):
    from v4flash_backend import cli
    from v4flash_backend.serving.engine_inprocess import InProcessEngine

    with pytest.raises(InProcessRefused, match="sequence_parallel"):
        InProcessEngine(Settings(checkpoint_dir=str(GOLDEN), launcher="inprocess", sequence_parallel=True))
    rc = cli.main(["generate", "--checkpoint", str(GOLDEN), "--prompt-ids", "0,5,6", "--max-tokens", "2",
                   "--sequence-parallel"])
    assert rc == 2 and "sequence_parallel" in capsys.readouterr().err


def _serve(settings: Settings, prompt: list[int], n: int):
    from v4flash_backend.serving.engine_inprocess import InProcessEngine

    eng = InProcessEngine(settings, log=lambda m: None)
    done, ids = threading.Event(), []

    def on_event(ev):
        ids.extend(ev.get("token_ids", []))
        if ev.get("finish_reason") is not None or ev.get("event") == "error":
            done.set()

    try:
        eng.submit(GenerateRequest(prompt=prompt, max_tokens=n, ignore_eos=True, seed=3, temperature=0.8),
                   "r", on_event)
        assert done.wait(120)
        return ids, eng.stats(), eng.engine.runner
    finally:
        eng.close()


def test_in_process_engine_honours_decode_graph_static():
    common = dict(checkpoint_dir=str(GOLDEN), launcher="inprocess", max_num_seqs=1, max_model_len=48,
                  spec_mode="fixed", fixed_len=3)
    ids_s, st, runner = _serve(Settings(decode_graph="static", **common), [0, 5, 6, 7], 8)
    assert runner.static_rounds and st["decode_graph"] == "static"
    assert st["static_steps"] > 0 and st["static_steps"] == st["decode_steps"]
    ids_e, st_e, _ = _serve(Settings(decode_graph="eager", **common), [0, 5, 6, 7], 8)
    assert st_e["decode_graph"] == "eager" and st_e["static_steps"] == 0
    assert len(ids_s) == 8 and ids_s == ids_e  # counter-based noise: the same tokens in both modes


def _runner_uses() -> set[str]:
    """Names used as `self.runner.X` (or `r.X` after `r = self.runner`) in the engine modules, and
    whether any module probes the runner with getattr."""
    used = set()
    for path in ENGINE.glob("*.py"):
        tree = ast.parse(path.read_text())
        aliases = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign)
                   and ast.unparse(n.value) == "self.runner" for t in n.targets if isinstance(t, ast.Name)}
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and (ast.unparse(n.value) == "self.runner"
                                                 or (isinstance(n.value, ast.Name) and n.value.id in aliases)):
                used.add(n.attr)
            if isinstance(n, ast.Call) and ast.unparse(n.func) == "getattr" and n.args \
                    and "runner" in ast.unparse(n.args[0]):
                used.add("getattr probe in " + path.name)
    return used


def _protocol_members() -> set[str]:
    return set(Runner.__annotations__) | {k for k, v in vars(Runner).items() if callable(v) and not k.startswith("_")}


def test_the_runner_protocol_names_everything_the_engine_uses():
    used = _runner_uses()
    assert {"forward", "dspark", "decode_round", "counters", "static_rounds"} <= used  # the scan sees them
    assert used <= _protocol_members(), used - _protocol_members()


def test_the_runners_provide_the_protocol(tiny_model):
    from v4flash_backend.group.worker import PlanRunner
    from v4flash_backend.parallel.micro_batch import MicroBatchRunner
    from v4flash_backend.trn2.launch import NeuronSettings
    from v4flash_backend.trn2.static_runner import StaticRunner

    local = LocalRunner(tiny_model, 2, 32)
    runners = [local, StaticRunner(tiny_model, 1, 32, settings=NeuronSettings(backend="none")),
               PlanRunner(MicroBatchRunner(local, 2), coll=None)]
    for r in runners:
        missing = [m for m in sorted(_protocol_members()) if not hasattr(r, m)]
        assert not missing, (type(r).__name__, missing)
    assert (local.static_rounds, local.round_fits(1, 4), runners[1].static_rounds) == (False, False, True)
    with pytest.raises(NotImplementedError, match="no static decode rounds"):
        local.decode_round({})
