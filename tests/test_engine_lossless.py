"""Lossless through the whole engine at T > 0: DSpark on (confidence + admit with online
calibration and stepping aside active), batch 8 with ragged prompts, lengths and sampling settings,
against the exact target distribution, with the test's power shown by mutated wiring.

Model: the golden tiny architecture with a 16-token vocabulary and random weights (seeded), the
target head and the Markov head scaled up so distributions are peaked and the Markov correction
matters, and the confidence head made to depend strongly on the predecessor token (so feeding it the
wrong tokens changes admission). Exact numerics make a row's logits independent of its batch, so
the exact joint of the first tokens comes from one batched forward over every prefix.

Statistic: per prompt, the total-variation distance between the empirical law of (x1, x2) (256
cells) and of x3 (16 cells) and their exact laws; the bound is E[TV] <= 0.5 sum sqrt(p (1 - p) / N)
plus 3 / sqrt(N) (McDiarmid: exceeded by chance with probability < exp(-18)), as in
tests/test_dspark_lossless.py. Each mutation must exceed its bound on some statistic.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from v4flash_backend import ops
from v4flash_backend.config import ModelConfig
from v4flash_backend.engine import dspark_accept as acc
from v4flash_backend.engine.dspark_sched import SPSTable
from v4flash_backend.engine.engine import Engine
from v4flash_backend.engine.runner import LocalRunner
from v4flash_backend.engine.sampling import SamplingParams, process_logits
from v4flash_backend.engine.step_cost import StepCost
from v4flash_backend.model.state import ModelState, make_segments
from v4flash_backend.model.transformer import V41Model
from v4flash_backend.request import GenerateRequest
from v4flash_backend.settings import Settings
from v4flash_backend.training.params import export_tensors, inference_weights, init_masters

pytestmark = pytest.mark.slow

V = 16
N = 300  # requests per prompt (2 prompts): 600 engine requests per run, ~1 min on 2 cores
PROMPTS = [  # ragged: lengths, max_tokens and sampling settings differ
    dict(prompt=[0, 3, 7, 4, 9], max_tokens=3, temperature=1.0),
    dict(prompt=[0, 5, 5, 8, 2, 11, 6, 3, 12], max_tokens=4, temperature=0.8, top_k=6),
]


@pytest.fixture(scope="module")
def model(golden_dir):
    ops.set_numerics("exact")
    cfg = ModelConfig.from_json(golden_dir / "config.json")
    cfg = dataclasses.replace(cfg, vocab_size=V, dspark_noise_token_id=V - 1, image_token_id=V - 2,
                              engram_layer_ids=(), engram_num_embeddings=())
    masters = init_masters(cfg, seed=11)
    g = torch.Generator().manual_seed(12)
    with torch.no_grad():
        masters["head.weight"] *= 6.0
        last = f"mtp.{cfg.n_mtp_layers - 1}"
        emb = masters[f"{last}.markov_head.embed.weight"]
        # the Markov head (zero at init) adds a bias of about +-2 per token: drafts differ from the
        # target (acceptance well below 1, large residual and bonus terms) and q depends on prev
        w2 = masters[f"{last}.markov_head.head.weight"]
        w2.copy_(torch.randn(w2.shape, generator=g))
        w2 *= 2.0 / float((emb @ w2.T).std())
        # the confidence head (zero at init) reads only the predecessor's Markov embedding, with
        # logits spread about +-3 over the vocabulary: c_k then swings with the token it is fed
        w = torch.randn(emb.shape[1], generator=g)
        w *= 3.0 / float((emb @ w).std())
        proj = masters[f"{last}.confidence_head.proj.weight"]
        proj.zero_()
        proj[0, cfg.dim:] = w
    return V41Model(cfg, inference_weights(cfg, export_tensors(cfg, masters)), None, None)


def params_of(spec, n=1):
    return SamplingParams.make(n, [spec.get("temperature", 1.0)] * n, [spec.get("top_k", 0)] * n,
                               [spec.get("top_p", 1.0)] * n)


def exact_laws(model, spec):
    """(joint of x1, x2 [V*V], law of x3 [V]) under the spec's sampling, from one forward."""
    prompt = spec["prompt"]
    prefixes = [[]] + [[a] for a in range(V)] + [[a, b] for a in range(V) for b in range(V)]
    state = ModelState(model.cfg, len(prefixes), len(prompt) + 4)
    toks, segs, rows, off = [], [], [], 0
    for slot, pre in enumerate(prefixes):
        seq = prompt + pre
        toks += seq
        segs.append((slot, 0, len(seq)))
        off += len(seq)
        rows.append(off - 1)
    out = model.forward(state, torch.tensor(toks), make_segments(segs), torch.tensor(rows))
    p = process_logits(out.logits.double(), params_of(spec, len(prefixes)))
    p1, p2, p3 = p[0], p[1:1 + V], p[1 + V:].view(V, V, V)
    joint12 = p1[:, None] * p2
    law3 = (joint12[..., None] * p3).sum((0, 1))
    return joint12.reshape(-1), law3


def engine_samples(model, seed: int, mutate=None):
    eng = Engine(LocalRunner(model, 9, 24), Settings(max_num_seqs=8, max_model_len=20, spec_mode="dspark",
                                                    probe_every=4, dspark_adaptive=True))
    eng.calib.refit_every = 64
    # a step cost under which admit's choices depend on the confidences (flat-ish, no draft cost)
    eng.cost = StepCost(SPSTable(list(range(1, 65)), [1.0 / (1 + 0.04 * b) for b in range(1, 65)]), {1: 1e-4})
    if mutate is not None:
        mutate(eng)
    outs = []
    todo = [(i, k) for i in range(N) for k in range(len(PROMPTS))][::-1]
    while todo or eng.has_work():  # a few waiting at a time: the queue stays short (no timeouts, no refusals)
        while todo and len(eng.waiting) < 8:
            i, k = todo.pop()
            toks = []
            outs.append((k, toks))
            eng.submit(GenerateRequest(seed=seed + 2 * i + k, ignore_eos=True,
                                       callback=lambda e, t=toks: t.extend(e.token_ids), **PROMPTS[k]))
        eng.step()
    st = eng.stats()
    return outs, st


