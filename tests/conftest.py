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


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    if not (GOLDEN / "config.json").exists():
        pytest.fail(f"golden fixture missing at {GOLDEN} (CI lays shared/ beside the clone)")
    return GOLDEN


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
    yield
    ops.set_backend("torch")
    ops.set_numerics("exact")
