"""Serving overhead, side by side in one run: the same prompts and sampling through

  engine      the Engine in this process (serving.engine_inprocess.InProcessEngine)
  rank-group  the torchrun rank group through its socket client (serving.engine_rank_group)
  v4flash     Triton gRPC streaming to the v4flash model (input_ids; tritonclient.grpc)
  v4flash_text  Triton gRPC streaming through the ensemble (text_input)

at concurrency 1 and 8 (a closed loop: c requests in flight, the next submitted when one ends),
interleaved (every round runs every mode and concurrency once, in a rotated order) and repeated.
All with the default serving settings (settings.Settings(): max_num_seqs 8, DSpark on) on the eager
decode path ($V4FLASH_CPU_DECODE_GRAPH=eager: no background compile beside the measurement) and the
checkpoint `make serve` serves. Starts `scripts/serve.sh` (what `make serve` runs) on free loopback
ports and stops it afterwards, or uses a running server (--grpc-port).

Ends with
  serving: triton_vs_engine=<x> conc8_vs_conc1=<y> engine_b8_vs_b1=<z>
x: v4flash gRPC streaming tokens/s over the in-process engine's at concurrency 1; y: v4flash total
tokens/s at concurrency 8 over concurrency 1; z: the same ratio for the in-process engine (medians
of the per-round ratios: the runs of one round are back to back, so a shared machine's drifting
load cancels better than in ratios of medians).

  .venv/bin/python perf/bench_serving.py [--rounds 3] [--prompts 16] [--max-tokens 32] [--grpc-port P]
"""

from __future__ import annotations

import argparse
import os
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "perf"))

import numpy as np  # noqa: E402

from v4flash_backend.group.rank_group import free_ports  # noqa: E402
from v4flash_backend.request import GenerateRequest  # noqa: E402
from v4flash_backend.settings import Settings  # noqa: E402

MODES = ("engine", "rank-group", "v4flash", "v4flash_text")


def start_server(log_path: Path, timeout_s: float = 600.0):
    http_port, grpc_port, metrics_port = free_ports(3)
    env = dict(os.environ, HTTP_PORT=str(http_port), GRPC_PORT=str(grpc_port), METRICS_PORT=str(metrics_port),
               OPENAI_PORT="off")  # no OpenAI frontend: serve.sh then execs tritonserver
    env.setdefault("SERVE_MAX_RESTARTS", "0")  # no figures from a server restarted mid-run
    log = open(log_path, "wb")
    proc = subprocess.Popen(["bash", str(ROOT / "scripts/serve.sh")], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"tritonserver exited ({proc.returncode}); see {log_path}")
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=2).status == 200:
                return proc, grpc_port
        except OSError:
            pass
        if time.monotonic() > deadline:
            stop_server(proc)
            raise RuntimeError(f"tritonserver not ready in {timeout_s:.0f} s; see {log_path}")
        time.sleep(0.5)


def stop_server(proc) -> None:
    proc.send_signal(signal.SIGTERM)  # serve.sh execs tritonserver: the server itself
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# ---- one request per backend: submit(k, done) runs prompt k and calls done(num_tokens) ----------
class EngineBackend:
    """An EngineClient (in-process engine or rank group): submit() returns at once."""

    def __init__(self, client, prompts, max_tokens):
        self.client, self.prompts, self.max_tokens = client, prompts, max_tokens
        self.n = 0

    def submit(self, k, done):
        counted = [0]

        def on_event(ev):
            counted[0] += len(ev.get("token_ids") or ())
            if ev.get("event") == "error":
                raise SystemExit(f"engine error: {ev}")
            if ev.get("finish_reason"):
                done(counted[0])

        self.n += 1
        req = GenerateRequest(prompt=list(self.prompts[k]), max_tokens=self.max_tokens, ignore_eos=True)
        self.client.submit(req, f"b{self.n}", on_event)


