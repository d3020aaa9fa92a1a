"""The target's logit processors on verify rows and draft slots (frequency / presence penalties,
then min_tokens' stop masking), in the one fixed-shape, sync-free form that both the eager engine
(`logits.LogitProcessing`, a thin adapter over ragged rows) and the static round graphs
(`trn2/static_round.py`) run. A zero penalty and an inactive min_tokens row leave the logits bit for
bit as they are, so every row goes through every processor with no host read.

DSpark stays lossless under these processors only if the draft slot and the verify row that
predict the same output position apply the same function: `process_verify_rows` (row j of a
request follows its committed output and its first j drafts, predicting output token n_out + j)
and `draft_logit_fn` (slot k: committed output and drafts x_1..x_k, output token n_out + k) are
built from the same `processed_rows`.
"""

from __future__ import annotations

import torch

from .sampling import apply_penalties, mask_stop_tokens


def processed_rows(logits: torch.Tensor, counts: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor,
                   stop_ids: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """logits [N, V]: penalties with the rows' generated-token counts [N, V] and frequency / presence
    [N], then -inf at the stop ids [N, W] (-1 pads) of the rows where min_tokens is active [N]."""
    x = apply_penalties(logits, counts, frequency.float(), presence.float())
    return mask_stop_tokens(x, stop_ids, active)


def process_verify_rows(logits: torch.Tensor, base: torch.Tensor, drafts: torch.Tensor, stop_ids: torch.Tensor,
                        proc: dict) -> torch.Tensor:
    """The processors on verify rows [S, G+1, V] (row j may be any of 0..G): row j follows the
    committed output (counts `base` [S, V]) and the first j drafts [S, >= G]; row j predicts output
    token n_out + j. proc: n_out [S], min_tokens [S], frequency / presence [S]. Returns [S*(G+1), V]."""
    S, G1, V = logits.shape
    before = torch.nn.functional.one_hot(drafts[:, :G1 - 1].long(), V).cumsum(1).to(base.dtype)  # [S, G, V]
    counts = torch.cat([base[:, None], base[:, None] + before], 1)
    rep = lambda t: t[:, None].expand(S, G1).reshape(-1)  # noqa: E731 - per-request values per row
    pos = proc["n_out"][:, None] + torch.arange(G1, device=logits.device)
    active = (pos < proc["min_tokens"][:, None]).reshape(-1)
    stops = stop_ids[:, None, :].expand(S, G1, stop_ids.shape[1]).reshape(S * G1, -1)
    return processed_rows(logits.reshape(S * G1, V), counts.reshape(S * G1, V), rep(proc["frequency"]),
                          rep(proc["presence"]), stops, active)


def draft_logit_fn(base: torch.Tensor, n_out: torch.Tensor, proc: dict):
    """The `logit_fn` of Markov drafting: slot k predicts output token n_out + k after the committed
    output (counts `base` [S, V]) and drafts x_1..x_k, through the verify row's processors. proc:
    min_tokens [S], frequency / presence [S], stop_ids [S, W]."""
    V = base.shape[1]

    def fn(k: int, z: torch.Tensor, drafted: torch.Tensor) -> torch.Tensor:
        if k:  # (drafted moves to base's device: the eager engine keeps base on the host)
            counts = base + torch.nn.functional.one_hot(drafted.long().to(base.device), V).sum(1).to(base.dtype)
        else:
            counts = base
        return processed_rows(z, counts, proc["frequency"], proc["presence"], proc["stop_ids"],
                              n_out + k < proc["min_tokens"])

    return fn
