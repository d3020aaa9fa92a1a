"""Rank 0's socket server: client connections (`protocol`) turned into engine calls."""

from __future__ import annotations

import json
import socket
import threading
import time
from queue import Queue

from v4flash_backend.group import protocol
from v4flash_backend.group.lifetime import _log


class _Conn:
    def __init__(self, sock: socket.socket, num: int):
        self.sock, self.num = sock, num
        self.out: Queue = Queue()
        self.inflight: dict[str, tuple[str, object]] = {}  # str(client id) -> (engine id, client id)
        self.lock = threading.Lock()
        self.closed = False
        threading.Thread(target=self._write, daemon=True, name=f"conn{num}-writer").start()

    def send(self, obj: dict) -> None:
        if not self.closed:
            self.out.put(protocol.encode(obj))

    def _write(self) -> None:
        while True:
            data = self.out.get()
            if data is None:
                return
            try:
                self.sock.sendall(data)
            except OSError:
                self.closed = True
                return

    def close(self) -> None:
        self.closed = True
        self.out.put(None)


class Server:
    """Accepts client connections and turns their messages into engine calls.

    Every connection first goes through `auth.server_handshake` on a thread of its own (the accept
    loop never waits on a client): with a `secret` the client must prove it within `auth_timeout_s`,
    else it is told why, logged, counted (health's auth_refused) and closed, having cost one
    short-lived thread and no engine state. At most `max_pending` handshakes run at once; further
    connections are closed at once until one finishes. Without a secret the server only listens on
    loopback (`auth.check_bind`)."""

    def __init__(self, engine, host: str, port: int, info: dict, stop: threading.Event, stats_extra=None,
                 secret: bytes | None = None, auth_timeout_s: float = 10.0, max_pending: int = 32, log=None):
        from v4flash_backend.group.auth import check_bind

        check_bind(host, secret)
        self.engine, self.info, self.stop = engine, info, stop
        self.stats_extra = stats_extra or (lambda: {})
        self.secret, self.auth_timeout_s = secret, auth_timeout_s
        self.log = log or (lambda msg: _log(0, msg))
        self.sock = socket.create_server((host, port), reuse_port=False)
        self.address = self.sock.getsockname()[:2]
        self.conns: dict[int, _Conn] = {}
        self.lock = threading.Lock()
        self.started = time.monotonic()
        self._n = 0
        self.auth_refused = 0
        self._pending = threading.BoundedSemaphore(max_pending)
        threading.Thread(target=self._accept, daemon=True, name="accept").start()

    def _accept(self) -> None:
        while True:
            try:
                s, peer = self.sock.accept()
            except OSError:
                return
            if not self._pending.acquire(blocking=False):
                self._refuse(s, peer, "too many connections authenticating at once")
                continue
            threading.Thread(target=self._admit, args=(s, peer), daemon=True, name="conn-handshake").start()

    def _refuse(self, s: socket.socket, peer, why: str) -> None:
        with self.lock:
            self.auth_refused += 1
        self.log(f"refused a connection from {peer[0]}:{peer[1]}: {why}")
        try:
            s.close()
        except OSError:
            pass

    def _admit(self, s: socket.socket, peer) -> None:
        from v4flash_backend.group.auth import AuthError, server_handshake

        try:
            server_handshake(s, self.secret, self.auth_timeout_s)
        except (AuthError, OSError) as e:
            self._refuse(s, peer, str(e) or type(e).__name__)
            return
        finally:
            self._pending.release()
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self.lock:
            self._n += 1
            c = _Conn(s, self._n)
            self.conns[c.num] = c
        threading.current_thread().name = f"conn{c.num}-reader"
        self._read(c)

    def _read(self, c: _Conn) -> None:
        try:
            with c.sock.makefile("rb") as f:
                for line in f:
                    if line.strip():
                        self._handle(c, line)
        except OSError:
            pass
        finally:
            with c.lock:
                ids = [eid for eid, _ in c.inflight.values()]
            for eid in ids:  # the client went away: its requests stop holding slots
                self.engine.cancel(eid)
            c.close()
            with self.lock:
                self.conns.pop(c.num, None)

    def _handle(self, c: _Conn, line: bytes) -> None:
        try:
            msg = json.loads(line)
            if not isinstance(msg, dict):
                raise ValueError("a message must be a JSON object")
        except ValueError as e:
            c.send(protocol.error(protocol.INVALID_ARG, f"malformed message: {e}"))
            return
        op, tag = msg.get("op"), msg.get("tag")
        if op == protocol.SUBMIT:
            self._submit(c, msg)
        elif op == protocol.CANCEL:
            with c.lock:
                hit = c.inflight.get(str(msg.get("id")))
            if hit is not None:
                self.engine.cancel(hit[0])
        elif op == "health":
            c.send(dict(event="health", tag=tag, ok=not self.stop.is_set(),
                        uptime_s=round(time.monotonic() - self.started, 3), auth_refused=self.auth_refused,
                        connections=len(self.conns), **self.info))
        elif op == "stats":
            c.send(dict(event="stats", tag=tag, engine=self.engine.stats(), **self.stats_extra()))
        elif op == "shutdown":
            c.send({"event": "shutdown", "tag": tag, "ok": True})
            self.stop.set()
            with self.engine.lock:
                self.engine.wakeup.notify_all()
        else:
            c.send(protocol.error(protocol.INVALID_ARG, f"unknown op {op!r}", tag=tag))

    def _submit(self, c: _Conn, msg: dict) -> None:
        from v4flash_backend.request import GenerateRequest, RequestError

        cid = msg.get("id")
        key = str(cid)
        try:
            if cid is None or isinstance(cid, (dict, list)):
                raise ValueError("submit needs an id (string or number)")
            eid = f"{c.num}:{key}"
            req = GenerateRequest.from_wire(msg.get("prompt_ids"), msg.get("params"), id=eid,
                                            callback=lambda ev: self._event(c, cid, ev),
                                            warmup=msg.get("warmup") is True)
            with c.lock:
                if key in c.inflight:
                    raise ValueError(f"request id {cid!r} is already in flight on this connection")
                c.inflight[key] = (eid, cid)
        except (ValueError, TypeError) as e:
            c.send(protocol.error(protocol.INVALID_ARG, str(e), cid))
            return
        try:
            self.engine.submit(req)
        except RequestError as e:
            with c.lock:
                c.inflight.pop(key, None)
            c.send(protocol.error(e.code, str(e), cid))
        except (ValueError, TypeError) as e:
            with c.lock:
                c.inflight.pop(key, None)
            c.send(protocol.error(protocol.INVALID_ARG, str(e), cid))

    def _event(self, c: _Conn, cid, ev) -> None:
        if ev.final:
            with c.lock:
                c.inflight.pop(str(cid), None)
        if ev.error is not None:
            c.send(protocol.error(ev.error_code or protocol.UNAVAILABLE, ev.error, cid))
            return
        c.send({"id": cid, **ev.to_wire()})

    def fail_all(self, message: str) -> None:
        """Give every request still in flight its final UNAVAILABLE error (shutdown, crash)."""
        with self.lock:
            conns = list(self.conns.values())
        for c in conns:
            with c.lock:
                ids = [cid for _, cid in c.inflight.values()]
                c.inflight.clear()
            for cid in ids:
                c.send(protocol.error(protocol.UNAVAILABLE, message, cid))

    def close(self, wait_s: float = 2.0) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
        with self.lock:
            conns = list(self.conns.values())
        deadline = time.monotonic() + wait_s
        for c in conns:  # let the writers flush the final messages
            while not c.out.empty() and not c.closed and time.monotonic() < deadline:
                time.sleep(0.01)
            c.close()
            try:
                c.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

