"""The engine's counters: request and token totals, decode-step accounting (graph executions, host
syncs, host-to-device bytes by step and by DSpark decision), per-position acceptance, and the
`stats()` dict built from them. A mixin of `Engine`."""

from __future__ import annotations

from .calibration import regime
from .seq import STEP_KINDS, Seq


class EngineStats:
    def _init_stats(self) -> None:
        """The counters, zero (called by Engine.__init__ once gamma is known)."""
        # rejected: refused at submit because the wait queue was full; expired: failed after
        # queue_timeout_s without a slot (both are UNAVAILABLE answers).
        self.totals = dict(requests=0, finished=0, prompt_tokens=0, output_tokens=0, drafted=0, admitted=0,
                           accepted=0, steps=0, verify_rows=0, draft_skipped=0, draft_probes=0, rejected=0,
                           expired=0, ring_rows_skipped=0)
        # per draft position j = 1..gamma: verify rows where draft j was admitted / accepted
        self.admitted_at = [0] * self.gamma
        self.accepted_at = [0] * self.gamma
        # decode-step accounting (engine stats, Prometheus, the CLI's step report): decode steps
        # (steps with no prefill rows), graph executions, host syncs (device-to-host reads other
        # than the final read-back of committed tokens) and host-to-device bytes in those steps
        # static_fallback_steps: decode steps a static runner ran eagerly (more than STOP_WIDTH stop
        # ids, no bucket); prefill_steps: steps with prefill rows, with their graph executions
        self.decode_totals = dict(decode_steps=0, static_steps=0, graph_executions=0, host_syncs=0,
                                  host_to_device_bytes=0, static_fallback_steps=0, prefill_steps=0,
                                  prefill_step_graph_executions=0, prefill_step_eager_forwards=0)
        # decode steps by DSpark decision (draft | probe | aside: stepped aside) with their graph
        # executions (a static round that steps aside runs graph 1 alone)
        self.kind_totals = {k: [0, 0] for k in STEP_KINDS}
        self._kind = "draft"  # the decision of the step in progress

    def stats(self) -> dict:
        # Wait for the step in progress (a client reading the stats after its final event, sent
        # mid-step, then sees that step counted), but not for ever: the lock is not fair, and a busy
        # engine thread takes it again at once after each step, which starved the gauges (the KV-slot
        # gauge read 0 while a request ran). After the bound the numbers are those of the last step.
        got = self.step_lock.acquire(timeout=0.25)
        try:
            with self.lock:
                d = dict(self.totals)
                n = self.settings.max_num_seqs
                d.update(waiting=len(self.waiting), running=len(self.running),
                         slots_in_use=n - len(self.free), slots_total=n,
                         waiting_limit=self.settings.max_queue_size)
        finally:
            if got:
                self.step_lock.release()
        d["tau"] = (d["accepted"] + d["verify_rows"]) / d["verify_rows"] if d["verify_rows"] else 0.0
        dt = dict(self.decode_totals)
        n = dt["decode_steps"]
        c = self.runner.counters
        d.update(dt, decode_graph=self.runner.decode_graph,
                 graphs_compiled=c.get("graphs_compiled", 0),
                 # a static rank's start-up (trn2.startup): graphs compiled, and loaded from compiled_artifacts
                 startup_graphs_compiled=c.get("startup_graphs_compiled", 0),
                 startup_graphs_loaded=c.get("startup_graphs_loaded", 0),
                 startup_graphs_traced=c.get("startup_graphs_traced", 0),  # by dynamo (0: all bound)
                 prefill_graphs=c.get("prefill_graphs", 0),
                 # first draft blocks after a prefill by the round's draft graph (round_step._first_blocks_static)
                 first_block_graphs=c.get("first_block_graphs", 0),
                 boundary_resident_moves=c.get("boundary_resident_moves"),
                 boundary_reads=c.get("boundary_reads"),
                 plain_decode_rounds=c.get("plain_decode_rounds", 0),
                 # a background compile's progress (trn2.warmup): graph sets warm, of all
                 warmup_done=c.get("warmup_done"), warmup_total=c.get("warmup_total"),
                 warmup_rss_bytes=(self.runner.exec_lock.compile_rss_bytes()
                                   if hasattr(self.runner.exec_lock, "compile_rss_bytes") else None),
                 graphs_per_step=dt["graph_executions"] / n if n else 0.0,
                 graphs_per_prefill_step=(dt["prefill_step_graph_executions"] / dt["prefill_steps"]
                                          if dt["prefill_steps"] else 0.0),
                 host_syncs_per_step=((dt["host_syncs"] / n if n else 0.0)
                                      if self.runner.counts_host_syncs else None),
                 host_to_device_bytes_per_step=dt["host_to_device_bytes"] / n if n else 0.0)
        d["decode_steps_by_kind"] = {k: v[0] for k, v in self.kind_totals.items()}
        d["graphs_per_step_by_kind"] = {k: v[1] / v[0] if v[0] else 0.0 for k, v in self.kind_totals.items()}
        d["accept_rate_at"] = [a / n if n else 0.0 for a, n in zip(self.accepted_at, self.admitted_at)]
        d.update(self.prefix.stats())
        if self.calib is not None:
            d.update(self.calib.stats())
        d.update(self.learner.stats(self.decode_path))
        if self.guard is not None:
            d.update(self.guard.stats())
        return d

    def _count_prefill_step(self, before: dict) -> None:
        """Steps with prefill rows: their graph executions (prefill graphs, the verify graph of the
        step's decode rows; none on the eager runner) and forwards that ran op by op. `before`: the
        runner's counters before the step."""
        t = self.decode_totals
        t["prefill_steps"] += 1
        c = self.runner.counters
        t["prefill_step_graph_executions"] += c.get("graph_executions", 0) - before.get("graph_executions", 0)
        t["prefill_step_eager_forwards"] += c.get("eager_forwards", 0) - before.get("eager_forwards", 0)

    def _count_step(self, before: dict) -> None:
        t = self.decode_totals
        t["decode_steps"] += 1
        c = self.runner.counters
        for k in ("graph_executions", "host_syncs", "host_to_device_bytes"):
            t[k] += c.get(k, 0) - before.get(k, 0)
        if self.spec:
            kt = self.kind_totals[self._kind]
            kt[0] += 1
            kt[1] += c.get("graph_executions", 0) - before.get("graph_executions", 0)

    def _account_verify(self, s: Seq, n_acc: int) -> None:
        if s.last_c is not None and s.conf_logits is not None and self.adaptive:
            self._observe_block(s, n_acc)
        if s.adm == "admit" and s.last_c is not None:  # a block admission chose: the fixed-length guard's
            self._step_blocks.append((regime(s.req.temperature), s.ell, n_acc, s.last_c,
                                      s.req.max_tokens - s.n_out - 1))
        if s.ell and s.conf_logits is not None:  # the block's confidences, for online calibration
            self._observed.append((regime(s.req.temperature), s.conf_logits, s.ell, n_acc))
        s.accepted += n_acc
        s.admitted += s.ell
        s.verify_steps += 1
        for j in range(s.ell):
            self.admitted_at[j] += 1
            self.accepted_at[j] += n_acc > j
        self.totals["admitted"] += s.ell
        self.totals["accepted"] += n_acc
        self.totals["verify_rows"] += 1
