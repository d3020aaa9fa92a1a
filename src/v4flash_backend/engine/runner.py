"""The engine's view of the model: a Runner executes forward and draft calls on cache slots.

`Runner` is the protocol the engine relies on. Implementations: `LocalRunner` (this process, op by
op), `group.worker.PlanRunner` (rank 0 of a rank group: broadcasts each call as a fixed-size integer
plan, so every rank executes the same `LocalRunner` method on its own shard; only rank 0 reads the
results) and `trn2.static_runner.StaticRunner` (the fixed-shape graphs per bucket). Taps of the last
forward stay on every rank, so DSpark ring writes name rows of that forward instead of shipping
hidden states.
"""

from __future__ import annotations

from typing import Protocol

import torch

from v4flash_backend.engine.round_plan import RoundPlan
from v4flash_backend.model.dspark import DraftOutput, DSparkDrafter
from v4flash_backend.model.snapshot import SnapshotStore
from v4flash_backend.model.state import ModelState, make_segments
from v4flash_backend.model.transformer import StepOutput, V41Model


class Runner(Protocol):
    """Every attribute and method the engine uses on a runner (`LocalRunner` has them all; the
    static-round methods there are defaults that a runner without static rounds never reaches)."""

    model: V41Model
    cfg: object  # the ModelConfig
    state: ModelState
    drafter: DSparkDrafter | None  # None: the checkpoint has no DSpark stages
    decode_graph: str  # "eager" | "static": what the engine's stats report
    static_rounds: bool  # True: decode-only steps may run as `decode_round` (when `round_fits`)
    # what a device would see, counted by the runner: graph_executions, host_syncs,
    # host_to_device_bytes (+ a static runner's prefill_graphs, graphs_compiled, eager_forwards ...)
    counters: dict
    counts_host_syncs: bool  # False: host_syncs is not counted (the stats report None, not 0)
    # a lock the engine holds for a whole step (and its profile) while compiled graphs run under it
    # beside the steps (trn2.warmup: graphs compiling in the background); None: nothing runs beside
    exec_lock: object
    graphs_ready: bool  # False while graphs compile in the background (the profile then times eager steps)

    def reset_slot(self, slot: int) -> None:
        """Forget a slot's state (a new request takes it)."""

    def forward(self, tokens: torch.Tensor, spec: list[tuple[int, int, int]], logits_rows,
                want_taps: bool) -> StepOutput:
        """One target forward over segments [(slot, start, n)] in row order; logits for `logits_rows`
        (a LongTensor of rows, or 'last' / 'all' / 'none'); DSpark taps kept when want_taps."""

    def dspark(self, writes: list[tuple[int, torch.Tensor, torch.Tensor]],
               items: list[tuple[int, int, int]]) -> DraftOutput | None:
        """Ring writes of committed rows, then draft blocks for items [(slot, p, anchor)]."""

    def round_fits(self, seqs: int, ctx_needed: int, processed: bool = False, plain: bool = False) -> bool:
        """Whether a decode round of `seqs` sequences needing `ctx_needed` cache rows has a graph
        (processed: of the logit-processing variant) that is ready to run; plain: a round that neither
        verifies nor drafts (the plain-decode graph)."""

    def decode_round(self, plan: RoundPlan) -> list[list[int]]:
        """One decode round in the static graphs (trn2.static_round); one read-back row a sequence."""

    def first_blocks(self, plan: RoundPlan) -> list[list[int]]:
        """The first draft blocks of requests whose prefill the last forward completed, by the static
        round's draft graph (trn2.static_runner; `plan` as a round's that has just committed the first
        token); one read-back row a sequence."""

    def load_block(self, slot: int, block) -> None:
        """A draft block drafted on the host into the slot's device-resident block."""

    def read_block(self, slot: int):
        """The slot's device-resident draft block, for an eager step after static rounds."""

    def set_counts(self, slot: int, generated) -> None:
        """The slot's generated-token counts (the penalties' input) set from `generated`."""

    def save_prefix(self, slot: int, entry: int, p: int, q0: int) -> int:
        """Keep the slot's state at boundary p as prefix-cache entry `entry` (extending the entry of
        boundary q0); returns its bytes on this rank (model.snapshot)."""

    def load_prefix(self, slot: int, chain: list[int]) -> None:
        """Restore the entries of a chain (root first) into the (reset) slot."""

    def drop_prefix(self, entries: list[int]) -> None:
        """Free prefix-cache entries."""


