"""The prefix cache: a prompt's prefill state kept at chunk boundaries, so a later request that
begins with the same tokens restores it into its slot and prefills only the rest.

Index (rank 0, here): a tree of entries, one per boundary b of a prefill (every chunk's end,
hence every prefill_chunk tokens and the prompt's end). An entry's key is a hash chain: blake2b of
its parent's digest and the token ids from the parent's boundary to its own, so two prompts with a
shared beginning share the entries of that beginning; the ids themselves are kept too and compared
on a match (a hash collision cannot restore a wrong state). The state (model.snapshot, every
rank's own shard, `runner.save_prefix / load_prefix / drop_prefix`, broadcast in a rank group)
is a copy of the slot's state at b, holding the rings' last rows and the compressed groups since
the parent's boundary, so a chain restored root first rebuilds the slot as a cold prefill left it.

Copy, not shared pages with copy-on-write: V4.1's state of a slot is mostly rings (window KV,
compressor pending rows, Engram history, DSpark rings) that the request overwrites from its first
new position on, so a shared read-only page would be copied at once anyway; only the compressed
groups (one row per 4 or 128 positions) could be shared, and they are the small part of a copy
that runs once per request (a few MB at the release config: checks/footprint prefix_cache_line).

Exactness: under the exact numerics a row's result does not depend on chunking, so a restored
boundary continues bit for bit as the cold prefill. A request takes the deepest entry whose
boundary b <= its prompt length; when b is the whole prompt, the last prompt position is run
again (its rows are rewritten with the same values) for the logits of the first token. Under the
reference numerics (chunking changes results) or the reference quirks the cache is off.

Memory: a byte budget (setting prefix_cache_bytes, per rank: the bytes rank 0's shard holds);
least recently used entries without children go first, never one a prefilling request extends
(pinned: its next entry's compressed groups continue that entry's). Entries live in the worker
process, so a restarted worker starts empty.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field

from v4flash_backend import ops


@dataclass(eq=False)
class Entry:
    id: int
    parent: "Entry | None"
    b: int  # boundary: the entry holds the state after positions 0..b-1
    span: tuple  # the token ids from the parent's boundary to b
    digest: bytes
    nbytes: int = 0
    children: dict = field(default_factory=dict)  # (len(span), digest) -> Entry
    pins: int = 0
    used: int = 0  # LRU tick

    def chain(self) -> list["Entry"]:
        out, e = [], self
        while e is not None and e.parent is not None:  # the root holds nothing
            out.append(e)
            e = e.parent
        return out[::-1]


def chain_digest(parent: bytes, ids) -> bytes:
    return hashlib.blake2b(parent + array("q", ids).tobytes(), digest_size=16).digest()


class PrefixCache:
    def __init__(self, runner, budget_bytes: int):
        self.runner = runner
        self.budget = int(budget_bytes)
        self.root = Entry(-1, None, 0, (), b"")
        self.entries: dict[int, Entry] = {}
        self.bytes = 0
        self._next_id = 0
        self._tick = 0
        self.counts = dict(hits=0, misses=0, cached_tokens=0, evictions=0, saved=0, refused=0)

    @property
    def enabled(self) -> bool:
        return self.budget > 0 and ops.get_numerics() == "exact" and not self.runner.state.reference_quirks

    # ---- lookup --------------------------------------------------------------------------------
    def lookup(self, prompt: list[int]) -> Entry | None:
        """The deepest entry whose ids are a prefix of `prompt` (None: no entry matches)."""
        best, stack = None, [self.root]
        while stack:
            e = stack.pop()
            for n in {k[0] for k in e.children}:
                if e.b + n > len(prompt):
                    continue
                ids = prompt[e.b:e.b + n]
                c = e.children.get((n, chain_digest(e.digest, ids)))
                if c is not None and c.span == tuple(ids):
                    if best is None or c.b > best.b:
                        best = c
                    stack.append(c)
        return best

    def admit(self, s) -> None:
        """A new request in its reset slot: restore the longest cached prefix of its prompt."""
        if not self.enabled:
            return
        prompt = s.req.prompt
        e = self.lookup(prompt)
        if e is None:
            self.counts["misses"] += 1
            self._pin(s, self.root)
            return
        chain = e.chain()
        self.runner.load_prefix(s.slot, [c.id for c in chain])
        self._tick += 1
        for c in chain:
            c.used = self._tick
        # a whole-prompt match runs the last position again: its logits give the first token
        s.n_cached = min(e.b, len(prompt) - 1)
        s.num_cached_tokens = s.n_cached
        self.counts["hits"] += 1
        self.counts["cached_tokens"] += s.n_cached
        self._pin(s, e)

    # ---- saving at boundaries ------------------------------------------------------------------
    def prefilling(self, running) -> dict:
        """Before a step: {request: prompt rows cached} of the prefilling requests."""
        return {id(s): s.n_cached for s in running if s.prefilling} if self.enabled else {}

    def after_step(self, running, before: dict) -> None:
        """After a step (forward, verification, DSpark ring writes): an entry at the new boundary of
        every request whose prefill advanced and that still runs (a request that ended in the step
        got no ring writes for its last chunk)."""
        for s in running:
            if id(s) not in before or s.n_cached <= before[id(s)] or s.finish is not None:
                continue
            parent = s.prefix_entry
            if parent is not None and s.n_cached > parent.b:
                self._save(s, parent)
            if not s.prefilling:
                self.release(s)

    def _save(self, s, parent: Entry) -> None:
        b = s.n_cached
        ids = s.req.prompt[parent.b:b]
        key = (len(ids), chain_digest(parent.digest, ids))
        e = parent.children.get(key)
        if e is None or e.span != tuple(ids):
            e = Entry(self._next_id, parent, b, tuple(ids), key[1])
            self._next_id += 1
            e.nbytes = int(self.runner.save_prefix(s.slot, e.id, b, parent.b))
            parent.children[key] = e
            self.entries[e.id] = e
            self.bytes += e.nbytes
            self.counts["saved"] += 1
        self._tick += 1
        e.used = self._tick
        self._pin(s, e)
        self._evict()
        if self.bytes > self.budget:  # the new entry alone does not fit beside the pinned ones
            self.release(s)
            self._drop([e])
            self.counts["refused"] += 1

    # ---- pins, eviction ------------------------------------------------------------------------
    def _pin(self, s, e: Entry) -> None:
        self.release(s)
        e.pins += 1
        s.prefix_entry = e

    def release(self, s) -> None:
        """The request no longer extends its entry (prefill done, finished, cancelled)."""
        e = getattr(s, "prefix_entry", None)
        if e is not None:
            e.pins -= 1
            s.prefix_entry = None

    def _evict(self) -> None:
        while self.bytes > self.budget:
            free = [e for e in self.entries.values() if not e.children and e.pins == 0]
            if not free:
                return
            self._drop([min(free, key=lambda e: e.used)])
            self.counts["evictions"] += 1

    def _drop(self, entries: list[Entry]) -> None:
        for e in entries:
            e.parent.children.pop((len(e.span), e.digest), None)
            del self.entries[e.id]
            self.bytes -= e.nbytes
        self.runner.drop_prefix([e.id for e in entries])

    def clear(self) -> None:
        """Free every entry no request extends."""
        while True:
            free = [e for e in self.entries.values() if not e.children and e.pins == 0]
            if not free:
                return
            self._drop(free)

    def stats(self) -> dict:
        c = self.counts
        return {"prefix_cache_hits": c["hits"], "prefix_cache_misses": c["misses"],
                "prefix_cache_cached_tokens": c["cached_tokens"], "prefix_cache_evictions": c["evictions"],
                "prefix_cache_bytes": self.bytes, "prefix_cache_entries": len(self.entries),
                "prefix_cache_budget_bytes": self.budget, "prefix_cache_enabled": self.enabled}
