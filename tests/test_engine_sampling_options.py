"""min_tokens and log-probabilities in the engine, with and without DSpark (golden tiny checkpoint,
exact numerics: logits do not depend on batching or on whether a row came from a draft, so the
comparisons below are exact unless a tolerance is stated)."""

import math
from pathlib import Path

import pytest
import torch

from v4flash_backend.engine.engine import Engine
from v4flash_backend.engine.runner import LocalRunner
from v4flash_backend.engine.sampling import SamplingParams, mask_stop_tokens, process_logits
from v4flash_backend.request import GenerateRequest, RequestError
from v4flash_backend.settings import Settings


def _engine(model, mode="dspark", seqs=2, max_len=128):
    return Engine(LocalRunner(model, seqs + 1, max_len),
                  Settings(max_num_seqs=seqs, max_model_len=max_len, spec_mode=mode, prefill_chunk=32))


def _run(model, mode, **kw):
    events = _engine(model, mode).run_request(GenerateRequest(**kw))
    return [t for e in events for t in e.token_ids], events


PROMPT = [0, 17, 250, 33, 901, 4, 77, 12]
EMBEDDED = Path(__file__).resolve().parents[1] / "models" / "v4flash-tiny"


@pytest.fixture(scope="module")
def embedded_model():
    """The trained embedded model: its DSpark drafts are accepted (the golden random weights' almost
    never are), so tokens from accepted drafts are really scored below."""
    from v4flash_backend.model.loading import load_model

    return load_model(EMBEDDED)


def test_mask_stop_tokens_masks_only_active_rows():
    x = torch.zeros(3, 5)
    out = mask_stop_tokens(x, torch.tensor([[1, -1], [2, 4], [0, 3]]), torch.tensor([True, True, False]))
    assert torch.isinf(out[0, 1]) and int(torch.isinf(out[0]).sum()) == 1
    assert torch.isinf(out[1, 2]) and torch.isinf(out[1, 4]) and int(torch.isinf(out[1]).sum()) == 2
    assert not torch.isinf(out[2]).any()


@pytest.mark.parametrize("mode", ["dspark", "off"])
def test_min_tokens_blocks_stop_ids_before_and_only_before(tiny_model, mode):
    # Make the greedy continuation's 3rd token a stop id: without min_tokens the request stops there.
    free, _ = _run(tiny_model, "off", prompt=PROMPT, max_tokens=24, ignore_eos=True)
    stop = free[2]
    first = free.index(stop)  # may occur earlier than position 2
    short, ev = _run(tiny_model, mode, prompt=PROMPT, max_tokens=24, ignore_eos=True, stop_token_ids=(stop,))
    assert short == free[:first + 1] and ev[-1].finish_reason == "stop"
    # min_tokens = 6: the stop id cannot be generated at output positions 0..5 (masked from the
    # distribution), so the output differs from the free run there and has >= 6 tokens.
    out, ev = _run(tiny_model, mode, prompt=PROMPT, max_tokens=24, ignore_eos=True, stop_token_ids=(stop,),
                   min_tokens=6)
    assert len(out) >= 6 and stop not in out[:6]
    if stop in out:  # after min_tokens the stop id ends the request again
        assert out.index(stop) == len(out) - 1 and ev[-1].finish_reason == "stop"
    plain, _ = _run(tiny_model, "off", prompt=PROMPT, max_tokens=24, ignore_eos=True, stop_token_ids=(stop,),
                    min_tokens=6)
    assert out == plain  # greedy DSpark under the mask = greedy plain decoding under the mask


def test_min_tokens_equal_max_tokens_gives_exactly_max_tokens(tiny_model):
    eos = tiny_model.cfg.eos_token_id
    out, ev = _run(tiny_model, "dspark", prompt=PROMPT, max_tokens=12, min_tokens=12, stop_token_ids=(eos,))
    assert len(out) == 12 and ev[-1].finish_reason == "length" and eos not in out


def test_min_tokens_out_of_range_is_refused(tiny_model):
    with pytest.raises(RequestError, match="min_tokens"):
        _engine(tiny_model).submit(GenerateRequest(prompt=PROMPT, max_tokens=4, min_tokens=5))


