"""The rank group's worker: `torchrun --nproc-per-node W -m v4flash_backend.group.rank_entry ...` (which
sets the rank's environment, then becomes `python -m v4flash_backend.group.worker ...`).

Every rank loads its shard (`parallel`; with pipeline stages, its stage's layers) and a runner:
`LocalRunner` (decode_graph eager) or the static round graphs' `trn2.static_runner.StaticRunner`
(decode_graph static; `group.build.build_runner`). Rank 0 owns the request queue, the
scheduler and sampling (`engine.Engine`) behind a socket server; its runner is a `PlanRunner`,
which broadcasts every runner call as a fixed-size int64 step plan before running it, so ranks
> 0 (`follow`) execute the same `LocalRunner` method on the same inputs and meet rank 0 in the
same collectives. No pickles cross ranks; results stay on rank 0 (the last forward's DSpark taps
stay on every rank, which is why ring writes name rows instead of shipping hidden states).

Plan layout and codec: `plan_codec`; the static round's `pack_round` / `unpack_round` are still here,
and so are `PlanRunner` and `follow`, the two ends of the broadcast that use them (a module of their
own would import this one back). The socket protocol: `protocol`; its server: `server`; the
process's lifetime (parent death, launcher watch, SIGTERM, the Neuron rank environment): `lifetime`;
micro-batched pipeline stages: `parallel.micro_batch`.

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
import sys
import threading
import time

import torch

from v4flash_backend.engine.round_plan import RoundPlan
from v4flash_backend.group.lifetime import (
    _check_rank_env,
    _die_with_parent,
    _log,
    _watch_launcher,
    stop_on_sigterm,
)
from v4flash_backend.group.plan_codec import (
    HDR,
    MAGIC,
    OP_COUNTS,
    OP_DSPARK,
    OP_FIRST_BLOCK,
    OP_FORWARD,
    OP_GROW,
    OP_LOAD_BLOCK,
    OP_NAMES,
    OP_NOOP,
    OP_PREFIX_DROP,
    OP_PREFIX_LOAD,
    OP_PREFIX_SAVE,
    OP_RESET,
    OP_ROUND,
    OP_STOP,
    PlanError,
    _long,
    pack_block,
    pack_dspark,
    pack_forward,
    unpack_block,
    unpack_dspark,
    unpack_forward,
)
from v4flash_backend.group.server import Server
from v4flash_backend.parallel.micro_batch import MicroBatchRunner


def pack_round(plan: RoundPlan):
    """A static decode round (engine._step_static's plan) as (a, body): its wire form is the plan
    type's (`RoundPlan.pack`: a = (S, stop width, spec mode, fixed_len))."""
    return plan.pack()


def unpack_round(a, body: torch.Tensor) -> RoundPlan:
    return RoundPlan.unpack(a, body)


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
        self.exec_lock = local.exec_lock  # a static runner's (trn2.warmup)

    @property
    def graphs_ready(self) -> bool:
        return self.local.graphs_ready

    def round_fits(self, seqs: int, ctx_needed: int, processed: bool = False, plain: bool = False) -> bool:
        return self.local.round_fits(seqs, ctx_needed, processed, plain)  # a function of the plan: no broadcast

    def decode_round(self, plan: dict):
        a, body = pack_round(plan)
        self.coll.begin_step()
        self._send(OP_ROUND, a, body)
        out = self.local.decode_round(plan)
        self.coll.end_step()
        return out

    def first_blocks(self, plan):
        a, body = pack_round(plan)
        self.coll.begin_step()
        self._send(OP_FIRST_BLOCK, a, body)
        out = self.local.first_blocks(plan)
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

    def save_prefix(self, slot: int, entry: int, p: int, q0: int) -> int:
        self._send(OP_PREFIX_SAVE, (slot, entry, p, q0))
        return self.local.save_prefix(slot, entry, p, q0)

    def load_prefix(self, slot: int, chain: list[int]) -> None:
        self._send(OP_PREFIX_LOAD, (slot, len(chain)), _long(chain))
        self.local.load_prefix(slot, chain)

    def drop_prefix(self, entries: list[int]) -> None:
        if entries:
            self._send(OP_PREFIX_DROP, (len(entries),), _long(entries))
            self.local.drop_prefix(entries)

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
        self.coll.broadcast(buf, self.src, "control")  # the control plane: gloo (parallel.collectives)
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
            self.coll.all_reduce(torch.zeros(1), "control", "heartbeat")

    def stop(self) -> None:
        self._send(OP_STOP)



def follow(local, coll, plan_size: int = 2048, src: int = 0, drafts: bool = True) -> int:
    """Every rank but the driver `src`: execute its plans until STOP; returns the number of plans
    executed. drafts False (a pipeline stage before the last): DSpark plans are skipped, the draft
    stages live on the last stage."""
    buf = torch.zeros(plan_size, dtype=torch.long)
    seq = 0
    while True:
        coll.broadcast(buf, src, "control")
        magic, op, got, n, *a = buf[:HDR].tolist()
        if magic != MAGIC or got != seq or not 0 <= n <= buf.numel() - HDR:
            raise PlanError(f"bad plan header {buf[:HDR].tolist()} (expected sequence {seq})")
        seq += 1
        body = buf[HDR:HDR + n]
        if op == OP_NOOP:
            coll.all_reduce(torch.zeros(1), "control", "heartbeat")
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
        elif op == OP_FIRST_BLOCK:  # the round's draft graph (its collectives run on every rank, as ROUND's)
            coll.begin_step()
            local.first_blocks(unpack_round(a, body))
            coll.end_step()
        elif op == OP_LOAD_BLOCK:
            local.load_block(*unpack_block(a, body))
        elif op == OP_COUNTS:
            local.set_counts(a[0], body[:a[1]].tolist())
        elif op == OP_PREFIX_SAVE:
            local.save_prefix(*a)
        elif op == OP_PREFIX_LOAD:
            local.load_prefix(a[0], body[:a[1]].tolist())
        elif op == OP_PREFIX_DROP:
            local.drop_prefix(body[:a[0]].tolist())
        else:
            raise PlanError(f"unknown plan op {op}")



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
    pids = [int(p) for p in coll.all_gather(torch.tensor([os.getpid()]), "control", "setup")]
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
    warming = getattr(local, "warming", None)
    if warming is not None and not warming.close():  # trn2.warmup: no thread of ours inside torch at exit
        _log(rank, "the background compile did not stop within 10 s")
    if lay.world > 1 and code == 0:
        import torch.distributed as dist

        dist.destroy_process_group()
    return code


def _serve_rank0(args, settings, lay, coll, local, pids, secret: bytes | None = None) -> int:
    from v4flash_backend.group.build import build_engine

    stop = threading.Event()
    info = {"world_size": lay.world, "attn_group_size": lay.group_size, "pids": pids,
            "pipeline_parallel": lay.pipeline, "driver_rank": lay.driver,
            "decode_graph": local.decode_graph,
            "max_num_seqs": settings.max_num_seqs, "max_model_len": settings.max_model_len}

    stop_on_sigterm(info, stop)
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
    # Leave without the interpreter's finalization: CPython 3.11 kills a daemon thread that is still
    # inside a C++ call then (pthread_exit; its forced unwind through a catch-all C++ frame aborts the
    # process: SIGABRT, and torchrun reports the group failed). Our own threads are stopped above
    # (the background compile) or hold no torch call (the socket server's); this covers the ones of
    # the libraries beneath (inductor's, dynamo's). The process group is already destroyed.
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