class LocalRunner:
    """The eager (op-by-op) runner. `counters` count what a device would see: graph executions
    (none here: every op is its own launch), host syncs (the device-to-host reads of the eager
    forward, found by `HostSyncCounter`, plus the read-back of the logits / draft logits the
    engine samples from on the host) and host-to-device bytes (the step's inputs).

    Host syncs are counted only with count_host_syncs: `HostSyncCounter` is a TorchFunctionMode
    that every torch call of the forward passes through, and on a CPU, where the tiny model's step
    is mostly per-op dispatch, it cost 39 % of a decode forward at 1 sequence and 29 % at 8
    (49.3 -> 29.9 ms and 104.0 -> 73.6 ms, `perf/eager_overhead.py`, medians of 5 rounds). Off,
    `counts_host_syncs` is False and the engine reports no figure for them rather than a 0."""

    decode_graph = "eager"
    static_rounds = False
    exec_lock = None  # nothing compiles beside the steps (StaticRunner: its own)
    graphs_ready = True

    def __init__(self, model: V41Model, num_slots: int, max_len: int, margin: int = 8,
                 count_host_syncs: bool = False):
        self.counts_host_syncs = count_host_syncs
        self.model = model
        self.cfg = model.cfg
        self.state = ModelState(model.cfg, num_slots, max_len, margin)
        self.drafter = DSparkDrafter(model) if model.cfg.dspark_block_size else None
        self.last_taps: torch.Tensor | None = None
        self.counters = dict(graph_executions=0, host_syncs=0, host_to_device_bytes=0)
        self.snapshots = SnapshotStore()  # the prefix cache's entries of this rank (engine.prefix_cache)

    def _count(self, syncs: int, h2d: int, graphs: int = 0) -> None:
        c = self.counters
        c["host_syncs"] += syncs
        c["host_to_device_bytes"] += h2d
        c["graph_executions"] += graphs

    def _sync_counter(self):
        from .device_boundary import HostSyncCounter, NoSyncCounter

        return HostSyncCounter() if self.counts_host_syncs else NoSyncCounter()

    def _inference(self):
        """The eager forward without autograd's bookkeeping (version counters, view tracking): a
        fifth of a CPU decode forward on the tiny model, where the step is mostly per-op dispatch
        (`perf/eager_overhead.py --grad-modes`). Not on a static runner: its compiled graphs were traced
        outside inference mode (a guard would re-trace them) and update its state in place."""
        return torch.inference_mode(not self.static_rounds)

    # every method below is one collective-synchronous call in a rank group
    def reset_slot(self, slot: int) -> None:
        self.state.reset_slot(slot)

    def forward(self, tokens: torch.Tensor, spec: list[tuple[int, int, int]], logits_rows,
                want_taps: bool) -> StepOutput:
        """spec: [(slot, start, n)] in row order; logits_rows: LongTensor of rows (or 'last'/'all')."""
        with self._sync_counter() as hs, self._inference():
            out = self.model.forward(self.state, tokens, make_segments(spec), logits_rows, want_taps)
        rows = 0 if isinstance(logits_rows, str) else len(logits_rows)
        self._count(hs.total + (out.logits is not None), 8 * (len(tokens) + 3 * len(spec) + rows))
        self.last_taps = out.taps
        return out

    def dspark(self, writes: list[tuple[int, torch.Tensor, torch.Tensor]],
               items: list[tuple[int, int, int]]) -> DraftOutput | None:
        """writes: [(slot, rows of the last forward's taps, their positions)] -> DSpark rings;
        items: [(slot, p, anchor)] -> draft blocks at positions p+1..p+B (None if no items)."""
        d = self.drafter
        h2d = 8 * (sum(2 * len(r) + 2 for _, r, _ in writes) + 3 * len(items))
        with self._sync_counter() as hs, self._inference():
            if writes:
                d.write_rings(self.state, self.last_taps, writes)
            out = d.draft(self.state, items) if items else None
        self._count(hs.total + (out is not None), h2d)
        return out

    def save_prefix(self, slot: int, entry: int, p: int, q0: int) -> int:
        return self.snapshots.save(self.state, slot, entry, p, q0)

    def load_prefix(self, slot: int, chain: list[int]) -> None:
        self.snapshots.load(self.state, slot, chain)

    def drop_prefix(self, entries: list[int]) -> None:
        self.snapshots.drop(entries)

    # no static rounds here (static_rounds is False): the engine never calls the methods below on
    # this runner; a runner with static rounds (trn2.static_runner.StaticRunner) overrides them
    def round_fits(self, seqs: int, ctx_needed: int, processed: bool = False, plain: bool = False) -> bool:
        return False

    def decode_round(self, plan: RoundPlan) -> list[list[int]]:
        raise NotImplementedError(f"{type(self).__name__} has no static decode rounds (decode_graph eager)")

    def first_blocks(self, plan: RoundPlan) -> list[list[int]]:
        raise NotImplementedError(f"{type(self).__name__} has no static decode rounds (decode_graph eager)")

    def load_block(self, slot: int, block) -> None:
        raise NotImplementedError(f"{type(self).__name__} holds no device-resident draft blocks")

    def read_block(self, slot: int):
        raise NotImplementedError(f"{type(self).__name__} holds no device-resident draft blocks")

    def set_counts(self, slot: int, generated) -> None:
        raise NotImplementedError(f"{type(self).__name__} holds no device-resident token counts")
