"""DSpark is lossless: exact enumeration and Monte Carlo through the real draft / admit / verify code.

Toy setting (notes/dspark.md section 6): a random order-2 target table p(. | x_{t-2}, x_{t-1}), a draft
whose base logits U depend on the context and the block slot, plus a random rank-2 Markov bias
B(prev) = W1[prev] @ W2, and a confidence that is a function of (slot k, x_{k-1}) only.

Exact enumeration replaces every random draw by a scripted branch: `ScriptSampler` returns the
scripted choice and multiplies the row's weight by the probability the real sampler would have given
it. All branches are rows of one batch, so `markov_draft`, `admit` and `verify` run unchanged and
vectorised. Weights are fp64; the joint of the first m emitted tokens must equal the target's joint to
1e-12 (sums of ~1e5 products of O(1) fp64 numbers: rounding is ~1e-14).
"""

import itertools
import math

import pytest
import torch

from v4flash_backend.engine.dspark_accept import (
    DraftBlock,
    commit_stats,
    markov_draft,
    verify,
    verify_greedy,
    verify_layout,
    verify_offsets,
)
from v4flash_backend.engine.dspark_sched import SPSTable, admit, admit_no_early_stop
from v4flash_backend.engine.sampling import (
    SamplingParams,
    TorchSampler,
    apply_penalties,
    make_generator,
    mask_stop_tokens,
    process_logits,
)

F64 = torch.float64
EXACT_TOL = 1e-12
CONTROL_MIN = 1e-3  # a negative control must move some probability by more than this


class ScriptSampler:
    """Enumeration sampler: call i of each kind returns the scripted per-row choice and multiplies the
    row weight by its probability. Running out of script (an unexpected draw) raises."""

    def __init__(self, cats=(), berns=()):
        self.cats, self.berns = list(cats), list(berns)
        self.weight = None

    def _mul(self, w):
        self.weight = w if self.weight is None else self.weight * w

    def categorical(self, probs):
        choice = self.cats.pop(0)
        self._mul(probs.gather(1, choice.unsqueeze(1)).squeeze(1) / probs.sum(1))
        return choice

    def bernoulli(self, prob):
        bits = self.berns.pop(0)
        self._mul(torch.where(bits, prob, 1 - prob).prod(1))
        return bits

    def done(self):
        return not self.cats and not self.berns


class Toy:
    def __init__(self, V, G, seed, conf_scale=2.0, conf_shift=0.0):
        g = torch.Generator().manual_seed(seed)
        self.V, self.G = V, G
        self.tgt = torch.randn(V, V, V, generator=g, dtype=F64) * 1.5  # logits of x_t given (x_{t-2}, x_{t-1})
        self.U = 0.6 * self.tgt[:, :, None, :] + torch.randn(V, V, G, V, generator=g, dtype=F64)
        self.W1 = torch.randn(V, 2, generator=g, dtype=F64)
        self.W2 = torch.randn(2, V, generator=g, dtype=F64)
        self.theta = torch.randn(G, V, generator=g, dtype=F64) * conf_scale + conf_shift

    def bias(self, prev):
        return self.W1[prev] @ self.W2

    def base_U(self, ctx):  # ctx [N, 2] -> [N, G, V]
        return self.U[ctx[:, 0], ctx[:, 1]]

    def conf(self, prev):  # prev [N, G] = x_{k-1} of each slot -> c [N, G]
        k = torch.arange(self.G).unsqueeze(0).expand_as(prev)
        return torch.sigmoid(self.theta[k, prev])

    def target_logits(self, ctx, drafts, ell):
        """Verify-forward logits in verify_layout order: row i of a request follows x_i."""
        _, req, step, _ = verify_layout(ctx[:, 1], drafts, ell)
        seq = torch.cat([ctx, drafts], 1)  # x_{-1}, x_0, x_1..x_G
        return self.tgt[seq[req, step], seq[req, step + 1]]


def rows_params(specs, req):
    """SamplingParams for rows whose request index is req (specs: one dict per request)."""
    def field(key, default, dtype):
        return torch.tensor([s.get(key, default) for s in specs], dtype=dtype)[req]

    return SamplingParams(field("temperature", 1.0, F64), field("top_k", 0, torch.int64), field("top_p", 1.0, F64))


def select_block(b, idx):
    return DraftBlock(b.tokens[idx], b.prev[idx], b.q_token[idx], b.z[idx])


