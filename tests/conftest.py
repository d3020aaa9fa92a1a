import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO.parent / "shared" / "golden" / "v41-tiny"

# Many small tensor ops: on a 2-core CI machine one intra-op thread is both faster and deterministic.
torch.set_num_threads(int(os.environ.get("V4FLASH_TEST_THREADS", "1")))

# The servers the tests start (scripts/serve.sh) are not restarted after a crash: a crash must fail
# the test that hit it (tests/test_serve_supervision.py turns restarts on for itself).
os.environ.setdefault("SERVE_MAX_RESTARTS", "0")

# The CPU default decode path compiles its graphs with inductor in the background (minutes of both
# cores per bucket on CI's machine): the servers and engines of the tests keep the eager default
# unless they name decode_graph (tests/test_background_compile.py tests the default itself).
os.environ.setdefault("V4FLASH_CPU_DECODE_GRAPH", "eager")
# ... and write no step-cost profile that a later test's server would load (scripts/serve.sh keeps
# them in .cache/state unless the variable is set; set and empty: none is written)
os.environ.setdefault("V4FLASH_STATE_DIR", "")


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    if not (GOLDEN / "config.json").exists():
        pytest.fail(f"golden fixture missing at {GOLDEN} (CI lays shared/ beside the clone)")
    return GOLDEN


@pytest.fixture(scope="session")
def gemm_level(golden_dir):
    """Which golden level this machine and GEMM order are held to (checks/gemm_probe.py): 'bits' where
    its fp32 GEMM reproduces the reference's own bits, else 'strict'."""
    from v4flash_backend.checks.gemm_probe import probe

    return probe(golden_dir)


# Files in the order of their expected cost, the dearest first (`make test` passes
# --no-loadscope-reorder so that xdist keeps this order). xdist's own order (files with the most tests
# first) put the files of one or two slow tests last: on 2 workers the last of them ran alone while
# the other worker idled. The cost of a file is estimated from its marks: a slow test ~60 s (they take
# 30-300 s on CI's machine), any other ~1 s. Tests keep their order within a file.
SLOW_TEST_S = 60.0


def pytest_collection_modifyitems(config, items):
    cost: dict[str, float] = {}  # file -> estimated seconds, in the files' collection order
    for it in items:
        f = it.path
        cost[f] = cost.get(f, 0.0) + (SLOW_TEST_S if it.get_closest_marker("slow") else 1.0)
    rank = {f: i for i, f in enumerate(cost)}
    items.sort(key=lambda it: (-cost[it.path], rank[it.path]))


def pytest_terminal_summary(terminalreporter):
    """Every run says which golden level it checked (the probe is ~1 s; the controller of an xdist run
    does not see the workers' fixtures, so it probes itself, in the same environment)."""
    if (GOLDEN / "config.json").exists() and any(
            "test_golden.py" in r.nodeid for k in ("passed", "failed") for r in terminalreporter.stats.get(k, [])):
        from v4flash_backend.checks.gemm_probe import probe

        terminalreporter.write_line(f"golden level checked: {probe(GOLDEN).line()}")


@pytest.fixture(scope="session")
def tiny_model(golden_dir):
    from v4flash_backend import ops
    from v4flash_backend.model.loading import load_model

    ops.set_numerics("exact")
    return load_model(golden_dir)


@pytest.fixture(autouse=True)
def _default_ops():
    """Every test starts on the serving defaults (torch ops, exact numerics), whatever a previous
    test or a module-scoped fixture switched to; tests that need others set them explicitly."""
    from v4flash_backend import ops

    ops.set_backend("torch")
    ops.set_numerics("exact")
    ops.set_gemm_order(_GEMM_ORDER)
    yield
    ops.set_backend("torch")
    ops.set_numerics("exact")
    ops.set_gemm_order(_GEMM_ORDER)


# the GEMM order of this run ($V4FLASH_GEMM_ORDER: the platform's, or `make test`'s second order)
_GEMM_ORDER = os.environ.get("V4FLASH_GEMM_ORDER", "platform")


# A 4-layer model with every block type of V4.1 (window-only layer 0, Engram before layers 1 and 2,
# a ratio-2 KV / index source, a ratio-1 KV / index / candidate source, a ratio-1 index source whose
# scores the candidate blocks mask, the 3 DSpark stages tapping 1-3), random weights (seeded), the
# embedded model's tokenizer and attention shape (2 o-groups of 2 heads: W = 4 runs as attention
# groups of 2). For the tests that compile graphs: dynamo traces every op of a graph in Python
# (~3 ms a node on the CI's cores), and the verify graph of the 10-layer golden model has ~17,600
# nodes against ~7,500 here, so a compiled test costs well under half. What it checks (one graph per
# entry point, fullgraph, no sync, compiled = eager bit for bit) does not depend on depth.
SMALL = dict(n_layers=4, compress_ratios=(0, 2, 1, 1, 0, 0, 0), kv_source_layers=(1, 2),
             index_source_layers=(1, 2, 3), candidate_source_layer=2, engram_layer_ids=(1, 2),
             dspark_target_layer_ids=(1, 2, 3))


@pytest.fixture(scope="session")
def small_ckpt(tmp_path_factory):
    from tokenizers import Tokenizer

    from v4flash_backend.training.params import init_masters
    from v4flash_backend.training.tiny import export, tiny_config

    tok = Tokenizer.from_file(str(REPO / "models" / "v4flash-tiny" / "tokenizer.json"))
    cfg = tiny_config(tok, **SMALL)
    cfg.validate()
    out = tmp_path_factory.mktemp("small4")
    export(cfg, init_masters(cfg, 7), tok, out)
    return out


@pytest.fixture(scope="session")
def small_model(small_ckpt):
    from v4flash_backend import ops
    from v4flash_backend.model.loading import load_model

    ops.set_numerics("exact")
    return load_model(small_ckpt)
