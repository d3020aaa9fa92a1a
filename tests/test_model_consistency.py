"""Decode with caches, chunked prefill, batching and speculative rollback all compute the same
logits as one full prefill of the sequence. Under 'exact' numerics (fp64 accumulation, ties by
lowest index) every row's result is independent of the step it runs in, so equality is bit for
bit; the golden tiny model's window (16) and compressed groups (ratio 2 and 1) are all crossed."""

import torch

from v4flash_backend.model.state import ModelState, make_segments


def _seq(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(3, 1000, (n,), generator=g)
    s[0] = 0
    return s


def _full(model, seq):
    st = ModelState(model.cfg, 1, 128)
    return model.forward(st, seq, make_segments([(0, 0, len(seq))]), logits_rows="all").logits


def test_decode_equals_prefill_recompute(tiny_model):
    m, seq, P = tiny_model, _seq(61), 19  # 19 and 60 are odd: partial ratio-2 groups on both ends
    full = _full(m, seq)
    st = ModelState(m.cfg, 1, 128)
    outs = [m.forward(st, seq[:P], make_segments([(0, 0, P)])).logits[0]]
    for t in range(P, len(seq) - 1):
        outs.append(m.forward(st, seq[t:t + 1], make_segments([(0, t, 1)])).logits[0])
    assert torch.equal(torch.stack(outs), full[P - 1:len(seq) - 1])


def test_chunked_prefill_equals_one_shot(tiny_model):
    m, seq = tiny_model, _seq(57, seed=1)
    full = _full(m, seq)
    st = ModelState(m.cfg, 1, 128)
    bounds = [0, 5, 6, 22, 23, 40, 57]
    outs = [m.forward(st, seq[a:b], make_segments([(0, a, b - a)]), logits_rows="all").logits
            for a, b in zip(bounds, bounds[1:])]
    assert torch.equal(torch.cat(outs), full)


def test_batched_segments_equal_separate_runs(tiny_model):
    m = tiny_model
    a, b = _seq(33, 2), _seq(20, 3)
    st = ModelState(m.cfg, 3, 128)
    out = m.forward(st, torch.cat([a, b]), make_segments([(2, 0, 33), (0, 0, 20)]), logits_rows="all").logits
    assert torch.equal(out[:33], _full(m, a)) and torch.equal(out[33:], _full(m, b))
    # then one decode step of each, batched, in the other order
    nxt = torch.tensor([7, 9])
    step = m.forward(st, nxt, make_segments([(0, 20, 1), (2, 33, 1)])).logits
    assert torch.equal(step[0], _full(m, torch.cat([b, nxt[:1]]))[-1])
    assert torch.equal(step[1], _full(m, torch.cat([a, nxt[1:]]))[-1])


def test_rejected_draft_rows_leave_no_trace(tiny_model):
    """A verify chunk writes rows for drafts that may be rejected; continuing from the accepted
    prefix must equal never having seen them (the rings are sized window + max draft)."""
    m, seq, P = tiny_model, _seq(45, 4), 30
    st = ModelState(m.cfg, 1, 128)
    m.forward(st, seq[:P], make_segments([(0, 0, P)]))
    drafts = torch.tensor([seq[P].item(), 11, 12, 13, 14, 15])  # 1 accepted + 5 rejected rows
    m.forward(st, drafts, make_segments([(0, P, 6)]), logits_rows="all")
    got = m.forward(st, seq[P + 1:], make_segments([(0, P + 1, len(seq) - P - 1)]), logits_rows="all").logits
    assert torch.equal(got, _full(m, seq)[P + 1:])


def test_state_bounds_are_enforced(tiny_model):
    st = ModelState(tiny_model.cfg, 1, 16)
    try:
        tiny_model.forward(st, _seq(20), make_segments([(0, 0, 20)]))
    except ValueError as e:
        assert "max_len" in str(e)
    else:
        raise AssertionError("a sequence longer than the state must be refused")


def test_batched_experts_equal_the_routed_loop(tiny_model, monkeypatch):
    """The eager forward's two batched MoE forms -- every local expert on every row with routing
    weight 0 where not routed (dense), and each expert on its own routed rows padded to the busiest
    expert's count (grouped) -- give bit-identical logits to running only the routed experts one
    expert at a time; a prompt (40 rows) and a single-row step both."""
    from v4flash_backend.model import ffn as model_ffn

    seq = _seq(40, 7)
    outs = {}
    for form, batched_max, dense_min in (("loop", 0, 0), ("dense", 10**9, 10**9), ("grouped", 10**9, 0)):
        monkeypatch.setattr(model_ffn, "BATCHED_MOE_MAX", batched_max)
        monkeypatch.setattr(model_ffn, "DENSE_MOE_MIN", dense_min)
        st = ModelState(tiny_model.cfg, 1, 64)
        full = tiny_model.forward(st, seq[:-1], make_segments([(0, 0, 39)]), logits_rows="all").logits
        step = tiny_model.forward(st, seq[-1:], make_segments([(0, 39, 1)]), logits_rows="all").logits
        outs[form] = (full, step)
    for form in ("dense", "grouped"):
        assert torch.equal(outs[form][0], outs["loop"][0]), form
        assert torch.equal(outs[form][1], outs["loop"][1]), form


def test_routed_experts_form_equals_the_routed_loop(tiny_model, monkeypatch):
    """moe form 'all' with fewer (row, expert) pairs than local experts runs only the routed experts
    on their gathered weights (ffn._routed_experts): bit-identical to the per-expert loop, for 1 and 2
    rows, with every expert local and with half of them on another rank (picks of those weigh 0)."""
    from v4flash_backend.model import ffn as model_ffn
    from v4flash_backend.model.weights import Weights

    cfg, comm = tiny_model.cfg, tiny_model.comm
    n_act, E = cfg.n_activated_experts, cfg.n_routed_experts
    g = torch.Generator().manual_seed(3)
    half = Weights({k: v for k, v in tiny_model.W.items()
                    if ".ffn.experts." not in k or int(k.split(".ffn.experts.")[1].split(".")[0]) < E // 2})
    calls = []
    real = model_ffn._routed_experts
    monkeypatch.setattr(model_ffn, "_routed_experts", lambda *a: calls.append(1) or real(*a))
    for W in (tiny_model.W, half):
        for T in (1, 2):
            assert T * n_act < len(model_ffn.local_experts(W, "layers.1.ffn")) or W is half
            x = (torch.randn(T, cfg.dim, generator=g) * 3).to(torch.bfloat16)
            monkeypatch.setattr(model_ffn, "BATCHED_MOE_MAX", 0)  # form None: the loop over routed experts
            want = model_ffn.moe(W, cfg, "layers.1", n_act, x, comm)
            monkeypatch.setattr(model_ffn, "BATCHED_MOE_MAX", 1024)
            n = len(calls)
            got = model_ffn.moe(W, cfg, "layers.1", n_act, x, comm, form="all")
            assert len(calls) == n + (T * n_act < len(model_ffn.local_experts(W, "layers.1.ffn")))
            assert torch.equal(got, want), (T, W is half)
    assert len(calls) >= 3
