"""Logit processing shared by drafts and verification (penalties, min_tokens, stop ids), the
requests' sampling parameters and noise, and log-probs of committed tokens. A mixin of `Engine`."""

from __future__ import annotations

import torch

from .logit_proc import draft_logit_fn, process_verify_rows
from .noise import CounterSampler
from .precision import loop_dtype
from .sampling import LOGPROB_WIDTH, SamplingParams, token_logprobs
from .seq import Seq


class LogitProcessing:
    def _params(self, seqs: list[Seq]) -> SamplingParams:
        return SamplingParams.make(len(seqs), [s.req.temperature for s in seqs], [s.req.top_k for s in seqs],
                                   [s.req.top_p for s in seqs])

    def _sampler(self, seqs: list[Seq], stream: int, rnd_offset: int = 0) -> CounterSampler:
        """The requests' noise of this sampling round (noise.py): the same draws the static graphs
        compute, so eager and static serving give the same tokens."""
        return CounterSampler([s.seed for s in seqs], [s.rounds + rnd_offset for s in seqs], stream)

    # ---- logit processing shared by drafts and verification ---------------------------------------
    def _process_target(self, logits: torch.Tensor, seqs: list[Seq], positions: list[list[int]]) -> torch.Tensor:
        """The target's logit processors on verify rows: request i's rows predict its output tokens
        positions[i] (consecutive; rows in request order); row j of a decoding request follows its
        committed output and its first j admitted drafts. The ragged rows are padded to [R, n, V],
        run through `logit_proc.process_verify_rows` (the static rounds' function) and unpadded. The
        draft slots that predict the same positions go through `_draft_logit_fn`, the same
        processors, which keeps DSpark lossless under them."""
        if not self._processed(seqs):
            return logits
        dev = logits.device
        counts = torch.tensor([len(p) for p in positions], device=dev)
        n = max(len(p) for p in positions)
        steps = torch.arange(n, device=dev)[None, :]
        grid = (torch.cumsum(counts, 0) - counts)[:, None] + torch.minimum(steps, counts[:, None] - 1)  # clamped
        drafts = torch.zeros(len(seqs), n - 1, dtype=torch.long)
        for i, (s, ps) in enumerate(zip(seqs, positions)):
            if len(ps) > 1:
                drafts[i, :len(ps) - 1] = s.draft[0][:len(ps) - 1]
        proc = self._proc_inputs(seqs, dev)
        proc["n_out"] = torch.tensor([ps[0] for ps in positions], device=dev)
        out = process_verify_rows(logits[grid], proc["base"], drafts.to(dev), proc["stop_ids"], proc)
        return out[(steps < counts[:, None]).reshape(-1)]

    def _draft_logit_fn(self, seqs: list[Seq]):
        """Draft slot k of request i predicts its output token n_out + k after its committed output
        and drafts x_1..x_k: the same processors as the verify row that will check it
        (`logit_proc.draft_logit_fn`, as the static rounds; None when no request needs any)."""
        if not self._processed(seqs):
            return None
        proc = self._proc_inputs(seqs)  # on the host: the processors move what they need to z's device
        return draft_logit_fn(proc["base"], torch.tensor([s.n_out for s in seqs]), proc)

    def _proc_inputs(self, seqs: list[Seq], device=None) -> dict:
        """The processors' per-request tensors, as a static round's plan packs them (on `device`)."""
        dt = loop_dtype()
        proc = dict(base=torch.stack([self._output_counts(s) for s in seqs]),
                    min_tokens=torch.tensor([s.req.min_tokens for s in seqs]),
                    frequency=torch.tensor([float(s.req.frequency_penalty) for s in seqs], dtype=dt),
                    presence=torch.tensor([float(s.req.presence_penalty) for s in seqs], dtype=dt),
                    stop_ids=self._stop_ids(seqs))
        return proc if device is None else {k: v.to(device) for k, v in proc.items()}

    @staticmethod
    def _processed(seqs: list[Seq]) -> bool:
        return any(s.req.min_tokens or s.req.frequency_penalty or s.req.presence_penalty for s in seqs)

    def _output_counts(self, s: Seq) -> torch.Tensor:
        """[V] how often each id occurs in the request's generated tokens (the prompt does not count)."""
        out = torch.tensor(s.tokens[len(s.req.prompt):], dtype=torch.long)
        return torch.bincount(out, minlength=self.mcfg.vocab_size).to(loop_dtype())  # exact counts either way

    def _logprobs(self, s: Seq, logits: torch.Tensor, tokens: list[int]) -> list | None:
        """[logprob, rank, top alternatives] of each committed token under the (processed) target row
        that produced it: a token from an accepted draft is scored by the verify row that accepted
        it, exactly as if plain decoding had sampled it."""
        if s.req.logprobs < 0 or not tokens:
            return None
        params = SamplingParams.make(len(tokens), s.req.temperature, s.req.top_k, s.req.top_p)
        lp, rank, top_ids, top_lp = token_logprobs(logits[:len(tokens)], params, torch.tensor(tokens),
                                                   LOGPROB_WIDTH)  # the graphs' width; the request's first n
        n = s.req.logprobs
        out = []
        for j in range(len(tokens)):
            alts = [[int(t), float(v)] for t, v in zip(top_ids[j, :n].tolist(), top_lp[j, :n].tolist())
                    if v > float("-inf")]
            out.append([float(lp[j]), int(rank[j]), alts])
        return out

    def _stop_lists(self, seqs: list[Seq]) -> list[list[int]]:
        return [list(s.req.stop_token_ids) + ([] if s.req.ignore_eos else [self.mcfg.eos_token_id]) for s in seqs]

    def _stop_ids(self, seqs: list[Seq]) -> torch.Tensor:
        lists = self._stop_lists(seqs)
        width = max(1, max(len(x) for x in lists))
        return torch.tensor([x + [-1] * (width - len(x)) for x in lists], dtype=torch.long)
