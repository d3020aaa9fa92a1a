"""Prometheus metrics of the `v4flash` model, on Triton's metrics port (/metrics).

Created through the python backend's ``pb_utils.MetricFamily`` (passed in as ``pb``, so
tests can pass a stand-in with the same API: ``MetricFamily(name, description, kind)``
with kinds COUNTER / GAUGE / HISTOGRAM, ``family.Metric(labels, buckets=None)``,
``metric.increment / set / observe``). Names follow vllm_backend's ``vllm:*`` family
(utils/metrics.py) with our prefix; every metric carries labels model and version.

  v4flash:time_to_first_token_seconds   histogram  arrival -> first token from the engine (streamed or not)
  v4flash:inter_token_latency_seconds   histogram  one observation per token after the first:
                                                   gap between responses / tokens in the later
                                                   one (a speculative chunk of 3 tokens counts
                                                   3 x gap/3, so sum/count is the mean TPOT)
  v4flash:e2e_request_latency_seconds   histogram  arrival -> final response
  v4flash:prompt_tokens_total           counter
  v4flash:generation_tokens_total       counter
  v4flash:draft_tokens_total            counter    DSpark draft tokens proposed
  v4flash:accepted_draft_tokens_total   counter    of those, accepted
  v4flash:requests_finished_total       counter    label reason: stop|length|cancelled|error
  v4flash:requests_in_flight            gauge      requests with a FINAL response still to send
  v4flash:kv_slots_in_use               gauge      engine KV slots held (refreshed periodically)
  v4flash:kv_slots_total                gauge      max_num_seqs
  v4flash:requests_waiting              gauge      requests queued on rank 0 for a KV slot (refreshed
                                                   with the slot gauges; vLLM's num_requests_waiting)
  v4flash:requests_waiting_limit        gauge      max_queue_size: the queue beyond which requests are
                                                   refused (with kv_slots_total, the server's capacity)
  v4flash:requests_rejected_total       counter    requests refused at once because the wait queue
                                                   was full (UNAVAILABLE, setting max_queue_size)
  v4flash:requests_expired_total        counter    requests failed after queue_timeout_s without a slot
  v4flash:decode_steps_by_kind          gauge      label kind: draft|probe|aside (DSpark's decision per
                                                   decode step; aside: stepped aside, no draft stages)
  v4flash:prefix_cache_hits_total        counter    requests that restored a cached prompt prefix
  v4flash:prefix_cache_misses_total      counter    requests that found none (cache on)
  v4flash:prefix_cache_cached_tokens_total counter  prompt tokens restored instead of prefilled
  v4flash:prefix_cache_evictions_total   counter    entries evicted for the byte budget
  v4flash:prefix_cache_bytes             gauge      bytes the cache holds (rank 0's shard)
  (and the decode path's own gauges below: graphs, host syncs and bytes per step, fallbacks; a
  background compile's sets warm / of all and the resident bytes it added, warmup_rss_bytes)
"""

from __future__ import annotations

TTFT_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]
E2E_BUCKETS = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0]
FINISH_REASONS = ("stop", "length", "cancelled", "error")
STEP_KINDS = ("draft", "probe", "aside")  # engine.STEP_KINDS (serving does not import the engine)


