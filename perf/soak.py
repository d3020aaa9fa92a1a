"""Soak test with faults: mixed traffic against a running server for a long time.

    python perf/soak.py --seconds N --http-port P --grpc-port Q --metrics-port R [--kill-worker]
        [--concurrency 6] [--burst-every 60] [--burst-size N] [--seed 0] [--start-server]

drives the tritonserver on 127.0.0.1 (started with `make serve` / scripts/serve.sh, or by
`--start-server`, which serves a temporary copy of model_repository/ with small parameters:
4 KV slots, a wait queue of 4, so bursts overflow it) for N seconds with:

  - streaming and non-streaming requests over gRPC (stream_infer) and HTTP (generate /
    generate_stream), to both models (v4flash with ids or text, the v4flash_text ensemble);
  - greedy requests of fixed prompts, whose answers must equal a reference run of the same
    prompt taken before the load starts (exact numerics: greedy output does not depend on the
    batch, and DSpark is lossless), and seeded sampled ones;
  - random cancellations (gRPC stop_stream(cancel_requests=True)) and dropped connections
    (gRPC channel closed, HTTP socket shut mid-stream), slow readers (HTTP SSE with a small
    receive buffer and pauses), a share of malformed requests (model- and Triton-level);
  - bursts of --burst-size requests at once every --burst-every seconds, above the capacity
    (KV slots + wait queue): the overflow must be refused with UNAVAILABLE ("server at
    capacity"), the rest served; by default the size is the capacity the server's metrics give
    (kv_slots_total + requests_waiting_limit) plus 8, so that it overflows any configuration;
  - with --shared-prefix, a share of greedy id requests that begin with one shared block of
    PREFIX_LEN ids and end in one of a few short tails (and some whose prompt is a whole earlier
    one): the prefix cache serves them, their answers must equal the reference (taken first, so
    cold), and the report adds the prefix-cache counters and its bytes against its budget
    (--start-server sets prefix_cache_bytes to PREFIX_BUDGET, small, so entries are evicted);
  - with --kill-worker, one rank-group worker (found in the server's process tree) SIGKILLed
    at 40 % of the run: requests overlapping the outage may fail with UNAVAILABLE, and the
    model must serve again by itself.

Checks: every request gets exactly one final answer (tokens with finish_reason stop/length,
or an error whose code -- the "[CODE]" the v4flash model puts first in its messages, Triton
2.51 passing no code on gRPC streams -- is one this request may get); no request goes
unanswered (lost: no final within --request-timeout-s, or a stream that ends without one);
after the load the kv_slots_in_use gauge returns to 0 (leaked_slots = what it still shows);
greedy answers equal the reference. The RSS and open fds of the server's process tree
(tritonserver, its python stubs, the rank group) are sampled every --sample-s (5 s); rss_growth_mib is
the mean of the last fifth of the run minus the mean of the fifth after the warm-up (the
first fifth), so startup allocation does not count. The growth is split by cause, over the
same windows, from the server's own gauges: compile (v4flash:warmup_rss_bytes, what grew while the
CPU default's background compile ran, and its compile helper process's resident set: by design,
bounded by its graph sets), the
prefix cache (v4flash:prefix_cache_bytes: by design, bounded by prefix_cache_bytes) and the
rest, which must stay under 50 MiB. The compile's share is what grew while its thread ran, freed
or not, so the rest can read below zero: the group grew less than its compile allocated. With
--kill-worker the samples from 5 s after the recovery on (one rank group's life) are used:
across the kill the two windows held two different groups, whose RSS differed by -46 to +132 MiB
from run to run (6 runs), no leak.
The last line is exactly

  soak: seconds=<s> requests=<n> errors_unexpected=<e> lost=<l> leaked_slots=<k> rss_growth_mib=<m>

after `soak: rss_growth_by_cause compile_mib=<c> prefix_cache_mib=<p> rest_mib=<r>`,
and the exit status is 0 only when e = l = k = 0, the rest < 50 MiB, bursts were refused
with UNAVAILABLE, and (with --kill-worker) a worker was killed and the server recovered.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import queue
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if (REPO / "src").is_dir() and str(REPO / "src") not in sys.path:
    sys.path.insert(0, str(REPO / "src"))

import tritonclient.grpc as grpcclient  # noqa: E402

from v4flash_backend.client import build_inputs  # noqa: E402

CODE_RE = re.compile(r"\[(INVALID_ARG|UNAVAILABLE|CANCELLED|INTERNAL|UNKNOWN)\]")
CAPACITY = "server at capacity"
MIB = float(1 << 20)
MIN_SAMPLES = 5  # RSS samples the growth window needs
HOST = "127.0.0.1"

# Fixed prompts of the greedy requests (text through v4flash and the ensemble, ids through v4flash).
TEXT_PROMPTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):",
                "# Return the sum of a list\n", "for i in range(10):\n"]
ID_PROMPTS = [[0, 17, 250, 33, 901, 12], [0, 5, 6, 7], [0, 300, 301, 302, 303, 304, 305, 306], [0, 42]]
GREEDY_MAX_TOKENS = 24
# --shared-prefix: a block of ids every such prompt begins with (--start-server serves it with a
# prefill_chunk of 64, so entries at chunk boundaries and at prompt ends both serve), and its tails
PREFIX_LEN = 200
PREFIX_IDS = [0] + [3 + (7919 * k) % 997 for k in range(1, PREFIX_LEN)]
PREFIX_TAILS = [[11 + i, 400 + 3 * i, 77, 5 + i] for i in range(4)] + [[]]
PREFIX_BUDGET = 1 << 20


# ---- one request's record ---------------------------------------------------------------------
@dataclass
class Rec:
    kind: str
    transport: str  # grpc | http
    model: str
    allowed: frozenset = frozenset()  # error codes this request may get besides capacity / outage ones
    expect_error: bool = False  # malformed: an answer with tokens is wrong
    triton_level: bool = False  # refused by Triton before the model (no [CODE] in the message)
    ref_key: tuple | None = None  # greedy: compare with the reference
    start: float = field(default_factory=time.monotonic)
    end: float | None = None
    finals: int = 0
    after_final: int = 0  # responses that arrived after the final one
    status: str = "pending"  # ok | error | abandoned (client cancelled / dropped) | lost
    code: str | None = None
    message: str = ""
    ids: list = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    http_status: int | None = None

    def error(self, message: str, http_status: int | None = None) -> None:
        self.finals += 1
        self.status, self.message, self.http_status = "error", message, http_status
        m = CODE_RE.search(message)
        self.code = m.group(1) if m else None


class Soak:
    def __init__(self, args):
        self.a = args
        self.rng = random.Random(args.seed)
        self.rng_lock = threading.Lock()
        self.recs: list[Rec] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.refs: dict[tuple, dict] = {}
        self.kill_t: float | None = None
        self.recovered_t: float | None = None
        self.killed_pid: int | None = None
        self.new_workers: list[int] = []
        # (t, rss MiB, fds, procs, compile MiB, prefix cache MiB): the last two from the gauges
        self.samples: list[tuple[float, float, int, int, float, float]] = []
        self.bursts: list[dict] = []
        self.t0 = time.monotonic()

    # ---- helpers ------------------------------------------------------------------------------
    def rand(self):
        with self.rng_lock:
            return random.Random(self.rng.random())

    def add(self, rec: Rec) -> Rec:
        with self.lock:
            self.recs.append(rec)
        return rec

    def metrics(self) -> dict:
        text = urllib.request.urlopen(f"http://{HOST}:{self.a.metrics_port}/metrics", timeout=10).read().decode()
        out = {}
        for line in text.splitlines():
            if line.startswith("v4flash:") and "_bucket" not in line:
                name, value = line.rsplit(" ", 1)
                reason = re.search(r'reason="(\w+)"', name)
                out[name.split("{")[0] + (f"[{reason.group(1)}]" if reason else "")] = float(value)
        return out

    # ---- gRPC ---------------------------------------------------------------------------------
    def grpc(self, rec: Rec, inputs_kw: dict, cancel_after: int | None = None, drop_after: int | None = None,
             raw_inputs=None) -> Rec:
        """One request on its own stream; cancel_after / drop_after: abandon after that many
        data responses (stop_stream(cancel_requests=True) / closing the channel)."""
        q: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(f"{HOST}:{self.a.grpc_port}")
        abandoned = False
        try:
            client.start_stream(callback=lambda result, error: q.put((result, error)))
            inputs = raw_inputs if raw_inputs is not None else build_inputs(**inputs_kw)
            client.async_stream_infer(rec.model, inputs, enable_empty_final_response=True)
            deadline = time.monotonic() + self.a.request_timeout_s
            data = 0
            while rec.finals == 0:
                try:
                    result, error = q.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    rec.status = "lost"
                    rec.message = f"no final response within {self.a.request_timeout_s} s"
                    break
                if error is not None:
                    rec.error(str(error.message() if hasattr(error, "message") else error))
                    break
                resp = result.get_response()
                final = "triton_final_response" in resp.parameters and \
                    resp.parameters["triton_final_response"].bool_param
                if resp.outputs:
                    data += 1
                    ids = result.as_numpy("output_ids")
                    rec.ids += [] if ids is None else [int(t) for t in ids.reshape(-1)]
                    text = result.as_numpy("text_output")
                    if text is not None and text.size:
                        rec.text += text.reshape(-1)[0].decode("utf-8")
                    reason = result.as_numpy("finish_reason")
                    if reason is not None and reason.size:
                        r = reason.reshape(-1)[0]
                        rec.finish_reason = (r.decode() if isinstance(r, bytes) else str(r)) or rec.finish_reason
                if final:
                    rec.finals += 1
                    rec.status = "ok"
                    break
                if cancel_after is not None and data >= cancel_after:
                    abandoned = True
                    rec.status = "abandoned"
                    client.stop_stream(cancel_requests=True)
                    break
                if drop_after is not None and data >= drop_after:
                    abandoned = True
                    rec.status = "abandoned"
                    client.close()  # the channel goes away mid-stream
                    client = None
                    break
            # a response after the final one would be a second answer: look briefly
            if rec.finals and not abandoned:
                try:
                    q.get(timeout=0.05)
                    rec.after_final += 1
                except queue.Empty:
                    pass
        finally:
            rec.end = time.monotonic()
            if client is not None:
                try:
                    client.stop_stream(cancel_requests=rec.finals == 0)
                    client.close()
                except Exception:  # noqa: BLE001 - a stream already torn down
                    pass
        return rec

    # ---- HTTP ---------------------------------------------------------------------------------
    def http(self, rec: Rec, body, stream: bool, drop_after: int | None = None, slow_s: float = 0.0) -> Rec:
        path = f"/v2/models/{rec.model}/generate" + ("_stream" if stream else "")
        payload = body if isinstance(body, (bytes, str)) else json.dumps(body)
        conn = http.client.HTTPConnection(HOST, self.a.http_port, timeout=self.a.request_timeout_s)
        try:
            conn.connect()
            if slow_s:  # a slow reader: a small receive window and pauses between reads
                conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            conn.request("POST", path, payload, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            rec.http_status = resp.status
            if not stream or resp.status != 200:
                # a refused generate_stream comes as SSE from the model ("data: {error}", the
                # status Triton's) but as a plain JSON error when Triton itself refuses it
                data = resp.read()
                events = [json.loads(x[6:]) for x in data.splitlines() if x.startswith(b"data: ")]
                if stream and events:
                    for ev in events:
                        if rec.finals:
                            rec.after_final += 1
                        else:
                            self._http_event(rec, ev, resp.status)
                    if not rec.finals:
                        rec.status, rec.message = "lost", "event stream ended without a final event"
                else:
                    self._http_answer(rec, data, resp.status)
                return rec
            events = 0
            while True:
                # resp.readline decodes the chunked body and returns b"" at its end (the raw
                # socket would block there: the connection stays open for the next request)
                line = resp.readline()
                if not line:
                    break
                if not line.startswith(b"data: "):
                    continue
                ev = json.loads(line[6:])
                if rec.finals:
                    rec.after_final += 1
                    continue
                events += 1
                self._http_event(rec, ev, resp.status)
                if slow_s:
                    time.sleep(slow_s)
                if drop_after is not None and events >= drop_after and not rec.finals:
                    rec.status = "abandoned"
                    conn.sock.shutdown(socket.SHUT_RDWR)
                    break
            if rec.finals == 0 and rec.status != "abandoned":
                rec.status, rec.message = "lost", "event stream ended without a final event"
        except (OSError, http.client.HTTPException, ValueError) as exc:
            if rec.finals == 0 and rec.status != "abandoned":
                rec.status, rec.message = "lost", f"{type(exc).__name__}: {exc}"
        finally:
            rec.end = time.monotonic()
            conn.close()
        return rec

    def _http_event(self, rec: Rec, ev: dict, status: int) -> None:
        if "error" in ev:
            rec.error(str(ev["error"]), status)
            return
        ids = ev.get("output_ids", [])
        rec.ids += ids if isinstance(ids, list) else [ids]
        rec.text += ev.get("text_output", "") or ""
        if ev.get("finish_reason"):
            rec.finish_reason = ev["finish_reason"]
            rec.finals += 1
            rec.status = "ok"

    def _http_answer(self, rec: Rec, data: bytes, status: int) -> None:
        try:
            obj = json.loads(data)
        except ValueError:
            rec.error(f"HTTP {status}: {data[:200]!r}", status)
            return
        if status != 200 or "error" in obj:
            rec.error(str(obj.get("error", obj)), status)
            return
        self._http_event(rec, obj, status)
        if not rec.finals:
            rec.status, rec.message = "lost", f"answer without finish_reason: {str(obj)[:200]}"

    # ---- the request mix ----------------------------------------------------------------------
    def greedy(self, r: random.Random) -> Rec:
        exclude = True
        if r.random() < 0.5:
            i = r.randrange(len(TEXT_PROMPTS))
            model = r.choice(["v4flash", "v4flash_text"])
            key = ("text", model, i)
            prompt = TEXT_PROMPTS[i]
            if r.random() < 0.6:
                rec = self.add(Rec("greedy", "grpc", model, ref_key=key))
                return self.grpc(rec, dict(prompt=prompt, stream=r.random() < 0.6, exclude_input_in_output=exclude,
                                           max_tokens=GREEDY_MAX_TOKENS))
            rec = self.add(Rec("greedy", "http", model, ref_key=key))
            stream = r.random() < 0.5
            return self.http(rec, {"text_input": prompt, "max_tokens": GREEDY_MAX_TOKENS, "stream": stream,
                                   "exclude_input_in_output": exclude}, stream)
        i = r.randrange(len(ID_PROMPTS))
        key = ("ids", "v4flash", i)
        if r.random() < 0.6:
            rec = self.add(Rec("greedy", "grpc", "v4flash", ref_key=key))
            return self.grpc(rec, dict(input_ids=ID_PROMPTS[i], stream=r.random() < 0.6,
                                       exclude_input_in_output=exclude, max_tokens=GREEDY_MAX_TOKENS))
        rec = self.add(Rec("greedy", "http", "v4flash", ref_key=key))
        stream = r.random() < 0.5
        return self.http(rec, {"input_ids": ID_PROMPTS[i], "max_tokens": GREEDY_MAX_TOKENS, "stream": stream,
                               "exclude_input_in_output": exclude}, stream)

    def sampled(self, r: random.Random) -> Rec:
        model = r.choice(["v4flash", "v4flash_text"])
        kw = dict(max_tokens=r.randint(4, 32), temperature=r.choice([0.7, 1.0, 1.3]), top_k=r.choice([0, 20, 50]),
                  top_p=r.choice([1.0, 0.9]), seed=r.randrange(2**32))
        prompt = r.choice(TEXT_PROMPTS) + r.choice(["", "x", " = "])
        if r.random() < 0.5:
            rec = self.add(Rec("sampled", "grpc", model))
            return self.grpc(rec, dict(prompt=prompt, stream=r.random() < 0.7, exclude_input_in_output=True, **kw))
        rec = self.add(Rec("sampled", "http", model))
        stream = r.random() < 0.6
        return self.http(rec, dict(text_input=prompt, stream=stream, exclude_input_in_output=True, **kw), stream)

    def cancelled(self, r: random.Random) -> Rec:
        # on v4flash: through the ensemble Triton 2.51 does not pass a cancellation to the
        # running step (README), the generation would just run to max_tokens
        kw = dict(input_ids=r.choice(ID_PROMPTS), max_tokens=r.randint(16, 64), ignore_eos=True)
        how = r.choice(["cancel", "grpc_drop", "http_drop"])
        after = r.randint(1, 4)
        if how == "cancel":
            return self.grpc(self.add(Rec("cancel", "grpc", "v4flash")), kw, cancel_after=after)
        if how == "grpc_drop":
            return self.grpc(self.add(Rec("drop", "grpc", "v4flash")), kw, drop_after=after)
        return self.http(self.add(Rec("drop", "http", "v4flash")), dict(kw, stream=True), True, drop_after=after)

    def slow(self, r: random.Random) -> Rec:
        i = r.randrange(len(ID_PROMPTS))
        rec = self.add(Rec("slow", "http", "v4flash", ref_key=("ids", "v4flash", i)))
        return self.http(rec, {"input_ids": ID_PROMPTS[i], "max_tokens": GREEDY_MAX_TOKENS, "stream": True,
                               "exclude_input_in_output": True}, True, slow_s=r.choice([0.2, 0.5, 1.0]))

    MALFORMED = [  # (model, body, refused by Triton before the model)
        ("v4flash", {"input_ids": []}, False),
        ("v4flash", {"text_input": ""}, False),
        ("v4flash_text", {"text_input": ""}, False),
        ("v4flash", {"input_ids": [0, 5], "max_tokens": 100000}, False),
        ("v4flash", {"input_ids": [0, 10**6]}, False),
        ("v4flash", {"text_input": "x", "top_p": 1.5}, False),
        ("v4flash_text", {"text_input": "x", "temperature": -1.0}, False),
        ("v4flash", {"text_input": "x", "sampling_parameters": "{max_tokens: 3"}, False),
        ("v4flash", {"text_input": "x", "sampling_parameters": '{"max_token": 3}'}, False),
        ("v4flash", {"input_ids": [0, 5], "text_input": "hi"}, False),
        ("v4flash", {"max_tokens": 3}, False),
        ("v4flash", {"input_ids": "abc"}, True),
        ("v4flash", b"{not json", True),
        ("v4flash_text", {"text_input": "x", "max_tokens": "many"}, True),
    ]

    def malformed(self, r: random.Random) -> Rec:
        if r.random() < 0.15:  # a wrong datatype over gRPC (Triton checks it against config.pbtxt)
            wrong = grpcclient.InferInput("input_ids", [2], "FP32")
            import numpy as np

            wrong.set_data_from_numpy(np.array([1.0, 2.0], dtype=np.float32))
            rec = self.add(Rec("malformed", "grpc", "v4flash", expect_error=True, triton_level=True))
            return self.grpc(rec, {}, raw_inputs=[wrong])
        model, body, triton = r.choice(self.MALFORMED)
        rec = self.add(Rec("malformed", "http", model, allowed=frozenset({"INVALID_ARG"}), expect_error=True,
                           triton_level=triton))
        return self.http(rec, body, stream=r.random() < 0.3 and isinstance(body, dict))

    def shared_prefix(self, r: random.Random) -> Rec:
        i = r.randrange(len(PREFIX_TAILS))
        ids = PREFIX_IDS + PREFIX_TAILS[i]
        key = ("prefix", "v4flash", i)
        if r.random() < 0.7:
            rec = self.add(Rec("prefix", "grpc", "v4flash", ref_key=key))
            return self.grpc(rec, dict(input_ids=ids, stream=r.random() < 0.6, exclude_input_in_output=True,
                                       max_tokens=GREEDY_MAX_TOKENS))
        rec = self.add(Rec("prefix", "http", "v4flash", ref_key=key))
        stream = r.random() < 0.5
        return self.http(rec, {"input_ids": ids, "max_tokens": GREEDY_MAX_TOKENS, "stream": stream,
                               "exclude_input_in_output": True}, stream)

    def one(self, r: random.Random) -> Rec:
        if self.a.shared_prefix and r.random() < 0.4:
            return self.shared_prefix(r)
        x = r.random()
        if x < 0.35:
            return self.greedy(r)
        if x < 0.60:
            return self.sampled(r)
        if x < 0.78:
            return self.cancelled(r)
        if x < 0.85:
            return self.slow(r)
        return self.malformed(r)

    # ---- threads -------------------------------------------------------------------------------
    def client_loop(self, k: int) -> None:
        r = random.Random(self.a.seed * 1000 + k)
        while not self.stop.is_set():
            try:
                self.one(r)
            except Exception as exc:  # noqa: BLE001 - a harness bug must show, not stop the soak
                self.add(Rec("harness", "-", "-", status="error", message=f"{type(exc).__name__}: {exc}", finals=1))
            time.sleep(r.uniform(0.0, self.a.think_s))

    def burst_loop(self) -> None:
        r = random.Random(self.a.seed + 7)
        while not self.stop.wait(self.a.burst_every):
            recs: list[Rec] = []
            threads = []
            for i in range(self.burst_size):
                if i % 2:
                    rec = Rec("burst", "grpc", "v4flash")
                    kw = dict(input_ids=[0, 7 + i], stream=False, exclude_input_in_output=True, max_tokens=8,
                              ignore_eos=True)
                    t = threading.Thread(target=self.grpc, args=(rec, kw))
                else:
                    rec = Rec("burst", "http", r.choice(["v4flash", "v4flash_text"]))
                    body = {"text_input": f"x{i} = ", "max_tokens": 8, "ignore_eos": True}
                    t = threading.Thread(target=self.http, args=(rec, body, False))
                recs.append(self.add(rec))
                threads.append(t)
            for t in threads:
                t.start()
            for t in threads:
                t.join(self.a.request_timeout_s + 10)
            refused = sum(1 for x in recs if x.code == "UNAVAILABLE" and CAPACITY in x.message)
            served = sum(1 for x in recs if x.status == "ok")
            self.bursts.append(dict(t=round(recs[0].start - self.t0), size=len(recs), served=served, refused=refused))

    def sample_loop(self) -> None:
        last_print = time.monotonic()
        gauges = (0.0, 0.0)
        while True:
            s = process_tree_usage(self.a.http_port)
            if s is not None:
                try:
                    m = self.metrics()
                    gauges = (m.get("v4flash:warmup_rss_bytes", 0) / MIB, m.get("v4flash:prefix_cache_bytes", 0) / MIB)
                except Exception:  # noqa: BLE001 - no gauges this time (a group restarting): the last ones
                    pass
                self.samples.append((time.monotonic() - self.t0, *s, *gauges))
            if time.monotonic() - last_print >= self.a.progress_s and self.samples:
                last_print = time.monotonic()
                with self.lock:
                    n = len(self.recs)
                    done = sum(1 for r in self.recs if r.end is not None)
                _, rss, fds, procs, _, _ = self.samples[-1]
                print(f"soak: t={time.monotonic() - self.t0:.0f}s requests={n} done={done} rss_mib={rss:.1f} "
                      f"fds={fds} procs={procs}", flush=True)
            if self.stop.wait(self.a.sample_s):
                return

    def kill_loop(self) -> None:
        if self.stop.wait(self.a.seconds * 0.4):
            return
        workers = worker_pids(self.a.http_port)
        if not workers:
            self.add(Rec("kill", "-", "-", status="error", finals=1, message="no rank-group worker found to kill"))
            return
        self.killed_pid = workers[0]
        self.kill_t = time.monotonic()
        os.kill(self.killed_pid, signal.SIGKILL)
        print(f"soak: t={self.kill_t - self.t0:.0f}s killed worker pid {self.killed_pid}", flush=True)
        deadline = time.monotonic() + self.a.request_timeout_s * 2
        while time.monotonic() < deadline:  # recovered = a small request served again
            rec = self.grpc(Rec("probe", "grpc", "v4flash"), dict(input_ids=[0, 5], stream=False, max_tokens=1))
            if rec.status == "ok":
                self.recovered_t = time.monotonic()
                self.new_workers = worker_pids(self.a.http_port)
                print(f"soak: t={self.recovered_t - self.t0:.0f}s serving again after "
                      f"{self.recovered_t - self.kill_t:.1f} s (workers {self.new_workers})", flush=True)
                return
            time.sleep(1.0)

    # ---- the run -------------------------------------------------------------------------------
    def reference(self) -> None:
        """Greedy answers of the fixed prompts, one at a time on the idle server."""
        for i, prompt in enumerate(TEXT_PROMPTS):
            for model in ("v4flash", "v4flash_text"):
                kw = dict(prompt=prompt, stream=False, exclude_input_in_output=True, max_tokens=GREEDY_MAX_TOKENS)
                rec = self.grpc(Rec("ref", "grpc", model), kw)
                assert rec.status == "ok", f"reference run failed: {rec.message}"
                self.refs[("text", model, i)] = dict(ids=rec.ids, text=rec.text)
        for i, ids in enumerate(ID_PROMPTS):
            kw = dict(input_ids=ids, stream=False, exclude_input_in_output=True, max_tokens=GREEDY_MAX_TOKENS)
            rec = self.grpc(Rec("ref", "grpc", "v4flash"), kw)
            assert rec.status == "ok", f"reference run failed: {rec.message}"
            self.refs[("ids", "v4flash", i)] = dict(ids=rec.ids, text=rec.text)
        for i, tail in enumerate(PREFIX_TAILS if self.a.shared_prefix else []):
            kw = dict(input_ids=PREFIX_IDS + tail, stream=False, exclude_input_in_output=True,
                      max_tokens=GREEDY_MAX_TOKENS)
            rec = self.grpc(Rec("ref", "grpc", "v4flash"), kw)
            assert rec.status == "ok", f"reference run failed: {rec.message}"
            self.refs[("prefix", "v4flash", i)] = dict(ids=rec.ids, text=rec.text)

    def run(self) -> int:
        self.reference()
        before = self.metrics()
        capacity = before.get("v4flash:kv_slots_total", 0) + before.get("v4flash:requests_waiting_limit", 24)
        self.burst_size = self.a.burst_size or int(capacity) + 8
        self.t0 = time.monotonic()
        threads = [threading.Thread(target=self.client_loop, args=(k,), daemon=True) for k in range(self.a.concurrency)]
        threads.append(threading.Thread(target=self.burst_loop, daemon=True))
        sampler = threading.Thread(target=self.sample_loop, daemon=True)
        if self.a.kill_worker:
            threads.append(threading.Thread(target=self.kill_loop, daemon=True))
        sampler.start()
        for t in threads:
            t.start()
        self.stop.wait(self.a.seconds)
        self.stop.set()
        load_end = time.monotonic() - self.t0
        for t in threads:
            t.join(self.a.request_timeout_s + 30)
        # The slot gauge must come back to 0 once nothing is in flight (cancelled ensemble
        # requests run on to max_tokens first).
        deadline = time.monotonic() + 120
        while True:
            after = self.metrics()
            if (after.get("v4flash:kv_slots_in_use", 0) == 0 and after.get("v4flash:requests_in_flight", 0) == 0) \
                    or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        sampler.join(10)
        return self.report(before, after, load_end)

    def allowed(self, rec: Rec) -> bool:
        """Is this request's answer one it may get?"""
        if rec.after_final or rec.finals > 1:
            return False
        if rec.status == "abandoned":
            return True
        if rec.status == "ok":
            if rec.expect_error or rec.finish_reason not in ("stop", "length"):
                return False
            if rec.ref_key is not None:
                ref = self.refs[rec.ref_key]
                return rec.ids == ref["ids"] and (not ref["text"] or rec.text == ref["text"])
            return True
        if rec.status != "error":
            return False
        if rec.triton_level:  # Triton's own answer (2.51 gives HTTP 500 for a body it cannot parse)
            return rec.code is None and (rec.http_status is None or 400 <= rec.http_status < 600)
        if rec.code in rec.allowed:
            return True
        if rec.code == "UNAVAILABLE" and CAPACITY in rec.message and not rec.expect_error:
            return True
        if rec.code == "UNAVAILABLE" and self.kill_t is not None:  # overlaps the outage
            until = (self.recovered_t or time.monotonic()) + 2.0
            return rec.start <= until and (rec.end or 0) >= self.kill_t - 1.0
        return False

    def report(self, before: dict, after: dict, load_end: float) -> int:
        recs = [r for r in self.recs if r.kind not in ("probe",)]
        lost = [r for r in recs if r.status in ("lost", "pending")]
        bad = [r for r in recs if r.status not in ("lost", "pending") and not self.allowed(r)]
        by_kind: dict[str, dict[str, int]] = {}
        for r in recs:
            d = by_kind.setdefault(r.kind, {})
            label = r.status if r.status != "error" else f"error:{r.code or 'triton'}"
            d[label] = d.get(label, 0) + 1
        for kind, d in sorted(by_kind.items()):
            print(f"soak: {kind:9s} " + " ".join(f"{k}={v}" for k, v in sorted(d.items())))
        for r in (bad + lost)[:15]:
            print(f"soak: UNEXPECTED {r.kind} {r.transport} {r.model} status={r.status} code={r.code} "
                  f"http={r.http_status} reason={r.finish_reason!r} finals={r.finals} after_final={r.after_final} "
                  f"t={r.start - self.t0:.0f}s msg={r.message[:160]!r}")
        refused = sum(b["refused"] for b in self.bursts)
        print(f"soak: bursts={len(self.bursts)} size={self.burst_size} refused_unavailable={refused} "
              f"served={sum(b['served'] for b in self.bursts)}")

        def delta(name):
            return after.get(name, 0) - before.get(name, 0)

        print(f"soak: server rejected_total+={delta('v4flash:requests_rejected_total'):.0f} "
              f"expired_total+={delta('v4flash:requests_expired_total'):.0f} "
              f"finished: " + " ".join(f"{k}+={delta(f'v4flash:requests_finished_total[{k}]'):.0f}"
                                       for k in ("stop", "length", "cancelled", "error")))
        if self.a.shared_prefix:
            nbytes = after.get("v4flash:prefix_cache_bytes", -1)
            budget = self.a.prefix_budget
            print(f"soak: prefix_cache hits+={delta('v4flash:prefix_cache_hits_total'):.0f} "
                  f"misses+={delta('v4flash:prefix_cache_misses_total'):.0f} "
                  f"cached_tokens+={delta('v4flash:prefix_cache_cached_tokens_total'):.0f} "
                  f"evictions+={delta('v4flash:prefix_cache_evictions_total'):.0f} bytes={nbytes:.0f} "
                  f"budget={budget} within_budget={'yes' if 0 <= nbytes <= budget else 'no'}")
        growth = compile_mib = prefix_mib = rest = 0.0
        samples = self.samples
        if self.a.kill_worker and self.recovered_t is not None:  # the restarted group's life only
            samples = [x for x in samples if x[0] >= self.recovered_t - self.t0 + 5.0]
        # growth is judged between two fifths of the window: fewer samples than MIN_SAMPLES judge
        # nothing (a window of one sample read 0 MiB whatever grew): then the run fails, saying so
        judged = len(samples) >= MIN_SAMPLES
        if not judged:
            print(f"soak: {len(samples)} RSS samples in the window, fewer than {MIN_SAMPLES}: growth not judged "
                  f"(a longer run, or a shorter --sample-s)")
        if samples:
            n = len(samples)
            fifth = max(1, n // 5)
            warm = samples[fifth:2 * fifth] or samples[:1]
            last = samples[-fifth:]
            mean = lambda xs, i: sum(x[i] for x in xs) / len(xs)  # noqa: E731
            growth = mean(last, 1) - mean(warm, 1)
            compile_mib, prefix_mib = mean(last, 4) - mean(warm, 4), mean(last, 5) - mean(warm, 5)
            rest = growth - compile_mib - prefix_mib
            print(f"soak: rss_mib warm={mean(warm, 1):.1f} last={mean(last, 1):.1f} "
                  f"max={max(x[1] for x in samples):.1f} "
                  f"fds warm={mean(warm, 2):.0f} last={mean(last, 2):.0f} max={max(x[2] for x in samples)} "
                  f"procs={samples[-1][3]} samples={n} of {len(self.samples)}")
        killed_ok = True
        if self.a.kill_worker:
            killed_ok = self.killed_pid is not None and self.recovered_t is not None
            print(f"soak: kill_worker pid={self.killed_pid} recovered_s="
                  f"{(self.recovered_t - self.kill_t) if killed_ok else float('nan'):.1f}")
        leaked = int(after.get("v4flash:kv_slots_in_use", -1))
        print(f"soak: rss_growth_by_cause compile_mib={compile_mib:.1f} prefix_cache_mib={prefix_mib:.1f} "
              f"rest_mib={rest:.1f}")
        print(f"soak: seconds={load_end:.0f} requests={len(recs)} errors_unexpected={len(bad)} lost={len(lost)} "
              f"leaked_slots={leaked} rss_growth_mib={growth:.1f}", flush=True)
        ok = (not bad and not lost and leaked == 0 and judged and rest < 50 and (refused > 0 or not self.bursts)
              and killed_ok)
        if self.a.shared_prefix:
            ok = ok and 0 <= after.get("v4flash:prefix_cache_bytes", -1) <= self.a.prefix_budget
        return 0 if ok else 1


# ---- the server's process tree ---------------------------------------------------------------------
def _procs() -> dict[int, tuple[int, str]]:
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        out[int(d)] = (ppid, cmd)
    return out


def server_tree(http_port: int) -> list[int]:
    """tritonserver serving --http-port http_port, and all its descendants."""
    procs = _procs()
    roots = [p for p, (_, cmd) in procs.items()
             if "tritonserver" in cmd.split(" ")[0] and re.search(rf"--http-port[ =]{http_port}\b", cmd)]
    tree, todo = [], list(roots)
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += [c for c, (pp, _) in procs.items() if pp == p]
    return tree


def worker_pids(http_port: int) -> list[int]:
    procs = _procs()
    # the ranks themselves, not torchrun (whose command line names the worker module too)
    return sorted(p for p in server_tree(http_port) if "v4flash_backend.group.worker" in procs.get(p, (0, ""))[1]
                  and "torch.distributed.run" not in procs[p][1])


def process_tree_usage(http_port: int) -> tuple[float, int, int] | None:
    """(RSS MiB, open fds, processes) summed over the server's process tree."""
    tree = server_tree(http_port)
    if not tree:
        return None
    rss_kb, fds = 0, 0
    for p in tree:
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        rss_kb += int(line.split()[1])
            fds += len(os.listdir(f"/proc/{p}/fd"))
        except OSError:
            continue
    return rss_kb / 1024, fds, len(tree)


# ---- --start-server ---------------------------------------------------------------------------------
SERVER_PARAMS = {"checkpoint_dir": str(REPO / "models" / "v4flash-tiny"), "max_num_seqs": "4", "max_model_len": "256",
                 "default_max_tokens": "16"}
EXTRA_PARAMS = {"max_queue_size": "4", "stats_interval_s": "0.2"}


def build_repository(root: Path, params: dict | None = None) -> Path:
    """A copy of model_repository/ (model.py files symlinked) with small v4flash parameters."""
    repo = root / "repo"
    for name in ("preprocessing", "postprocessing", "v4flash"):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").symlink_to(REPO / "model_repository" / name / "1" / "model.py")
        if name != "v4flash":
            shutil.copy(REPO / "model_repository" / name / "config.pbtxt", repo / name)
    config = (REPO / "model_repository/v4flash/config.pbtxt").read_text()
    values = dict(SERVER_PARAMS, **EXTRA_PARAMS, **(params or {}))
    for key, value in values.items():
        pattern = r'(key: "%s", value: \{ string_value: )"[^"]*"' % re.escape(key)
        config, n = re.subn(pattern, r'\g<1>"%s"' % value, config)
        if n == 0:
            config += f'parameters {{ key: "{key}", value: {{ string_value: "{value}" }} }}\n'
    (repo / "v4flash" / "config.pbtxt").write_text(config)
    shutil.copytree(REPO / "model_repository/v4flash_text", repo / "v4flash_text")
    return repo


def start_server(args, root: Path, ready_timeout_s: float = 300.0) -> subprocess.Popen:
    extra = {"prefix_cache_bytes": str(args.prefix_budget), "prefill_chunk": "64"} if args.shared_prefix else None
    repo = build_repository(root, extra)
    env = dict(os.environ, MODEL_REPOSITORY=str(repo), HTTP_PORT=str(args.http_port), GRPC_PORT=str(args.grpc_port),
               METRICS_PORT=str(args.metrics_port), OPENAI_PORT="off")  # Triton's own protocols
    env.pop("V4FLASH_CHECKPOINT_DIR", None)
    env.setdefault("SERVE_MAX_RESTARTS", "0")  # a crash must show as one, not as a restarted server
    log = open(root / "tritonserver.log", "wb")
    proc = subprocess.Popen(["bash", str(REPO / "scripts/serve.sh")], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    log.close()
    deadline = time.monotonic() + ready_timeout_s
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"soak: tritonserver exited ({proc.returncode}); log {root / 'tritonserver.log'}")
        try:
            if urllib.request.urlopen(f"http://{HOST}:{args.http_port}/v2/health/ready", timeout=2).status == 200:
                return proc
        except OSError:
            pass
        if time.monotonic() > deadline:
            stop_server(proc)
            raise SystemExit(f"soak: tritonserver not ready in {ready_timeout_s:.0f} s; "
                             f"log {root / 'tritonserver.log'}")
        time.sleep(0.5)


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, required=True, help="how long the load runs")
    ap.add_argument("--http-port", type=int, required=True)
    ap.add_argument("--grpc-port", type=int, required=True)
    ap.add_argument("--metrics-port", type=int, required=True)
    ap.add_argument("--kill-worker", action="store_true", help="SIGKILL one rank-group worker at 40%% of the run")
    ap.add_argument("--concurrency", type=int, default=6, help="client threads of the steady mix")
    ap.add_argument("--think-s", type=float, default=0.3, help="max pause between a client's requests")
    ap.add_argument("--burst-every", type=float, default=60.0, help="seconds between bursts")
    ap.add_argument("--burst-size", type=int, default=0,
                    help="requests of one burst (0: the server's capacity, slots + wait queue, plus 8)")
    ap.add_argument("--request-timeout-s", type=float, default=300.0, help="no final within this: lost")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sample-s", type=float, default=5.0, help="seconds between RSS samples")
    ap.add_argument("--progress-s", type=float, default=60.0, help="seconds between progress lines")
    ap.add_argument("--start-server", action="store_true",
                    help="serve a temporary copy of model_repository/ (4 slots, queue 4) on the given ports first")
    ap.add_argument("--shared-prefix", action="store_true",
                    help="add greedy requests sharing a long prefix (the prefix cache's traffic)")
    ap.add_argument("--prefix-budget", type=int, default=PREFIX_BUDGET,
                    help="prefix_cache_bytes of --start-server, and the bound the report checks the bytes against")
    args = ap.parse_args(argv)
    proc = root = None
    if args.start_server:
        root = Path(tempfile.mkdtemp(prefix="v4flash-soak-"))
        print(f"soak: starting tritonserver (log {root / 'tritonserver.log'})", flush=True)
        proc = start_server(args, root)
    try:
        return Soak(args).run()
    finally:
        if proc is not None:
            stop_server(proc)
            text = (root / "tritonserver.log").read_text(errors="replace")
            if "successfully unloaded 'v4flash'" not in text:
                print("soak: the server did not unload v4flash cleanly", flush=True)
            else:
                shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
