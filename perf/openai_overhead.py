"""What the OpenAI frontend adds to latency: the same requests through Triton's own gRPC stream (the
`v4flash` model, tritonclient) and through the frontend's streamed /v1/completions (raw HTTP, SSE),
side by side.

    .venv/bin/python perf/openai_overhead.py --start-server [--rounds 3] [--max-tokens 32]
    .venv/bin/python perf/openai_overhead.py --grpc-url 127.0.0.1:8001 --openai-url http://127.0.0.1:9000/v1

Each round sends every prompt (perf/prompts_unseen_code.json: 16 code prompts) once each way, the
two requests of a prompt back to back and their order alternating, at concurrency 1, greedy with
ignore_eos, so both ways generate the same tokens; each way keeps its connection open (a gRPC
channel, an HTTP/1.1 keep-alive connection), so neither pays a connection set-up per request. Per
request: TTFT (send -> first token) and ITL ((last token - first token) / (tokens - 1)), timed in
this process for both. Per round the ratio of
the OpenAI way's median to Triton's; the summary line is the median of the rounds' ratios (their
spread on the line before it):

    openai-overhead: ttft_ratio=<x> itl_ratio=<y>

--start-server starts scripts/serve.sh (what `make serve` runs, with the frontend) on free loopback
ports with the embedded model, the eager decode path (the background compile of the default
path would change the speed during the run) and the prefix cache off (the second request of a
pair would otherwise find its prompt cached). Against a running server, keep that in mind: its
prefix cache favours whichever way goes second (the alternation halves it, it does not remove it).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import queue
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from v4flash_backend.client import build_inputs  # noqa: E402
from v4flash_backend.group.rank_group import free_ports  # noqa: E402


def start_server(root: Path):
    """serve.sh with a repository holding v4flash alone (prefix cache off); (proc, grpc url, openai url)."""
    repo = root / "repo"
    (repo / "v4flash" / "1").mkdir(parents=True)
    (repo / "v4flash" / "1" / "model.py").symlink_to(ROOT / "model_repository/v4flash/1/model.py")
    config = (ROOT / "model_repository/v4flash/config.pbtxt").read_text()
    config += 'parameters { key: "prefix_cache_bytes", value: { string_value: "0" } }\n'
    # the embedded model (the default checkpoint is found beside the repository: name it here)
    config += f'parameters {{ key: "checkpoint_dir", value: {{ string_value: "{ROOT / "models/v4flash-tiny"}" }} }}\n'
    (repo / "v4flash" / "config.pbtxt").write_text(config)
    http_port, grpc_port, metrics_port, openai_port = free_ports(4)
    env = dict(os.environ, MODEL_REPOSITORY=str(repo), HTTP_PORT=str(http_port), GRPC_PORT=str(grpc_port),
               METRICS_PORT=str(metrics_port), OPENAI_PORT=str(openai_port), SERVE_MAX_RESTARTS="0",
               V4FLASH_CPU_DECODE_GRAPH="eager", V4FLASH_STATE_DIR="")
    env.pop("V4FLASH_CHECKPOINT_DIR", None)
    env.pop("V4FLASH_OPENAI_KEY_FILE", None)
    log = open(root / "serve.log", "wb")
    proc = subprocess.Popen(["bash", str(ROOT / "scripts/serve.sh")], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + 300
    while True:
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{openai_port}/health", timeout=2).status == 200:
                break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"server did not start:\n{(root / 'serve.log').read_text()[-3000:]}")
        time.sleep(0.5)
    return proc, f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{openai_port}/v1"


class TritonWay:
    """Requests on Triton's gRPC stream of the `v4flash` model (text_input, as the frontend sends it),
    over one channel kept open (as the frontend keeps its own), timed here."""

    def __init__(self, url: str):
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(url)

    def __call__(self, prompt: str, n: int) -> tuple[float, float, int]:
        """(ttft_s, itl_s, tokens) of one request."""
        events: queue.Queue = queue.Queue()
        inputs = build_inputs(prompt, stream=True, exclude_input_in_output=True,
                              sampling_parameters={"max_tokens": n, "temperature": 0, "ignore_eos": True})
        t0 = time.monotonic()
        self.client.start_stream(callback=lambda result, error: events.put((result, error, time.monotonic())))
        first = last = None
        tokens = 0
        try:
            self.client.async_stream_infer("v4flash", inputs, enable_empty_final_response=True)
            while True:
                result, error, now = events.get(timeout=300)
                if error is not None:
                    sys.exit(f"triton: {error}")
                response = result.get_response()
                out = result.as_numpy("num_output_tokens")
                if out is not None and int(out.reshape(-1)[0]):
                    first = first if first is not None else now
                    last = now
                    tokens += int(out.reshape(-1)[0])
                if response.parameters["triton_final_response"].bool_param:
                    break
        finally:
            self.client.stop_stream()
        return first - t0, (last - first) / max(1, tokens - 1), tokens


class OpenAIWay:
    """Streamed /v1/completions requests read as raw SSE, on one HTTP/1.1 connection kept alive."""

    def __init__(self, base: str, key: str | None):
        u = urllib.parse.urlparse(base)
        self.conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
        self.path = u.path.rstrip("/") + "/completions"
        self.headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}

    def __call__(self, prompt: str, n: int) -> tuple[float, float, int]:
        body = json.dumps({"model": "v4flash", "prompt": prompt, "max_tokens": n, "temperature": 0,
                           "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
        t0 = time.monotonic()
        self.conn.request("POST", self.path, body, self.headers)
        resp = self.conn.getresponse()
        if resp.status != 200:
            sys.exit(f"/v1/completions answered {resp.status}: {resp.read()[:500]!r}")
        first = last = None
        tokens = 0
        while True:
            line = resp.readline()
            if not line or line.startswith(b"data: [DONE]"):
                break
            if not line.startswith(b"data: "):
                continue
            now = time.monotonic()
            ev = json.loads(line[6:])
            if "error" in ev:
                sys.exit(f"stream error: {ev['error']}")
            if ev.get("choices") and ev["choices"][0]["text"]:
                first = first if first is not None else now
                last = now
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
        resp.read()  # the end of the chunked body: the connection is then free for the next request
        return first - t0, (last - first) / max(1, tokens - 1), tokens


def ratio_summary(rounds: list[dict]) -> tuple[float, float, str]:
    """(ttft ratio, itl ratio, spread text): per round the OpenAI way's median over the Triton way's
    median; the medians of those ratios over the rounds, and their min-max."""
    tt = [statistics.median(r["openai_ttft"]) / statistics.median(r["triton_ttft"]) for r in rounds]
    it = [statistics.median(r["openai_itl"]) / statistics.median(r["triton_itl"]) for r in rounds]
    spread = (f"rounds={len(rounds)} ttft_ratio min-max {min(tt):.3f}-{max(tt):.3f} "
              f"itl_ratio min-max {min(it):.3f}-{max(it):.3f}")
    return statistics.median(tt), statistics.median(it), spread


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--start-server", action="store_true")
    ap.add_argument("--grpc-url", default="127.0.0.1:8001")
    ap.add_argument("--openai-url", default="http://127.0.0.1:9000/v1")
    ap.add_argument("--api-key-file", default=os.environ.get("V4FLASH_OPENAI_KEY_FILE"))
    ap.add_argument("--prompts", type=Path, default=ROOT / "perf" / "prompts_unseen_code.json")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup below (the server it started)
    prompts = json.loads(args.prompts.read_text())
    key = Path(args.api_key_file).read_text().strip() if args.api_key_file else None
    proc = tmp = None
    if args.start_server:
        tmp = tempfile.TemporaryDirectory(prefix="openai_overhead_")
        proc, args.grpc_url, args.openai_url = start_server(Path(tmp.name))
        key = None
    try:
        triton, openai_way = TritonWay(args.grpc_url), OpenAIWay(args.openai_url, key)
        for p in prompts[:2]:  # warm-up: first requests pay one-time costs on both sides
            triton(p, 4)
            openai_way(p, 4)
        rng = random.Random(args.seed)
        rounds = []
        for r in range(args.rounds):
            order = list(range(len(prompts)))
            rng.shuffle(order)
            res = {k: [] for k in ("triton_ttft", "triton_itl", "openai_ttft", "openai_itl")}
            for j, k in enumerate(order):
                ways = [("triton", triton), ("openai", openai_way)]
                for name, fn in (ways if (j + r) % 2 == 0 else ways[::-1]):
                    ttft, itl, tokens = fn(prompts[k], args.max_tokens)
                    if tokens != args.max_tokens:
                        sys.exit(f"{name}: {tokens} tokens, expected {args.max_tokens} (ignore_eos)")
                    res[f"{name}_ttft"].append(ttft)
                    res[f"{name}_itl"].append(itl)
            rounds.append(res)
            med = {k: statistics.median(v) * 1e3 for k, v in res.items()}
            print(f"round {r + 1}: ttft_ms triton={med['triton_ttft']:.1f} openai={med['openai_ttft']:.1f} "
                  f"itl_ms triton={med['triton_itl']:.2f} openai={med['openai_itl']:.2f} "
                  f"({len(prompts)} prompts x {args.max_tokens} tokens each way)", flush=True)
        ttft, itl, spread = ratio_summary(rounds)
        print(spread)
        print(f"openai-overhead: ttft_ratio={ttft:.3f} itl_ratio={itl:.3f}")
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
            tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
