"""The static graphs per bucket: the decode and prefill buckets (`decode_buckets`,
`prefill_buckets`, `startup_graphs` counts what a rank compiles at start) and `StaticGraphs`, one
compiled verify graph and one DSpark graph per bucket (the served round graphs of trn2.static_round
when it holds the draft blocks); `warm_up()` compiles all buckets at start (progress bar on stderr; a
warm cache makes this a load), and it counts executions.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from dataclasses import dataclass, field

import torch

from v4flash_backend.engine.round_plan import RoundPlan

from .compiler import CompileStats, compile_step
from .launch import NeuronSettings
from .static_step import Bucket, StaticDecoder, bucket_sizes


def decode_buckets(max_num_seqs: int, max_model_len: int, rows: int, min_ctx: int = 256) -> list[Bucket]:
    """Buckets: sequences and context bounds in powers of two (up to the limits), `rows` per sequence."""
    return [Bucket(S, rows, L) for S in bucket_sizes(max_num_seqs)
            for L in bucket_sizes(max_model_len, min(min_ctx, max_model_len))]


MAX_PREFILL_ROWS = 4096  # the port's prompt segment


def prefill_buckets(prefill_rows: int, max_model_len: int, min_ctx: int = 256) -> list[Bucket]:
    """The prefill graphs' buckets: one sequence's chunk of up to `prefill_rows` rows (<= 4096, and never more
    than the context), padded into the next power-of-two row count from 16, x the context bounds of the
    decode buckets (from min_ctx)."""
    prefill_rows = min(prefill_rows, MAX_PREFILL_ROWS, max_model_len)
    return [Bucket(1, q, L) for q in bucket_sizes(prefill_rows, min(16, prefill_rows))
            for L in bucket_sizes(max_model_len, min(min_ctx, max_model_len))]


def startup_graphs(settings, dspark: bool = True) -> int:
    """The graphs a rank of a static server (decode_graph static) compiles at start, as
    `worker.build_runner` warms them: per decode bucket the verify round graph, its logit-processing
    variant (warm_processed) and the bare verify graph; per sequence bucket the draft round graph
    (and variant) when the checkpoint drafts; the plain-decode round graphs (and variants) when the
    server may step aside or does not draft; one prefill graph per row x context bucket. With the
    defaults (8 sequences, 1024 tokens, 256-token chunks, DSpark, dspark_adaptive):
    12 + 12 + 12 + 4 + 4 + 12 + 12 + 15 = 83."""
    variants = 2 if settings.warm_processed else 1
    decode = decode_buckets(settings.max_num_seqs, settings.max_model_len, 1)
    drafting = dspark and settings.spec_mode != "off"
    n = len(decode) * variants + len(decode)  # verify rounds (+ processed) and bare verify graphs
    if drafting:
        n += len({b.seqs for b in decode}) * variants
    if settings.dspark_adaptive or not drafting:
        n += len(decode) * variants
    return n + len(prefill_buckets(settings.prefill_chunk, settings.max_model_len))


_QUIET = threading.local()


@contextlib.contextmanager
def uncounted():
    """Graph runs of this thread are not counted as executions: trn2.warmup's padding rounds, run
    beside the serving thread, whose steps count the executions of their own rounds."""
    _QUIET.on = True
    try:
        yield
    finally:
        _QUIET.on = False


class _Progress:
    def __init__(self, total: int, out, title: str = "warm-up", width: int = 24):
        self.total, self.out, self.width, self.t0 = total, out, width, time.perf_counter()
        self.title = title

    def show(self, done: int, what: str) -> None:
        if self.out is None:
            return
        fill = self.width * done // max(self.total, 1)
        self.out.write(f"\r[neuron {self.title}] [{'#' * fill}{'.' * (self.width - fill)}] {done}/{self.total} "
                       f"{what} {time.perf_counter() - self.t0:.1f}s")
        if done == self.total:
            self.out.write("\n")
        self.out.flush()


@dataclass
class StaticGraphs:
    """Compiled verify (and DSpark) graphs per bucket over one StaticDecoder."""

    decoder: StaticDecoder
    buckets: list[Bucket]
    settings: NeuronSettings = field(default_factory=NeuronSettings)
    stats: CompileStats = field(default_factory=CompileStats)
    blocks: object = None  # static_round.BlockState: the served round graphs (None: bare verify/draft)
    executions: int = 0  # graph executions (verify + draft calls)
    primed: bool = False  # `prime` ran (the host-side caches it fills are the model's: once is enough)
    lock: object = None  # held while a compiled graph runs (compile_step; the runner's graph_lock)
    label: str = ""  # what the graphs are named by: "" (decode rounds), "plain" (plain-decode), "prefill"
    artifacts: object = None  # trn2.artifacts.ArtifactSource: graphs loaded by key (compiled_artifacts)
    _verify: dict = field(default_factory=dict)
    _draft: dict = field(default_factory=dict)
    _rverify: dict = field(default_factory=dict)
    _rdraft: dict = field(default_factory=dict)

    # ---- the served decode round (static_round) -----------------------------------------------------
    def round_verify_graph(self, b: Bucket, processed: bool = False):
        """Graph 1 of bucket b; processed: the variant with min_tokens, penalties and log-probs."""
        if (b, processed) not in self._rverify:
            from .static_round import verify_round

            dec, blk = self.decoder, self.blocks
            if processed:
                def fn(slot, start, n, pending, temperature, top_k, top_p, seed, rnd, budget, stop_ids, n_out,
                       min_tokens, frequency, presence):
                    return verify_round(dec, blk, b.ctx, slot, start, n, pending, temperature, top_k, top_p, seed,
                                        rnd, budget, stop_ids, _proc(n_out, min_tokens, frequency, presence, stop_ids))
            else:
                def fn(slot, start, n, pending, temperature, top_k, top_p, seed, rnd, budget, stop_ids):
                    return verify_round(dec, blk, b.ctx, slot, start, n, pending, temperature, top_k, top_p, seed,
                                        rnd, budget, stop_ids)
            kind = "plain round" if self.label == "plain" else "round verify"
            name = f"{kind} {b}{' processed' if processed else ''}"
            self._rverify[(b, processed)] = self._compile(fn, name)
        return self._rverify[(b, processed)]

    def round_draft_graph(self, b: Bucket, mode: str, fixed_len: int, processed: bool = False):
        key = (b.seqs, b.rows, mode, fixed_len if mode == "fixed" else 0, processed)
        if key not in self._rdraft:
            from .static_round import draft_round

            dec, blk = self.decoder, self.blocks
            if processed:
                def fn(*a):
                    *a, n_out, min_tokens, frequency, presence, stop_ids, lp = a
                    return draft_round(dec, blk, mode, fixed_len, *a,
                                       proc=_proc(n_out, min_tokens, frequency, presence, stop_ids), extra=lp)
            else:
                def fn(*a):
                    return draft_round(dec, blk, mode, fixed_len, *a)
            mname = f"fixed{fixed_len}" if mode == "fixed" else mode
            self._rdraft[key] = self._compile(fn, f"round draft {b} {mname}{' processed' if processed else ''}")
        return self._rdraft[key]

    def _compile(self, fn, name: str):
        return compile_step(fn, self.settings, self.stats, self.lock, name, self.artifacts)

    def _ran(self, graph) -> None:
        """Count one graph execution and the collectives traced into it (counting stays outside
        the graph: the compile backend listed them, `Collectives.count_traced` books them)."""
        if getattr(_QUIET, "on", False):
            return
        self.executions += 1
        counts = getattr(graph, "traced", {}).get("collectives")
        comm = getattr(getattr(self.decoder, "m", None), "comm", None)
        if counts and hasattr(comm, "coll"):
            comm.coll.count_traced(counts)

    def round(self, b: Bucket, mode: str, fixed_len: int, x: dict) -> torch.Tensor:
        """One decode round: graph 1, then (with DSpark) graph 2; returns the [S, 2G+5] read-back.
        mode off (no DSpark, or a round that steps aside): graph 1 alone, whose own read-back has
        next ell 0 -- no ring writes, no draft stages."""
        processed = "n_out" in x  # the processed variant (static_round: min_tokens, penalties, log-probs)
        proc = [x[k] for k in PROC_INPUTS] if processed else []
        g1 = self.round_verify_graph(b, processed)
        tokens_out, committed, accepted, stopped, taps, *lp, alone = g1(
            x["slot"], x["start"], x["n"], x["pending"], x["temperature"], x["top_k"], x["top_p"], x["seed"],
            x["rnd"], x["budget"], x["stop_ids"], *proc)
        self._ran(g1)
        if mode == "off":
            return alone
        g2 = self.round_draft_graph(b, mode, fixed_len, processed)
        extra = proc + [x["stop_ids"]] + lp if processed else []
        out = g2(taps, committed, tokens_out, accepted, stopped, x["slot"], x["start"], x["n"], x["temperature"],
                 x["top_k"], x["top_p"], x["seed"], x["rnd"], x["budget"], x["len_left"], x["sps_t"],
                 x["t_draft"], x["cal"], x["fixed_ell"], *extra)
        self._ran(g2)
        return out

    def first_block(self, b: Bucket, mode: str, fixed_len: int, x: dict, taps: torch.Tensor) -> torch.Tensor:
        """Graph 2 alone, for requests whose prefill an eager step has just completed (their first
        token sampled on the host, their prompt rows in the DSpark rings): their first draft block,
        drafted by the round's own draft graph instead of the eager drafter. x: a round plan's
        inputs (`RoundPlan.inputs`) whose start is each request's last prompt position, pending its
        first token (the block's anchor), n 1 (0: a padding sequence), budget the tokens left before
        that first token and rnd its round; taps [S*Q, taps*D] in the verify graph's layout, row
        i*Q the request's last prompt row. As if graph 1 had committed that one token: the draft
        graph writes its row into the rings (again: the eager write put the same row there) and
        drafts at the token. Returns the [S, 2G+5] read-back (next ell, confidences)."""
        S, G = b.seqs, b.rows - 1
        live = x["n"] > 0
        committed = live.long()
        tokens_out = torch.full((S, G + 1), -1, dtype=torch.long, device=live.device)
        tokens_out[:, 0] = torch.where(live, x["pending"], tokens_out[:, 0])
        zero = torch.zeros(S, dtype=torch.long, device=live.device)
        g2 = self.round_draft_graph(b, mode, fixed_len, False)
        out = g2(taps, committed, tokens_out, zero, zero.bool(), x["slot"], x["start"], x["n"], x["temperature"],
                 x["top_k"], x["top_p"], x["seed"], x["rnd"], x["budget"], x["len_left"], x["sps_t"],
                 x["t_draft"], x["cal"], x["fixed_ell"])
        self._ran(g2)
        return out

    def verify_graph(self, b: Bucket):
        if b not in self._verify:
            dec = self.decoder
            self._verify[b] = self._compile(lambda tokens, slot, start, n: dec.verify(tokens, slot, start, n, b.ctx),
                                            f"{'prefill' if self.label == 'prefill' else 'forward'} {b}")
        return self._verify[b]

    def draft_graph(self, b: Bucket):
        key = (b.seqs, b.rows)  # the draft graph does not depend on the context bound
        if key not in self._draft:
            self._draft[key] = self._compile(self.decoder.draft, f"draft S={b.seqs} Q={b.rows}")
        return self._draft[key]

    def verify(self, b: Bucket, tokens, slot, start, n):
        self.executions += 1
        return self.verify_graph(b)(tokens, slot, start, n)

    def draft(self, b: Bucket, taps, commit, slot, start, anchor):
        self.executions += 1
        return self.draft_graph(b)(taps, commit, slot, start, anchor)

    def prime(self, mode: str = "off", fixed_len: int = 0, stop_width: int = 8) -> None:
        """One uncompiled padding round: it fills the host-side caches of the ops backend and of
        DistComm (dequantized weights, stacked experts) -- traced before that, the graphs would
        capture the cache fills and be re-traced once serving has filled them."""
        b = self.buckets[0]
        StaticGraphs(self.decoder, [b], NeuronSettings(backend="none"), blocks=self.blocks).round(
            b, mode, fixed_len, self.round_padding(b, stop_width))
        self.primed = True

    def round_padding(self, b: Bucket, stop_width: int, processed: bool = False) -> dict:
        """Inputs of a round of padding sequences only (`RoundPlan.padding_inputs`) on the device:
        it changes no real slot's state, so it compiles the round graphs at start."""
        x = RoundPlan.padding_inputs(b.seqs, self.decoder.max_rows - 1, self.decoder.scratch, stop_width, processed)
        return to_device(x, self.decoder.device)

    def warm_up(self, progress=sys.stderr, mode: str | None = None, fixed_len: int = 0,
                stop_width: int = 8, processed: bool = True) -> float:
        """Compile (or load from the cache) every bucket's graphs by running them on padding plans,
        which leave the state untouched. With `blocks` (the served runner) these are the round
        graphs of spec mode `mode`. Returns the seconds it took."""
        dec = self.decoder
        bar = _Progress(len(self.buckets), progress)
        t0 = time.perf_counter()
        bar.show(0, "")
        if self.blocks is not None and self.buckets and self.settings.backend != "none":
            self.prime(mode or "off", fixed_len, stop_width)
        for i, b in enumerate(self.buckets):
            if self.blocks is not None:
                for proc in (False, True)[:1 + processed]:  # the plain and the logit-processing variant
                    self.round(b, mode or "off", fixed_len, self.round_padding(b, stop_width, proc))
                bar.show(i + 1, str(b))
                continue
            tokens, slot, start, n = dec.padding_plan(b.seqs, b.rows)
            _, taps = self.verify_graph(b)(tokens, slot, start, n)
            if dec.drafter is not None and taps is not None:
                self.draft_graph(b)(taps, n, slot, start, tokens[:, 0])
            bar.show(i + 1, str(b))
        return time.perf_counter() - t0


PROC_INPUTS = ("n_out", "min_tokens", "frequency", "presence")  # the processed round's extra inputs


def _proc(n_out, min_tokens, frequency, presence, stop_ids) -> dict:
    return dict(n_out=n_out, min_tokens=min_tokens, frequency=frequency, presence=presence, stop_ids=stop_ids)


def to_device(x: dict, device) -> dict:
    """A round's host-built inputs on the runner's device (a no-op where they already are)."""
    return {k: v.to(device) for k, v in x.items()}