def _teacher_forced_logits(model, prompt, out):
    """Target logits predicting out[j] from prompt + out[:j], by one prefill (no drafts involved)."""
    runner = LocalRunner(model, 1, 256)
    seq = prompt + out
    n = len(seq) - 1
    lg = runner.forward(torch.tensor(seq[:n]), [(0, 0, n)], torch.arange(len(prompt) - 1, n), False).logits
    return lg


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.0, 0, 1.0), (0.8, 40, 1.0), (1.0, 0, 0.9)])
def test_logprobs_are_the_processed_target_for_every_token(embedded_model, temperature, top_k, top_p):
    # "def main(" in the embedded model's byte-level BPE: a prompt it continues confidently
    from tokenizers import Tokenizer

    prompt = Tokenizer.from_file(str(EMBEDDED / "tokenizer.json")).encode("import os\n\ndef main(").ids
    kw = dict(prompt=prompt, max_tokens=20, ignore_eos=True, temperature=temperature, top_k=top_k, top_p=top_p,
              seed=3, logprobs=2)
    out, ev = _run(embedded_model, "fixed", **kw)  # fixed: 5 drafts verified every step
    lps = [x for e in ev if e.logprobs for x in e.logprobs]
    assert len(lps) == len(out) == 20
    assert ev[-1].accepted >= 3, ev[-1].accepted  # tokens from accepted drafts are among those scored
    lg = _teacher_forced_logits(embedded_model, prompt, out).double()
    params = SamplingParams.make(len(out), temperature, top_k, top_p)
    want = torch.log(process_logits(lg, params)) if temperature > 0 else torch.log_softmax(lg, -1)
    for j, (lp, rank, alts) in enumerate(lps):
        # exact numerics make the verify rows equal the teacher-forced rows bit for bit; 1e-9 allows for
        # the fp64 log of an fp32-rounded softmax computed in a different row grouping.
        assert lp == pytest.approx(float(want[j, out[j]]), abs=1e-9), j
        assert math.isfinite(lp) and lp <= 0
        assert rank == 1 + int((want[j] > want[j, out[j]]).sum())
        # the 2 most likely alternatives, less those top-k / top-p filtered out (log-prob -inf)
        assert len(alts) == min(2, int(torch.isfinite(want[j]).sum()))
        assert alts[0][0] == int(want[j].argmax()) and all(a[1] >= b[1] for a, b in zip(alts, alts[1:]))
    if temperature == 0:
        assert all(rank == 1 for _, rank, _ in lps)


def test_no_logprobs_unless_asked(tiny_model):
    _, ev = _run(tiny_model, "dspark", prompt=PROMPT, max_tokens=6, ignore_eos=True)
    assert all(e.logprobs is None for e in ev)
    assert "logprobs" not in ev[-1].to_wire()


@pytest.mark.parametrize("mode", ["dspark", "off"])
def test_min_tokens_boundary_is_exact(tiny_model, mode):
    # The stop id first appears at output position k of the free greedy run: min_tokens = k lets it
    # be generated there (the request stops with k + 1 tokens); min_tokens = k + 1 masks position k.
    # An off-by-one in the positions given to the mask (verify rows or draft slots) fails one side.
    free, _ = _run(tiny_model, "off", prompt=PROMPT, max_tokens=24, ignore_eos=True)
    k = next(j for j in range(3, 24) if free[j] not in free[:j])
    kw = dict(prompt=PROMPT, max_tokens=24, ignore_eos=True, stop_token_ids=(free[k],))
    out, ev = _run(tiny_model, mode, min_tokens=k, **kw)
    assert out == free[:k + 1] and ev[-1].finish_reason == "stop"
    out, _ = _run(tiny_model, mode, min_tokens=k + 1, **kw)
    assert out[:k] == free[:k] and out[k] != free[k]


def _embedded_prompt():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(EMBEDDED / "tokenizer.json")).encode("import os\n\ndef main(").ids


def test_penalties_greedy_dspark_equals_plain_and_changes_the_output(embedded_model):
    prompt = _embedded_prompt()
    kw = dict(prompt=prompt, max_tokens=32, ignore_eos=True)
    free, _ = _run(embedded_model, "off", **kw)
    for pen in (dict(frequency_penalty=1.5), dict(presence_penalty=1.0), dict(frequency_penalty=-0.5)):
        plain, _ = _run(embedded_model, "off", **kw, **pen)
        spec, ev = _run(embedded_model, "fixed", **kw, **pen)
        assert spec == plain, pen  # drafts and verify rows use the same penalised logits
        assert ev[-1].accepted > 0, pen
        if pen.get("frequency_penalty", 0) > 0 or pen.get("presence_penalty", 0) > 0:
            assert plain != free, pen


def test_penalised_logprobs_are_the_processed_target(embedded_model):
    from v4flash_backend.engine.sampling import apply_penalties

    prompt = _embedded_prompt()
    out, ev = _run(embedded_model, "fixed", prompt=prompt, max_tokens=20, ignore_eos=True, temperature=0.9,
                   top_k=50, seed=5, logprobs=0, frequency_penalty=0.7, presence_penalty=0.4)
    lps = [x[0] for e in ev if e.logprobs for x in e.logprobs]
    lg = _teacher_forced_logits(embedded_model, prompt, out)  # fp32, penalised in fp32 as the engine does
    V = lg.shape[1]
    counts = torch.stack([torch.bincount(torch.tensor(out[:j], dtype=torch.long), minlength=V).double()
                          for j in range(len(out))])
    pen = apply_penalties(lg, counts, torch.full((len(out),), 0.7), torch.full((len(out),), 0.4))
    want = torch.log(process_logits(pen.double(), SamplingParams.make(len(out), 0.9, 50, 1.0)))
    for j, lp in enumerate(lps):
        assert lp == pytest.approx(float(want[j, out[j]]), abs=1e-9), j  # as in the test above
