"""The static rounds' sampling, acceptance and stop-mask forms against independent expectations.

The eager path and the static graphs share one implementation (sampling.process_logits_static,
dspark_accept._draft / _verify, logit_proc), so a test comparing the two paths cannot see a mistake in
it; these check the graphs' entry points (markov_draft_static, verify_static, a StaticRunner engine)
against values worked out by hand or taken from a run without the feature, as tests/test_sampling.py
and tests/test_engine_sampling_options.py do for the eager adapters.
"""

from __future__ import annotations

import math

import pytest
import torch

from v4flash_backend.engine import dspark_accept as acc
from v4flash_backend.engine.dspark_sched import SPSTable
from v4flash_backend.engine.engine import Engine
from v4flash_backend.engine.step_cost import StepCost
from v4flash_backend.request import GenerateRequest
from v4flash_backend.settings import Settings
from v4flash_backend.trn2.launch import NeuronSettings

# sorted: .5 (id 1), .2 (id 3), .15 (id 2), .1 (id 0), .05 (id 4); top_p = .8 keeps {1, 3, 2} (mass .85,
from v4flash_backend.trn2.static_runner import StaticRunner

# the shortest prefix reaching .8). Renormalised, the inverse CDF in id order is
# id 1: [0, .588), id 2: [.588, .765), id 3: [.765, 1); ids 0 and 4 have no mass.
P = [0.1, 0.5, 0.15, 0.2, 0.05]
# (uniform, token drawn) pairs; .7 lands on id 2, the last token of the kept prefix, so a cut one
# token early (an inclusive cumulative mass) draws id 3 instead, and a cut one late (id 0 kept,
# the CDF in id order starts with it: id 0 [0, .105)) moves .05 off id 1
DRAWS = [(0.05, 1), (0.5, 1), (0.7, 2), (0.9, 3)]


def _bucket(n: int):
    logits = torch.tensor([math.log(p) for p in P], dtype=torch.float64).expand(n, -1).contiguous()
    T = torch.ones(n, dtype=torch.float64)
    return logits, T, torch.zeros(n, dtype=torch.long), torch.full((n,), 0.8, dtype=torch.float64)


def test_static_draft_and_verify_draw_from_the_top_p_prefix():
    """verify_static's final draw (plain decode: G = 0) and markov_draft_static's draft draw both
    take the inverse CDF of the top-p filtered distribution; exact fp64 values, no tolerance needed
    (the uniforms sit at least .03 from a CDF boundary)."""
    S = len(DRAWS)
    u = torch.tensor([d[0] for d in DRAWS], dtype=torch.float64)
    want = [d[1] for d in DRAWS]
    logits, T, K, Pp = _bucket(S)
    res = acc.verify_static(logits[:, None], torch.zeros(S, 0, dtype=torch.long), torch.ones(S, 0),
                            torch.zeros(S, 0, 5), torch.zeros(S, dtype=torch.long), T, K, Pp,
                            torch.zeros(S, 0, dtype=torch.float64), u, torch.full((S, 1), -1), torch.full((S,), 9))
    assert res.tokens[:, 0].tolist() == want and res.num_tokens.tolist() == [1] * S
    blk = acc.markov_draft_static(logits[:, None], torch.zeros(S, dtype=torch.long),
                                  lambda prev: torch.zeros(S, 5, dtype=torch.float64), T, K, Pp, u[:, None])
    assert blk.tokens[:, 0].tolist() == want
    kept = {1: 0.5, 2: 0.15, 3: 0.2}
    assert torch.allclose(blk.q_token[:, 0], torch.tensor([kept[t] / 0.85 for t in want], dtype=torch.float64),
                          atol=1e-12, rtol=0)  # fp64 softmax of log-probs: rounding only


@pytest.mark.slow
def test_static_round_min_tokens_boundary_is_exact(tiny_model):
    """min_tokens in the static rounds' processed variant (greedy, DSpark): the stop id first appears
    at output position k of the free run; min_tokens = k lets it be generated there, min_tokens = k + 1
    masks position k. An off-by-one in the positions given to the mask (verify rows or draft slots)
    fails one side. Every decode step must be a static round (not an eager fallback)."""
    def run(**kw):
        eng = Engine(StaticRunner(tiny_model, 2, 64, settings=NeuronSettings(backend="none")),
                     Settings(max_num_seqs=1, max_model_len=64, spec_mode="dspark"))
        eng.cost = StepCost(SPSTable([1, 2, 4, 8, 16], [10.0, 9.8, 9.5, 9.0, 8.0]))
        ev = eng.run_request(GenerateRequest(prompt=[0, 17, 250, 33, 901, 4, 77, 12], max_tokens=20,
                                             ignore_eos=True, **kw))
        st = eng.stats()
        assert st["static_steps"] == st["decode_steps"] > 0 and st["static_fallback_steps"] == 0
        return [t for e in ev for t in e.token_ids], ev

    free, _ = run()
    k = next(j for j in range(3, 20) if free[j] not in free[:j])
    out, ev = run(min_tokens=k, stop_token_ids=(free[k],))
    assert out == free[:k + 1] and ev[-1].finish_reason == "stop"
    out, _ = run(min_tokens=k + 1, stop_token_ids=(free[k],))
    assert out[:k] == free[:k] and out[k] != free[k]
