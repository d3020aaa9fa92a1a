"""Token sampling: temperature / top-k / top-p processing that returns the exact distribution a
token is drawn from, greedy decoding, and per-request seeded random draws.

Everything is batched over rows; every row may have its own temperature, top-k, top-p and
generator. `process_logits` is a pure, deterministic function of (logits, params): DSpark's
lossless acceptance (dspark_accept) relies on the draft distribution q and the target
distribution p both being exactly this function's output, so it is the one place where the
sampling transform is defined.

Randomness goes through a `Sampler` (`categorical`, `bernoulli`). `TorchSampler` draws from
torch generators; tests substitute a scripted sampler that enumerates branches exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import torch

from .precision import loop_dtype

# Temperatures below this are greedy. The same cut-off as DeepSpec's evaluator (T < 1e-5):
# dividing logits by such a temperature would overflow fp32 anyway.
GREEDY_TEMPERATURE = 1e-5
# log-prob alternatives computed per token (GenerateRequest.logprobs <= 20); a request's first n
# are kept, so the host and the static graphs take the same topk (ties break the same way)
LOGPROB_WIDTH = 20


def _per_row(value, n: int, dtype: torch.dtype, device) -> torch.Tensor:
    if isinstance(value, (int, float, bool)):  # a fill: as_tensor on a device would copy from the host
        return torch.full((n,), value, dtype=dtype, device=device)
    t = torch.as_tensor(value, dtype=dtype, device=device)
    if t.dim() == 0:
        t = t.expand(n).clone()
    if t.shape != (n,):
        raise ValueError(f"expected a scalar or {n} per-row values, got shape {tuple(t.shape)}")
    return t


@dataclass(frozen=True)
class SamplingParams:
    """Per-row sampling parameters.

    temperature [R] float: < GREEDY_TEMPERATURE means greedy (argmax, first index on ties).
    top_k [R] int64: <= 0 (or >= vocab) disables; ties with the k-th logit are kept.
    top_p [R] float in (0, 1]: 1 disables; keeps the smallest most-probable prefix of the
      (temperature-scaled, top-k filtered) distribution whose mass reaches top_p.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor

    def __post_init__(self):
        n = self.temperature.shape[0]
        if self.temperature.dim() != 1 or self.top_k.shape != (n,) or self.top_p.shape != (n,):
            raise ValueError("temperature, top_k and top_p must be 1-D tensors of equal length")
        if bool((self.temperature < 0).any()) or bool(torch.isnan(self.temperature).any()):
            raise ValueError("temperature must be >= 0")
        if bool((self.top_p <= 0).any()) or bool((self.top_p > 1).any()):
            raise ValueError("top_p must be in (0, 1]")

    @staticmethod
    def make(n: int, temperature=1.0, top_k=0, top_p=1.0, device=None) -> "SamplingParams":
        """Scalars broadcast to all n rows; sequences/tensors give one value per row. temperature and
        top_p in `loop_dtype()`, as the static rounds take them (a greedy cut-off compared in another
        type could decide otherwise at the edge)."""
        return SamplingParams(
            temperature=_per_row(temperature, n, loop_dtype(), device),
            top_k=_per_row(top_k, n, torch.int64, device),
            top_p=_per_row(top_p, n, loop_dtype(), device),
        )

    def __len__(self) -> int:
        return int(self.temperature.shape[0])

    @property
    def greedy(self) -> torch.Tensor:
        return self.temperature < GREEDY_TEMPERATURE

    def all_greedy(self) -> bool:
        return bool(self.greedy.all())

    def select(self, index: torch.Tensor) -> "SamplingParams":
        """Rows `index` (a long index tensor or bool mask)."""
        return SamplingParams(self.temperature[index], self.top_k[index], self.top_p[index])

    def repeat_interleave(self, repeats: torch.Tensor) -> "SamplingParams":
        """Row r repeated repeats[r] times (e.g. one copy per verify row of a request)."""
        repeats = repeats.to(self.temperature.device)
        return SamplingParams(
            self.temperature.repeat_interleave(repeats),
            self.top_k.repeat_interleave(repeats),
            self.top_p.repeat_interleave(repeats),
        )

    def to(self, device) -> "SamplingParams":
        return SamplingParams(self.temperature.to(device), self.top_k.to(device), self.top_p.to(device))


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    # bf16/fp16 logits are processed in fp32; fp64 (used by the exactness tests) stays fp64.
    return x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32