class TritonBackend:
    """gRPC streaming, one stream per request on its own thread (what a client does)."""

    def __init__(self, url, model, prompts, texts, max_tokens):
        import tritonclient.grpc as grpcclient

        self.g, self.url, self.model = grpcclient, url, model
        self.prompts, self.texts, self.max_tokens = prompts, texts, max_tokens

    def _inputs(self, k):
        g = self.g

        def t(name, dtype, arr):
            x = g.InferInput(name, list(arr.shape), dtype)
            x.set_data_from_numpy(arr)
            return x

        first = (t("input_ids", "INT32", np.asarray(self.prompts[k], dtype=np.int32)) if self.model == "v4flash"
                 else t("text_input", "BYTES", np.array([self.texts[k].encode()], dtype=object)))
        return [first, t("stream", "BOOL", np.array([True])), t("max_tokens", "INT32", np.int32([self.max_tokens])),
                t("ignore_eos", "BOOL", np.array([True]))]

    def submit(self, k, done):
        threading.Thread(target=self._run, args=(k, done), daemon=True).start()

    def _run(self, k, done):
        client = self.g.InferenceServerClient(self.url)
        q = queue.Queue()
        client.start_stream(callback=lambda result, error: q.put((result, error)))
        client.async_stream_infer(self.model, self._inputs(k), enable_empty_final_response=True)
        n = 0
        while True:
            result, error = q.get(timeout=300)
            if error is not None:
                raise SystemExit(f"{self.model}: {error}")
            resp = result.get_response()
            if resp.outputs:
                n += int(result.as_numpy("num_output_tokens").reshape(-1)[0])
            if resp.parameters["triton_final_response"].bool_param:
                break
        client.stop_stream()
        client.close()
        done(n)


def closed_loop(backend, n_prompts: int, conc: int) -> tuple[float, int]:
    """All prompts, `conc` in flight at a time. Returns (total tokens/s, tokens)."""
    lock = threading.Lock()
    finished = threading.Event()
    state = {"next": 0, "done": 0, "tokens": 0}

    def done(n):
        with lock:
            state["done"] += 1
            state["tokens"] += n
            k = state["next"]
            state["next"] += k < n_prompts
        if k < n_prompts:
            backend.submit(k, done)
        if state["done"] == n_prompts:
            finished.set()

    t0 = time.perf_counter()
    with lock:
        first = min(conc, n_prompts)
        state["next"] = first
    for k in range(first):
        backend.submit(k, done)
    if not finished.wait(1800):
        raise SystemExit("benchmark run timed out")
    dt = time.perf_counter() - t0
    return state["tokens"] / dt, state["tokens"]


