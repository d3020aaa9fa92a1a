"""The rank group's worker: `torchrun --nproc-per-node W -m v4flash_backend.group.rank_entry ...` (which
sets the rank's environment, then becomes `python -m v4flash_backend.group.worker ...`).

Every rank loads its shard (`parallel`; with pipeline stages, its stage's layers) and a runner:
`LocalRunner` (decode_graph eager) or the static round graphs' `trn2.neuron.StaticRunner`
(decode_graph static; `group.build.build_runner`). Rank 0 owns the request queue, the
scheduler and sampling (`engine.Engine`) behind a socket server; its runner is a `PlanRunner`,
which broadcasts every runner call as a fixed-size int64 step plan before running it, so ranks
> 0 (`follow`) execute the same `LocalRunner` method on the same inputs and meet rank 0 in the
same collectives. No pickles cross ranks; results stay on rank 0 (the last forward's DSpark taps
stay on every rank, which is why ring writes name rows instead of shipping hidden states).

Plan layout: int64[size]; header [MAGIC, op, sequence number, body length, a0, a1, a2, a3], then
the body. FORWARD: a = (T tokens, S segments, L logits rows or -1 'last' / -2 'all' / -3 'none',
want_taps); body = tokens[T], (slot, start, n)[S], rows[L]. DSPARK: a = (writes, items); body =
per write (slot, m, rows[m], positions[m]), then (slot, p, anchor) per item. ROUND (a static
decode round, decode_graph static): a = (S, stop width, spec mode (+ 4: the logit-processing variant,
with the n_out / min_tokens and frequency / presence columns), fixed_len); body = `pack_round`'s
int64 columns, float64 columns as bits, stop ids, the SPS table. LOAD_BLOCK: a host-drafted draft
block into every rank's per-slot block state (`pack_block`). COUNTS: a = (slot, n), body = the slot's
n generated ids (the processed rounds' penalty counts, after eager steps). RESET: a0 = slot.
GROW: a0 = the new plan size (both sides switch buffers; sizes only grow). NOOP: a heartbeat
rank 0 sends when idle so followers waiting for a plan never reach the collective timeout; it is
followed by a one-element world all-reduce (counted as 'heartbeat'), so a rank that hangs while
the group is idle is noticed within the timeout, not at the next request; STOP: followers return.
A plan is validated on rank 0 before it is sent, so a bad request cannot make ranks disagree. A
dead rank breaks the next collective (gloo reports the closed connection; a hung one hits the
timeout), that rank exits, and torchrun ends the others.

Socket protocol (rank 0 <-> clients; `rank_group` is the client): one JSON object per line,
UTF-8, over TCP (127.0.0.1 unless --host says otherwise; rank 0 writes the bound address to
--port-file once every rank is ready). Several connections may be open; a request belongs to
the connection that submitted it and is cancelled if that connection closes. Every connection
opens with the server's hello line and, when the group has a shared secret, a challenge-response
(`auth`: HMAC-SHA256 of a per-connection nonce); a client that fails it is refused and logged.
Beyond loopback the server does not start without a secret.
  client -> server
    {"op":"submit","id":ID,"prompt_ids":[int,...],"params":{"max_tokens":int,"temperature":float,
     "top_k":int,"top_p":float,"seed":int|null,"stop_token_ids":[int,...],"ignore_eos":bool,
     "min_tokens":int,"logprobs":int,"frequency_penalty":float,"presence_penalty":float}}
    (request.GenerateRequest's wire fields)
    {"op":"cancel","id":ID}
    {"op":"health","tag":T}  {"op":"stats","tag":T}  {"op":"shutdown","tag":T}
  server -> client
    {"id":ID,"event":"chunk","token_ids":[..],"context_ids":[..],"finish_reason":null|"stop"|
     "length"|"cancelled","num_prompt_tokens":n,"num_output_tokens":n,"drafted":n,"accepted":n,
     "logprobs":[[lp,rank,[[id,lp],..]],..] (only when the request asked for log-probs)}
    {"id":ID,"event":"error","code":"INVALID_ARG"|"UNAVAILABLE","message":str}
    {"event":"health"|"stats"|"shutdown","tag":T,...}; a malformed line gets
    {"event":"error","code":"INVALID_ARG","message":..,"tag":T} (with the id when it has one).
  Every request ends with exactly one final message: a chunk with a finish_reason, or an error.

Multi-node: run one torchrun per node (`--nnodes N --node-rank i --master-addr <node 0>`,
`rank_group.node_command`) with `--host <reachable address of the driver> --port P` and the same
shared secret on every node (group_secret_file; see `auth`), then point the client at that address
with the secret. With `--pipeline-parallel P` the stages are consecutive blocks of W / P ranks
(a node each) and the driver (engine, sampling, socket server, plan broadcasts) is the last stage's
first rank, where the logits are: plans go out from it, boundary payloads go stage to stage
(`parallel.pipeline`), and ranks of earlier stages skip DSpark plans.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
import time
from queue import Queue

import torch

from v4flash_backend.trn2.round_plan import RoundPlan

MAGIC = 0x56344650
HDR = 8
OP_NOOP, OP_STOP, OP_GROW, OP_RESET, OP_FORWARD, OP_DSPARK, OP_ROUND, OP_LOAD_BLOCK, OP_COUNTS = range(9)
OP_NAMES = {OP_NOOP: "noop", OP_STOP: "stop", OP_GROW: "grow", OP_RESET: "reset_slot",
            OP_FORWARD: "forward", OP_DSPARK: "dspark", OP_ROUND: "decode_round", OP_LOAD_BLOCK: "load_block",
            OP_COUNTS: "set_counts"}
_ROWS = {"last": -1, "all": -2, "none": -3}
_ROWS_INV = {v: k for k, v in _ROWS.items()}


class PlanError(RuntimeError):
    """A follower received a plan it cannot decode (desynchronised or corrupted)."""


def _long(x) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.long).reshape(-1)


def pack_forward(tokens, spec, logits_rows, want_taps: bool):
    tokens = _long(tokens)
    spec_t = _long([v for s in spec for v in s])
    if isinstance(logits_rows, str):
        mode, rows = _ROWS[logits_rows], _long([])
    else:
        rows = _long(logits_rows)
        mode = rows.numel()
    return (tokens.numel(), len(spec), mode, int(bool(want_taps))), torch.cat([tokens, spec_t, rows])


def unpack_forward(a, body: torch.Tensor):
    T, S, mode, want = a
    tokens = body[:T].clone()
    spec = [tuple(r) for r in body[T:T + 3 * S].view(S, 3).tolist()]
    rows = _ROWS_INV[mode] if mode < 0 else body[T + 3 * S:T + 3 * S + mode].clone()
    return tokens, spec, rows, bool(want)


def pack_dspark(writes, items):
    parts = []
    for slot, rows, positions in writes:
        rows, positions = _long(rows), _long(positions)
        if rows.numel() != positions.numel():
            raise ValueError("a DSpark ring write needs one position per row")
        parts += [_long([slot, rows.numel()]), rows, positions]
    parts.append(_long([v for it in items for v in it]))
    return (len(writes), len(items), 0, 0), torch.cat(parts)


def unpack_dspark(a, body: torch.Tensor):
    n_writes, n_items = a[0], a[1]
    writes, off = [], 0
    for _ in range(n_writes):
        slot, m = body[off:off + 2].tolist()
        writes.append((slot, body[off + 2:off + 2 + m].clone(), body[off + 2 + m:off + 2 + 2 * m].clone()))
        off += 2 + 2 * m
    items = [tuple(r) for r in body[off:off + 3 * n_items].view(n_items, 3).tolist()]
    return writes, items


def pack_round(plan: RoundPlan):
    """A static decode round (engine._step_static's plan) as (a, body): its wire form is the plan
    type's (`RoundPlan.pack`: a = (S, stop width, spec mode, fixed_len))."""
    return plan.pack()


def unpack_round(a, body: torch.Tensor) -> RoundPlan:
    return RoundPlan.unpack(a, body)


def pack_block(slot: int, block):
    """A host-drafted block (tokens, prev, q, z) for load_block: a = (slot, G, V); body = tokens,
    then q and z as float32 bits (padded to whole int64s)."""
    tokens, _, q, z = block
    f = torch.cat([q.float().reshape(-1), z.float().reshape(-1)])
    if f.numel() % 2:
        f = torch.cat([f, f.new_zeros(1)])
    return (slot, tokens.numel(), z.shape[-1], 0), torch.cat([_long(tokens), f.view(torch.int64)])


def unpack_block(a, body: torch.Tensor):
    slot, G, V = a[0], a[1], a[2]
    tokens = body[:G].clone()
    f = body[G:].clone().view(torch.float32)
    return slot, (tokens, None, f[:G].clone(), f[G:G + G * V].view(G, V).clone())


class MicroBatchRunner:
    """A pipeline stage's runner that splits a forward of several sequences into `n` micro-batches
    of whole segments (contiguous rows, balanced by rows) and runs them one after another: stage s
    sends micro-batch k and goes on with k + 1 while stage s + 1 works on k, so the stages overlap
    inside one step. Every rank splits the same plan the same way. Results are reassembled in row
    order (logits of the requested rows, taps of every row), so the engine sees one forward.
    Other calls go to the wrapped runner."""

    def __init__(self, local, n: int):
        self.local, self.n = local, n
        self.micro_batched = 0  # forwards split so far

    def __getattr__(self, name):
        return getattr(self.local, name)

    @staticmethod
    def split(spec, n: int) -> list[list]:
        rows = [int(s[2]) for s in spec]
        total, groups, cur, acc = sum(rows), [], [], 0
        for k, seg in enumerate(spec):
            cur.append(seg)
            acc += rows[k]
            left = len(spec) - k - 1
            if len(groups) < n - 1 and left and (acc >= total * (len(groups) + 1) / n or left == n - 1 - len(groups)):
                groups.append(cur)
                cur = []
        return groups + [cur]

    def forward(self, tokens, spec, logits_rows, want_taps: bool):
        from v4flash_backend.model.transformer import StepOutput

        if self.n < 2 or len(spec) < 2:
            return self.local.forward(tokens, spec, logits_rows, want_taps)
        groups = self.split(list(spec), min(self.n, len(spec)))
        self.micro_batched += 1
        rows_t = None if isinstance(logits_rows, str) else torch.as_tensor(logits_rows, dtype=torch.long)
        outs, r0 = [], 0
        for g in groups:
            n = sum(int(s[2]) for s in g)
            if rows_t is None:
                sel, lr = None, logits_rows
            else:
                sel = torch.nonzero((rows_t >= r0) & (rows_t < r0 + n)).reshape(-1)
                lr = rows_t[sel] - r0
            out = self.local.forward(tokens[r0:r0 + n], g, lr if rows_t is None or len(lr) else "none", want_taps)
            outs.append((sel, out))
            r0 += n
        taps = torch.cat([o.taps for _, o in outs]) if want_taps and outs[0][1].taps is not None else None
        self.local.last_taps = taps
        if outs[-1][1].logits is None and logits_rows != "none" and rows_t is None:
            return StepOutput(None, taps, None)  # an earlier stage: nothing to assemble
        parts = [(sel, o) for sel, o in outs if o.logits is not None]
        if not parts:
            return StepOutput(None, taps, None)
        if rows_t is None:
            return StepOutput(torch.cat([o.logits for _, o in parts]), taps,
                              torch.cat([o.final_hidden for _, o in parts]))
        lg = parts[0][1].logits.new_empty((len(rows_t),) + tuple(parts[0][1].logits.shape[1:]))
        hd = parts[0][1].final_hidden.new_empty((len(rows_t),) + tuple(parts[0][1].final_hidden.shape[1:]))
        for sel, o in parts:
            lg[sel], hd[sel] = o.logits, o.final_hidden
        return StepOutput(lg, taps, hd)


class PlanRunner:
    """Rank 0's runner: the `LocalRunner` interface, each call broadcast as a plan first."""

    def __init__(self, local, coll, plan_size: int = 2048, heartbeat_s: float = 2.0, src: int = 0):
        self.local = local
        self.src = src  # this rank (the driver: global rank 0, or the last stage's first rank)
        self.model = local.model
        self.cfg = local.cfg
        self.state = local.state
        self.drafter = local.drafter
        self.coll = coll
        self.size = plan_size
        self.buf = torch.zeros(plan_size, dtype=torch.long)
        self.seq = 0
        self.heartbeat_s = heartbeat_s
        self.last_send = time.monotonic()
        self.sent = {name: 0 for name in OP_NAMES.values()}
        self.decode_graph = local.decode_graph  # the engine.runner.Runner attributes, the local runner's
        self.static_rounds = local.static_rounds
        self.counters = local.counters
        self.counts_host_syncs = local.counts_host_syncs

    def round_fits(self, seqs: int, ctx_needed: int) -> bool:
        return self.local.round_fits(seqs, ctx_needed)  # a pure function of the plan: no broadcast

    def decode_round(self, plan: dict):
        a, body = pack_round(plan)
        self.coll.begin_step()
        self._send(OP_ROUND, a, body)
        out = self.local.decode_round(plan)
        self.coll.end_step()
        return out

    def load_block(self, slot: int, block) -> None:
        a, body = pack_block(slot, block)
        self._send(OP_LOAD_BLOCK, a, body)
        self.local.load_block(slot, block)

    def read_block(self, slot: int):
        return self.local.read_block(slot)  # every rank holds the same blocks: rank 0 reads its own

    def set_counts(self, slot: int, generated) -> None:
        ids = list(generated)
        self._send(OP_COUNTS, (slot, len(ids)), _long(ids) if ids else None)
        self.local.set_counts(slot, ids)

    def _send(self, op: int, a=(), body: torch.Tensor | None = None) -> None:
        n = 0 if body is None else body.numel()
        if HDR + n > self.size:
            new = self.size
            while new < HDR + n:
                new *= 2
            self._send(OP_GROW, (new,))
            self.size, self.buf = new, torch.zeros(new, dtype=torch.long)
        buf = self.buf
        buf[:HDR] = _long([MAGIC, op, self.seq, n, *a, *([0] * (4 - len(a)))])
        if n:
            buf[HDR:HDR + n] = body
        self.coll.broadcast(buf, self.src, "world")
        self.seq += 1
        self.sent[OP_NAMES[op]] += 1
        self.last_send = time.monotonic()

    def _check_forward(self, tokens, spec) -> None:
        st, V = self.state, self.cfg.vocab_size
        if sum(int(n) for _, _, n in spec) != len(tokens):
            raise ValueError("forward: the segments' lengths must add up to the number of tokens")
        for slot, start, n in spec:
            if not 0 <= slot < st.num_slots or start < 0 or n <= 0 or start + n > st.max_len:
                raise ValueError(f"forward: bad segment (slot {slot}, start {start}, n {n}) for "
                                 f"{st.num_slots} slots of {st.max_len} positions")
        t = _long(tokens)
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= V):
            raise ValueError(f"forward: token ids outside [0, {V})")

    def reset_slot(self, slot: int) -> None:
        if not 0 <= slot < self.state.num_slots:
            raise ValueError(f"reset_slot: slot {slot} outside 0..{self.state.num_slots - 1}")
        self._send(OP_RESET, (slot,))
        self.local.reset_slot(slot)

    def forward(self, tokens, spec, logits_rows, want_taps: bool):
        self._check_forward(tokens, spec)
        a, body = pack_forward(tokens, spec, logits_rows, want_taps)
        self.coll.begin_step()
        self._send(OP_FORWARD, a, body)
        out = self.local.forward(tokens, spec, logits_rows, want_taps)
        self.coll.end_step()
        return out

    def dspark(self, writes, items):
        for slot, _, _ in list(writes) + [(it[0], 0, 0) for it in items]:
            if not 0 <= slot < self.state.num_slots:
                raise ValueError(f"dspark: slot {slot} outside 0..{self.state.num_slots - 1}")
        a, body = pack_dspark(writes, items)
        self.coll.begin_step()
        self._send(OP_DSPARK, a, body)
        out = self.local.dspark(writes, items)
        self.coll.end_step()
        return out

    def heartbeat_due_in(self) -> float:
        return max(0.0, self.last_send + self.heartbeat_s - time.monotonic())

    def heartbeat_if_due(self) -> None:
        if self.heartbeat_due_in() == 0.0:
            self._send(OP_NOOP)
            self.coll.all_reduce(torch.zeros(1), "world", "heartbeat")

    def stop(self) -> None:
        self._send(OP_STOP)