def _filter_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, use_k: torch.Tensor,
                        top_p: torch.Tensor, use_p: torch.Tensor, branch_free: bool = False) -> torch.Tensor:
    """Set filtered-out logits to -inf. One stable descending sort serves both filters, so the
    kept set is a deterministic function of the logits (ties broken by token id).
    branch_free: apply both filters to every row (a row that does not filter keeps all: k = V,
    no top-p drop), with no host read of use_k / use_p -- the static graphs' form; row by row
    the result is the same."""
    n, v = x.shape
    sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)
    keep = torch.ones_like(sorted_x, dtype=torch.bool)
    if branch_free or bool(use_k.any()):
        k = torch.where(use_k, top_k, torch.full_like(top_k, v)).clamp(1, v)
        kth = sorted_x.gather(1, (k - 1).unsqueeze(1))
        keep &= sorted_x >= kth  # keep every token tied with the k-th logit
    if branch_free or bool(use_p.any()):
        probs = torch.softmax(sorted_x.masked_fill(~keep, float("-inf")), dim=-1)
        # exclusive cumulative mass: the mass strictly ahead of each token in sorted order
        before = torch.cumsum(probs, dim=-1) - probs
        before[:, 0] = 0  # the top token is always kept, exactly
        drop = use_p.unsqueeze(1) & (before >= top_p.to(x.dtype).unsqueeze(1))
        keep &= ~drop
    filtered = sorted_x.masked_fill(~keep, float("-inf"))
    return torch.empty_like(x).scatter_(1, order, filtered)


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [N, V] each row is sampled from: softmax(top_p(top_k(logits / T))); greedy
    rows are one-hot at argmax(logits) (first index on ties). fp64 in -> fp64 out, else fp32."""
    if logits.dim() != 2 or logits.shape[0] != len(params):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(params)} rows of params")
    x = logits.to(_work_dtype(logits))
    n, v = x.shape
    params = params.to(x.device)
    greedy = params.greedy
    temp = torch.where(greedy, torch.ones_like(params.temperature), params.temperature).to(x.dtype)
    x = x / temp.unsqueeze(1)
    use_k = (params.top_k > 0) & (params.top_k < v) & ~greedy
    use_p = (params.top_p < 1) & ~greedy
    filt = use_k | use_p
    if bool(filt.all()):
        x = _filter_top_k_top_p(x, params.top_k, use_k, params.top_p, use_p)
    elif bool(filt.any()):  # sort only the rows that filter (row-wise op: same result per row)
        rows = filt.nonzero().squeeze(1)
        x = x.index_copy(0, rows, _filter_top_k_top_p(x[rows], params.top_k[rows], use_k[rows],
                                                       params.top_p[rows], use_p[rows]))
    probs = torch.softmax(x, dim=-1)
    if bool(greedy.any()):
        onehot = torch.zeros_like(probs).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy.unsqueeze(1), onehot, probs)
    return probs


def process_logits_static(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                          top_p: torch.Tensor) -> torch.Tensor:
    """`process_logits` without host reads (no `bool(...)` on the params, no row subsets): the
    form the static decode graphs run. logits [N, V]; temperature (`loop_dtype`) / top_k / top_p [N].
    Row by row it computes the same values as `process_logits` (every row goes through the
    filters, which keep everything for a row that does not filter; greedy rows are one-hot), so
    eager serving and the graphs sample from bit-identical distributions (tests/test_sampling.py)."""
    x = logits.to(_work_dtype(logits))
    v = x.shape[1]
    greedy = temperature < GREEDY_TEMPERATURE
    temp = torch.where(greedy, torch.ones_like(temperature), temperature).to(x.dtype)
    x = x / temp.unsqueeze(1)
    use_k = (top_k > 0) & (top_k < v) & ~greedy
    use_p = (top_p < 1) & ~greedy
    x = _filter_top_k_top_p(x, top_k, use_k, top_p, use_p, branch_free=True)
    probs = torch.softmax(x, dim=-1)
    onehot = torch.zeros_like(probs).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy.unsqueeze(1), onehot, probs)


def categorical_from_uniform(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: the first index whose cumulative mass exceeds u * total mass.

    probs [N, V] non-negative (need not be normalised), u [N] in [0, 1). A zero-probability
    token is never returned: its cumulative sum equals its predecessor's, so an earlier index
    always wins the search; the clamp below only catches u * total rounding up to total."""
    cdf = torch.cumsum(probs, dim=-1)
    target = u.to(cdf.dtype) * cdf[:, -1]
    idx = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)
    v = probs.shape[1]
    last_positive = v - 1 - (probs.flip(-1) > 0).to(torch.int8).argmax(-1)
    return torch.minimum(idx, last_positive)


class Sampler(Protocol):
    """Source of randomness, batched over rows (row r = request r)."""

    def categorical(self, probs: torch.Tensor) -> torch.Tensor:
        """probs [R, V] (rows sum to 1) -> drawn token ids [R] int64."""

    def bernoulli(self, prob: torch.Tensor) -> torch.Tensor:
        """prob [R, n] -> bool [R, n], True with probability prob."""