def load_prompts(ckpt: Path, n: int):
    from bench_dspark import heldout_prompts
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    # held-out corpus prompts for the embedded model (bench_dspark's); bench_dspark has no fixed
    # prompts to fall back on (the import of its PROMPTS failed before any run could start)
    ids = heldout_prompts(tok, max(n, 6))
    if ids is None:
        raise SystemExit("bench_serving: the held-out corpus (the interpreter's standard library sources) "
                         "is not available to cut prompts from")
    ids = [ids[i % len(ids)] for i in range(n)]
    # the texts go through the preprocessing tokenizer (BOS added); engine paths get the same ids
    texts = [tok.decode(p, skip_special_tokens=True) for p in ids]
    return [tok.encode(t).ids for t in texts], texts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16, help="prompts per (mode, concurrency) run")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--grpc-port", type=int, default=None, help="use a running server on 127.0.0.1:PORT")
    ap.add_argument("--log", default=str(ROOT / "artifacts" / "bench_serving_tritonserver.log"))
    a = ap.parse_args(argv)
    concs = [int(c) for c in a.concurrency.split(",")]

    from v4flash_backend.serving.engine_inprocess import InProcessEngine
    from v4flash_backend.serving.engine_rank_group import RankGroupEngine
    from v4flash_backend.serving.triton_settings import repository_checkpoint_dir

    ckpt, why = repository_checkpoint_dir(ROOT / "model_repository")
    # the eager decode path in every mode (the server inherits the variable): the CPU default compiles
    # its graphs in the background for minutes, which would run beside the measurement
    os.environ["V4FLASH_CPU_DECODE_GRAPH"] = "eager"
    settings = Settings().replace(checkpoint_dir=str(ckpt))
    prompts, texts = load_prompts(Path(ckpt), a.prompts)
    print(f"checkpoint {ckpt} ({why}); {len(prompts)} prompts of {min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens, max_tokens {a.max_tokens}, greedy, ignore_eos; "
          f"settings: max_num_seqs {settings.max_num_seqs}, spec_mode {settings.spec_mode}; "
          f"cores {os.cpu_count()}, load average {os.getloadavg()[0]:.1f}", flush=True)

    proc = None
    if a.grpc_port is None:
        Path(a.log).parent.mkdir(parents=True, exist_ok=True)
        proc, grpc_port = start_server(Path(a.log))
    else:
        grpc_port = a.grpc_port
    url = f"127.0.0.1:{grpc_port}"
    quiet = lambda msg: None  # noqa: E731
    engine = InProcessEngine(settings, quiet)
    group = RankGroupEngine(settings.replace(launcher="torchrun"), quiet)
    try:
        backends = {"engine": EngineBackend(engine, prompts, a.max_tokens),
                    "rank-group": EngineBackend(group, prompts, a.max_tokens),
                    "v4flash": TritonBackend(url, "v4flash", prompts, texts, a.max_tokens),
                    "v4flash_text": TritonBackend(url, "v4flash_text", prompts, texts, a.max_tokens)}
        for m, b in backends.items():  # warm-up: every path once (DSpark tables, stubs, sockets)
            closed_loop(b, 2, 2)
        runs = [(m, c) for m in MODES for c in concs]
        res = {r: [] for r in runs}
        print(f"{'round':>5} {'mode':>12} {'conc':>4} {'tok/s':>8} {'tokens':>6}", flush=True)
        for rnd in range(a.rounds):
            order = runs[rnd % len(runs):] + runs[:rnd % len(runs)]  # rotate: no mode always first
            for m, c in order:
                tps, n = closed_loop(backends[m], len(prompts), c)
                res[m, c].append(tps)
                print(f"{rnd:>5} {m:>12} {c:>4} {tps:8.2f} {n:>6}", flush=True)
    finally:
        engine.close()
        group.close()
        if proc is not None:
            stop_server(proc)

    med = {r: statistics.median(v) for r, v in res.items()}
    print(f"\n{'mode':>12} {'conc':>4} {'tok/s median':>12} {'min-max':>15}")
    for (m, c), v in res.items():
        print(f"{m:>12} {c:>4} {med[m, c]:12.2f} {min(v):7.2f}-{max(v):<7.2f}")
    lo, hi = concs[0], concs[-1]
    # The ratios pair the runs of one round (the load of a shared machine drifts between rounds;
    # within a round every mode runs once, back to back): medians of the per-round ratios.
    def ratio(a, b):
        return statistics.median(p / q for p, q in zip(res[a], res[b]))

    x = ratio(("v4flash", lo), ("engine", lo))
    y = ratio(("v4flash", hi), ("v4flash", lo))
    z = ratio(("engine", hi), ("engine", lo))
    print(f"per-round ratios (median): rank-group/engine at {lo} {ratio(('rank-group', lo), ('engine', lo)):.2f}; "
          f"v4flash_text/engine at {lo} {ratio(('v4flash_text', lo), ('engine', lo)):.2f}; "
          f"v4flash_text {hi} vs {lo} {ratio(('v4flash_text', hi), ('v4flash_text', lo)):.2f}; "
          f"rank-group {hi} vs {lo} {ratio(('rank-group', hi), ('rank-group', lo)):.2f}; load average now "
          f"{os.getloadavg()[0]:.1f}")
    print(f"serving: triton_vs_engine={x:.2f} conc8_vs_conc1={y:.2f} engine_b8_vs_b1={z:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
