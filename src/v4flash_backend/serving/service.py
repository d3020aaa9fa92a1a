"""The request loop of the `v4flash` Triton model, without pb_utils.

Shape of vllm_backend's model.py: `handle()` runs in ``execute`` and only parses and
submits; engine events are queued by the engine client's thread and a dedicated sender thread
turns them into responses, sends them, watches for cancellation and updates metrics, so
the engine never waits on the stub's IPC.

One thread talks to the stub. Every response send, cancellation check and metric update runs on
the sender thread: ``execute`` (an immediate refusal), the stats thread and ``close`` hand theirs
over as callables on the same queue (`_post`). The python backend's stub does not serialize them
(python_backend r24.10, the 2.51 release: `Metric::SendIncrementRequest` / `SendObserveRequest`
release the GIL and then rewrite the metric's shared-memory message members in
`Metric::SaveToSharedMemory` with no lock, so two threads updating one metric, as the execute
thread's refusals and the sender's finals did with `requests_finished_total` and the e2e
histogram, race inside the stub; `ResponseSender::Send` also runs without the GIL). Logging
(`pb_utils.Logger`) stays on any thread: the stub queues log records under its own mutex.

Every request gets exactly one FINAL response:
with its last data, or with an error (INVALID_ARG for a bad request, CANCELLED after a
client cancellation, UNAVAILABLE when the engine failed or is shutting down).

model.py adapts a Triton request into ``inputs`` (dict name -> numpy array of the inputs
present), ``parameters`` (the request parameters' JSON) and a `ResponseSink` over its
response sender.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Protocol

from v4flash_backend.request import GenerateRequest, RequestError

from .metrics import ServingMetrics
from .parse import RequestParser
from .response import ResponseBuilder


class ResponseSink(Protocol):
    def send(self, outputs: dict | None, error: RequestError | None, final: bool) -> None: ...

    def is_cancelled(self) -> bool: ...


@dataclass
class _Flight:
    id: str
    req: GenerateRequest
    sink: ResponseSink
    builder: ResponseBuilder
    arrival: float
    last_token_time: float | None = None
    drafted: int = 0
    accepted: int = 0
    cancel_requested: bool = False
    send_failed: bool = False


class GenerateService:
    """Parses requests, submits them to an engine client and streams responses back."""

    def __init__(self, engine, parser: RequestParser, detok=None, metrics: ServingMetrics | None = None,
                 log: Callable[[str], None] = print, poll_s: float = 0.1, stats_interval_s: float = 0.5):
        self.engine = engine
        self.parser = parser
        self.detok = detok
        self.metrics = metrics
        self.log = log
        self.poll_s = poll_s
        self.settings = None  # the Settings it was built from (model_setup), if any
        self._events: queue.Queue = queue.Queue()  # (request id, event) | a callable | None: stop
        self._gauge_in_flight: int | None = None  # the in-flight gauge's last value (sender thread)
        self._flights: dict[str, _Flight] = {}
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._sender = threading.Thread(target=self._send_loop, name="v4flash-responses", daemon=True)
        self._sender.start()
        self._stats_interval_s = stats_interval_s
        self._stats_kick = threading.Event()  # set when a request ends: refresh the slot gauge now
        self._stats = threading.Thread(target=self._stats_loop, name="v4flash-stats", daemon=True)
        if metrics is not None:
            self._stats.start()

    # ---- execute side ------------------------------------------------------------------------
    def handle(self, inputs: dict, parameters: str | None, sink: ResponseSink) -> str | None:
        """Validate and submit one request; returns its id, or None if it was answered already."""
        arrival = time.monotonic()
        if self._closing.is_set():
            self._reject(sink, RequestError("the model is shutting down", "UNAVAILABLE"), arrival)
            return None
        try:
            req = self.parser.parse(inputs, parameters)
        except RequestError as exc:
            self._reject(sink, exc, arrival)
            return None
        rid = uuid.uuid4().hex
        try:
            builder = ResponseBuilder(req, self.detok)
        except RequestError as exc:
            self._reject(sink, exc, arrival)
            return None
        flight = _Flight(rid, req, sink, builder, arrival)
        self._add(flight)
        try:
            self.engine.submit(req, rid, lambda ev, rid=rid: self._events.put((rid, ev)))
        except RequestError as exc:
            self._drop(flight)
            self._reject(sink, exc, arrival)
            return None
        except Exception as exc:  # the engine is down: not the client's fault
            self._drop(flight)
            self._reject(sink, RequestError(f"engine unavailable: {type(exc).__name__}: {exc}", "UNAVAILABLE"),
                         arrival)
            return None
        return rid

    def in_flight(self) -> int:
        with self._lock:
            return len(self._flights)

    def _post(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the sender thread, the one thread that calls the stub (see the module doc);
        once that thread has ended (after close), here: no other thread talks to the stub then."""
        if self._sender.is_alive():
            self._events.put(fn)
        else:
            fn()

    def close(self, drain_s: float = 5.0) -> None:
        """Cancel what is in flight, give the engine ``drain_s`` to confirm, fail the rest,
        then close the engine client and the metrics."""
        self._closing.set()
        self._stats_kick.set()
        with self._lock:
            flights = list(self._flights.values())
        for f in flights:
            self._request_cancel(f)
        deadline = time.monotonic() + drain_s
        while self.in_flight() and time.monotonic() < deadline:
            time.sleep(0.05)
        with self._lock:
            left = list(self._flights.values())
        for f in left:
            self._post(lambda f=f: self._finish(f, "error", RequestError("the model is shutting down", "UNAVAILABLE")))
        self._events.put(None)
        self._sender.join(timeout=10)
        if self._stats.is_alive():
            self._stats.join(timeout=10)
        try:
            self.engine.close()
        finally:
            if self.metrics is not None:
                metrics, self.metrics = self.metrics, None  # later refusals update nothing
                metrics.close()

    # ---- bookkeeping ---------------------------------------------------------------------------
    # (the in-flight gauge is refreshed by the sender thread, `_refresh_in_flight`)
    def _add(self, f: _Flight) -> None:
        with self._lock:
            self._flights[f.id] = f

    def _drop(self, f: _Flight) -> bool:
        with self._lock:
            return self._flights.pop(f.id, None) is not None

    def _reject(self, sink: ResponseSink, exc: RequestError, arrival: float) -> None:
        """Answer a request that never reached the engine (called from ``execute``)."""
        def answer():
            self._safe_send(sink, None, exc, True)
            if self.metrics:
                self.metrics.on_finished("error", time.monotonic() - arrival)
        self._post(answer)

    def _safe_send(self, sink: ResponseSink, outputs, error, final) -> bool:
        try:
            sink.send(outputs, error, final)
            return True
        except Exception as exc:  # the client is gone; the engine side still gets cleaned up
            self.log(f"[v4flash] sending a response failed: {type(exc).__name__}: {exc}")
            return False

    def _finish(self, f: _Flight, reason: str, error: RequestError | None = None, outputs=None) -> None:
        """The one FINAL response of a request, then forget it."""
        if not self._drop(f):
            return  # already finished (shutdown raced the engine's final event)
        self._safe_send(f.sink, outputs, error, True)
        if self.metrics:
            self.metrics.on_finished(reason, time.monotonic() - f.arrival)
            self._stats_kick.set()

    def _request_cancel(self, f: _Flight) -> None:
        if f.cancel_requested:
            return
        f.cancel_requested = True
        try:
            self.engine.cancel(f.id)
        except Exception as exc:
            self.log(f"[v4flash] cancel of {f.id} failed: {type(exc).__name__}: {exc}")

    # ---- sender thread -------------------------------------------------------------------------
    def _send_loop(self) -> None:
        last_poll = time.monotonic()
        while True:
            try:
                item = self._events.get(timeout=self.poll_s)
            except queue.Empty:
                item = ()
            if item is None:
                self._refresh_in_flight()
                return
            if callable(item):
                try:
                    item()
                except Exception as exc:  # a failed metric update or refusal must not stop the loop
                    self.log(f"[v4flash] sender task failed: {type(exc).__name__}: {exc}")
            elif item:
                rid, ev = item
                with self._lock:
                    f = self._flights.get(rid)
                if f is not None:
                    try:
                        self._deliver(f, ev)
                    except Exception as exc:  # a bug here must not stop every other stream
                        self.log(f"[v4flash] internal error on request {rid}: {type(exc).__name__}: {exc}")
                        self._request_cancel(f)
                        self._finish(f, "error", RequestError(f"internal error: {exc}", "INTERNAL"))
            self._refresh_in_flight()
            if time.monotonic() - last_poll >= self.poll_s:
                last_poll = time.monotonic()
                self._poll_cancellations()

    def _refresh_in_flight(self) -> None:
        if self.metrics is None:
            return
        n = self.in_flight()
        if n != self._gauge_in_flight:
            self._gauge_in_flight = n
            self.metrics.set_in_flight(n)

    def _poll_cancellations(self) -> None:
        with self._lock:
            flights = [f for f in self._flights.values() if not f.cancel_requested]
        for f in flights:
            try:
                cancelled = f.sink.is_cancelled()
            except Exception:
                cancelled = False
            if cancelled:
                self._request_cancel(f)

    def _deliver(self, f: _Flight, ev: dict) -> None:
        if ev.get("event") == "error":
            self._finish(f, "error", RequestError(str(ev.get("message", "engine error")),
                                                  str(ev.get("code") or "INTERNAL")))
            return
        reason = ev.get("finish_reason") or ""
        if reason == "cancelled":
            self._finish(f, "cancelled", RequestError("request was cancelled", "CANCELLED"))
            return
        now = time.monotonic()
        n = len(ev.get("token_ids") or ())
        drafted, accepted = int(ev.get("drafted", 0)), int(ev.get("accepted", 0))
        if self.metrics:
            if f.last_token_time is None and n:
                self.metrics.on_prompt(len(f.req.prompt))
            if n:
                gap = None if f.last_token_time is None else now - f.last_token_time
                self.metrics.on_tokens(n, gap, now - f.arrival)
            self.metrics.on_speculation(drafted - f.drafted, accepted - f.accepted)
        if n:
            f.last_token_time = now
        f.drafted, f.accepted = max(f.drafted, drafted), max(f.accepted, accepted)
        outputs, reason = f.builder.on_chunk(ev)
        if reason:
            if f.builder.stopped_early:  # a stop string ended it: the engine need not go on
                self._request_cancel(f)
            self._finish(f, reason, None, outputs)
            return
        if outputs is not None and not f.send_failed:
            if not self._safe_send(f.sink, outputs, None, False):
                f.send_failed = True
                self._request_cancel(f)
                return
        try:
            if f.sink.is_cancelled():  # checked after each send, as vllm_backend does
                self._request_cancel(f)
        except Exception:
            pass

    # ---- stats thread --------------------------------------------------------------------------
    def _stats_loop(self) -> None:
        failed = False
        while not self._closing.is_set():
            self._stats_kick.wait(self._stats_interval_s)
            self._stats_kick.clear()
            if self._closing.is_set():
                return
            try:
                st = self.engine.stats()  # a rank-group round trip: here, not on the sender thread
                self._post(lambda st=st: self._apply_stats(st))
                failed = False
            except Exception as exc:
                if not failed:  # log once per outage, not twice a second
                    self.log(f"[v4flash] engine stats unavailable: {type(exc).__name__}: {exc}")
                failed = True

    def _apply_stats(self, st: dict) -> None:  # on the sender thread
        self.metrics.set_slots(int(st.get("slots_in_use", 0)), int(st.get("slots_total", 0)), st.get("waiting_limit"))
        self.metrics.set_queue(int(st.get("waiting", 0)), int(st.get("rejected", 0)),
                               int(st.get("expired", 0)), int(st.get("restarts") or 0))
        self.metrics.set_decode(st)
        self.metrics.set_prefix_cache(st, int(st.get("restarts") or 0))
