"""`StaticRunner`: the engine's runner (`runner.LocalRunner` interface) on top of the static graphs:
decode rounds go through the bucket graphs (`decode_round`, from a typed `round_plan.RoundPlan`),
anything else (prefill chunks, mixed steps) through the bucket forward graphs or the eager forward;
and `place_resident`, which puts the weights and every per-slot cache on the rank's device once. It
runs on CPU in the tests (compile backend none / eager) as on a NeuronCore.
"""

from __future__ import annotations

import os
import threading

import torch

from v4flash_backend.engine.round_plan import RoundPlan, filters_sampling
from v4flash_backend.engine.runner import LocalRunner
from v4flash_backend.model.dspark import DraftOutput
from v4flash_backend.model.transformer import StepOutput

from .graphs import StaticGraphs, _Progress, decode_buckets, prefill_buckets, to_device
from .launch import NeuronSettings
from .static_step import BoundarySpy, Bucket, HostSyncCounter, StaticDecoder, pick_bucket
from .warmup import StepGate


class StaticRunner(LocalRunner):
    """The served static decode path: `LocalRunner` (prefill chunks and mixed steps run the eager
    forward) plus `decode_round`, which runs a decode step as the bucket's two round graphs
    (`static_round`: verify + acceptance + sampling; DSpark rings + draft + Markov drafting +
    confidence + admission) over state that stays where the model is: the KV caches, the DSpark
    rings and the per-slot draft blocks. A round moves in only its plan (int64 / float64 vectors of
    the bucket's S rows, and the SPS table) and moves out one [S, G+5] int64 tensor."""

    decode_graph = "static"
    static_rounds = True

    def __init__(self, model, num_slots: int, max_len: int, buckets: list[Bucket] | None = None,
                 settings: NeuronSettings | None = None, margin: int = 8, prefill_rows: int = 0,
                 count_host_syncs: bool = True, ctx_buckets: bool = True):
        # + the scratch slot; host syncs counted as before: a static decode round is one graph call
        # (its count is the interface: 0), and the eager forwards of fallback steps are rare -- except
        # while the graphs compile in the background, where eager steps serve (count_host_syncs False:
        # the counting hook costs 30-40 % of an eager forward)
        super().__init__(model, num_slots + 1, max_len, margin, count_host_syncs=count_host_syncs)
        _settle_weights(model)
        settings = settings or NeuronSettings()
        # held by every compiled graph while it runs, and (through exec_lock, the gate the engine holds
        # for a whole step) by the serving thread: graphs compiled in the background (trn2.warmup) run
        # their padding rounds between steps, and the compile pauses while a step runs
        self.graph_lock = threading.RLock()
        self.exec_lock = StepGate(self.graph_lock)
        # the graph sets that are warm while trn2.warmup compiles in the background: ("round", decode
        # bucket, processed), ("forward", decode bucket), ("prefill", prefill bucket); None: all (compiled
        # at start, or nothing to compile). A round or a forward that needs a set not in it runs eager
        # steps meanwhile (round_fits, forward_plan).
        self.ready: set | None = None
        self.warming = None  # the trn2.warmup.BackgroundWarmup compiling them
        self.G = model.cfg.dspark_block_size or 0
        rows = 1 + self.G
        self.decoder = StaticDecoder(model, self.state, scratch=num_slots, max_rows=rows)
        # ctx_buckets False: one context bound, max_len, for every sequence count (decode and prefill
        # buckets alike): a third of the graphs at the default 1024 tokens, for a background compile
        ctx0 = 256 if ctx_buckets else max_len
        self.buckets = buckets or decode_buckets(num_slots, max_len, rows, min_ctx=ctx0)
        from .static_round import BlockState

        self.blocks = BlockState.empty(num_slots + 1, self.G, model.cfg.vocab_size)
        self.graphs = StaticGraphs(self.decoder, self.buckets, settings, blocks=self.blocks, lock=self.graph_lock)
        # prefill graphs (prefill_rows > 0): one sequence's chunk of up to prefill_rows rows (<= the
        # port's 4096-token segment), padded into the next power-of-two row bucket
        self.pgraphs = None
        if prefill_rows:
            pb = prefill_buckets(prefill_rows, max_len, min_ctx=ctx0)
            self.pdecoder = StaticDecoder(model, self.state, scratch=num_slots, max_rows=max(b.rows for b in pb),
                                          prefill=True)
            self.pgraphs = StaticGraphs(self.pdecoder, pb, settings, lock=self.graph_lock, label="prefill")
        # the plain-decode graphs (DSpark checkpoints): one row per sequence, for a round where no
        # sequence verifies a draft and none drafts (stepped aside, or spec_mode off): graph 1 over
        # 1 row instead of 1 + G (perf/nodraft_round_cpu.py: up to ~1.5-2x less at S >= 4 here)
        self.ngraphs = None
        if self.G:
            self.ndecoder = StaticDecoder(model, self.state, scratch=num_slots, max_rows=1)
            self.ngraphs = StaticGraphs(self.ndecoder, [Bucket(b.seqs, 1, b.ctx) for b in self.buckets], settings,
                                        stats=self.graphs.stats, blocks=self.blocks, lock=self.graph_lock,
                                        label="plain")
        self.counters.update(prefill_graphs=0, forward_graphs=0, eager_forwards=0, plain_decode_rounds=0,
                             first_block_graphs=0)
        self.last_spec: list = []  # the last forward's segments (first_blocks finds its tap rows there)
        if self.drafter is not None:  # the engine's eager drafting calls the heads with host tensors
            self.drafter = _HostDrafter(self.drafter, self)

    def warm_up_nodraft(self, progress=None, stop_width: int = 8, processed: bool = True) -> None:
        """Compile every bucket's plain-decode round graph (and its logit-processing variant) on a
        padding plan: the servers that step aside (dspark_adaptive) or do not draft (spec_mode off)."""
        if self.ngraphs is None or self.graphs.settings.backend == "none":
            return
        bar = _Progress(len(self.ngraphs.buckets), progress)
        if not self.ngraphs.primed:  # its own forms' caches (startup.prime)
            self.ngraphs.prime("off", 0, stop_width)
        for i, b in enumerate(self.ngraphs.buckets):
            for proc in (False, True)[:1 + processed]:
                self.ngraphs.round(b, "off", 0, self.ngraphs.round_padding(b, stop_width, proc))
            bar.show(i + 1, f"plain decode {b}")

    def set_artifacts(self, source) -> None:
        """Load every graph by its key from `source` (a trn2.artifacts.ArtifactSource) instead of compiling it."""
        for g in (self.graphs, self.ngraphs, self.pgraphs):
            if g is not None:
                g.artifacts = source

    @property
    def graphs_ready(self) -> bool:
        """Every bucket's rounds are warm (the step-cost profile times the rounds only then): all of them
        (compiled at start), or the background compile's announced sets (trn2.warmup)."""
        return self.ready is None or (self.warming is not None and self.warming.announced_warm)

    def _warm(self, *key) -> bool:
        ready = self.ready
        return ready is None or key in ready

    def warm_round(self, b: Bucket, processed: bool, mode: str, fixed_len: int, stop_width: int) -> None:
        """Compile, on a padding plan (it changes no real slot), the graphs a drafting round of decode
        bucket b runs in one variant (processed: logit processing): the round graphs of `mode` -- what
        `warm_up` compiles for b at start."""
        self.graphs.round(b, mode, fixed_len, self.graphs.round_padding(b, stop_width, processed))

    def warm_plain_round(self, b: Bucket, processed: bool, stop_width: int) -> None:
        """Compile decode bucket b's plain-decode round graph (1 row a sequence: a round that neither
        verifies nor drafts) in one variant, on a padding plan -- what `warm_up_nodraft` compiles for b."""
        nb = Bucket(b.seqs, 1, b.ctx)
        self.ngraphs.round(nb, "off", 0, self.ngraphs.round_padding(nb, stop_width, processed))

    def warm_forward(self, b: Bucket) -> None:
        """Compile decode bucket b's bare verify graph (a step's short segments) on a padding plan."""
        self.graphs.verify_graph(b)(*self.decoder.padding_plan(b.seqs, b.rows))

    def warm_prefill_bucket(self, pb: Bucket) -> None:
        """Compile prefill bucket pb's graph on a padding chunk (it writes nothing)."""
        self.pgraphs.verify_graph(pb)(*self.pdecoder.padding_plan(1, pb.rows))

    def warm_up_prefill(self, progress=None) -> None:
        """Compile every prefill bucket on a padding chunk (it writes nothing), and every decode
        bucket's bare verify graph (the forward of a step's short segments, `forward`)."""
        if self.graphs.settings.backend == "none":
            return
        pb = self.pgraphs.buckets if self.pgraphs is not None else []
        bar = _Progress(len(pb) + len(self.buckets), progress)
        for i, b in enumerate(pb):
            self.warm_prefill_bucket(b)
            bar.show(i + 1, f"prefill {b}")
        for i, b in enumerate(self.buckets):
            self.warm_forward(b)
            bar.show(len(pb) + i + 1, f"forward {b}")

    def forward_plan(self, spec):
        """How a step's target forward runs as fixed-shape graphs: (verify bucket or None, the
        segments through it, [(prefill bucket, segment index)]) -- segments of up to 1 + G rows
        (decode rows, short chunks) go together through the decode bucket's verify graph, longer
        ones (prefill chunks) each through the prefill graph of their row bucket. None: no bucket
        holds the step (it runs the eager forward, counted as eager_forwards)."""
        Q = 1 + self.G
        short = [i for i, (_, _, n) in enumerate(spec) if n <= Q]
        long = [i for i, (_, _, n) in enumerate(spec) if n > Q]
        vb, pre = None, []
        try:
            if short:
                vb = pick_bucket(self.buckets, len(short), Q, max(spec[i][1] + spec[i][2] for i in short))
            for i in long:
                if self.pgraphs is None:
                    return None
                _, start, n = spec[i]
                pre.append((pick_bucket(self.pgraphs.buckets, 1, n, start + n), i))
        except ValueError:
            return None
        cold = ([("forward", vb)] if vb is not None and not self._warm("forward", vb) else []) + \
            [("prefill", pb) for pb, _ in pre if not self._warm("prefill", pb)]
        if cold:  # a graph still compiling in the background: the eager forward meanwhile (it is wanted now)
            for key in cold:
                if self.warming is not None:
                    self.warming.want(key)
            return None
        return vb, short, pre

    def forward(self, tokens, spec, logits_rows, want_taps):
        """Any step's target forward through the graphs of `forward_plan`: a step of several
        sequences' prefill chunks, or a chunk with other sequences' decode rows, is one verify graph
        (all the short segments) plus one prefill graph per long chunk; the logits and DSpark taps
        come back in the step's row order, equal to the eager forward's bit for bit. The SPS
        profile's scratch-slot forwards and steps no bucket holds run the eager forward."""
        self.last_spec = [tuple(int(v) for v in seg) for seg in spec]
        plan = None if any(sl == self.decoder.scratch for sl, _, _ in spec) else self.forward_plan(spec)
        if plan is None:
            if not any(sl == self.decoder.scratch for sl, _, _ in spec):
                self.counters["eager_forwards"] += 1
            out = super().forward(torch.as_tensor(tokens).to(self.decoder.device), spec, logits_rows, want_taps)
            return StepOutput(self._to_host(out.logits), out.taps, self._to_host(out.final_hidden))
        vb, short, pre = plan
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        offs = [0]
        for _, _, n in spec:
            offs.append(offs[-1] + n)
        logits_parts, taps_parts, src = [], [], [None] * offs[-1]  # src[row] = row of the concatenated outputs
        base, h2d, before = 0, 0, (self.graphs.executions, self.pgraphs.executions if self.pgraphs else 0)
        if vb is not None:
            S, Q = vb.seqs, vb.rows
            tok = torch.zeros(S, Q, dtype=torch.long)
            slot = torch.full((S,), self.decoder.scratch, dtype=torch.long)
            start, n = torch.zeros(S, dtype=torch.long), torch.zeros(S, dtype=torch.long)
            for j, i in enumerate(short):
                sl, a, k = spec[i]
                tok[j, :k] = tokens[offs[i]:offs[i] + k]
                slot[j], start[j], n[j] = sl, a, k
                for r in range(k):
                    src[offs[i] + r] = base + j * Q + r
            self.decoder.check_plan(vb, slot.tolist(), start.tolist(), n.tolist())
            dev = self.decoder.device  # the plan moves in once
            lg, tp = self.graphs.verify(vb, tok.to(dev), slot.to(dev), start.to(dev), n.to(dev))
            logits_parts.append(lg)
            taps_parts.append(tp)
            base += S * Q
            h2d += 8 * (tok.numel() + 3 * S)
        for pb, i in pre:
            sl, a, k = spec[i]
            tok = torch.zeros(1, pb.rows, dtype=torch.long)
            tok[0, :k] = tokens[offs[i]:offs[i] + k]
            dev = self.pdecoder.device
            lg, tp = self.pgraphs.verify(pb, tok.to(dev), *(torch.tensor([v], device=dev) for v in (sl, a, k)))
            for r in range(k):
                src[offs[i] + r] = base + r
            logits_parts.append(lg)
            taps_parts.append(tp)
            base += pb.rows
            h2d += 8 * (pb.rows + 3)
        src = torch.tensor(src, dtype=torch.long, device=self.decoder.device)
        taps = torch.cat(taps_parts)[src] if taps_parts and taps_parts[0] is not None else None
        self.last_taps = taps
        if isinstance(logits_rows, str):
            # the last row of each segment
            last = torch.tensor([o - 1 for o in offs[1:]], dtype=torch.long, device=src.device)
            pick = {"all": src, "last": src[last], "none": None}[logits_rows]
        else:
            pick = src[torch.as_tensor(logits_rows, dtype=torch.long).to(src.device)]
        out = None if pick is None else torch.cat(logits_parts)[pick]
        rows = 0 if pick is None else len(pick)
        graphs = self.graphs.executions - before[0] + ((self.pgraphs.executions - before[1]) if self.pgraphs else 0)
        self._count(out is not None, h2d + 8 * rows, graphs)
        self.counters["prefill_graphs"] += len(pre)
        self.counters["forward_graphs"] += graphs
        return StepOutput(self._to_host(out), taps if want_taps else None, None)

    # ---- the host boundary of a device-resident runner -------------------------------------------
    # The engine verifies, samples and drafts an eager step (a prefill chunk, a mixed step) on the
    # host. Where the weights and caches live on a device (`place_resident`: the rank's NeuronCore,
    # or the GPU standing in for one), this runner is the boundary: what the engine hands in moves to
    # the device here, and what it reads (logits, draft logits, the draft heads' outputs, a draft
    # block) comes back here. On a CPU-resident runner every move is a no-op.
    def _to_host(self, t):
        return t.cpu() if isinstance(t, torch.Tensor) and t.device.type != "cpu" else t

    def dspark(self, writes, items):
        dev = self.decoder.device
        writes = [(slot, rows.to(dev), pos.to(dev)) for slot, rows, pos in writes]
        out = super().dspark(writes, items)
        if out is None:
            return None
        return DraftOutput(self._to_host(out.base_logits), self._to_host(out.hidden))

    def resident_tensors(self) -> list[torch.Tensor]:
        """What stays on the device: the weights, every per-slot cache, the draft blocks."""
        st = self.state
        out = list(self.model.W.values()) + list(self.model.W.meta.get("rank_offsets", {}).values())
        for d in (st.window, st.ckv, st.ik, st.pend_kv, st.pend_score, st.dspark):
            out += list(d.values())
        return out + [st.engram_hist, self.blocks.tokens, self.blocks.q, self.blocks.z]

    def round_fits(self, seqs: int, ctx_needed: int, processed: bool = False, plain: bool = False) -> bool:
        """A bucket holds the round and its variant's graphs are warm (compiling in the background:
        not yet -> an eager step, and the set moves to the front of the compile queue). plain: a
        round that neither verifies nor drafts, which runs the bucket's plain-decode graph alone
        (the set ("plain", b, processed)); else the drafting round's graphs ("round", b, processed)."""
        try:
            b = pick_bucket(self.buckets, seqs, 1 + self.G, ctx_needed)
        except ValueError:
            return False
        kind = "plain" if plain and self.ngraphs is not None else "round"
        if self._warm(kind, b, processed):
            return True
        if self.warming is not None:
            self.warming.want((kind, b, processed))
        return self._round_bucket(seqs, ctx_needed, processed, kind) is not None

    def _round_bucket(self, seqs: int, ctx_needed: int, processed: bool, kind: str) -> Bucket | None:
        """The bucket a round runs in: the smallest that holds it (`pick_bucket`), or while the
        background compile has not warmed that one, the smallest larger one whose set is warm (the
        round padded with more padding sequences: a compiled round of the larger bucket is several
        times faster than the eager step); None: none warm."""
        try:
            return pick_bucket([b for b in self.buckets if self._warm(kind, b, processed)], seqs, 1 + self.G,
                               ctx_needed)
        except ValueError:
            return None

    def load_block(self, slot: int, block) -> None:
        """A draft block drafted on the host (an eager step) into the per-slot state."""
        tokens, _, q, z = block
        dev = self.decoder.device
        self.blocks.tokens[slot] = tokens.to(dev)
        self.blocks.q[slot] = q.float().to(dev)
        self.blocks.z[slot] = z.float().to(dev)
        self._count(0, tokens.numel() * 8 + q.numel() * 4 + z.numel() * 4)

    def read_block(self, slot: int):
        """The per-slot draft block for an eager step (a device-to-host read: counted)."""
        self._count(1, 0)
        b = self.blocks
        host = self._to_host
        tokens = host(b.tokens[slot]).clone()
        return tokens, torch.zeros_like(tokens), host(b.q[slot]).clone(), host(b.z[slot]).clone()

    def round_inputs(self, plan: RoundPlan):
        """(bucket, inputs) of a round plan, padded to the bucket with padding sequences."""
        ctx_needed = max(a + 1 + e for a, e in zip(plan.start, plan.ell))
        b = pick_bucket(self.buckets, plan.size, 1 + self.G, ctx_needed)
        kind = "plain" if self._plain(plan) else "round"
        if not self._warm(kind, b, plan.processed):  # compiling in the background: a warm larger bucket
            b = self._round_bucket(plan.size, ctx_needed, plan.processed, kind) or b
        self.decoder.check_plan(b, plan.slot, plan.start, [1 + e for e in plan.ell])
        if not plan.processed and filters_sampling(plan.temperature, plan.top_k, plan.top_p, self.cfg.vocab_size):
            raise ValueError("a round whose sampling filters (top-k / top-p) needs the processed round variant: "
                             "the plain one samples without the filters")
        x = plan.inputs(b.seqs, self.G, self.decoder.scratch)
        # the plan moves in once, here (the round's only host-to-device copy)
        return b, to_device(x, self.decoder.device)

    def set_counts(self, slot: int, generated) -> None:
        """The slot's generated-token counts (the penalties' input of the processed rounds) from its
        generated ids: after eager steps committed tokens the device counts have not seen."""
        t = torch.as_tensor(list(generated), dtype=torch.long)
        counts = self.blocks.counts
        counts[slot] = torch.bincount(t, minlength=self.cfg.vocab_size).to(counts.dtype).to(counts.device)
        self._count(0, t.numel() * 8)

    def _plain(self, plan: RoundPlan) -> bool:
        """A round that neither verifies nor drafts: the bucket's plain-decode graph runs it."""
        mode = plan.spec_mode if self.G else "off"
        return mode == "off" and self.ngraphs is not None and all(e <= 0 for e in plan.ell)

    def first_blocks(self, plan: RoundPlan) -> list[list[int]]:
        """`StaticGraphs.first_block` on `Engine._first_blocks_static`'s plan; the taps are the last
        forward's rows at the plan's positions (every rank ran that forward: none cross ranks)."""
        b, x = self.round_inputs(plan)
        taps, offs, rows, o = self.last_taps, {}, [], 0
        for sl, a, n in self.last_spec:
            offs[(sl, a + n - 1)] = o + n - 1
            o += n
        for sl, a in zip(plan.slot, plan.start):
            if (sl, a) not in offs or taps is None:
                raise ValueError(f"first_blocks: slot {sl} position {a} is not a row of the last forward's taps")
            rows.append(offs[(sl, a)])
        t = taps.new_zeros(b.seqs * b.rows, taps.shape[1])
        t[torch.arange(plan.size, device=t.device) * b.rows] = taps[torch.tensor(rows, device=taps.device)]
        before = self.graphs.executions
        rows_out = self.graphs.first_block(b, plan.spec_mode, int(plan.fixed_len), x, t)[:plan.size].tolist()
        self._count(0, sum(v.numel() * v.element_size() for v in x.values()), self.graphs.executions - before)
        self.counters["first_block_graphs"] += 1
        return rows_out

    def decode_round(self, plan: RoundPlan) -> list[list[int]]:
        b, x = self.round_inputs(plan)
        mode = plan.spec_mode if self.G else "off"
        # bytes in: the round's inputs (a round without the draft graph does not take its admission inputs)
        h2d = sum(t.numel() * t.element_size() for k, t in x.items()
                  if mode != "off" or k not in ("t_draft", "cal", "fixed_ell"))
        counting = self.graphs.settings.backend == "none"  # op by op: watch for syncs (compiled: refused at compile)
        ctx = HostSyncCounter() if counting else _Null()
        spy = BoundarySpy(self.resident_tensors()) if os.environ.get("V4FLASH_BOUNDARY_SPY") == "1" else _Null()
        graphs, before = self.graphs, self.graphs.executions
        if self._plain(plan):
            # nothing to verify, nothing to draft: the bucket's plain-decode graph (1 row per sequence;
            # its read-back has G = 0 columns of drafts and confidences, which the host reads alike)
            graphs, before = self.ngraphs, self.ngraphs.executions
            b = Bucket(b.seqs, 1, b.ctx)
            self.counters["plain_decode_rounds"] += 1
        with spy:
            with ctx:  # host syncs inside the round (the read-back below is not one)
                out = graphs.round(b, mode, int(plan.fixed_len), x)
            rows = out[:plan.size].tolist()  # the round's one read-back (committed tokens + counts)
        self._count(ctx.total, h2d, graphs.executions - before)
        if isinstance(spy, BoundarySpy):
            c = self.counters
            c["boundary_resident_moves"] = c.get("boundary_resident_moves", 0) + spy.resident_moves
            c["boundary_reads"] = c.get("boundary_reads", 0) + spy.reads
        self.counters["graphs_compiled"] = self.graphs.stats.graphs
        return rows