class TorchSampler:
    """Uniform draws from torch generators: row r uses generators[r] when given (a seeded
    request consumes a fixed number of draws per call, so its stream does not depend on the
    rest of the batch), otherwise the shared `default` generator."""

    def __init__(self, generators: Optional[Sequence[Optional[torch.Generator]]] = None,
                 default: Optional[torch.Generator] = None):
        self.generators = list(generators) if generators is not None else None
        self.default = default if default is not None else torch.default_generator

    @staticmethod
    def seeded(seeds: Sequence[Optional[int]], default_seed: Optional[int] = None) -> "TorchSampler":
        gens = [make_generator(s) if s is not None else None for s in seeds]
        return TorchSampler(gens, make_generator(default_seed) if default_seed is not None else None)

    def uniform(self, shape: Sequence[int]) -> torch.Tensor:
        """Float64 uniforms in [0, 1) of `shape`; the leading dimension is the row."""
        shape = tuple(int(s) for s in shape)
        gens = self.generators
        if gens is not None and len(gens) != shape[0]:
            raise ValueError(f"sampler has {len(gens)} generators for {shape[0]} rows")
        if gens is None or any(g is None for g in gens):
            u = torch.rand(shape, generator=self.default, dtype=torch.float64)
        else:
            u = torch.empty(shape, dtype=torch.float64)
        if gens is not None:
            for r, g in enumerate(gens):
                if g is not None:
                    u[r] = torch.rand(shape[1:], generator=g, dtype=torch.float64)
        return u

    def categorical(self, probs: torch.Tensor) -> torch.Tensor:
        u = self.uniform((probs.shape[0],)).to(probs.device)
        return categorical_from_uniform(probs, u)

    def bernoulli(self, prob: torch.Tensor) -> torch.Tensor:
        u = self.uniform(tuple(prob.shape)).to(prob.device)
        return u < prob.to(torch.float64)


def make_generator(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(int(seed))
    return g


def sample(logits: torch.Tensor, params: SamplingParams, sampler: Optional[Sampler] = None) -> torch.Tensor:
    """One token per row [N] int64 from process_logits(logits, params). An all-greedy batch
    takes argmax without touching the full softmax or the sampler."""
    if params.all_greedy():
        return logits.argmax(-1)
    probs = process_logits(logits, params)
    ids = (sampler or TorchSampler()).categorical(probs)
    # greedy rows in a mixed batch: the one-hot row already forces argmax; this makes it explicit
    return torch.where(params.greedy.to(ids.device), logits.argmax(-1), ids)


# ---- logit processors and log-probabilities ---------------------------------------------------
# A logit processor changes the target distribution itself (vLLM's logits processors run before
# temperature / top-k / top-p). DSpark stays lossless only if the draft rows and the verify rows
# that predict the same output position go through the same processor: the engine applies these
# functions to both (engine._min_tokens_fn, Engine._step_running), and markov_draft stores the
# processed draft logits so the residual uses the q the drafts were drawn from.


def mask_stop_tokens(logits: torch.Tensor, stop_ids: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """vLLM's min_tokens: on rows where `active` [N] is true, the ids of `stop_ids` [N, S] (-1 pads)
    get logit -inf, so neither EOS nor a stop token id can be generated there. Returns a new tensor."""
    if not bool(active.any()) or stop_ids.numel() == 0:
        return logits
    active = active.to(logits.device)
    stop_ids = stop_ids.to(logits.device)
    hit = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    valid = (stop_ids >= 0) & active.unsqueeze(1)
    rows = torch.arange(logits.shape[0], device=logits.device).unsqueeze(1).expand_as(stop_ids)
    hit[rows[valid], stop_ids[valid]] = True
    return logits.masked_fill(hit, float("-inf"))


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, frequency: torch.Tensor,
                    presence: torch.Tensor) -> torch.Tensor:
    """OpenAI / vLLM frequency and presence penalties: logits - frequency * count - presence *
    [count > 0], per row; counts [N, V] are the row's generated-token counts so far (the prompt does
    not count), frequency / presence [N]. Before temperature / top-k / top-p, as vLLM applies them."""
    f = frequency.to(logits.device, logits.dtype).unsqueeze(1)
    p = presence.to(logits.device, logits.dtype).unsqueeze(1)
    c = counts.to(logits.device, logits.dtype)
    return logits - f * c - p * (c > 0).to(logits.dtype)


def token_logprobs(logits: torch.Tensor, params: SamplingParams, tokens: torch.Tensor, top_n: int = 0):
    """Log-probabilities of `tokens` [N] under the distribution row r is sampled from:
    log(process_logits(logits, params)) (after temperature, top-k, top-p). Greedy rows, whose
    sampling distribution is a point mass, report log_softmax of the logits (T = 1, unfiltered).
    Returns (logprob [N] in `loop_dtype()`, rank [N] (1 = most likely), top_ids [N, top_n], top_logprob
    [N, top_n]); tokens outside the filtered support of the top_n alternatives have -inf. The static
    rounds' form is trn2/static_round.logprobs_pack (the same ops in the same dtype)."""
    x = logits.to(loop_dtype())
    lp = torch.log(process_logits(x, params))
    greedy = params.greedy.to(x.device)
    if bool(greedy.any()):
        lp = torch.where(greedy.unsqueeze(1), torch.log_softmax(x, -1), lp)
    tok = lp.gather(1, tokens.to(x.device, torch.int64).unsqueeze(1)).squeeze(1)
    rank = 1 + (lp > tok.unsqueeze(1)).sum(1)
    top_lp, top_ids = lp.topk(min(top_n, lp.shape[1]), dim=-1) if top_n > 0 else (lp[:, :0], tokens[:, None][:, :0])
    return tok, rank, top_ids, top_lp