class ServingMetrics:
    """All metric objects of one model instance; method names say what happened."""

    def __init__(self, pb, model: str, version: str):
        labels = {"model": model, "version": str(version)}
        F = pb.MetricFamily
        self._families = []

        def family(name, description, kind):
            fam = F(name=name, description=description, kind=kind)
            self._families.append(fam)
            return fam

        self.ttft = family("v4flash:time_to_first_token_seconds", "Time to first token (seconds)",
                           F.HISTOGRAM).Metric(labels=labels, buckets=TTFT_BUCKETS)
        self.itl = family("v4flash:inter_token_latency_seconds",
                          "Latency between generated tokens (seconds; chunk gap / tokens in the chunk)",
                          F.HISTOGRAM).Metric(labels=labels, buckets=ITL_BUCKETS)
        self.e2e = family("v4flash:e2e_request_latency_seconds", "Request latency, arrival to final (seconds)",
                          F.HISTOGRAM).Metric(labels=labels, buckets=E2E_BUCKETS)
        self.prompt_tokens = family("v4flash:prompt_tokens_total", "Prompt tokens processed",
                                    F.COUNTER).Metric(labels=labels)
        self.generation_tokens = family("v4flash:generation_tokens_total", "Tokens generated",
                                        F.COUNTER).Metric(labels=labels)
        self.draft_tokens = family("v4flash:draft_tokens_total", "DSpark draft tokens proposed",
                                   F.COUNTER).Metric(labels=labels)
        self.accepted_tokens = family("v4flash:accepted_draft_tokens_total",
                                      "DSpark draft tokens accepted by verification", F.COUNTER).Metric(labels=labels)
        finished = family("v4flash:requests_finished_total", "Finished requests by finish reason", F.COUNTER)
        self.finished = {r: finished.Metric(labels=dict(labels, reason=r)) for r in FINISH_REASONS}
        self.in_flight = family("v4flash:requests_in_flight", "Requests whose final response is not sent yet",
                                F.GAUGE).Metric(labels=labels)
        self.slots_in_use = family("v4flash:kv_slots_in_use", "Engine KV slots held by requests",
                                   F.GAUGE).Metric(labels=labels)
        self.slots_total = family("v4flash:kv_slots_total", "Engine KV slots (max_num_seqs)",
                                  F.GAUGE).Metric(labels=labels)
        self.waiting = family("v4flash:requests_waiting", "Requests waiting on rank 0 for a KV slot",
                              F.GAUGE).Metric(labels=labels)
        self.waiting_limit = family("v4flash:requests_waiting_limit",
                                    "Requests that may wait for a KV slot before more are refused (max_queue_size)",
                                    F.GAUGE).Metric(labels=labels)
        self.rejected = family("v4flash:requests_rejected_total",
                               "Requests refused with UNAVAILABLE because the wait queue was full (max_queue_size)",
                               F.COUNTER).Metric(labels=labels)
        self.expired = family("v4flash:requests_expired_total",
                              "Requests failed with UNAVAILABLE after queue_timeout_s without a KV slot",
                              F.COUNTER).Metric(labels=labels)
        # the prefix cache (engine.prefix_cache): engine-cumulative counts, as rejected / expired
        self.prefix_counters = {
            key: family(f"v4flash:prefix_cache_{key}_total", text, F.COUNTER).Metric(labels=labels)
            for key, text in (("hits", "Requests that restored a cached prompt prefix"),
                              ("misses", "Requests that found no cached prompt prefix (cache on)"),
                              ("cached_tokens", "Prompt tokens restored from the prefix cache, not prefilled"),
                              ("evictions", "Prefix-cache entries evicted for the byte budget"))}
        self.prefix_bytes = family("v4flash:prefix_cache_bytes", "Bytes the prefix cache holds (rank 0's shard)",
                                   F.GAUGE).Metric(labels=labels)
        # the engine's cumulative counts at the last refresh (a new rank group starts from 0)
        self._engine_counts = {"rejected": 0, "expired": 0, **{k: 0 for k in self.prefix_counters}}
        self._engine_epoch = 0
        self._prefix_epoch = 0

        # the decode path reports itself (engine stats): averages over decode steps (no prefill rows)
        self.decode_steps = family("v4flash:decode_steps", "Engine decode steps so far (steps with no prefill rows)",
                                   F.GAUGE).Metric(labels=labels)
        self.graphs_per_step = family("v4flash:decode_graph_executions_per_step",
                                      "Graph executions per decode step (0: the eager op-by-op forward)",
                                      F.GAUGE).Metric(labels=labels)
        self.host_syncs_per_step = family("v4flash:decode_host_syncs_per_step",
                                          "Device-to-host reads per decode step other than the committed tokens",
                                          F.GAUGE).Metric(labels=labels)
        self.h2d_bytes_per_step = family("v4flash:decode_host_to_device_bytes_per_step",
                                         "Host-to-device bytes per decode step (plans, noise keys, uploads)",
                                         F.GAUGE).Metric(labels=labels)
        self.static_fallback_steps = family("v4flash:static_fallback_steps",
                                            "Decode steps a static runner ran op by op (more than 8 stop ids, "
                                            "no bucket, or its graphs still compiling in the "
                                            "background)", F.GAUGE).Metric(labels=labels)
        self.graphs_per_prefill_step = family("v4flash:prefill_graph_executions_per_step",
                                              "Graph executions per step with prefill rows (prefill graphs + the "
                                              "verify graph of its decode rows; 0: eager)",
                                              F.GAUGE).Metric(labels=labels)
        # a static server compiling in the background (graph_warmup background): its progress
        self.warmup_done = family("v4flash:warmup_graph_sets_warm",
                                  "Sets of static graphs warm (background compile: a bucket's plain-decode round, "
                                  "its drafting round; a logit-processing variant, a forward graph or a prefill "
                                  "bucket once traffic wanted it; the rest serve eager steps)",
                                  F.GAUGE).Metric(labels=labels)
        self.warmup_total = family("v4flash:warmup_graph_sets", "Sets of static graphs a background compile warms "
                                   "(the announced ones, and those traffic asked for)", F.GAUGE).Metric(labels=labels)
        self.warmup_rss = family("v4flash:warmup_rss_bytes",
                                 "Resident bytes the background compile added (grown while its thread ran, and "
                                 "its helper process's resident set; bounded by its graph sets)",
                                 F.GAUGE).Metric(labels=labels)
        by_kind = family("v4flash:decode_steps_by_kind",
                         "Decode steps by DSpark's decision: draft (verify + draft), probe (one draft "
                         "admitted), aside (stepped aside: no draft stages; 1 graph on the static path)", F.GAUGE)
        self.steps_by_kind = {k: by_kind.Metric(labels=dict(labels, kind=k)) for k in STEP_KINDS}

    # ---- events --------------------------------------------------------------------------------
    def on_tokens(self, n: int, gap_s: float | None, since_arrival_s: float) -> None:
        """``n`` generated tokens sent in one response; ``gap_s`` since the previous response
        that carried tokens (None: this is the first). Observations are chosen so that the
        ITL histogram's sum/count is (e2e - TTFT) / (tokens - 1), genai-perf's definition:
        the tokens that come with the first one add zeros, a later chunk of n tokens adds
        n observations of gap/n."""
        if n <= 0:
            return
        self.generation_tokens.increment(n)
        if gap_s is None:
            self.ttft.observe(since_arrival_s)
            values = [0.0] * (n - 1)
        else:
            values = [gap_s / n] * n
        for v in values:
            self.itl.observe(v)

    def on_speculation(self, drafted: int, accepted: int) -> None:
        if drafted > 0:
            self.draft_tokens.increment(drafted)
        if accepted > 0:
            self.accepted_tokens.increment(accepted)

    def on_prompt(self, n: int) -> None:
        self.prompt_tokens.increment(n)

    def on_finished(self, reason: str, e2e_s: float) -> None:
        self.finished.get(reason, self.finished["error"]).increment(1)
        self.e2e.observe(e2e_s)

    def set_in_flight(self, n: int) -> None:
        self.in_flight.set(n)

    def set_slots(self, in_use: int, total: int, waiting_limit: int | None = None) -> None:
        self.slots_in_use.set(in_use)
        self.slots_total.set(total)
        if waiting_limit is not None:
            self.waiting_limit.set(waiting_limit)

    def set_queue(self, waiting: int, rejected: int, expired: int, epoch: int = 0) -> None:
        """The engine's queue depth and its cumulative refusal / expiry counts (engine stats);
        ``epoch`` changes when a new rank group (counting from 0 again) took over."""
        self.waiting.set(waiting)
        fresh = epoch != self._engine_epoch
        self._engine_epoch = epoch
        for name, total, metric in (("rejected", rejected, self.rejected), ("expired", expired, self.expired)):
            last = 0 if fresh else self._engine_counts[name]
            delta = total - last if total >= last else total
            if delta > 0:
                metric.increment(delta)
            self._engine_counts[name] = total

    def set_prefix_cache(self, st: dict, epoch: int = 0) -> None:
        """The prefix cache's counts of an engine stats dict (prefix_cache_*; absent: nothing);
        call after set_queue, which notes a new rank group's epoch."""
        if "prefix_cache_bytes" not in st:
            return
        self.prefix_bytes.set(float(st["prefix_cache_bytes"]))
        fresh = epoch != self._prefix_epoch
        self._prefix_epoch = epoch
        for name, metric in self.prefix_counters.items():
            total = int(st.get(f"prefix_cache_{name}", 0))
            last = 0 if fresh else self._engine_counts[name]
            delta = total - last if total >= last else total
            if delta > 0:
                metric.increment(delta)
            self._engine_counts[name] = total

    def set_decode(self, st: dict) -> None:
        """The decode-step counters of an engine stats dict (absent keys: left as they are)."""
        for key, metric in (("decode_steps", self.decode_steps), ("graphs_per_step", self.graphs_per_step),
                            ("host_syncs_per_step", self.host_syncs_per_step),
                            ("host_to_device_bytes_per_step", self.h2d_bytes_per_step),
                            ("static_fallback_steps", self.static_fallback_steps),
                            ("graphs_per_prefill_step", self.graphs_per_prefill_step),
                            ("warmup_done", self.warmup_done), ("warmup_total", self.warmup_total),
                            ("warmup_rss_bytes", self.warmup_rss)):
            if st.get(key) is not None:  # None: not measured (the eager runner's uncounted host syncs)
                metric.set(float(st[key]))
        for kind, n in (st.get("decode_steps_by_kind") or {}).items():
            if kind in self.steps_by_kind:
                self.steps_by_kind[kind].set(float(n))

    def close(self) -> None:
        # Metric objects must go before their families (the stub refuses otherwise).
        for name in ("ttft", "itl", "e2e", "prompt_tokens", "generation_tokens", "draft_tokens",
                     "accepted_tokens", "finished", "in_flight", "slots_in_use", "slots_total", "waiting",
                     "waiting_limit", "rejected", "expired", "decode_steps", "graphs_per_step", "host_syncs_per_step",
                     "h2d_bytes_per_step", "static_fallback_steps", "graphs_per_prefill_step", "warmup_done",
                     "warmup_rss", "warmup_total", "steps_by_kind",
                     "prefix_counters", "prefix_bytes"):
            setattr(self, name, None)
        self._families.clear()
