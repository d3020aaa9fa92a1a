"""Client of the rank group, used by the Triton model and the CLI.

`RankGroup.launch(...)` starts `torchrun --nproc-per-node W -m v4flash_backend.group.rank_entry ...` in its
own process session with the project's Python (the Triton stub runs another interpreter, so the
worker's interpreter is never guessed from `sys.executable` alone), waits until rank 0 reports its
address, and connects; `RankGroup.connect(address)` uses a group someone else started (multi-node:
one torchrun per node). Then `submit` streams a request's events, `cancel`, `health`, `stats` and
`shutdown` do what they say. The wire protocol is documented in `protocol`.

This module imports only the standard library: it runs inside the Triton python-backend stub,
whose interpreter need not have torch.

Lifetime: a launched group dies with the process that launched it (the Triton stub, or the CLI),
however that process ends, so a crashed server never leaves ranks holding the devices: every rank
watches the launcher (`--watch-launcher PID:START`, the pid and its start time so that a reused pid
is not mistaken for it; the Triton model adds the server's, `watch_also`) and exits within about a
second of its death, and torchrun itself gets PR_SET_PDEATHSIG (`_guarded`). A group reached with
`connect` (started by hand or by an orchestrator, one torchrun per node) carries no watch and
outlives its clients.

Failure: when the connection to rank 0 breaks (a rank died: the others exit within seconds on
their collective's error or timeout and torchrun tears the group down), every request in flight
receives a final UNAVAILABLE error message (`protocol.error`), `health()` reports
ok=False with the reason, and `restart()` launches a fresh group.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from v4flash_backend.group import protocol
from v4flash_backend.group.auth import AuthError, client_handshake, load_secret, new_secret, write_secret
from v4flash_backend.group.lifetime import _guarded, launcher_identity, process_start_time  # noqa: F401 - re-exported
from v4flash_backend.request import RequestError

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # <repo>/src/v4flash_backend (or site-packages/...)
REPO_DIR = PACKAGE_DIR.parents[1]  # <repo>/src/v4flash_backend -> <repo>


class RankGroupError(RequestError):
    """The rank group cannot serve (not started, dead, unreachable): a RequestError, UNAVAILABLE."""

    def __init__(self, message: str, code: str = "UNAVAILABLE"):
        super().__init__(message, code)


def project_python(explicit: str | None = None) -> str:
    """The interpreter that runs the workers: `explicit`, else $V4FLASH_PYTHON, else the repo's
    .venv, else this interpreter if it can import torch (a system-wide install, e.g. a container)."""
    named = [(explicit, True), (os.environ.get("V4FLASH_PYTHON"), True),
             (str(REPO_DIR / ".venv" / "bin" / "python"), False)]
    for cand, required in named:
        if not cand:
            continue
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
        if required:
            raise RankGroupError(f"worker python {cand!r} does not exist or is not executable")
    import importlib.util

    if importlib.util.find_spec("torch") is not None:
        return sys.executable
    raise RankGroupError("no python with torch for the workers: set V4FLASH_PYTHON or the python parameter")


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct free ports on host (all bound at once, so they cannot coincide)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def node_command(settings, python: str, nproc_per_node: int, nnodes: int, node_rank: int, master_addr: str,
                 master_port: int, host: str = "127.0.0.1", port: int = 0, port_file: str | None = None,
                 watch_launcher: str | None = None) -> list[str]:
    """The torchrun command of one node of a rank group (`launch` runs the single-node one; a
    multi-node group runs one per node, the same settings everywhere). The driver (rank 0, or the
    last pipeline stage's first rank, whichever node holds it) listens on host:port and writes
    port_file. ``watch_launcher`` ("PID:START[,PID:START...]", `launcher_identity`): every rank exits
    when one of those processes is gone (what `launch` passes; a group started by hand has none).
    Every rank starts in `rank_entry`, which completes its environment (a Neuron launch: its NeuronCore,
    compiler flags, LNC, compile cache) before torch loads, then runs the worker. A host other than
    loopback needs a shared secret on every node (settings.group_secret_file, or
    $V4FLASH_GROUP_SECRET_FILE / $V4FLASH_GROUP_SECRET in the node's environment): `group.auth`."""
    cmd = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc_per_node), "--nnodes", str(nnodes),
           "--node-rank", str(node_rank), "--master-addr", master_addr, "--master-port", str(master_port),
           "--monitor-interval", "0.5", "-m", "v4flash_backend.group.rank_entry", "--settings-json", settings.to_json(),
           "--host", host, "--port", str(port)]
    return (cmd + (["--port-file", port_file] if port_file else [])
            + (["--watch-launcher", watch_launcher] if watch_launcher else []))


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address must be host:port, got {address!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


class Stream:
    """The events of one request, in order: iterate it (blocking) or pass a callback to submit."""

    def __init__(self, request_id, callback=None):
        self.id = request_id
        self.callback = callback
        self.q: queue.Queue = queue.Queue()
        self.done = threading.Event()

    def _put(self, ev: dict) -> None:
        if protocol.is_final(ev):
            self.done.set()
        if self.callback is not None:
            try:
                self.callback(ev)
            except Exception as e:  # noqa: BLE001 - a broken consumer must not stop the reader thread
                print(f"[v4flash] request {self.id!r}: event callback raised {type(e).__name__}: {e}",
                      file=sys.stderr)
        self.q.put(ev)

    def __iter__(self):
        while True:
            ev = self.q.get()
            yield ev
            if protocol.is_final(ev):
                return

    def result(self, timeout: float | None = None) -> dict:
        """Block until the final event: {"token_ids", "finish_reason", "error", "code", "events"}."""
        deadline = None if timeout is None else time.monotonic() + timeout
        events, tokens = [], []
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                ev = self.q.get(timeout=left)
            except queue.Empty:
                raise TimeoutError(f"request {self.id!r}: no final event within {timeout} s") from None
            events.append(ev)
            if ev.get("event") == "error":
                return dict(token_ids=tokens, finish_reason=None, error=ev.get("message"), code=ev.get("code"),
                            events=events)
            tokens += ev.get("token_ids", [])
            if ev.get("finish_reason") is not None:
                return dict(token_ids=tokens, finish_reason=ev["finish_reason"], error=None, code=None,
                            events=events)


class RankGroup:
    """A connection to rank 0 of a rank group, and the group's process when we launched it."""

    def __init__(self, sock: socket.socket, proc: subprocess.Popen | None = None, info: dict | None = None,
                 launch_args: dict | None = None, log_path: str | None = None, workdir: str | None = None):
        self.sock = sock
        self.proc = proc
        self.info = info or {}
        self.launch_args = launch_args
        self.log_path = log_path
        self.workdir = workdir  # port file + log of a launched group; removed after a clean exit
        self.failure: str | None = None
        self.secret: bytes | None = None  # what this client proved (a launched group's own, per launch)
        self.streams: dict[str, Stream] = {}
        self.replies: dict[str, queue.Queue] = {}
        self.lock = threading.Lock()
        self.wlock = threading.Lock()
        self._ids = itertools.count()
        self.reader = threading.Thread(target=self._read, daemon=True, name="rank-group-reader")
        self.reader.start()
        if proc is not None:
            threading.Thread(target=self._watch, daemon=True, name="rank-group-watch").start()

    # ---- starting ---------------------------------------------------------------------------------
    @classmethod
    def launch(cls, settings, python: str | None = None, env: dict | None = None, log_path: str | None = None,
               nproc_per_node: int | None = None, tie_to_thread: bool | None = None,
               watch_also: tuple[int, ...] = ()) -> "RankGroup":
        """Start a single-node group of `settings.world_size` ranks and connect to it. The workers get
        the settings as one JSON object (`Settings.to_json`); rank 0 listens on loopback.

        The group dies with this process: every rank watches it (`--watch-launcher`). With
        ``tie_to_thread`` (default: when called from the main thread) torchrun also gets
        PR_SET_PDEATHSIG, which the kernel sends when the *calling thread* ends, so pass True only
        from a thread that lives as long as the group. ``watch_also``: more pids whose death ends the
        group (the Triton model passes the server's: a stub can hang instead of exiting when the
        server under it dies, see `serving.engine_rank_group`)."""
        py = project_python(python)
        workdir = tempfile.mkdtemp(prefix="v4flash-group-")  # mode 0700
        port_file = os.path.join(workdir, "rank0.json")
        log_path = log_path or os.path.join(workdir, "group.log")
        start_timeout_s = settings.startup_timeout_s
        # a fresh secret per launch, to the workers as a 0600 file (its path, not the secret, is on
        # the command line): other local users reaching the loopback port cannot drive the group
        secret = new_secret()
        secret_file = write_secret(os.path.join(workdir, "secret"), secret)
        cmd = node_command(settings.replace(group_secret_file=secret_file), py, nproc_per_node or settings.world_size,
                           1, 0, "127.0.0.1", free_port(), "127.0.0.1", 0, port_file,
                           watch_launcher=",".join(launcher_identity(p) for p in (os.getpid(), *watch_also)))
        if tie_to_thread is None:
            tie_to_thread = threading.current_thread() is threading.main_thread()
        if tie_to_thread:
            cmd = _guarded(cmd, py)
        e = dict(os.environ)
        if PACKAGE_DIR.parent.name not in ("site-packages", "dist-packages"):
            # a source checkout (<repo>/src): make the workers import this copy. An installed package
            # is already importable by its own interpreter, and prepending another interpreter's
            # site-packages would shadow the worker venv's numpy / torch.
            e["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_DIR.parent)]
                                              + ([e["PYTHONPATH"]] if e.get("PYTHONPATH") else []))
        e.setdefault("OMP_NUM_THREADS", "1")
        e.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only, whatever the hostname resolves to
        e.update(env or {})
        log = open(log_path, "ab")
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=e,
                                start_new_session=True)
        log.close()
        launch_args = dict(settings=settings, python=python, env=env, nproc_per_node=nproc_per_node,
                           watch_also=watch_also)
        deadline = time.monotonic() + start_timeout_s
        while not os.path.exists(port_file):
            if proc.poll() is not None:
                raise RankGroupError(f"rank group exited with code {proc.returncode} while starting; "
                                     f"log {log_path}:\n{_tail(log_path)}")
            if time.monotonic() > deadline:
                _kill_group(proc)
                raise RankGroupError(f"rank group not ready within {start_timeout_s:.0f} s; log {log_path}:\n"
                                     f"{_tail(log_path)}")
            time.sleep(0.1)
        with open(port_file) as f:
            info = json.load(f)
        # every rank read the secret before the port file appeared (worker.load_group_secret runs
        # first, the port file after the all-ranks barrier): it need not stay on disk
        os.unlink(secret_file)
        try:
            sock = socket.create_connection((info["host"], info["port"]), timeout=30)
            client_handshake(sock, secret)
        except (OSError, AuthError) as e:
            _kill_group(proc)
            raise RankGroupError(f"cannot connect to the launched rank group: {e}") from None
        sock.settimeout(None)
        g = cls(sock, proc, info, launch_args, log_path, workdir)
        g.secret = secret
        return g

    @classmethod
    def connect(cls, address: str, timeout_s: float = 30.0, secret: bytes | None = None,
                secret_file: str | None = None) -> "RankGroup":
        """Use a group started elsewhere (e.g. one torchrun per node) whose rank 0 serves `address`.
        The shared secret, when the group requires one: `secret`, else `auth.load_secret(secret_file)`
        (the file, $V4FLASH_GROUP_SECRET_FILE, $V4FLASH_GROUP_SECRET). A refused secret raises at once
        (RankGroupError); only an unreachable address is retried."""
        host, port = parse_address(address)
        try:
            secret = secret if secret is not None else load_secret(secret_file or None)
        except (AuthError, OSError) as e:
            raise RankGroupError(f"rank group secret: {e}") from None
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=10)
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise RankGroupError(f"cannot reach the rank group at {address}: {e}") from None
                time.sleep(0.5)
        try:
            client_handshake(sock, secret, timeout_s=min(30.0, max(1.0, timeout_s)))
        except (AuthError, OSError) as e:
            sock.close()
            raise RankGroupError(f"rank group at {address}: {e}") from None
        sock.settimeout(None)
        g = cls(sock)
        g.secret = secret
        g.info = {k: v for k, v in g.health(timeout=timeout_s).items() if k not in ("event", "tag")}
        g.info.update(host=host, port=port)
        return g

    def restart(self) -> "RankGroup":
        """A fresh group with the same launch arguments (only for groups this client launched)."""
        if self.launch_args is None:
            raise RankGroupError("this group was not launched by this client; restart it where it runs")
        self.shutdown(timeout=10)
        return RankGroup.launch(**self.launch_args)

    # ---- requests --------------------------------------------------------------------------------
    def submit(self, prompt_ids, params: dict | None = None, request_id=None, callback=None,
               warmup: bool = False) -> Stream:
        """Send a request; its events arrive on the returned Stream (and `callback`, from the reader
        thread). A dead group answers at once with a final UNAVAILABLE error event. warmup: the
        server's start-up request (not traffic: its steps ask a background compile for no graph)."""
        rid = request_id if request_id is not None else f"r{next(self._ids)}"
        st = Stream(rid, callback)
        with self.lock:
            if str(rid) in self.streams:
                raise ValueError(f"request id {rid!r} is already in flight")
            failure = self.failure
            if failure is None:
                self.streams[str(rid)] = st
        if failure is not None:
            st._put(protocol.error(protocol.UNAVAILABLE, failure, rid))
            return st
        msg = protocol.submit(rid, prompt_ids, params, warmup)
        if not self._send(msg):
            self._fail_stream(str(rid))
        return st

    def cancel(self, request_id) -> None:
        self._send(protocol.cancel(request_id))

    def health(self, timeout: float = 10.0) -> dict:
        """{"ok": bool, ...}: rank 0's answer, or ok=False with the reason it could not answer."""
        if self.failure is not None:
            return {"ok": False, "error": self.failure}
        try:
            return self._call("health", timeout)
        except RankGroupError as e:
            return {"ok": False, "error": str(e)}

    def stats(self, timeout: float = 10.0) -> dict:
        return self._call("stats", timeout)

    @property
    def alive(self) -> bool:
        return self.failure is None and (self.proc is None or self.proc.poll() is None)

    @property
    def pids(self) -> list[int]:
        return list(self.info.get("pids", []))

    def shutdown(self, timeout: float = 30.0) -> int | None:
        """Stop the group: a shutdown message (in-flight requests end with UNAVAILABLE), then, for a
        group we launched, wait for its exit and escalate to SIGTERM and SIGKILL of its session."""
        if self.failure is None:
            try:
                self._call("shutdown", min(timeout, 10.0))
            except RankGroupError:
                pass
        code = None
        if self.proc is not None:
            try:
                code = self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                code = _kill_group(self.proc)
            if code == 0 and self.workdir:
                shutil.rmtree(self.workdir, ignore_errors=True)
        self._set_failure("rank group shut down")
        try:
            self.sock.close()
        except OSError:
            pass
        return code

    def close(self) -> None:
        """Drop this connection (its requests end with UNAVAILABLE) and leave the group running."""
        self._set_failure("connection closed by the client")
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    # ---- internals -------------------------------------------------------------------------------
    def _send(self, msg: dict) -> bool:
        data = protocol.encode(msg)
        try:
            with self.wlock:
                self.sock.sendall(data)
            return True
        except OSError as e:
            self._set_failure(f"rank group connection lost: {e}")
            return False

    def _call(self, op: str, timeout: float) -> dict:
        tag = f"{op}-{next(self._ids)}"
        q: queue.Queue = queue.Queue()
        with self.lock:
            if self.failure is not None:
                raise RankGroupError(self.failure)
            self.replies[tag] = q
        try:
            if not self._send(protocol.control(op, tag)):
                raise RankGroupError(self.failure or "rank group connection lost")
            try:
                reply = q.get(timeout=timeout)
            except queue.Empty:
                raise RankGroupError(f"rank group did not answer {op!r} within {timeout} s") from None
        finally:
            with self.lock:
                self.replies.pop(tag, None)
        if reply.get("event") == "error":
            raise RankGroupError(reply.get("message", "error"), reply.get("code", "UNAVAILABLE"))
        return reply

    def _read(self) -> None:
        reason = "rank group closed the connection"
        try:
            with self.sock.makefile("rb") as f:
                for line in f:
                    try:
                        msg = json.loads(line)
                    except ValueError:
                        continue
                    self._dispatch(msg)
        except OSError as e:
            reason = f"rank group connection lost: {e}"
        if self.proc is not None and self.proc.poll() is not None:
            reason += f" (exit code {self.proc.returncode})"
        self._set_failure(reason)

    def _dispatch(self, msg: dict) -> None:
        tag = msg.get("tag")
        if tag is not None:
            with self.lock:
                q = self.replies.get(tag)
            if q is not None:
                q.put(msg)
            return
        if "id" not in msg:
            return
        key = str(msg["id"])
        with self.lock:
            st = self.streams.get(key)
            if st is not None and protocol.is_final(msg):
                del self.streams[key]
        if st is not None:
            st._put(msg)

    def _watch(self) -> None:
        self.proc.wait()
        if self.failure is None:
            time.sleep(0.5)  # let the reader deliver rank 0's own final messages first
            self._set_failure(f"rank group exited with code {self.proc.returncode}")

    def _fail_stream(self, key: str) -> None:
        with self.lock:
            st = self.streams.pop(key, None)
        if st is not None:
            st._put(protocol.error(protocol.UNAVAILABLE, self.failure or "unavailable", st.id))

    def _set_failure(self, reason: str) -> None:
        with self.lock:
            if self.failure is None:
                self.failure = reason
            streams, self.streams = list(self.streams.values()), {}
            replies = list(self.replies.values())
        for st in streams:
            st._put(protocol.error(protocol.UNAVAILABLE, self.failure, st.id))
        for q in replies:
            q.put(protocol.error(protocol.UNAVAILABLE, self.failure))


def _tail(path: str, n: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _kill_group(proc: subprocess.Popen, grace_s: float = 10.0) -> int | None:
    """SIGTERM torchrun's session (torchrun then stops its workers), SIGKILL after `grace_s`; the
    workers die with their parent (the worker sets PR_SET_PDEATHSIG)."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            return proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue
    return proc.poll()