def _move_attrs(obj, device) -> int:
    """Move every tensor attribute (and every tensor value of a dict attribute) of obj; returns
    how many tensors it placed."""
    n = 0
    for name, v in list(vars(obj).items()):
        if isinstance(v, torch.Tensor):
            setattr(obj, name, v.to(device))
            n += 1
        elif isinstance(v, dict) and v and all(isinstance(t, torch.Tensor) for t in v.values()):
            for k in v:
                v[k] = v[k].to(device)
            n += len(v)
    return n


def place_resident(runner: "StaticRunner", device) -> int:
    """Put the rank's weight shard, every per-slot cache (KV rings, compressed KV, index keys,
    compressor pending rows, DSpark rings, Engram history), the draft blocks and the RoPE / Engram
    tables on `device` once, at load (the rank's NeuronCore on trn2; 'cpu' here, where it is a
    no-op). A decode round then moves only its plan in and its committed tokens out. Returns the
    number of tensors placed."""
    W = runner.model.W
    for k in list(W.keys()):
        W[k] = W[k].to(device)
    n = len(W)
    offsets = W.meta.get("rank_offsets", {})  # the shard's starts, read by the graphs (Weights.rank_offset)
    for k in offsets:
        offsets[k] = offsets[k].to(device)
    n += len(offsets)
    W.meta.pop("stacked", None)  # the stacked experts (W's expert entries are views of them): rebuilt there
    _settle_weights(runner.model)
    n += _move_attrs(runner.state, device) + _move_attrs(runner.blocks, device)
    # every decoder's tables (decode, plain-decode, prefill): each `_TableRope` holds the model
    # Rope's table, so a table shared before the move stays shared (moved once)
    decoders = [getattr(runner, d, None) for d in ("decoder", "ndecoder", "pdecoder")]
    ropes = list(runner.model.ropes.values()) + [r for d in decoders if d is not None for r in d.ropes.values()]
    moved: dict = {}
    for rope in ropes:
        for name, v in list(vars(rope).items()):
            if isinstance(v, torch.Tensor):
                if id(v) not in moved:
                    moved[id(v)] = (v, v.to(device))  # keep v alive: ids stay unique
                    n += 1
                setattr(rope, name, moved[id(v)][1])
    hasher = getattr(runner.model, "hasher", None)
    if hasher is not None and hasattr(hasher, "to"):
        hasher.to(device)
    from v4flash_backend.formats import quant

    return n + (quant.place_tables(device) if torch.device(device).type != "cpu" else 0)


