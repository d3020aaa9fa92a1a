"""How soon `make serve` answers, and how soon its compiled decode path takes over.

    .venv/bin/python perf/serve_ready.py [--starts 2] [--warm-timeout 1800] [--skip-warm] [--cold]

Starts `scripts/serve.sh` (what `make serve` runs, set up already) on free loopback ports with the
default model repository and the CPU default decode path (its own environment without
$V4FLASH_CPU_DECODE_GRAPH), times /v2/health/ready, then polls the metrics gauges
v4flash:warmup_graph_sets_warm / v4flash:warmup_graph_sets (the background compile's progress)
until the first set (one sequence's plain rounds) is warm and, unless --skip-warm, all of them;
stops the server; `--starts` times.
The second start is a restart: inductor's FX graph cache and the saved step-cost profile (when
$V4FLASH_STATE_DIR is set) are there. --cold: every start uses one new, empty inductor cache
directory (TORCHINDUCTOR_CACHE_DIR), so the first start compiles as on a fresh machine and the
next ones restart with what it cached. One line a start:

  serve-ready: start=<k> ready_s=<x> first_rounds_warm_s=<y> all_warm_s=<z> sets=<n>

and before it, from the rank group's log (read before the server stops), a line per set that got
warm, in order: the seconds since the compile began, the seconds the server's thread spent on the set
(waiting for the compile helper's report, then loading it from inductor's cache) and the helper's
seconds compiling it cold:

  serve-ready-set: start=<k> n=<i>/<total> at_s=<t> server_s=<s> helper_s=<h|none> set=<name>
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench_serving import free_ports  # noqa: E402 - perf/ is this script's directory

ROOT = Path(__file__).resolve().parents[1]


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status, r.read().decode()
    except Exception:  # noqa: BLE001 - not up yet
        return 0, ""


def gauges(text: str) -> tuple[int, int] | None:
    vals = {}
    for name in ("warmup_graph_sets_warm", "warmup_graph_sets"):
        m = re.search(rf"^v4flash:{name}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
        if m:
            vals[name] = int(float(m.group(1)))
    return (vals["warmup_graph_sets_warm"], vals["warmup_graph_sets"]) if len(vals) == 2 else None


WARM = re.compile(r"graphs warm: (.+) in ([0-9.]+) s \((\d+)/(\d+), (\d+) s since start\)")
HELPER = re.compile(r"compile helper: compiled (.+) in ([0-9.]+) s")


def set_lines(k: int, group_log: str) -> list[str]:
    """The serve-ready-set lines from the rank group's log text (module docstring)."""
    helper = {m.group(1): m.group(2) for m in HELPER.finditer(group_log)}
    return [f"serve-ready-set: start={k} n={m.group(3)}/{m.group(4)} at_s={m.group(5)} server_s={m.group(2)} "
            f"helper_s={helper.get(m.group(1), 'none')} set={m.group(1)}" for m in WARM.finditer(group_log)]


def group_log_text(server_log: Path) -> str:
    """The rank group's log, named in the server's log (it lives in a directory the group removes
    when it stops); empty when not found."""
    m = re.findall(rb"log (\S+/group\.log)\)", server_log.read_bytes())
    try:
        return Path(m[-1].decode()).read_text(errors="replace") if m else ""
    except OSError:
        return ""


def one_start(k: int, args, cache_dir: str | None) -> None:
    http, grpc, metrics = free_ports(3)
    env = dict(os.environ, HTTP_PORT=str(http), GRPC_PORT=str(grpc), METRICS_PORT=str(metrics),
               SERVE_MAX_RESTARTS="0", OPENAI_PORT="off")  # Triton's readiness alone
    env.pop("V4FLASH_CPU_DECODE_GRAPH", None)
    if cache_dir:
        env["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    log = open(Path(tempfile.gettempdir()) / f"serve_ready_{k}.log", "wb")
    t0 = time.monotonic()
    proc = subprocess.Popen(["bash", str(ROOT / "scripts/serve.sh")], env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    ready = first = warm = None
    n = 0
    try:
        while time.monotonic() - t0 < args.warm_timeout and proc.poll() is None:
            now = time.monotonic() - t0
            if ready is None:
                if get(f"http://127.0.0.1:{http}/v2/health/ready")[0] == 200:
                    ready = now
                    print(f"[serve-ready] start {k}: ready in {ready:.1f} s", file=sys.stderr, flush=True)
            else:
                g = gauges(get(f"http://127.0.0.1:{metrics}/metrics")[1])
                if g is not None and g[1]:
                    n = g[1]
                    if first is None and g[0] >= 1:
                        first = now
                        print(f"[serve-ready] start {k}: first rounds warm at {first:.0f} s", file=sys.stderr,
                              flush=True)
                    if g[0] >= g[1]:
                        warm = now
                    if warm is not None or (first is not None and args.skip_warm):
                        break
            time.sleep(0.25 if ready is None else 2.0)
    finally:
        log.flush()
        sets = set_lines(k, group_log_text(Path(log.name)))
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    if ready is None:
        sys.exit(f"start {k}: not ready (log {log.name})")

    def fmt(v):
        return "none" if v is None else f"{v:.1f}"

    for line in sets:
        print(line, flush=True)
    print(f"serve-ready: start={k} ready_s={fmt(ready)} first_rounds_warm_s={fmt(first)} all_warm_s={fmt(warm)} "
          f"sets={n}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--starts", type=int, default=2)
    ap.add_argument("--warm-timeout", type=float, default=1800.0, help="seconds to wait for the compile")
    ap.add_argument("--skip-warm", action="store_true", help="stop once the first set is warm")
    ap.add_argument("--cold", action="store_true", help="a new inductor cache directory for these starts")
    args = ap.parse_args()
    cache_dir = tempfile.mkdtemp(prefix="serve_ready_inductor_") if args.cold else None
    for k in range(1, args.starts + 1):
        one_start(k, args, cache_dir)


if __name__ == "__main__":
    main()