def tv_bound(samples: torch.Tensor, p: torch.Tensor):
    n = samples.numel()
    freq = torch.bincount(samples, minlength=p.numel()).double() / n
    return 0.5 * float((freq - p).abs().sum()), 0.5 * float(torch.sqrt(p * (1 - p) / n).sum()) + 3 / math.sqrt(n)


def statistics_of(model, outs):
    res = []
    for k, spec in enumerate(PROMPTS):
        j12, l3 = exact_laws(model, spec)
        rows = [t for kk, t in outs if kk == k]
        if not all(len(t) == spec["max_tokens"] for t in rows):  # a request cut short or failed
            res.append((float("inf"), 1.0))
            continue
        x = torch.tensor([t[:3] for t in rows])
        res.append(tv_bound(x[:, 0] * V + x[:, 1], j12))
        res.append(tv_bound(x[:, 2], l3))
    return res


# ---- the mutations: each is one wrong wire in the engine's DSpark round ----------------------------
def conf_on_drafts(eng):  # the confidence head reads x_k instead of its predecessor x_{k-1}
    d = eng.runner.drafter
    eng._confidence_logits = lambda out, block: d.confidence(out.hidden, d.markov(block.tokens)[1])


def _wrap_draft(eng, change):
    real = acc.markov_draft

    def draft(U, anchor, bias_fn, params, sampler, **kw):
        block = real(U, anchor, bias_fn, params, sampler, **kw)
        return change(block, U, params)

    eng._mutation = ("markov_draft", real)
    acc.markov_draft = draft


def q_from_base(eng):  # q recorded from the stage's base logits, not the Markov-corrected ones
    def change(block, U, params):
        R, G = block.tokens.shape
        q = process_logits(U.reshape(R * G, -1).float(), params.repeat_interleave(torch.full((R,), G)))
        q_tok = q.view(R, G, -1).gather(2, block.tokens.unsqueeze(-1)).squeeze(-1)
        return acc.DraftBlock(block.tokens, block.prev, q_tok.to(block.q_token.dtype), U.float())
    _wrap_draft(eng, change)


def q_rows_misordered(eng):  # draft k is verified against the q of draft k + 1 (rows shifted in the block)
    def change(block, U, params):
        return acc.DraftBlock(block.tokens, block.prev, block.q_token.roll(-1, 1), block.z.roll(-1, 1))
    _wrap_draft(eng, change)


def bonus_from_unadmitted(eng):  # after a fully accepted run, the bonus is the next (unverified) draft
    real = acc.verify

    def verify(target_logits, block, ell, params, sampler=None, stop_ids=None, max_tokens=None, **kw):
        res = real(target_logits, block, ell, params, sampler, stop_ids, max_tokens, **kw)
        G = block.tokens.shape[1]
        for r in range(len(ell)):
            a, e = int(res.accepted[r]), int(ell[r])
            if a == e and 0 < e < G and int(res.num_tokens[r]) == e + 1:
                res.tokens[r, e] = block.tokens[r, e]
        return res

    eng._mutation = ("verify", real)
    acc.verify = verify


@pytest.fixture(autouse=True)
def _restore_acc():
    real_draft, real_verify = acc.markov_draft, acc.verify
    yield
    acc.markov_draft, acc.verify = real_draft, real_verify


def test_engine_dspark_sampling_equals_the_target_distribution(model):
    outs, st = engine_samples(model, seed=0)
    # the run exercised what it claims to: drafts admitted at several lengths, some accepted,
    # stepping aside decided per step, online calibration refitted
    assert st["admitted"] > 0.5 * st["verify_rows"] and 0.1 < st["accepted"] / st["admitted"] < 0.95
    assert sum(st["calibration_refits"].values()) >= 1
    for tv, bound in statistics_of(model, outs):
        assert tv < bound, (tv, bound)


# Power, measured at N = 300 (max TV / bound over the four statistics): q_from_base 1.43, bonus_from_unadmitted
# 2.75 -- both fail the test. conf_on_drafts (0.14) and q_rows_misordered (0.28) stay below the bound at this
# sample size: online calibration flattens the confidences (the head is weakly informative), so admission
# barely depends on the token it is fed, and with ~1 draft admitted per row a shifted q row rarely meets a
# verified draft. Those two wires are held by tests/test_calibration.py (the head reads the predecessors)
# and by the exact enumeration in tests/test_dspark_lossless.py. Tried and dropped (issue 14): a head with
# logits +-30 by token (binary admission) plus the law of x2 alone as a fifth statistic measured 0.28
# (conf_on_drafts) and 0.22 (q_rows_misordered): admission became rare (0.05-0.32 drafts per verify row),
# so neither mutation met a verified draft often enough; the pass run also broke the "admitted > 0.5 per
# row" check. The power these two need is admission that stays frequent yet hinges on the token fed.
@pytest.mark.parametrize("mutation", [q_from_base, bonus_from_unadmitted], ids=lambda f: f.__name__)
def test_each_wiring_mistake_fails_the_statistic(model, mutation):
    outs, _ = engine_samples(model, seed=0, mutate=mutation)
    ratios = [tv / bound for tv, bound in statistics_of(model, outs)]
    assert max(ratios) > 1.0, ratios
