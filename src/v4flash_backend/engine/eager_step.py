"""An eager step: one target forward over a flattened batch (decode rows [pending, drafts] first,
then prefill chunks), lossless verification on the host, the first token of completed prefills,
then DSpark drafting on the host (`_draft`). A mixin of `Engine`."""

from __future__ import annotations

import time

import torch

from . import dspark_accept as acc
from .dspark_sched import admit, admit_fixed
from .noise import STREAM_DRAFT, STREAM_VERIFY
from .precision import loop_dtype
from .seq import KIND_OF, Seq


class EagerStep:
    def _step_eager(self, decision: str | None = None) -> None:
        tokens, spec, rows, decode, prefill = self._eager_batch()
        # stepping aside is decided before the forward, from past acceptances only (the requests that
        # draft after this step: the decoding ones and those whose prefill completes now); a step that
        # steps aside computes no taps and writes no ring rows, its prefill rows' neither, so it costs
        # what plain decoding costs (the rings miss those positions: a later draft sees older context
        # there, lossless; a prompt's first 256-token chunks, which no request drafts after, still
        # fill them)
        drafting = [s for s in self.running if not s.prefilling] + [s for s, o, n in prefill
                                                                     if s.n_cached + n == len(s.req.prompt)]
        if decision is None:  # (a decode-only step's, taken before: Engine._run_step)
            decision = self._drafting_decision(drafting) if self.spec and drafting else "draft"
        self._kind = KIND_OF[decision]
        self._explore = self._guard_explores(decision)
        want_taps = self.spec and decision != "skip"
        out = self.runner.forward(torch.tensor(tokens, dtype=torch.long), spec, torch.tensor(rows, dtype=torch.long),
                                  want_taps)
        self.totals["steps"] += 1
        logits_at = {r: i for i, r in enumerate(rows)}
        writes, draft_seqs = [], []
        if decode:
            self._verify_decode_rows(out, logits_at, decode, decision, writes, draft_seqs)
        self._prefill_chunks(out, logits_at, prefill, None if self.spec and not want_taps else writes, draft_seqs)
        self._retire_finished()
        if self.spec:
            writes = [w for w in writes if any(w[0] == s.slot for s in self.running)]
            # a step that only prefilled drafts its requests' first blocks in the static round's draft
            # graph where the runner has one warm (round_step._first_blocks_static), else on the host
            if decode or not self._first_blocks_static(writes, draft_seqs, decision):
                self._draft(writes, draft_seqs, decision)

    def _eager_batch(self) -> tuple[list, list, list, list, list]:
        """The step's flattened batch: (tokens, segments [(slot, start, n)], logits rows, decode
        [(seq, offset, n rows)], prefill [(seq, offset, n rows)])."""
        tokens, spec, rows = [], [], []
        decode, prefill = [], []  # (seq, segment offset, n rows)
        off = 0
        for s in self.running:  # decode rows first: they are latency-critical
            if s.prefilling:
                continue
            ids = [s.tokens[s.n_cached]] + (s.draft[0][: s.ell].tolist() if s.ell else [])
            decode.append((s, off, len(ids)))
            tokens += ids
            spec.append((s.slot, s.n_cached, len(ids)))
            rows += range(off, off + len(ids))
            off += len(ids)
        budget = self.settings.step_token_budget
        for s in self.running:
            if not s.prefilling or budget <= 0:
                continue
            n = min(self.settings.prefill_chunk, len(s.req.prompt) - s.n_cached, budget)
            budget -= n
            prefill.append((s, off, n))
            tokens += s.req.prompt[s.n_cached:s.n_cached + n]
            spec.append((s.slot, s.n_cached, n))
            if s.n_cached + n == len(s.req.prompt):
                rows.append(off + n - 1)
            off += n
        return tokens, spec, rows, decode, prefill

    def _verify_decode_rows(self, out, logits_at: dict, decode: list, decision: str, writes: list,
                            draft_seqs: list) -> None:
        """Verify the decode rows and commit; their ring writes go to `writes` (none when the step
        steps aside), the requests still running to `draft_seqs`."""
        seqs = [d[0] for d in decode]
        ell = torch.tensor([s.ell for s in seqs], dtype=torch.long)
        lg = out.logits[[logits_at[r] for s, o, n in decode for r in range(o, o + n)]]
        # verify row j of a request predicts its output token n_out + j
        lg = self._process_target(lg, seqs, [list(range(s.n_out, s.n_out + n)) for s, o, n in decode])
        res = acc.verify(lg, self._block(seqs), ell, self._params(seqs), self._sampler(seqs, STREAM_VERIFY),
                         self._stop_ids(seqs), torch.tensor([s.req.max_tokens - s.n_out for s in seqs]))
        lp_row = 0
        for i, (s, o, n) in enumerate(decode):
            k = int(res.num_tokens[i])
            new = res.tokens[i, :k].tolist()
            lps = self._logprobs(s, lg[lp_row:lp_row + k], new)
            lp_row += n
            self._account_verify(s, int(res.accepted[i]))
            s.rounds += 1
            pos0 = s.n_cached
            s.n_cached += k  # the rows of x0 and the accepted drafts are committed context
            if decision != "skip":
                writes.append((s.slot, torch.arange(o, o + k), torch.arange(pos0, pos0 + k)))
            else:  # the ring misses these positions: a later draft sees older context there (lossless)
                self.totals["ring_rows_skipped"] += k
            self._commit(s, new, bool(res.stopped[i]), lps)
            if not self._done(s):
                draft_seqs.append(s)

    def _prefill_chunks(self, out, logits_at: dict, prefill: list, writes: list | None, draft_seqs: list) -> None:
        """The prefill chunks' ring writes (into `writes`; None: none, a step that steps aside); a request
        whose prompt is now cached samples its first token."""
        first = []
        for s, o, n in prefill:
            if writes is not None:
                writes.append((s.slot, torch.arange(o, o + n), torch.arange(s.n_cached, s.n_cached + n)))
            else:
                self.totals["ring_rows_skipped"] += n
            s.n_cached += n
            if not s.prefilling:
                first.append((s, logits_at[o + n - 1]))
        if not first:
            return
        seqs = [s for s, _ in first]
        lg = self._process_target(out.logits[[i for _, i in first]], seqs, [[0]] * len(seqs))
        res = acc.verify(lg, self._block(seqs), torch.zeros(len(seqs), dtype=torch.long), self._params(seqs),
                         self._sampler(seqs, STREAM_VERIFY), self._stop_ids(seqs),
                         torch.tensor([s.req.max_tokens for s in seqs]))
        for i, s in enumerate(seqs):
            s.rounds += 1
            s.first_token_time = time.monotonic()
            new = res.tokens[i, :1].tolist()
            self._commit(s, new, bool(res.stopped[i]), self._logprobs(s, lg[i:i + 1], new))
            if not self._done(s):
                draft_seqs.append(s)

    # ---- DSpark drafting ---------------------------------------------------------------------
    def _draft(self, writes, seqs: list[Seq], decision: str = "draft") -> None:
        if decision == "skip":  # no draft stages; only prefill rows reach the rings (see _step_eager)
            if writes:
                self.runner.dspark(writes, [])
            for s in seqs:
                s.draft, s.conf_logits, s.last_c, s.ell = None, None, None, 0
            self.totals["draft_skipped"] += len(seqs)
            return
        items = [(s.slot, s.n_cached - 1, s.tokens[s.n_cached]) for s in seqs]
        out = self.runner.dspark(writes, items)
        if not seqs:
            return
        d = self.runner.drafter
        anchors = torch.tensor([a for _, _, a in items], dtype=torch.long)
        # drafting after the verify of round r draws from round r's drafting stream
        block = acc.markov_draft(out.base_logits, anchors, d.markov_bias, self._params(seqs),
                                 self._sampler(seqs, STREAM_DRAFT, -1), logit_fn=self._draft_logit_fn(seqs))
        room = torch.tensor([min(s.req.max_tokens - s.n_out - 1, self.settings.max_model_len - s.n_cached - 2,
                                 self.gamma) for s in seqs]).clamp_min(0)
        conf_logits = self._confidence_logits(out, block)
        c = None
        if self.adaptive and self.settings.spec_mode == "dspark":
            c = self._calibrated(seqs, conf_logits)
        adm = "admit"
        if self.settings.spec_mode == "fixed":
            ell, adm = admit_fixed(len(seqs), self.settings.fixed_len, self.gamma), "fixed"
        elif decision == "probe":  # one draft each, fixed before the draws: refreshes the acceptance seen
            ell, adm = admit_fixed(len(seqs), 1, self.gamma), "probe"
            self.totals["draft_probes"] += 1
        elif self._explore:  # the guard's fixed-length step (fixed_guard), fixed before the draws
            ell, adm = admit_fixed(len(seqs), self.settings.fixed_len, self.gamma), "explore"
        else:
            if c is not None:
                ell = admit(c, self.ensure_cost().sps_for(len(seqs)))
                floor = self._guard_floors(seqs)  # the fixed-length guard's floor (fixed_guard): before any draw
                if any(floor):
                    ell = torch.maximum(ell, torch.tensor(floor, dtype=ell.dtype))
            else:  # the head as it is and the forward's steps/s: what the static rounds compute
                ell = admit(torch.sigmoid(conf_logits), self.ensure_cost().forward_for(len(seqs)))
        ell = torch.minimum(ell, room)
        for i, s in enumerate(seqs):
            s.draft = (block.tokens[i], block.prev[i], block.q_token[i], block.z[i])
            s.conf_logits = conf_logits[i].detach()
            s.ell, s.adm = int(ell[i]), adm
            s.drafted += self.gamma
        self.totals["drafted"] += self.gamma * len(seqs)

    def _confidence_logits(self, out, block: acc.DraftBlock) -> torch.Tensor:
        """The confidence head on each draft's predecessor (block.prev), never the draft itself: c_k
        must not look at x_k, or admission would depend on the draws it gates (notes/dspark.md 5)."""
        d = self.runner.drafter
        return d.confidence(out.hidden, d.markov_embed(block.prev))

    def _block(self, seqs: list[Seq]) -> acc.DraftBlock:
        """Stack the seqs' draft blocks; a seq without one gets a placeholder verified with ell 0.
        Where no seq verifies a draft (a first token, a step that stepped aside) the block has no
        draft columns: verify then processes 1 row per seq instead of 1 + G (at T = 1, batch 8, the
        G idle rows' logit processing cost a stepped-aside step ~3 ms of ~100). The tokens are the
        same: the acceptance draw still takes its call (0 columns), so the final draw's counter does
        not move (noise.CounterSampler), and rows past ell are never read."""
        G, V = (self.gamma if any(s.ell for s in seqs) else 0), self.mcfg.vocab_size
        parts = [s.draft if (s.draft is not None and s.ell) else None for s in seqs]
        t = torch.stack([p[0] if p else torch.zeros(G, dtype=torch.long) for p in parts])
        pv = torch.stack([p[1] if p else torch.zeros(G, dtype=torch.long) for p in parts])
        dt = loop_dtype()  # q(x) as verify reads it (fp32 under the kernels' numerics, like the round's state)
        q = torch.stack([p[2].to(dt) if p else torch.ones(G, dtype=dt) for p in parts])
        z = (torch.stack([p[3].float() if p else torch.zeros(G, V) for p in parts]) if G
             else torch.zeros(len(seqs), 0, V))
        return acc.DraftBlock(tokens=t, prev=pv, q_token=q, z=z)
