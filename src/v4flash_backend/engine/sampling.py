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

    def stages(self, vocab: int) -> dict:
        """The host adapters' knowledge of the batch, as `process_logits_static`'s `filters` /
        `sampled` arguments (host reads): whether any row's top-k / top-p filters anything, whether
        any row samples (is not greedy). The stages no row needs are left out: their cost, not their
        result, which is the same bits either way."""
        greedy = self.greedy
        k = (self.top_k > 0) & (self.top_k < vocab)
        return dict(filters=bool(((k | (self.top_p < 1)) & ~greedy).any()), sampled=not bool(greedy.all()))

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
                        top_p: torch.Tensor, use_p: torch.Tensor) -> torch.Tensor:
    """Set filtered-out logits to -inf. One stable descending sort serves both filters, so the
    kept set is a deterministic function of the logits (ties broken by token id). Both filters run
    on every row with no host read of use_k / use_p: a row that does not filter keeps all (k = V,
    no top-p drop), so it comes back bit for bit as it went in."""
    n, v = x.shape
    sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)
    k = torch.where(use_k, top_k, torch.full_like(top_k, v)).clamp(1, v)
    kth = sorted_x.gather(1, (k - 1).unsqueeze(1))
    keep = sorted_x >= kth  # keep every token tied with the k-th logit
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
    rows are one-hot at argmax(logits) (first index on ties). fp64 in -> fp64 out, else fp32.
    The host's adapter of `process_logits_static` (the one implementation)."""
    if logits.dim() != 2 or logits.shape[0] != len(params):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(params)} rows of params")
    params = params.to(logits.device)
    return process_logits_static(logits, params.temperature, params.top_k, params.top_p,
                                 **params.stages(logits.shape[1]))


def process_logits_static(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                          top_p: torch.Tensor, filters: bool = True, sampled: bool = True) -> torch.Tensor:
    """THE sampling transform, with no host reads (no `bool(...)` on the params, no row subsets):
    the static decode graphs run it as it is and the host calls it through `process_logits`, so
    eager serving and the graphs sample from bit-identical distributions. logits [N, V];
    temperature (`loop_dtype`) / top_k / top_p [N]. Every row goes through the filters (which keep
    everything for a row that does not filter); greedy rows are one-hot.
    A caller that knows no row filters (filters=False) or every row is greedy (sampled=False:
    `SamplingParams.stages`) leaves out that stage -- the identity, bit for bit, on such rows -- and
    with it its cost (the sort; the softmax). The graphs run every stage."""
    x = logits.to(_work_dtype(logits))
    onehot = torch.zeros(x.shape, dtype=x.dtype, device=x.device).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
    if not sampled:
        return onehot
    v = x.shape[1]
    greedy = temperature < GREEDY_TEMPERATURE
    temp = torch.where(greedy, torch.ones_like(temperature), temperature).to(x.dtype)
    x = x / temp.unsqueeze(1)
    use_k = (top_k > 0) & (top_k < v) & ~greedy
    use_p = (top_p < 1) & ~greedy
    if filters:
        x = _filter_top_k_top_p(x, top_k, use_k, top_p, use_p)
    probs = torch.softmax(x, dim=-1)
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


def bernoulli_from_uniform(prob: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """True where u < prob (u in [0, 1) of the noise's dtype; prob compared in that dtype): the
    acceptance draw of noise.CounterSampler (eager) and of dspark_accept.verify_static (graphs)."""
    return u < prob.to(u.dtype)


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
# that predict the same output position go through the same processor: logit_proc builds both
# from these functions (the eager engine and the static rounds alike), and markov_draft stores the
# processed draft logits so the residual uses the q the drafts were drawn from.


def mask_stop_tokens(logits: torch.Tensor, stop_ids: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """vLLM's min_tokens: on rows where `active` [N] is true, the ids of `stop_ids` [N, W] (-1 pads)
    get logit -inf, so neither EOS nor a stop token id can be generated there. Returns a new tensor.
    No host read (a scatter into one spare column takes the pads and the inactive rows): the eager
    path and the static rounds run this same function."""
    V = logits.shape[-1]
    active = active.to(logits.device)
    stop_ids = stop_ids.to(logits.device)
    idx = torch.where((stop_ids >= 0) & active[:, None], stop_ids, V)
    hit = torch.zeros(logits.shape[0], V + 1, dtype=torch.bool, device=logits.device).scatter(1, idx, True)[:, :V]
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
    [N, top_n]); tokens outside the filtered support of the top_n alternatives have -inf. The host's
    adapter of `token_logprobs_static`."""
    params = params.to(logits.device)
    return token_logprobs_static(logits, params.temperature, params.top_k, params.top_p,
                                 tokens.to(logits.device, torch.int64), top_n, **params.stages(logits.shape[1]))


def token_logprobs_static(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                          top_p: torch.Tensor, tokens: torch.Tensor, top_n: int, filters: bool = True,
                          sampled: bool = True):
    """THE log-prob computation (no host read; `token_logprobs` and the static rounds'
    `logprobs_pack` call it): logits [N, V], per-row params [N], tokens [N] int64 (a negative id,
    a padding row, is scored as id 0). In `loop_dtype()`, so both paths give the same bits."""
    x = logits.to(loop_dtype())
    lp = torch.log(process_logits_static(x, temperature, top_k, top_p, filters, sampled))
    lp = torch.where((temperature < GREEDY_TEMPERATURE).unsqueeze(1), torch.log_softmax(x, -1), lp)
    tok = lp.gather(1, tokens.clamp_min(0).unsqueeze(1)).squeeze(1)
    rank = 1 + (lp > tok.unsqueeze(1)).sum(1)
    top_lp, top_ids = lp.topk(min(top_n, lp.shape[1]), dim=-1)
    return tok, rank, top_ids, top_lp
