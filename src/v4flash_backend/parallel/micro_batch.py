"""Micro-batched pipeline forwards: a stage's runner that lets the stages overlap inside one step."""

from __future__ import annotations

import torch


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

