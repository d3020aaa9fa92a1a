"""The continuous-batching engine on the golden tiny checkpoint (exact numerics: a request's
greedy output does not depend on what it is batched with, so 'equals the request run alone' is
checked bit for bit)."""

import threading

import pytest
import torch

from v4flash_backend.engine.engine import Engine
from v4flash_backend.engine.runner import LocalRunner
from v4flash_backend.request import GenerateRequest, RequestError
from v4flash_backend.settings import Settings


def _engine(model, mode="dspark", seqs=4, max_len=160, **kw):
    return Engine(LocalRunner(model, seqs + 1, max_len), Settings(max_num_seqs=seqs, max_model_len=max_len,
                                                                        spec_mode=mode, prefill_chunk=24, **kw))


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(3, 1000, (n - 1,), generator=g).tolist()


def _collect(eng, reqs):
    events = {r.id: [] for r in reqs}
    for r in reqs:
        r.callback = events[r.id].append
        eng.submit(r)
    for _ in range(2000):
        if all(ev and ev[-1].final for ev in events.values()):
            break
        eng.step()
    return events


def _alone(model, r):
    eng = _engine(model, mode="off", seqs=1)
    ev = eng.run_request(GenerateRequest(prompt=r.prompt, max_tokens=r.max_tokens, ignore_eos=r.ignore_eos,
                              stop_token_ids=r.stop_token_ids))
    return [t for e in ev for t in e.token_ids]


@pytest.mark.parametrize("mode", ["dspark", "fixed", "off"])
def test_concurrent_requests_equal_alone_and_free_slots(tiny_model, mode):
    eng = _engine(tiny_model, mode)
    specs = [(5, 9), (40, 3), (17, 12), (1, 6), (63, 8), (9, 1), (30, 10), (12, 7), (25, 5)]
    reqs = [GenerateRequest(prompt=_prompt(n, i), max_tokens=k, ignore_eos=True) for i, (n, k) in enumerate(specs)]
    events = _collect(eng, reqs)
    for r in reqs:
        ev = events[r.id]
        assert sum(e.final for e in ev) == 1 and ev[-1].finish_reason == "length"
        out = [t for e in ev for t in e.token_ids]
        assert len(out) == r.max_tokens
        assert out == _alone(tiny_model, r), (mode, len(r.prompt))
        # context_ids: the last <= 8 committed ids before each chunk
        seq = list(r.prompt)
        for e in ev:
            assert e.context_ids == seq[-8:]
            seq += e.token_ids
    st = eng.stats()
    assert st["slots_in_use"] == 0 and st["running"] == 0 and st["waiting"] == 0 and sorted(eng.free) == [0, 1, 2, 3]
    if mode != "off":
        assert st["drafted"] > 0 and st["admitted"] > 0


def test_cancel_frees_slot_within_one_step(tiny_model):
    eng = _engine(tiny_model, seqs=2)
    a = GenerateRequest(prompt=_prompt(10, 1), max_tokens=100, ignore_eos=True)
    b = GenerateRequest(prompt=_prompt(10, 2), max_tokens=100, ignore_eos=True)
    c = GenerateRequest(prompt=_prompt(10, 3), max_tokens=3, ignore_eos=True)
    got = {r.id: [] for r in (a, b, c)}
    for r in (a, b, c):
        r.callback = got[r.id].append
        eng.submit(r)
    for _ in range(3):
        eng.step()
    assert eng.stats()["slots_in_use"] == 2 and eng.stats()["waiting"] == 1
    eng.cancel(a.id)
    eng.cancel(c.id)  # still queued
    eng.step()
    assert got[a.id][-1].finish_reason == "cancelled" and got[c.id][-1].finish_reason == "cancelled"
    assert eng.stats()["slots_in_use"] == 1
    eng.cancel(b.id)
    eng.step()
    assert eng.stats()["slots_in_use"] == 0 and got[b.id][-1].finish_reason == "cancelled"


def test_stop_tokens_and_eos(tiny_model):
    r = GenerateRequest(prompt=_prompt(20, 5), max_tokens=12, ignore_eos=True)
    full = _alone(tiny_model, r)
    stop = full[4]
    cut = full[: full.index(stop) + 1]
    eng = _engine(tiny_model)
    ev = eng.run_request(GenerateRequest(prompt=r.prompt, max_tokens=12, stop_token_ids=(stop,)))
    assert [t for e in ev for t in e.token_ids] == cut and ev[-1].finish_reason == "stop"


