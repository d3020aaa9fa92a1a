"""The lint check is real: ruff (the rules selected in pyproject.toml) reports nothing on src, tests, perf."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_ruff_check_is_clean():
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "src", "tests", "perf"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, f"ruff check src tests perf:\n{r.stdout}{r.stderr}"
