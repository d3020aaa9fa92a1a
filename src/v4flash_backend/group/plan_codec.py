"""The step plans rank 0 broadcasts to the other ranks (`worker.PlanRunner` sends, `worker.follow`
executes): fixed-size int64 buffers, so no pickles cross ranks.

Plan layout: int64[size]; header [MAGIC, op, sequence number, body length, a0, a1, a2, a3], then
the body. FORWARD: a = (T tokens, S segments, L logits rows or -1 'last' / -2 'all' / -3 'none',
want_taps); body = tokens[T], (slot, start, n)[S], rows[L]. DSPARK: a = (writes, items); body =
per write (slot, m, rows[m], positions[m]), then (slot, p, anchor) per item. ROUND (a static
decode round, decode_graph static): a = (S, stop width, spec mode (+ 4: the logit-processing variant,
with the n_out / min_tokens and frequency / presence columns), fixed_len); body = `pack_round`'s
int64 columns, float64 columns as bits, stop ids, the SPS table. FIRST_BLOCK: a round plan as ROUND's,
for `first_blocks` (the draft graph alone after a prefill; each rank takes the taps from its own
last forward). LOAD_BLOCK: a host-drafted draft
block into every rank's per-slot block state (`pack_block`). PREFIX_SAVE: a = (slot, entry, p, q0);
PREFIX_LOAD: a = (slot, n), body = the chain's n entry ids; PREFIX_DROP: a0 = n, body = the entry
ids (engine.prefix_cache). COUNTS: a = (slot, n), body = the slot's n generated ids (the processed
rounds' penalty counts, after eager steps). RESET: a0 = slot.
GROW: a0 = the new plan size (both sides switch buffers; sizes only grow). NOOP: a heartbeat
rank 0 sends when idle so followers waiting for a plan never reach the collective timeout; it is
followed by a one-element world all-reduce (counted as 'heartbeat'), so a rank that hangs while
the group is idle is noticed within the timeout, not at the next request; STOP: followers return.
A plan is validated on rank 0 before it is sent, so a bad request cannot make ranks disagree. A
dead rank breaks the next collective (gloo reports the closed connection; a hung one hits the
timeout), that rank exits, and torchrun ends the others.

The static round's codec (`pack_round` / `unpack_round`) is in `worker` for now.
"""

from __future__ import annotations

import torch

MAGIC = 0x56344650
HDR = 8
OP_NOOP, OP_STOP, OP_GROW, OP_RESET, OP_FORWARD, OP_DSPARK, OP_ROUND, OP_LOAD_BLOCK, OP_COUNTS = range(9)
# the prefix cache (engine.prefix_cache): every rank keeps and restores its own shard of an entry
OP_PREFIX_SAVE, OP_PREFIX_LOAD, OP_PREFIX_DROP = range(9, 12)
OP_FIRST_BLOCK = 12  # the first draft blocks after a prefill, by the round's draft graph (a ROUND's codec)
OP_NAMES = {OP_NOOP: "noop", OP_STOP: "stop", OP_GROW: "grow", OP_RESET: "reset_slot",
            OP_FORWARD: "forward", OP_DSPARK: "dspark", OP_ROUND: "decode_round", OP_LOAD_BLOCK: "load_block",
            OP_COUNTS: "set_counts", OP_PREFIX_SAVE: "save_prefix", OP_PREFIX_LOAD: "load_prefix",
            OP_PREFIX_DROP: "drop_prefix", OP_FIRST_BLOCK: "first_blocks"}
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

