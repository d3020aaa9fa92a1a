"""Stress the threads of the `v4flash` model's Triton stub: refusals answered in ``execute``
(INVALID_ARG, top_p = 2) concurrently with short streams finished by the sender thread, both of
which end in a `requests_finished_total` increment and an e2e-histogram observation.

Before the model sent everything through one thread (serving/service.py), this crashed
tritonserver 2.51 with SIGSEGV in libtriton_python.so within a minute (the python backend's
metric updates are not thread-safe). It starts its own server (perf/soak.py --start-server's
temporary repository, 4 KV slots) on free loopback ports and prints one line:

    .venv/bin/python perf/stub_stress.py --seconds 120
    stub_stress: seconds=120 refused=... served=... other=... crashed=0

crashed=1 (exit code 1) when the server died or its log shows a signal.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import soak  # perf/soak.py, beside this file

from v4flash_backend.group.rank_group import free_ports  # noqa: E402 - soak puts src/ on the path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--refusers", type=int, default=6, help="client threads sending requests refused in execute")
    ap.add_argument("--streams", type=int, default=4, help="client threads sending 2-token streams")
    a = ap.parse_args(argv)
    h, g, m = free_ports(3)
    args = SimpleNamespace(http_port=h, grpc_port=g, metrics_port=m, seed=0, request_timeout_s=30.0)
    root = Path(tempfile.mkdtemp(prefix="v4flash-stub-stress-"))
    proc = soak.start_server(args, root)
    s = soak.Soak(args)
    stop = threading.Event()
    counts = {"refused": 0, "served": 0, "other": 0}
    lock = threading.Lock()

    def client(kw: dict, want: str) -> None:
        while not stop.is_set():
            r = s.grpc(soak.Rec("stress", "grpc", "v4flash"), kw)
            ok = r.code == "INVALID_ARG" if want == "refused" else r.status == "ok"
            with lock:
                counts[want if ok else "other"] += 1

    refuse = dict(input_ids=[0, 5], stream=False, max_tokens=1, top_p=2.0)
    stream = dict(input_ids=[0, 5], stream=True, max_tokens=2)
    threads = ([threading.Thread(target=client, args=(refuse, "refused"), daemon=True) for _ in range(a.refusers)]
               + [threading.Thread(target=client, args=(stream, "served"), daemon=True) for _ in range(a.streams)])
    t0 = time.monotonic()
    for t in threads:
        t.start()
    alive = True
    while alive and time.monotonic() - t0 < a.seconds:
        time.sleep(1.0)
        alive = proc.poll() is None and bool(soak.server_tree(h))
    elapsed = time.monotonic() - t0
    stop.set()
    for t in threads:
        t.join(40)
    log = (root / "tritonserver.log").read_text(errors="replace")
    crashed = not alive or any(k in log for k in ("Signal (", "lock_exception", "died of signal"))
    soak.stop_server(proc)
    if not crashed:
        shutil.rmtree(root, ignore_errors=True)
    print(f"stub_stress: seconds={elapsed:.0f} refused={counts['refused']} served={counts['served']} "
          f"other={counts['other']} crashed={int(crashed)}" + (f" log={root / 'tritonserver.log'}" if crashed else ""),
          flush=True)
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