@pytest.mark.parametrize("kw,msg", [
    (dict(prompt=[]), "empty prompt"),
    (dict(prompt=[0] * 200), "max_model_len"),
    (dict(prompt=[0, 5000]), "outside the vocabulary"),
    (dict(prompt=[0, 5], max_tokens=0), "max_tokens"),
    (dict(prompt=[0, 5], temperature=-1.0), "temperature"),
    (dict(prompt=[0, 5], top_p=0.0), "top_p"),
    (dict(prompt=[0, 5], top_p=1.5), "top_p"),
    (dict(prompt=[0, 5], top_k=-2), "top_k"),
    (dict(prompt=[0, 5], stop_token_ids=(-3,)), "stop token"),
    # checks the engine shares with the Triton side (engine.validation), once only the Triton side's
    (dict(prompt=[0, 5], frequency_penalty=2.5), r"frequency_penalty must be in \[-2, 2\]"),
    (dict(prompt=[0, 5], seed=2**64), r"seed must be in \[0, 2\*\*64\)"),
    (dict(prompt=[0, 5], temperature=float("inf")), "temperature must be >= 0"),
    (dict(prompt=[0, 5], stop=("x" * 300,)), "stop: at most"),
])
def test_bad_requests_get_clear_errors(tiny_model, kw, msg):
    eng = _engine(tiny_model)
    with pytest.raises(RequestError, match=msg) as e:
        eng.submit(GenerateRequest(**kw))
    assert e.value.code == "INVALID_ARG" and eng.stats()["waiting"] == 0


def test_queue_timeout_is_an_error_not_a_hang(tiny_model):
    eng = _engine(tiny_model, seqs=1, queue_timeout_s=0.0)
    got = []
    eng.submit(GenerateRequest(prompt=[0, 5], max_tokens=50, ignore_eos=True))
    eng.step()
    eng.submit(GenerateRequest(prompt=[0, 6], max_tokens=5, callback=got.append))
    eng.step()
    assert got and got[-1].error_code == "UNAVAILABLE" and "no free slot" in got[-1].error
    assert eng.stats()["expired"] == 1


def test_a_full_wait_queue_refuses_at_once_with_unavailable(tiny_model):
    """max_queue_size bounds the requests waiting beyond the free slots: the next one is refused
    in submit (UNAVAILABLE, 'at capacity'), nothing it held remains, the others complete."""
    eng = _engine(tiny_model, mode="off", seqs=1, max_queue_size=2)
    got = {}
    reqs = [GenerateRequest(prompt=[0, 5 + i], max_tokens=3, ignore_eos=True) for i in range(3)]
    for r in reqs:  # one for the free slot, two queued
        got[r.id] = []
        r.callback = got[r.id].append
        eng.submit(r)
    full = "server at capacity: all 1 KV slots are busy and 2 requests are already waiting"
    with pytest.raises(RequestError, match=full) as e:
        eng.submit(GenerateRequest(prompt=[0, 9], max_tokens=3))
    assert e.value.code == "UNAVAILABLE"
    st = eng.stats()
    assert st["rejected"] == 1 and st["waiting"] == 3 and st["requests"] == 3
    eng.step()  # the first takes the slot: still two waiting beyond the (now no) free slots
    with pytest.raises(RequestError, match="at capacity"):
        eng.submit(GenerateRequest(prompt=[0, 11], max_tokens=3))
    while not got[reqs[0].id][-1].final:
        eng.step()
    eng.step()  # the second takes the freed slot: one queued place is free again
    eng.submit(GenerateRequest(prompt=[0, 10], max_tokens=3, callback=lambda ev: None))
    for _ in range(200):
        if not eng.has_work():
            break
        eng.step()
    assert all(ev[-1].finish_reason == "length" and sum(e.final for e in ev) == 1 for ev in got.values())
    st = eng.stats()
    assert st["rejected"] == 2 and st["waiting"] == 0 and st["slots_in_use"] == 0 and st["finished"] == 4