def follow(local, coll, plan_size: int = 2048, src: int = 0, drafts: bool = True) -> int:
    """Every rank but the driver `src`: execute its plans until STOP; returns the number of plans
    executed. drafts False (a pipeline stage before the last): DSpark plans are skipped, the draft
    stages live on the last stage."""
    buf = torch.zeros(plan_size, dtype=torch.long)
    seq = 0
    while True:
        coll.broadcast(buf, src, "world")
        magic, op, got, n, *a = buf[:HDR].tolist()
        if magic != MAGIC or got != seq or not 0 <= n <= buf.numel() - HDR:
            raise PlanError(f"bad plan header {buf[:HDR].tolist()} (expected sequence {seq})")
        seq += 1
        body = buf[HDR:HDR + n]
        if op == OP_NOOP:
            coll.all_reduce(torch.zeros(1), "world", "heartbeat")
            continue
        if op == OP_STOP:
            return seq
        if op == OP_GROW:
            buf = torch.zeros(a[0], dtype=torch.long)
        elif op == OP_RESET:
            local.reset_slot(a[0])
        elif op == OP_FORWARD:
            coll.begin_step()
            local.forward(*unpack_forward(a, body))
            coll.end_step()
        elif op == OP_DSPARK:
            if drafts:
                coll.begin_step()
                local.dspark(*unpack_dspark(a, body))
                coll.end_step()
        elif op == OP_ROUND:
            coll.begin_step()
            local.decode_round(unpack_round(a, body))
            coll.end_step()
        elif op == OP_LOAD_BLOCK:
            local.load_block(*unpack_block(a, body))
        elif op == OP_COUNTS:
            local.set_counts(a[0], body[:a[1]].tolist())
        else:
            raise PlanError(f"unknown plan op {op}")


