"""perf_analyzer over a concurrency range against a running server (`make serve`), then
TTFT / inter-token latency / tokens-per-second tables per concurrency (p50/p90/p99).

    python perf/run_perf_analyzer.py [--url 127.0.0.1:8001] [--model v4flash_text]
        [--concurrency 1,2,4 | 1:8:1] [--requests N] [--input-data perf/perf_analyzer_input.json]
        [--out-dir artifacts/perf]
    python perf/run_perf_analyzer.py --from-export artifacts/perf/c1.json ...   # tables only

For each concurrency c it runs

    perf_analyzer -m MODEL -u URL -i grpc --streaming --input-data FILE
        --concurrency-range c:c --request-count N --profile-export-file OUT/c{c}.json -f OUT/c{c}.csv

(one run per level: perf_analyzer refuses --request-count with several levels, and a fixed
request count makes levels comparable). perf_analyzer itself only reports the latency of the
first response of a decoupled model ("Detected decoupled model, using the first response for
measuring latency"), i.e. TTFT; the per-response timestamps in the profile export give the
rest:

  TTFT          first response - request sent
  ITL           per token after the first: the gap since the previous response that carried
                tokens, divided by the tokens in this response (a DSpark chunk of 3 tokens after
                a gap g counts 3 x g/3) -- genai-perf's definition, and the server's
                v4flash:inter_token_latency_seconds histogram
  tok/s         all output tokens / (last response - first request) of the level
  tok/s/req     per request: (tokens - 1) / (last response - first response)
  accept        DSpark accepted / drafted tokens (num_accepted_tokens / num_drafted_tokens)

Token counts come from the num_output_tokens output of each response (1 when absent).
perf_analyzer runs with scripts/triton_env.sh's environment (its libcudart and libb64).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); nan for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _tokens(output: dict) -> int:
    n = output.get("num_output_tokens")
    if isinstance(n, list):
        n = sum(n)
    return 1 if n is None else int(n)


def _count(output: dict, key: str) -> int:
    v = output.get(key, 0)
    return int(sum(v) if isinstance(v, list) else v)


def summarize_experiment(exp: dict) -> dict:
    """Latency and throughput statistics of one perf_analyzer experiment (times in seconds)."""
    ttft, itl, per_req = [], [], []
    total_tokens = drafted = accepted = failed = 0
    start, end = math.inf, -math.inf
    for req in exp.get("requests", []):
        stamps = req.get("response_timestamps") or []
        outputs = req.get("response_outputs") or [{}] * len(stamps)
        if not stamps:
            failed += 1
            continue
        t0 = req["timestamp"]
        start, end = min(start, t0), max(end, stamps[-1])
        first = last = None
        n_req = 0
        for ts, out in zip(stamps, outputs):
            n = _tokens(out) if out else 0
            drafted += _count(out, "num_drafted_tokens") if out else 0
            accepted += _count(out, "num_accepted_tokens") if out else 0
            if n <= 0:
                continue  # an empty (e.g. flags-only final) response carries no token
            if first is None:
                first = ts
                ttft.append((ts - t0) / 1e9)
                itl += [0.0] * (n - 1)  # tokens that arrived with the first one
            else:
                itl += [(ts - last) / 1e9 / n] * n
            last = ts
            n_req += n
        total_tokens += n_req
        if first is not None and n_req > 1 and last > first:
            per_req.append((n_req - 1) / ((last - first) / 1e9))
    span = (end - start) / 1e9 if end > start else math.nan
    return {
        "concurrency": exp.get("experiment", {}).get("value"),
        "requests": len(exp.get("requests", [])) - failed,
        "failed": failed,
        "tokens": total_tokens,
        "ttft_s": {q: percentile(ttft, q) for q in (50, 90, 99)},
        "itl_s": {q: percentile(itl, q) for q in (50, 90, 99)},
        "tok_per_s": total_tokens / span if span and span > 0 else math.nan,
        "tok_per_s_per_req": {q: percentile(per_req, q) for q in (50, 90, 99)},
        "drafted": drafted,
        "accepted": accepted,
    }


def summarize_export(path: Path) -> list[dict]:
    data = json.loads(Path(path).read_text())
    return [summarize_experiment(e) for e in data.get("experiments", [])]


def format_table(rows: list[dict]) -> str:
    def ms(d):
        return "/".join(f"{d[q] * 1e3:.1f}" for q in (50, 90, 99))

    head = ["conc", "reqs", "TTFT ms p50/p90/p99", "ITL ms p50/p90/p99", "tok/s", "tok/s/req p50/p90/p99",
            "accept"]
    lines = []
    for r in rows:
        acc = f"{r['accepted']}/{r['drafted']}" + (f" ({r['accepted'] / r['drafted']:.0%})" if r["drafted"] else "")
        lines.append([str(r["concurrency"]), f"{r['requests']}" + (f" ({r['failed']} failed)" if r["failed"] else ""),
                      ms(r["ttft_s"]), ms(r["itl_s"]), f"{r['tok_per_s']:.2f}",
                      "/".join(f"{r['tok_per_s_per_req'][q]:.2f}" for q in (50, 90, 99)), acc])
    widths = [max(len(h), *(len(row[i]) for row in lines)) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(row) for row in lines])


def parse_levels(text: str) -> list[int]:
    """"1,2,4" or "start:end[:step]" -> levels."""
    if ":" in text:
        parts = [int(p) for p in text.split(":")]
        start, end, step = (parts + [1])[:3]
        return list(range(start, end + 1, step))
    return [int(p) for p in text.split(",") if p.strip()]


def run_level(args, c: int, out_dir: Path) -> Path:
    export = out_dir / f"c{c}.json"
    export.unlink(missing_ok=True)
    n = args.requests or max(4, 2 * c)
    cmd = ["perf_analyzer", "-m", args.model, "-u", args.url, "-i", "grpc", "--streaming",
           "--input-data", str(args.input_data), "--concurrency-range", f"{c}:{c}", "--request-count", str(n),
           "--profile-export-file", str(export), "-f", str(out_dir / f"c{c}.csv"), *args.extra]
    # triton_env.sh puts perf_analyzer on PATH and its shared libraries on LD_LIBRARY_PATH.
    shell = ['bash', '-c', f'source "{REPO}/scripts/triton_env.sh" && exec "$@"', "perf_analyzer"] + cmd
    print(f"[perf] concurrency {c}: {n} requests ...", file=sys.stderr, flush=True)
    proc = subprocess.run(shell, capture_output=True, text=True)
    (out_dir / f"c{c}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not export.exists():
        raise SystemExit(f"perf_analyzer failed at concurrency {c} (exit {proc.returncode}); "
                         f"log {out_dir / f'c{c}.log'}:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return export


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="127.0.0.1:8001", help="gRPC address of the server")
    ap.add_argument("--model", default="v4flash_text", help="v4flash_text (ensemble) or v4flash")
    ap.add_argument("--concurrency", default="1,2,4", help='levels: "1,2,4" or "1:8:1"')
    ap.add_argument("--requests", type=int, default=0, help="requests per level (default max(4, 2*c))")
    ap.add_argument("--input-data", type=Path, default=REPO / "perf" / "perf_analyzer_input.json")
    ap.add_argument("--out-dir", type=Path, default=REPO / "artifacts" / "perf")
    ap.add_argument("--from-export", nargs="+", type=Path, help="only summarize these profile exports")
    ap.add_argument("extra", nargs="*", help="after --: more perf_analyzer arguments")
    args = ap.parse_args(argv)
    if args.from_export:
        exports = args.from_export
    else:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        exports = [run_level(args, c, args.out_dir) for c in parse_levels(args.concurrency)]
    rows = [row for path in exports for row in summarize_export(path)]
    rows.sort(key=lambda r: r["concurrency"] or 0)
    print(f"model {args.model} at {args.url}" if not args.from_export else "from " + ", ".join(map(str, exports)))
    print(format_table(rows))
    if not args.from_export:
        (args.out_dir / "summary.json").write_text(json.dumps(rows, indent=1))
    return 0 if all(r["failed"] == 0 and r["requests"] > 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
