"""`release-check` at release scale (issue 18): ranks 0 and 63 of W = 64 on a sparse V4.1-Flash
checkpoint (474 GiB apparent, ~18 MB on disk).

Each rank runs the CLI in its own process (so the ~11 GiB a rank's shard takes is returned between
them, and an error of one rank cannot hide behind the other; the sparse checkpoint is written once and
shared): the serving loader reads the shard, its bytes must be within 2 % of the placement report's (the
issue's bound; measured: identical to 4 decimals, and the RSS growth within 1.2 %), the static graphs
trace on the meta device at the corner buckets (decode: 1 and 8 sequences x context 256 and 65536, and
the draft graphs; prefill: 16 and 256 rows x the same contexts), and every kernel runs under the simulator
within the budget: kernels_ok=16/16 and max_sbuf_kib <= 192 (the full bucket set is the CLI's default
and is run by hand, README).

Cost (issue 18's K-tiled kernels, prefill graphs added), measured on the 2-core machine shared with other
jobs (load average 8-14): 804 s for rank 0 and 372 s for rank 63, 19 min 43 s for the module, 5.0 min of
CPU in all (GNU time: user 207 s + sys 92 s); peak RSS 20.2 GiB (the loaded tensors, ~11 GiB, plus clean
page-cache pages of the reader's memory map, reclaimable). The ranks run one after the other, so CI's
24 GiB holds.
"""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO.parent / "shared" / "configs" / "deepseek-v4.1-flash.json"
SRC = REPO / "src"


@pytest.fixture(scope="module")
def release_ckpt(tmp_path_factory):
    from v4flash_backend.checks.release import build_checkpoint
    from v4flash_backend.config import ModelConfig

    if not CONFIG.exists():
        pytest.fail(f"release config missing at {CONFIG} (CI lays shared/ beside the clone)")
    d = tmp_path_factory.mktemp("release")
    sc = build_checkpoint(ModelConfig.from_json(CONFIG), d)
    assert sc.apparent_bytes() > 470 * 1024 ** 3 and sc.disk_bytes() < 64 * 1024 ** 2
    yield d
    shutil.rmtree(d, ignore_errors=True)  # 474 GiB apparent: never left behind in pytest's kept temp dirs


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 63])
def test_release_check_rank(release_ckpt, rank):
    cmd = [sys.executable, "-m", "v4flash_backend", "release-check", "--config", str(CONFIG), "--world-size", "64",
           "--rank", str(rank), "--checkpoint", str(release_ckpt), "--buckets", "corners"]
    env = {"PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, check=False)
    out = res.stdout
    final = out.strip().splitlines()[-1] if out.strip() else ""
    m = re.fullmatch(r"release-check: rank=(\d+) loaded_gib=([\d.]+) placement_gib=([\d.]+) graphs_traced=(\d+) "
                     r"kernels_ok=(\d+)/(\d+) max_sbuf_kib=([\d.]+)", final)
    assert m, (final, res.stderr[-3000:])
    r, loaded, placed, graphs, k_ok, k_all, sbuf = m.groups()
    assert int(r) == rank
    assert abs(float(loaded) - float(placed)) <= 0.02 * float(placed), final
    assert 12.0 < float(placed) < 13.5  # the placement report's 12.60 GiB per rank
    assert not [x for x in out.splitlines() if x.startswith("load mismatch")]
    graph_lines = [x for x in out.splitlines() if x.startswith("graph ")]
    # 4 verify + 2 draft graphs + 4 prefill graphs (16 and 256 rows x context 256 and 65536), all traced
    assert len(graph_lines) == 10 == int(graphs), graph_lines
    assert len([x for x in graph_lines if x.startswith("graph prefill ")]) == 4, graph_lines
    states = re.findall(r"^kernel-footprint \S+: (ok|OVER BUDGET|FAILED|unmeasured)", out, re.MULTILINE)
    assert int(k_all) == 16 == len(states)
    assert states == ["ok"] * 16 and int(k_ok) == 16, states  # every kernel measured and within the budget
    assert 0 < float(sbuf) <= 192, final  # the simulator's usable SBUF per partition (nki_sim._rules R8)
    assert res.returncode == 0