# ---- rank 0: the socket server ----------------------------------------------------------------------
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
            self.out.put((json.dumps(obj, separators=(",", ":")) + "\n").encode())

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
            c.send({"event": "error", "code": "INVALID_ARG", "message": f"malformed message: {e}"})
            return
        op, tag = msg.get("op"), msg.get("tag")
        if op == "submit":
            self._submit(c, msg)
        elif op == "cancel":
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
            c.send({"event": "error", "code": "INVALID_ARG", "tag": tag, "message": f"unknown op {op!r}"})

    def _submit(self, c: _Conn, msg: dict) -> None:
        from v4flash_backend.request import GenerateRequest, RequestError

        cid = msg.get("id")
        key = str(cid)
        try:
            if cid is None or isinstance(cid, (dict, list)):
                raise ValueError("submit needs an id (string or number)")
            eid = f"{c.num}:{key}"
            req = GenerateRequest.from_wire(msg.get("prompt_ids"), msg.get("params"), id=eid,
                                            callback=lambda ev: self._event(c, cid, ev))
            with c.lock:
                if key in c.inflight:
                    raise ValueError(f"request id {cid!r} is already in flight on this connection")
                c.inflight[key] = (eid, cid)
        except (ValueError, TypeError) as e:
            c.send({"id": cid, "event": "error", "code": "INVALID_ARG", "message": str(e)})
            return
        try:
            self.engine.submit(req)
        except RequestError as e:
            with c.lock:
                c.inflight.pop(key, None)
            c.send({"id": cid, "event": "error", "code": e.code, "message": str(e)})
        except (ValueError, TypeError) as e:
            with c.lock:
                c.inflight.pop(key, None)
            c.send({"id": cid, "event": "error", "code": "INVALID_ARG", "message": str(e)})

    def _event(self, c: _Conn, cid, ev) -> None:
        if ev.final:
            with c.lock:
                c.inflight.pop(str(cid), None)
        if ev.error is not None:
            c.send({"id": cid, "event": "error", "code": ev.error_code or "UNAVAILABLE", "message": ev.error})
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
                c.send({"id": cid, "event": "error", "code": "UNAVAILABLE", "message": message})

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


