"""The control plane runs on gloo, the device collectives on the device backend (parallel/collectives.py
`make_groups`): a W = 2 rank group whose device backend is a stand-in that refuses every message of the
control plane (tests/standin_device_backend.py: broadcasts, barriers, integer tensors) serves a request
with heartbeats before it, and the stand-in carried only the forward's collectives (floating-point
activations, never the [1] heartbeat tensor). Before the split, the worker broadcast its int64 step plans
and all-reduced its heartbeats over the world group of `dist_backend` alone: the stand-in refuses the
first plan and the group never serves."""

import json
import os
import time
from pathlib import Path

from v4flash_backend.group.rank_group import RankGroup
from v4flash_backend.settings import Settings

REPO = Path(__file__).resolve().parents[1]


def test_no_control_message_reaches_the_device_backend(golden_dir, tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(  # every rank process registers the stand-in before torchrun's init
        f"import sys\nsys.path.insert(0, {str(REPO / 'tests')!r})\n"
        "import standin_device_backend\nstandin_device_backend.register()\n")
    record = tmp_path / "seen"
    env = {"PYTHONPATH": os.pathsep.join([str(site), str(REPO / "src")]), "V4FLASH_STANDIN_RECORD": str(record)}
    settings = Settings(checkpoint_dir=str(golden_dir), world_size=2, max_num_seqs=1, max_model_len=32,
                        dist_backend="v4flash_standin", heartbeat_s=0.3, collective_timeout_s=60.0,
                        startup_timeout_s=600.0, spec_mode="off", prefix_cache_bytes=0)
    g = RankGroup.launch(settings, env=env)
    try:
        time.sleep(1.5)  # idle: rank 0 sends heartbeat plans (and all-reduces) meanwhile
        res = g.submit([0, 17, 230, 5], {"max_tokens": 4, "ignore_eos": True}).result(timeout=120)
        assert res["error"] is None, res["error"]  # the group served (a refused plan ends it)
        ids = res["token_ids"]
        st = g.stats()
    finally:
        g.shutdown(timeout=60)
    assert len(ids) == 4
    assert st["plans"]["noop"] >= 2, st["plans"]  # heartbeats went out while idle ...
    for r in range(2):
        seen = [json.loads(line) for line in Path(f"{record}.{r}").read_text().splitlines()]
        ops = {op for op, _, _ in seen}
        # ... and the device backend carried the forward's activations only
        assert ops == {"allreduce", "allgather"} and len(seen) >= 10, (r, seen[:5])
        assert all(d in ("torch.float32", "torch.bfloat16", "torch.float64") for _, d, _ in seen), seen
        assert not [s for _, _, s in seen if s == [1]], "a heartbeat reached the device backend"