def test_queue_size_zero_still_serves_the_free_slots(tiny_model):
    eng = _engine(tiny_model, mode="off", seqs=2, max_queue_size=0)
    eng.submit(GenerateRequest(prompt=[0, 5], max_tokens=2))
    eng.submit(GenerateRequest(prompt=[0, 6], max_tokens=2))  # a burst onto free slots is not refused
    with pytest.raises(RequestError, match="at capacity") as e:
        eng.submit(GenerateRequest(prompt=[0, 7], max_tokens=2))
    assert e.value.code == "UNAVAILABLE"


def test_seeded_sampling_is_batch_independent_without_speculation(tiny_model):
    r = dict(prompt=_prompt(8, 9), max_tokens=6, temperature=1.0, top_k=50, seed=77, ignore_eos=True)
    alone = [t for e in _engine(tiny_model, "off", 1).run_request(GenerateRequest(**r)) for t in e.token_ids]
    eng = _engine(tiny_model, "off")
    reqs = [GenerateRequest(**r)] + [GenerateRequest(prompt=_prompt(15, i), max_tokens=6, temperature=1.0,
                                                     ignore_eos=True)
                                     for i in range(3)]
    ev = _collect(eng, reqs)
    assert [t for e in ev[reqs[0].id] for t in e.token_ids] == alone


def test_run_loop_serves_from_another_thread(tiny_model):
    eng = _engine(tiny_model)
    stop = threading.Event()
    th = threading.Thread(target=eng.run, args=(stop,), daemon=True)
    th.start()
    done = threading.Event()
    out = []
    eng.submit(GenerateRequest(prompt=[0, 5, 6], max_tokens=4, ignore_eos=True,
                       callback=lambda e: (out.append(e), e.final and done.set())))
    assert done.wait(60)
    stop.set()
    th.join(5)
    assert sum(len(e.token_ids) for e in out) == 4


def test_eager_host_syncs_are_counted_only_when_asked(tiny_model):
    """The eager runner counts host syncs only with count_host_syncs (the setting the worker and the
    in-process client pass; `generate --step-report` sets it): uncounted, the stats say None (not
    measured) and the Prometheus gauge keeps its value instead of reading 0; counted, the eager
    forward's syncs are seen, and the tokens are the same either way."""
    from v4flash_backend.group.build import build_runner

    out = {}
    for count in (False, True):
        s = Settings(max_num_seqs=1, max_model_len=64, spec_mode="dspark", count_host_syncs=count)
        eng = Engine(build_runner(tiny_model, s), s)
        ev = eng.run_request(GenerateRequest(prompt=_prompt(8, 3), max_tokens=6, ignore_eos=True))
        out[count] = ([t for e in ev for t in e.token_ids], eng.stats())
    assert out[False][0] == out[True][0] and len(out[True][0]) == 6
    assert out[False][1]["host_syncs_per_step"] is None
    # seen when counted: the eager forward is sync-free but for its token-id check (2 reads), and the
    # step reads back its logits and draft logits on top (6.2 per step here; > 10 before the
    # forward ran over index tensors, issue 30)
    assert out[True][1]["host_syncs_per_step"] > 2
    assert Settings().count_host_syncs is False


def test_ring_writes_of_several_slots_at_once_equal_slot_by_slot(tiny_model):
    """The runner writes a step's DSpark ring rows for every slot in one call (write_rings); the
    rings must hold exactly what slot-by-slot write_ring stores, a write longer than the window
    (only its last `window` rows kept) included."""
    import copy

    win = tiny_model.cfg.window_size
    r = LocalRunner(tiny_model, 4, 2 * win + 16)
    n = [win + 6, 5, 3]
    g = torch.Generator().manual_seed(1)
    r.forward(torch.randint(3, 1000, (sum(n),), generator=g), [(i, 0, k) for i, k in enumerate(n)],
              torch.tensor([sum(n) - 1]), True)
    offs = [0, n[0], n[0] + n[1]]
    writes = [(i, torch.arange(o, o + k), torch.arange(k)) for i, (o, k) in enumerate(zip(offs, n))]
    one_by_one = copy.deepcopy(r.state)
    d = r.drafter
    for slot, rows, pos in writes:
        d.write_ring(one_by_one, slot, d.main_x(r.last_taps[rows]), pos)
    d.write_rings(r.state, r.last_taps, writes)
    for k in range(d.n_stages):
        assert torch.equal(r.state.dspark[k], one_by_one.dspark[k])
        assert r.state.dspark[k][1].abs().sum() > 0