def serve(engine, plan: PlanRunner, stop: threading.Event) -> None:
    """Rank 0's loop: engine steps while there is work, heartbeat plans while idle."""
    while not stop.is_set():
        if engine.has_work():
            engine.step()
            continue
        with engine.lock:
            if not engine.has_work() and not stop.is_set():
                engine.wakeup.wait(timeout=min(0.25, plan.heartbeat_due_in()))
        plan.heartbeat_if_due()


# ---- process setup ----------------------------------------------------------------------------------
def _die_with_parent() -> None:
    """torchrun starts each worker in its own session; if torchrun itself is killed (SIGKILL by a
    supervisor), the kernel sends us SIGTERM instead of leaving an orphan holding the device."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:
        sys.exit("parent process already gone")


LAUNCHER_GONE_EXIT = 3  # a rank's exit code when the process that launched the group died


def _watch_launcher(spec: str | None) -> None:
    """Exit (code LAUNCHER_GONE_EXIT, torchrun then ends the other ranks) as soon as one of the
    processes "PID:START[,PID:START...]" (`rank_group.launcher_identity`; `RankGroup.launch` passes
    its own process, and the Triton model adds the server) is gone: the Triton stub may die without
    stopping us (SIGSEGV, SIGKILL), or hang when the server under it died, and PR_SET_PDEATHSIG only
    watches torchrun. A pidfd each (Linux >= 5.3) wakes a daemon thread the moment one exits;
    elsewhere the thread polls /proc every second. The start time tells a reused pid from the
    process it named. No watch without a spec: a group started by hand (rank_group_address)
    outlives its clients."""
    if not spec:
        return
    import select

    from v4flash_backend.group.rank_group import process_start_time

    rank = int(os.environ.get("RANK", "0"))

    def gone(pid: int, why: str) -> None:
        _log(rank, f"launcher pid {pid} is gone ({why}): stopping the rank group")
        os._exit(LAUNCHER_GONE_EXIT)

    watched = {}  # pid -> (start time, pidfd or None)
    for item in spec.split(","):
        pid_s, _, start_s = item.partition(":")
        pid, start = int(pid_s), int(start_s) if start_s.isdigit() else None
        fd = None
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            gone(pid, "no such process")
        except (OSError, AttributeError):
            pass
        if start is None or process_start_time(pid) != start:  # after pidfd_open: it pins the process it names
            gone(pid, "exited, or its pid now names another process")
        watched[pid] = (start, fd)

    def watch() -> None:
        fds = {fd: pid for pid, (_, fd) in watched.items() if fd is not None}
        p = select.poll()
        for fd in fds:
            p.register(fd, select.POLLIN)
        while True:
            for fd, _ in p.poll(None if len(fds) == len(watched) else 1000):
                gone(fds[fd], "exited")
            for pid, (start, fd) in watched.items():
                if fd is None and process_start_time(pid) != start:
                    gone(pid, "exited")

    threading.Thread(target=watch, daemon=True, name="launcher-watch").start()


def _log(rank: int, msg: str) -> None:
    print(f"[v4flash rank {rank}] {msg}", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    from v4flash_backend.settings import Settings

    ap = argparse.ArgumentParser(prog="python -m v4flash_backend.group.worker",
                                 description="one rank of the v4flash rank group (start it with torchrun)")
    ap.add_argument("--settings-json", help="all settings as one JSON object (what RankGroup.launch passes); "
                                            "flags given beside it win")
    ap.add_argument("--host", default="127.0.0.1", help="address rank 0 listens on (loopback by default; any other "
                                                        "address needs a shared secret: group_secret_file, "
                                                        "$V4FLASH_GROUP_SECRET_FILE or $V4FLASH_GROUP_SECRET)")
    ap.add_argument("--port", type=int, default=0, help="rank 0's port (0: any free port)")
    ap.add_argument("--port-file", help="rank 0 writes {host, port, pids, ...} here once every rank is ready")
    ap.add_argument("--watch-launcher", metavar="PID:START[,PID:START...]",
                    help="exit when one of these processes (pid, start time: /proc/PID/stat field 22) is "
                         "gone (RankGroup.launch passes its own, the Triton model adds the server's; none "
                         "for a group started by hand)")
    Settings.add_arguments(ap, scopes=("group", "engine"), extra=("checkpoint_dir",))
    return ap


def parse_settings(ap: argparse.ArgumentParser, argv=None):
    """(launch arguments, Settings) of a worker command line; errors exit through `ap.error`."""
    from v4flash_backend.settings import Settings

    args = ap.parse_args(argv)
    try:
        base = Settings.from_json(args.settings_json) if args.settings_json else None
        settings = Settings.from_args(args, base)
    except ValueError as e:
        ap.error(str(e))
    if not settings.checkpoint_dir:
        ap.error("give --checkpoint (or checkpoint_dir in --settings-json)")
    return args, settings


def load_group_secret(args, settings) -> bytes | None:
    """The socket's shared secret (`auth.load_secret`: group_secret_file, $V4FLASH_GROUP_SECRET_FILE,
    $V4FLASH_GROUP_SECRET), checked against --host before anything is loaded: listening beyond
    loopback needs one. Raises auth.AuthError or OSError (an unreadable file)."""
    from v4flash_backend.group.auth import check_bind, load_secret

    secret = load_secret(settings.group_secret_file or None)
    check_bind(args.host, secret)
    return secret


def main(argv=None) -> int:
    args, settings = parse_settings(build_parser(), argv)
    from v4flash_backend.group.auth import AuthError

    try:
        secret = load_group_secret(args, settings)
    except (AuthError, OSError) as e:
        _log(int(os.environ.get("RANK", "0")), f"error: {e}")
        return 2
    _check_rank_env(settings)
    _die_with_parent()
    _watch_launcher(args.watch_launcher)
    from v4flash_backend import ops
    from v4flash_backend.parallel.collectives import init_distributed
    from v4flash_backend.parallel.comm import load_sharded_model

    torch.set_num_threads(settings.threads)
    ops.set_backend(settings.ops_backend)
    if settings.numerics:
        ops.set_numerics(settings.numerics)
    from v4flash_backend.config import ModelConfig
    from v4flash_backend.parallel.layout import attention_group_max

    # the attention group is bounded by what the checkpoint can be split by, inside one stage
    cfg = ModelConfig.from_json(settings.checkpoint_dir)
    P = settings.pipeline_parallel  # >= 1; $V4FLASH_PIPELINE is applied by with_env_overrides
    stage_world = max(1, int(os.environ.get("WORLD_SIZE", "1")) // max(1, P))
    lay, coll = init_distributed(settings.dist_backend or None, settings.collective_timeout_s,
                                 settings.pipeline_parallel, attention_group_max(cfg, stage_world))
    rank = lay.rank
    t0 = time.monotonic()
    if lay.world > 1:
        model = load_sharded_model(settings.checkpoint_dir, lay, coll, settings.sequence_parallel)
    else:
        from v4flash_backend.model.loading import load_model

        model = load_model(settings.checkpoint_dir)
    from v4flash_backend.group.build import build_runner

    local = build_runner(model, settings, rank)
    if lay.pipeline > 1:  # the stage's caches only (eager runner: its ModelState is plain per-layer dicts)
        from v4flash_backend.parallel.pipeline import trim_state

        trim_state(local.state, *lay.stage_layers(model.cfg), lay.is_last_stage)
    if lay.pipeline > 1 and settings.pipeline_micro_batches > 1:
        local = MicroBatchRunner(local, settings.pipeline_micro_batches)
    # every rank's pid (for health reports); also the barrier after which all ranks are ready
    pids = [int(p) for p in coll.all_gather(torch.tensor([os.getpid()]), "world", "setup")]
    _log(rank, f"loaded shard {rank}/{lay.world} in {time.monotonic() - t0:.1f} s")
    if lay.pipeline > 1:
        lo, hi = lay.stage_layers(model.cfg)
        _log(rank, f"pipeline stage {lay.stage}/{lay.pipeline}: layers {lo}..{hi - 1}, in-stage rank "
                   f"{lay.srank}/{lay.stage_world}, driver rank {lay.driver}")
    if settings.sequence_parallel:
        from v4flash_backend.parallel.layout import SP_MIN_ROWS_PER_RANK

        lo, hi = lay.stage_layers(model.cfg)
        G = lay.group_size
        state = (f"on for forwards of >= {SP_MIN_ROWS_PER_RANK * G} rows in layers {lo}..{hi - 1} (attention group "
                 f"of {G}: wo_b / MoE reduce-scatter, all-gathers before attention, MoE and the stage's end)"
                 if G > 1 else f"off: attention group of 1 rank (layers {lo}..{hi - 1})")
        _log(rank, f"sequence parallel {state}")
    if rank != lay.driver:
        follow(local, coll, settings.plan_size, lay.driver, lay.is_last_stage)
        _log(rank, "stop")
        code = 0
    else:
        code = _serve_rank0(args, settings, lay, coll, local, pids, secret)
    if lay.world > 1 and code == 0:
        import torch.distributed as dist

        dist.destroy_process_group()
    return code


def _check_rank_env(settings) -> None:
    """A Neuron rank whose environment lacks what `rank_entry` sets (started as `-m ...group.worker`)
    would compile without the flags or share a NeuronCore: refuse it instead."""
    from v4flash_backend.trn2.launch import env_mismatch

    wrong = env_mismatch(settings, os.environ, int(os.environ.get("LOCAL_RANK", "0")))
    if wrong:
        raise SystemExit(f"rank environment of a Neuron launch not applied ({', '.join(sorted(wrong))}): start the "
                         "ranks with `torchrun ... -m v4flash_backend.group.rank_entry` (rank_group.node_command)")


def _serve_rank0(args, settings, lay, coll, local, pids, secret: bytes | None = None) -> int:
    from v4flash_backend.group.build import build_engine

    stop = threading.Event()
    info = {"world_size": lay.world, "attn_group_size": lay.group_size, "pids": pids,
            "pipeline_parallel": lay.pipeline, "driver_rank": lay.driver,
            "decode_graph": local.decode_graph,
            "max_num_seqs": settings.max_num_seqs, "max_model_len": settings.max_model_len}

    def on_sigterm(*_):  # torchrun stopping the group (e.g. after another rank died)
        info.setdefault("error", "rank group terminated (SIGTERM)")
        stop.set()

    signal.signal(signal.SIGTERM, on_sigterm)
    plan = PlanRunner(local, coll, settings.plan_size, settings.heartbeat_s, lay.driver)
    engine = build_engine(settings, plan)

    def extra():
        return {"collectives_total": coll.as_json(dict(coll.total)),
                "collectives_last_step": coll.as_json(dict(coll.last_step)), "plans": dict(plan.sent),
                "plan_size": plan.size, "world_size": lay.world,
                "micro_batched": getattr(local, "micro_batched", 0)}

    server = Server(engine, args.host, args.port, info, stop, extra, secret=secret)
    host, port = server.address
    if args.port_file:
        tmp = args.port_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump(dict(host=host, port=port, **info), f)
        os.replace(tmp, args.port_file)
    mode = "shared-secret authentication" if secret else "loopback only, no authentication"
    _log(lay.rank, f"serving on {host}:{port} ({mode})")
    code = 0
    try:
        serve(engine, plan, stop)
        reason = info.get("error", "rank group shutting down")
        code = 1 if "error" in info else 0
    except Exception as e:  # noqa: BLE001 - any failure ends the group; clients get UNAVAILABLE
        code, reason = 1, f"rank group failed: {type(e).__name__}: {e}"
        info["error"] = reason
        stop.set()  # health now answers ok=false while the last messages go out
        _log(0, reason)
    server.fail_all(reason)
    if code == 0:
        try:
            plan.stop()
        except Exception as e:  # noqa: BLE001 - a follower already gone: nothing left to stop
            _log(0, f"stop plan not delivered: {e}")
    server.close()
    _log(0, "exit")
    return code


if __name__ == "__main__":
    sys.exit(main())