def _settle_weights(model) -> None:
    """Fill the weight dict's lazy metadata now (expert lists; the stacked expert weights, which
    replace W's per-expert entries by views): the eager forward would otherwise do it on its first
    call and change objects the compiled graphs were traced against (a re-trace while serving)."""
    from v4flash_backend.model.ffn import local_experts, stacked_experts

    for k in [k for k in model.W if k.endswith(".embed.scale") and model.W[k].dtype == torch.float8_e8m0fnu]:
        # the Engram tables' scales are read inside the graphs (looked-up rows): as their bytes, which
        # every backend takes (quant.e8m0_to_float) and a compiler without an e8m0 type (inductor) too
        model.W[k] = model.W[k].view(torch.uint8)
    prefixes = sorted({k.split(".experts.")[0] for k in model.W if ".experts." in k})
    for p in prefixes:
        local_experts(model.W, p)
        stacked_experts(model.W, p)


class _HostDrafter:
    """The runner's DSparkDrafter as the engine's host code calls it: the Markov and confidence
    heads take host tensors in and give host tensors back (their weights stay on the device);
    everything else (the rings, the draft stages, which `dspark` drives) is the drafter itself."""

    def __init__(self, drafter, runner: "StaticRunner"):
        self._d, self._r = drafter, runner

    def __getattr__(self, name):
        return getattr(self._d, name)

    def _call(self, fn, *args):
        dev = self._r.decoder.device
        out = fn(*(a.to(dev) for a in args))
        return tuple(map(self._r._to_host, out)) if isinstance(out, tuple) else self._r._to_host(out)

    def markov(self, prev_ids):
        return self._call(self._d.markov, prev_ids)

    def markov_embed(self, prev_ids):
        return self._call(self._d.markov_embed, prev_ids)

    def confidence(self, hidden, markov_embed):
        return self._call(self._d.confidence, hidden, markov_embed)


class _Null:
    total = 0
    resident_moves = reads = 0

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False