def enumerate_round(toy, ctxs, specs, sps, admit_fn=admit, q_from_base=False, bonus_from_unadmitted=False,
                    proc=None, pos0=0, raw_z=False, hist_counts=None, verify_ignores_drafts=False):
    """Every outcome of one round for n_inst independent batch instances of R requests (ctxs [n_inst, R, 2]).

    Returns (inst, req, result, weight, ell) over rows (instance, branch, request): `weight` is the
    probability of the branch (identical across the R rows of one branch).

    proc(logits [N, V], pos [N]) -> logits: a logit processor of the target that depends on the output
    position of the predicted token (min_tokens masking); the round starts at output position pos0.
    It is applied to the draft through markov_draft's logit_fn and to the verify rows, the way the
    engine does (Engine._draft_logit_fn / _process_target). With hist_counts [n_inst, V] (the generated
    tokens before the round, per instance) proc also gets each row's counts: history plus the drafts
    before the row (penalties)."""
    n_inst, R, _ = ctxs.shape
    V, G = toy.V, toy.G
    greedy = all(s.get("temperature", 1.0) == 0 for s in specs)
    scripts = (torch.zeros(1, G, dtype=torch.long) if greedy
               else torch.tensor(list(itertools.product(range(V), repeat=G))))
    S = scripts.shape[0]
    # draft stage: rows (instance, joint draft script d, request r); request r follows script (d // S^r) % S
    D = S ** R
    inst = torch.arange(n_inst).repeat_interleave(D * R)
    d = torch.arange(D).repeat_interleave(R).repeat(n_inst)
    req = torch.arange(R).repeat(n_inst * D)
    ctx = ctxs[inst, req]
    params = rows_params(specs, req)
    sampler = ScriptSampler(cats=[scripts[(d // S ** req) % S, k] for k in range(G)]) if not greedy else ScriptSampler()
    logit_fn = None
    if proc is not None:
        base = hist_counts[inst] if hist_counts is not None else torch.zeros(len(inst), V, dtype=F64)

        def logit_fn(k, z, drafted):
            counts = base + torch.nn.functional.one_hot(drafted, V).sum(1).to(F64)
            return proc(z, torch.full((z.shape[0],), pos0 + k), counts)
    block = markov_draft(toy.base_U(ctx), ctx[:, 1], toy.bias, params, sampler, logit_fn=logit_fn)
    assert sampler.done()
    if raw_z:  # NEGATIVE CONTROL: drafts drawn from the processed q, but block.z keeps the raw logits
        raw = toy.base_U(ctx) + torch.stack([toy.bias(block.prev[:, k]) for k in range(G)], 1)
        block = DraftBlock(block.tokens, block.prev, block.q_token, raw)
    w_row = sampler.weight if sampler.weight is not None else torch.ones(len(req), dtype=F64)
    w_branch = w_row.view(-1, R).prod(1)
    live = (w_branch > 0).nonzero().squeeze(1)  # drop impossible draft paths (top-k, greedy)
    rows = (live.unsqueeze(1) * R + torch.arange(R)).reshape(-1)
    block, ctx, inst, req, w_branch = select_block(block, rows), ctx[rows], inst[rows], req[rows], w_branch[live]
    if q_from_base:  # NEGATIVE CONTROL: q taken from the base logits, ignoring the Markov bias
        U = toy.base_U(ctx)
        p_rows = params.select(rows)
        q_tok = torch.stack([process_logits(U[:, k], p_rows).gather(1, block.tokens[:, k:k + 1]).squeeze(1)
                             for k in range(G)], 1)
        block = DraftBlock(block.tokens, block.prev, q_tok, U.clone())
    ell = admit_fn(toy.conf(block.prev).view(-1, R, G), sps).reshape(-1)
    # verify stage: per request 2^G accept patterns x V final tokens, joint over the R requests
    if greedy:
        P, pats = 1, None
    else:
        pats = torch.tensor(list(itertools.product([False, True], repeat=G)))
        P = len(pats) * V
    E = P ** R
    K = len(live)
    src = (torch.arange(K).repeat_interleave(E * R) * R + torch.arange(R).repeat(K * E))
    e = torch.arange(E).repeat_interleave(R).repeat(K)
    r2 = req[src]
    script = (e // P ** r2) % P
    b2, ell2, ctx2 = select_block(block, src), ell[src], ctx[src]
    logits = toy.target_logits(ctx2, b2.tokens, ell2)
    if proc is not None:
        _, lreq, step, _ = verify_layout(ctx2[:, 1], b2.tokens, ell2)
        base = hist_counts[inst[src]] if hist_counts is not None else torch.zeros(len(src), V, dtype=F64)
        cum = torch.cat([torch.zeros(len(src), 1, V, dtype=F64),
                         torch.nn.functional.one_hot(b2.tokens, V).to(F64).cumsum(1)], 1)  # [N, G+1, V]
        counts = base[lreq] + (0 if verify_ignores_drafts else cum[lreq, step])
        logits = proc(logits, pos0 + step, counts)
    vs = ScriptSampler() if greedy else ScriptSampler(berns=[pats[script // V]], cats=[script % V])
    res = verify(logits, b2, ell2, rows_params(specs, r2), vs)
    assert vs.done()
    w_v = vs.weight if vs.weight is not None else torch.ones(len(src), dtype=F64)
    weight = (w_branch.repeat_interleave(E) * w_v.view(-1, R).prod(1)).repeat_interleave(R)
    if bonus_from_unadmitted:  # NEGATIVE CONTROL: all admitted accepted -> emit the next (unadmitted) draft
        bug = (res.accepted == ell2) & (ell2 < G)
        idx = bug.nonzero().squeeze(1)
        res.tokens[idx, ell2[idx]] = b2.tokens[idx, ell2[idx]]
    return inst[src], r2, res, weight, ell2


def outcome_tables(inst, res, weight, n_inst):
    """Per instance: {emitted token tuple: probability}."""
    V1 = int(res.tokens.max()) + 2
    width = res.tokens.shape[1]
    code = ((res.tokens + 1) * V1 ** torch.arange(width)).sum(1) + inst * V1 ** width
    keys, inv = torch.unique(code, return_inverse=True)
    tot = torch.zeros(len(keys), dtype=F64).scatter_add_(0, inv, weight)
    tables = [dict() for _ in range(n_inst)]
    for k, p in zip(keys.tolist(), tot.tolist()):
        i, c = divmod(k, V1 ** width)
        toks = []
        while c:
            c, t = divmod(c, V1)
            if t:
                toks.append(t - 1)
        if p != 0:
            tables[i][tuple(toks)] = tables[i].get(tuple(toks), 0.0) + p
    return tables


def spec_joint(toy, tables, ctx_list, m):
    """Joint law of the first m emitted tokens from each context, composing rounds (R = 1)."""
    index = {c: i for i, c in enumerate(ctx_list)}
    memo = {}

    def joint(ctx, n):
        if n == 0:
            return torch.ones((), dtype=F64)
        if (ctx, n) not in memo:
            J = torch.zeros([toy.V] * n, dtype=F64)
            for s, p in tables[index[ctx]].items():
                if len(s) >= n:
                    J[s[:n]] += p
                else:
                    seq = ctx + s
                    J[s] += p * joint(seq[-2:], n - len(s))
            memo[ctx, n] = J
        return memo[ctx, n]

    return {c: joint(c, m) for c in ctx_list}


def target_joint(toy, spec, ctx_list, m):
    memo = {}

    def joint(ctx, n):
        if n == 0:
            return torch.ones((), dtype=F64)
        if (ctx, n) not in memo:
            p = process_logits(toy.tgt[ctx][None], rows_params([spec], torch.zeros(1, dtype=torch.long)))[0]
            memo[ctx, n] = torch.stack([p[y] * joint((ctx[1], y), n - 1) for y in range(toy.V)])
        return memo[ctx, n]

    return {c: joint(c, m) for c in ctx_list}


V1, G1 = 5, 3  # the R = 1 enumeration: 25 contexts x 125 draft paths x (8 x 5) verify branches
SPS1 = SPSTable([1, 2, 3, 4], [1.0, 0.7, 0.6, 0.52])
M1 = G1 + 1  # m = gamma + 1 tokens: covers a full round (all accepted + bonus) and later rounds


def discrepancy_r1(spec, toy, **kw):
    ctx_list = list(itertools.product(range(V1), repeat=2))
    ctxs = torch.tensor(ctx_list).view(-1, 1, 2)
    inst, _, res, weight, ell = enumerate_round(toy, ctxs, [spec], SPS1, **kw)
    tables = outcome_tables(inst, res, weight, len(ctx_list))
    for t in tables:  # each context's outcomes form a distribution
        assert abs(sum(t.values()) - 1) < EXACT_TOL
    got = spec_joint(toy, tables, ctx_list, M1)
    want = target_joint(toy, spec, ctx_list, M1)
    ell_mass = torch.zeros(G1 + 1, dtype=F64).scatter_add_(0, ell, weight) / len(ctx_list)
    return max(float((got[c] - want[c]).abs().max()) for c in ctx_list), got, want, ell_mass


SPECS = {
    "T1": dict(temperature=1.0),
    "T0.7_topk3": dict(temperature=0.7, top_k=3),
    "T0.8_topp0.85": dict(temperature=0.8, top_p=0.85),
    "greedy": dict(temperature=0.0),
}


@pytest.mark.parametrize("name", list(SPECS))
def test_enumeration_first_tokens_equal_target(name):
    toy = Toy(V1, G1, seed=0, conf_shift=1.0)
    err, got, want, ell_mass = discrepancy_r1(SPECS[name], toy)
    assert err <= EXACT_TOL, err
    if name == "greedy":  # a point mass on the target's greedy sequence
        for c in got:
            assert float(got[c].max()) == pytest.approx(1.0, abs=EXACT_TOL)
    # the scheduler really produced ragged lengths 0..gamma in this toy (mass averaged over contexts)
    assert bool((ell_mass > 0.01).all()), ell_mass


@pytest.mark.parametrize("control", ["q_from_base", "admit_no_early_stop", "bonus_from_unadmitted"])
def test_enumeration_detects_negative_controls(control):
    toy = Toy(V1, G1, seed=0, conf_shift=1.0)
    kw = {"admit_fn": admit_no_early_stop} if control == "admit_no_early_stop" else {control: True}
    err, *_ = discrepancy_r1(SPECS["T1"], toy, **kw)
    assert err > CONTROL_MIN, (control, err)


# ---- a position-dependent logit processor: min_tokens ------------------------------------------------
MIN_TOKENS, STOP_ID = 2, 0  # token 0 plays EOS: masked at output positions 0 and 1


def min_tokens_proc(logits, pos, counts=None):
    return mask_stop_tokens(logits, torch.full((logits.shape[0], 1), STOP_ID), pos < MIN_TOKENS)


def discrepancy_min_tokens(spec, toy, **kw):
    """Joint of the first M1 tokens from output position 0, composing rounds that start at positions
    0, 1, 2 (from 2 on the mask is off, so one table serves every later position)."""
    ctx_list = list(itertools.product(range(V1), repeat=2))
    ctxs = torch.tensor(ctx_list).view(-1, 1, 2)
    tables = {}
    for pos0 in range(MIN_TOKENS + 1):
        inst, _, res, weight, _ = enumerate_round(toy, ctxs, [spec], SPS1, proc=min_tokens_proc, pos0=pos0, **kw)
        tables[pos0] = outcome_tables(inst, res, weight, len(ctx_list))
    index = {c: i for i, c in enumerate(ctx_list)}
    memo, tmemo = {}, {}

    def got(ctx, pos, n):
        if n == 0:
            return torch.ones((), dtype=F64)
        key = (ctx, min(pos, MIN_TOKENS), n)
        if key not in memo:
            J = torch.zeros([toy.V] * n, dtype=F64)
            for s, p in tables[min(pos, MIN_TOKENS)][index[ctx]].items():
                if len(s) >= n:
                    J[s[:n]] += p
                else:
                    J[s] += p * got((ctx + s)[-2:], pos + len(s), n - len(s))
            memo[key] = J
        return memo[key]

    def want(ctx, pos, n):
        if n == 0:
            return torch.ones((), dtype=F64)
        key = (ctx, min(pos, MIN_TOKENS), n)
        if key not in tmemo:
            lg = min_tokens_proc(toy.tgt[ctx][None], torch.tensor([pos]))
            p = process_logits(lg, rows_params([spec], torch.zeros(1, dtype=torch.long)))[0]
            tmemo[key] = torch.stack([p[y] * want((ctx[1], y), pos + 1, n - 1) for y in range(toy.V)])
        return tmemo[key]

    err = max(float((got(c, 0, M1) - want(c, 0, M1)).abs().max()) for c in ctx_list)
    masked = max(float(want(c, 0, M1)[STOP_ID].abs().max()) + float(want(c, 0, M1)[:, STOP_ID].abs().max())
                 for c in ctx_list)
    return err, masked


@pytest.mark.parametrize("name", ["T1", "T0.7_topk3", "greedy"])
def test_enumeration_min_tokens_equals_masked_target(name):
    # The mask changes the target (token 0 impossible at positions 0, 1); DSpark's output must follow
    # the masked target exactly, with drafts and verify rows processed alike.
    toy = Toy(V1, G1, seed=0, conf_shift=1.0)
    err, masked = discrepancy_min_tokens(SPECS[name], toy)
    assert masked == 0.0  # the wanted joint really excludes token 0 at the first two positions
    assert err <= EXACT_TOL, err


def test_enumeration_min_tokens_detects_unprocessed_residual():
    # NEGATIVE CONTROL: drafts drawn from the masked q, but the residual computed from raw draft logits
    # (what a markov_draft that processed z only for sampling would do).
    toy = Toy(V1, G1, seed=0, conf_shift=1.0)
    err, _ = discrepancy_min_tokens(SPECS["T1"], toy, raw_z=True)
    assert err > CONTROL_MIN, err


# ---- a history-dependent logit processor: frequency / presence penalties --------------------------
V2, G2, M2 = 4, 2, 3  # M2 = G2 + 1 tokens: a full round and what follows shorter rounds
PEN_F, PEN_P = 0.8, 0.5


def penalty_proc(logits, pos, counts):
    n = logits.shape[0]
    return apply_penalties(logits, counts, torch.full((n,), PEN_F, dtype=F64), torch.full((n,), PEN_P, dtype=F64))


def discrepancy_penalties(spec, toy, starts, sps, **kw):
    """Joint of the first M2 tokens after each start context under the penalised target. A round's
    distribution depends on everything generated before it, so one instance per (start, history)
    with len(history) < M2, all enumerated in one batch; rounds are composed over histories."""
    states = [(c0, h) for c0 in starts for n in range(M2) for h in itertools.product(range(V2), repeat=n)]
    ctxs = torch.tensor([list((c0 + h)[-2:]) for c0, h in states]).view(-1, 1, 2)
    hist = torch.stack([torch.bincount(torch.tensor(h, dtype=torch.long), minlength=V2).to(F64) for _, h in states])
    inst, _, res, weight, ell = enumerate_round(toy, ctxs, [spec], sps, proc=penalty_proc, hist_counts=hist, **kw)
    tables = outcome_tables(inst, res, weight, len(states))
    index = {st: i for i, st in enumerate(states)}
    params = rows_params([spec], torch.zeros(1, dtype=torch.long))
    memo = {}

    def got(c0, h, n):
        J = torch.zeros([V2] * n, dtype=F64)
        for s_, p in tables[index[c0, h]].items():
            if len(s_) >= n:
                J[s_[:n]] += p
            else:
                J[s_] += p * got(c0, h + s_, n - len(s_))
        return J

    def want(c0, h, n):
        if n == 0:
            return torch.ones((), dtype=F64)
        if (c0, h) not in memo:
            ctx = (c0 + h)[-2:]
            lg = penalty_proc(toy.tgt[ctx][None], None, hist[index[c0, h]][None])
            memo[c0, h] = process_logits(lg, params)[0]
        p = memo[c0, h]
        return torch.stack([p[y] * want(c0, h + (y,), n - 1) for y in range(V2)])

    err = max(float((got(c0, (), M2) - want(c0, (), M2)).abs().max()) for c0 in starts)
    # the penalty really moves the target: compare with the unpenalised joint of one start
    c0 = starts[0]
    plain = target_joint(toy, spec, [c0], M2)[c0]
    moved = float((want(c0, (), M2) - plain).abs().max())
    ell_mass = torch.zeros(G2 + 1, dtype=F64).scatter_add_(0, ell, weight) / len(states)
    return err, moved, ell_mass


PEN_STARTS = [(0, 1), (2, 3), (1, 1)]
PEN_SPS = SPSTable([1, 2, 3], [1.0, 0.65, 0.5])


@pytest.mark.parametrize("name", ["T1", "T0.7_topk3", "greedy"])
def test_enumeration_penalties_equal_penalised_target(name):
    toy = Toy(V2, G2, seed=2, conf_shift=0.5)
    err, moved, ell_mass = discrepancy_penalties(SPECS[name], toy, PEN_STARTS, PEN_SPS)
    assert moved > 0.01 or name == "greedy"  # the penalised target differs from the plain one
    assert err <= EXACT_TOL, err
    assert bool((ell_mass > 0.01).all()) or name == "greedy", ell_mass  # drafts admitted 0..gamma


@pytest.mark.parametrize("control", ["verify_ignores_drafts", "raw_z"])
def test_enumeration_penalties_detect_wrong_wiring(control):
    # NEGATIVE CONTROLS: verify rows penalised for the committed history only (not the drafts before
    # them), or the residual taken from unpenalised draft logits.
    toy = Toy(V2, G2, seed=2, conf_shift=0.5)
    err, _, _ = discrepancy_penalties(SPECS["T1"], toy, PEN_STARTS, PEN_SPS, **{control: True})
    assert err > CONTROL_MIN, (control, err)


class AppendixAToy(Toy):
    """Paper App. A: target (0.7, 0.3) everywhere, draft q = (0.5, 0.5), c1 = 0.8, c2 = 1 if x1 = 0 else 0."""

    def __init__(self):
        self.V, self.G = 2, 2
        self.tgt = torch.log(torch.tensor([0.7, 0.3], dtype=F64)).expand(2, 2, 2).clone()
        self.U = torch.zeros(2, 2, 2, 2, dtype=F64)

    def bias(self, prev):
        return torch.zeros(prev.shape[0], 2, dtype=F64)

    def conf(self, prev):
        return torch.stack([torch.full(prev[:, 0].shape, 0.8, dtype=F64), (prev[:, 1] == 0).to(F64)], 1)


def test_appendix_a_counterexample_is_reproduced():
    # SPS (1, .5, .45): early stop -> ell = 0 always -> first token ~ p = (.7, .3). Without the stop, x1 = 0
    # (prob .5) makes a2 = .8 and drags x1 in (2.6 * .45 > 1); it is accepted surely (p/q = 1.4) -> token 0.
    # x1 = 1 leaves ell = 0 -> p. So P(first = 0) = .5 * 1 + .5 * .7 = .85.
    toy, sps = AppendixAToy(), SPSTable([1, 2, 3], [1.0, 0.5, 0.45])
    for fn, want in ((admit, [0.7, 0.3]), (admit_no_early_stop, [0.85, 0.15])):
        inst, _, res, weight, _ = enumerate_round(toy, torch.zeros(1, 1, 2, dtype=torch.long), [{}], sps, admit_fn=fn)
        first = torch.zeros(2, dtype=F64).scatter_add_(0, res.tokens[:, 0], weight)
        assert torch.allclose(first, torch.tensor(want, dtype=F64), atol=EXACT_TOL, rtol=0), (fn.__name__, first)


def test_enumeration_two_requests_share_one_admission():
    # R = 2 in one batch: row 1's confidences move row 0's admitted length and vice versa. Each request's
    # first emitted token must still follow its own target exactly; the no-early-stop control must not.
    toy = Toy(3, 2, seed=6)
    specs = [dict(temperature=1.0), dict(temperature=0.7, top_k=2)]
    ctxs = torch.tensor([[[0, 1], [2, 2]]])
    sps = SPSTable([2, 3, 4, 5, 6], [1.0, 0.8, 0.62, 0.6, 0.5])
    errs = {}
    for fn in (admit, admit_no_early_stop):
        _, req, res, weight, ell = enumerate_round(toy, ctxs, specs, sps, admit_fn=fn)
        err = 0.0
        for r in range(2):
            sel = req == r
            first = torch.zeros(3, dtype=F64).scatter_add_(0, res.tokens[sel, 0], weight[sel])
            p = process_logits(toy.tgt[tuple(ctxs[0, r].tolist())][None], rows_params([specs[r]], torch.tensor([0])))[0]
            err = max(err, float((first - p).abs().max()))
            if fn is admit:
                lens = torch.zeros(3, dtype=F64).scatter_add_(0, ell[sel], weight[sel])
                assert int((lens > 0.01).sum()) >= 2, lens  # ragged across branches
        errs[fn.__name__] = err
    assert errs["admit"] <= EXACT_TOL, errs
    assert errs["admit_no_early_stop"] > CONTROL_MIN, errs


# --------------------------------------------------------------------------- verify unit vectors


def _onehot_logits(ids, V=6):
    return torch.nn.functional.one_hot(torch.tensor(ids), V).to(F64) * 5.0


def test_markov_draft_chains_on_the_sampled_predecessor():
    toy = Toy(7, 4, seed=8)
    ctx = torch.tensor([[0, 1], [2, 3], [4, 5]])
    for spec in (dict(temperature=1.0, top_k=4), dict(temperature=0.0)):
        params = rows_params([spec], torch.zeros(3, dtype=torch.long))
        block = markov_draft(toy.base_U(ctx), ctx[:, 1], toy.bias, params, TorchSampler(default=make_generator(0)))
        assert torch.equal(block.prev[:, 0], ctx[:, 1]) and torch.equal(block.prev[:, 1:], block.tokens[:, :-1])
        U = toy.base_U(ctx)
        for k in range(4):
            z = U[:, k] + toy.bias(block.tokens[:, k - 1] if k else ctx[:, 1])
            assert torch.allclose(block.z[:, k], z, atol=1e-15, rtol=0)
            q = process_logits(z, params)
            assert torch.allclose(block.q_token[:, k], q.gather(1, block.tokens[:, k:k + 1]).squeeze(1),
                                  atol=1e-15, rtol=0)
            assert bool((block.q_token[:, k] > 0).all())
            if spec["temperature"] == 0:
                assert torch.equal(block.tokens[:, k], z.argmax(-1))
        U2 = toy.base_U(ctx)  # in place: same draft, z written into U's buffer
        block2 = markov_draft(U2, ctx[:, 1], toy.bias, params, TorchSampler(default=make_generator(0)), inplace=True)
        assert block2.z is U2 and torch.equal(block2.tokens, block.tokens) and torch.equal(block2.z, block.z)


def test_layout_and_offsets():
    anchor = torch.tensor([7, 8, 9])
    drafts = torch.tensor([[1, 2, 3], [4, 5, 6], [10, 11, 12]])
    ids, req, step, off = verify_layout(anchor, drafts, torch.tensor([2, 0, 3]))
    assert ids.tolist() == [7, 1, 2, 8, 9, 10, 11, 12]
    assert req.tolist() == [0, 0, 0, 1, 2, 2, 2, 2]
    assert step.tolist() == [0, 1, 2, 0, 0, 1, 2, 3]
    assert off.tolist() == [0, 3, 4] and verify_offsets(torch.tensor([2, 0, 3])).tolist() == [0, 3, 4]
    with pytest.raises(ValueError):
        verify_layout(anchor, drafts, torch.tensor([4, 0, 0]))


def test_greedy_verify_fixtures():
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3], [4, 4, 4]])
    ell = torch.tensor([3, 3, 1, 0])
    target = [[1, 2, 3, 5],  # all match -> bonus 5
              [1, 0, 3, 5],  # mismatch at the 2nd draft -> emit target 0
              [1, 4],  # only one draft admitted: x2 = 2 is never used, bonus = argmax of row 1 (4)
              [2]]  # nothing admitted: plain greedy step
    logits = _onehot_logits([t for row in target for t in row])
    res = verify_greedy(logits, drafts, ell)
    assert res.token_lists() == [[1, 2, 3, 5], [1, 0], [1, 4], [2]]
    assert res.accepted.tolist() == [3, 1, 1, 0] and res.admitted.tolist() == [3, 3, 1, 0]
    assert res.drafted.tolist() == [3, 3, 3, 3]
    assert res.last_tokens().tolist() == [5, 0, 4, 2]  # next anchors
    # rows kept as context: x0..x_acc of each request (offsets 0, 4, 8, 10)
    assert res.committed_rows().tolist() == [0, 1, 2, 3, 4, 5, 8, 9, 10]
    assert commit_stats([res, res]) == {"drafted": 24, "admitted": 14, "accepted": 10, "committed": 18, "rounds": 8}
    # the general path with T = 0 rows (one-hot p and q) gives the same tokens
    params = SamplingParams.make(4, temperature=0.0)
    block = DraftBlock(drafts, torch.zeros_like(drafts), torch.ones(4, 3, dtype=F64), torch.zeros(4, 3, 6, dtype=F64))
    assert verify(logits, block, ell, params, ScriptSampler()).token_lists() == res.token_lists()


def test_stop_tokens_and_token_budget_truncate_the_accepted_run():
    drafts = torch.tensor([[1, 9, 3], [1, 2, 3], [9, 2, 3]])
    ell = torch.tensor([3, 3, 3])
    logits = _onehot_logits([1, 9, 3, 5, 1, 2, 3, 9, 9, 2, 3, 4], V=10)
    res = verify_greedy(logits, drafts, ell, stop_ids=torch.tensor([9, 7]))
    # row 0 stops at the accepted draft 9 (nothing after it); row 1 stops at the bonus 9; row 2 at once
    assert res.token_lists() == [[1, 9], [1, 2, 3, 9], [9]]
    assert res.stopped.tolist() == [True, True, True]
    assert res.accepted.tolist() == [3, 3, 3]  # verification stats are kept
    res = verify_greedy(logits, drafts, ell, stop_ids=torch.tensor([[9], [-1], [2]]),
                        max_tokens=torch.tensor([5, 2, 1]))
    assert res.token_lists() == [[1, 9], [1, 2], [9]]
    assert res.stopped.tolist() == [True, False, False]


def test_seeded_requests_consume_a_fixed_number_of_draws():
    # A seeded request draws G uniforms while drafting and G + 1 while verifying, whatever ell is, so its
    # stream never shifts with the batch's admission; identical inputs and seeds give identical output.
    toy = Toy(6, 3, seed=4)
    ctx = torch.tensor([[0, 1], [2, 3]])
    params = SamplingParams.make(2, temperature=[1.0, 0.9])

    def run(ell):
        sampler = TorchSampler([make_generator(1), make_generator(2)])
        block = markov_draft(toy.base_U(ctx), ctx[:, 1], toy.bias, params, sampler)
        res = verify(toy.target_logits(ctx, block.tokens, ell), block, ell, params, sampler)
        return block.tokens, res.token_lists(), [float(torch.rand(1, generator=g)) for g in sampler.generators]

    a, b = run(torch.tensor([3, 0])), run(torch.tensor([3, 0]))
    assert torch.equal(a[0], b[0]) and a[1] == b[1]
    for ell in ([0, 0], [1, 3], [2, 2]):
        c = run(torch.tensor(ell))
        assert torch.equal(c[0], a[0]) and c[2] == a[2]  # same drafts, same generator position


def test_mixed_greedy_and_sampled_rows_in_one_batch():
    toy = Toy(6, 3, seed=3)
    R = 6
    ctx = torch.tensor([[0, 1], [2, 3], [4, 5], [1, 0], [3, 3], [5, 2]])
    params = SamplingParams.make(R, temperature=[0.0, 1.0, 0.0, 0.8, 0.0, 1.0], top_k=[0, 0, 0, 3, 0, 0])
    greedy_rows = torch.tensor([0, 2, 4])
    sampler = TorchSampler(default=make_generator(0))
    for _ in range(5):
        block = markov_draft(toy.base_U(ctx), ctx[:, 1], toy.bias, params, sampler)
        ell = admit(toy.conf(block.prev), SPSTable(list(range(6, 25)), [1.0] * 19))
        logits = toy.target_logits(ctx, block.tokens, ell)
        res = verify(logits, block, ell, params, sampler)
        # greedy rows drafted argmax and committed exactly what the all-greedy path commits
        gp = params.select(greedy_rows)
        gblock = markov_draft(toy.base_U(ctx[greedy_rows]), ctx[greedy_rows, 1], toy.bias, gp, ScriptSampler())
        assert torch.equal(gblock.tokens, block.tokens[greedy_rows])
        glog = toy.target_logits(ctx[greedy_rows], gblock.tokens, ell[greedy_rows])
        gres = verify(glog, gblock, ell[greedy_rows], gp, ScriptSampler())
        assert [res.token_lists()[i] for i in greedy_rows.tolist()] == gres.token_lists()
        ctx = torch.stack([torch.randint(0, 6, (R,)), res.tokens[torch.arange(R), res.num_tokens - 1]], 1)


# --------------------------------------------------------------------------- Monte Carlo


MC_SPECS = [dict(temperature=1.0), dict(temperature=0.7, top_k=3), dict(temperature=1.0, top_p=0.8),
            dict(temperature=1.3)]
MC_CTX = torch.tensor([[0, 1], [2, 3], [4, 5], [1, 0]])
# steps/s for B = 4..16 tokens; with this toy the early-stop walk admits 0..3 drafts per request
MC_SPS = SPSTable(list(range(4, 17)), [1.0, 0.9, 0.9, 0.855, 0.855, 0.81, 0.77, 0.77, 0.77, 0.69, 0.66, 0.66, 0.66])


def run_rounds(toy, admit_fn, n, seed, rounds=2):
    """n independent batches of the 4 requests, two rounds each, through the production layout:
    one markov_draft / admit / verify call per round for all n*4 rows. Returns the first two emitted
    tokens per row [n, 4] each (the second is -1 where one round emitted one token and rounds = 1)
    and the first round's ell."""
    R, G = MC_CTX.shape[0], toy.G
    ctx = MC_CTX.repeat(n, 1)
    params = rows_params(MC_SPECS, torch.arange(R).repeat(n))
    sampler = TorchSampler(default=make_generator(seed))
    rows = torch.arange(n * R)
    for rnd in range(rounds):
        block = markov_draft(toy.base_U(ctx), ctx[:, 1], toy.bias, params, sampler)
        ell = admit_fn(toy.conf(block.prev).view(n, R, G), MC_SPS).reshape(-1)
        res = verify(toy.target_logits(ctx, block.tokens, ell), block, ell, params, sampler)
        if rnd == 0:
            first, second, ell0 = res.tokens[:, 0].clone(), res.tokens[:, 1].clone(), ell
        else:
            second = torch.where(second < 0, res.tokens[:, 0], second)
        seq = torch.cat([ctx, res.tokens], 1)
        ctx = torch.stack([seq[rows, res.num_tokens], seq[rows, res.num_tokens + 1]], 1)
    return first.view(n, R), second.view(n, R), ell0.view(n, R)


def tv_and_bound(samples, p):
    """TV of the empirical law of `samples` vs p, and a bound it exceeds with probability < exp(-18):
    E[TV] <= 0.5 * sum sqrt(p (1 - p) / N) (Jensen) and TV moves by <= 1/N per sample (McDiarmid)."""
    N = samples.numel()
    freq = torch.bincount(samples, minlength=p.numel()).to(F64) / N
    tv = 0.5 * float((freq - p).abs().sum())
    return tv, 0.5 * float(torch.sqrt(p * (1 - p) / N).sum()) + 3 / math.sqrt(N)


def test_monte_carlo_batch4_ragged_matches_target():
    toy, n = Toy(6, 3, seed=2), 50_000  # 200k request-rounds per run; >= 200k emitted tokens per round
    V = toy.V
    exact1, exact2 = [], []
    for r in range(4):
        c = tuple(MC_CTX[r].tolist())
        one = rows_params([MC_SPECS[r]], torch.zeros(V, dtype=torch.long))
        p1 = process_logits(toy.tgt[c][None], rows_params([MC_SPECS[r]], torch.tensor([0])))[0]
        exact1.append(p1)
        exact2.append((p1[:, None] * process_logits(toy.tgt[c[1]], one)).reshape(-1))  # p(y1) p(y2 | c1, y1)
    worst_control = 0.0
    for fn in (admit, admit_no_early_stop):
        # the control's bias already shows in the first token (one round keeps the test fast)
        first, second, ell = run_rounds(toy, fn, n, seed=0, rounds=2 if fn is admit else 1)
        for r in range(4):
            tv1, b1 = tv_and_bound(first[:, r], exact1[r])
            if fn is admit:
                tv2, b2 = tv_and_bound(first[:, r] * V + second[:, r], exact2[r])
                assert tv1 < b1 and tv2 < b2, (r, tv1, b1, tv2, b2)
            else:
                worst_control = max(worst_control, tv1 / b1)
        if fn is admit:  # ragged: several lengths occur, and within one batch the lengths differ
            counts = torch.bincount(ell.reshape(-1), minlength=4)
            assert int((counts > n // 50).sum()) >= 3, counts
            assert float((ell.max(1).values != ell.min(1).values).double().mean()) > 0.3
    assert worst_control > 1.0, worst_control  # the no-early-stop control fails the same bound
