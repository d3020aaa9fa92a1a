"""Stop strings, streamed exactly: v4flash's own text_output and the ensemble's stateless
postprocessing (fed v4flash's output_ids / context_ids / finish_reason / text_trim) must both stream
exactly the generated text up to the first stop string, never a character of it, and end with
finish_reason "stop". Random chunkings of real byte-level BPE ids (the embedded model's tokenizer),
stop strings that start and end inside ids, multi-byte characters."""

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from v4flash_backend.request import GenerateRequest
from v4flash_backend.serving.detok import StreamDetokenizer
from v4flash_backend.serving.prepost import Postprocessor
from v4flash_backend.serving.response import ResponseBuilder
from v4flash_backend.serving.stop import StopMatcher

TOKENIZER = Path(__file__).resolve().parents[1] / "models" / "v4flash-tiny" / "tokenizer.json"
TEXT = ("def main(argv):\n    \"\"\"Run it — naïve café 東京 🙂.\"\"\"\n    for i in range(10):\n"
        "        print(i)  # done\n\n\nreturn 0\n")


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file(str(TOKENIZER))


def _stream(tok, ids, prompt, stops, chunks, min_tokens=0, stream=True, text_input=True):
    """Run the generated `ids` through ResponseBuilder in `chunks` (engine events; the last one final
    with 'length'), then through the postprocessing step. Returns (v4flash text, postprocessing
    text, finish_reason, number of ids sent, responses)."""
    detok = StreamDetokenizer(tok)
    req = GenerateRequest(prompt=prompt, prompt_text="p" if text_input else None, stream=stream,
                          echo=False, stop=tuple(stops), min_tokens=min_tokens)
    b = ResponseBuilder(req, detok)
    post = Postprocessor(tok)
    own, pp, reason, sent, responses = "", "", "", 0, []
    pos = 0
    for i, n in enumerate(chunks):
        last = i == len(chunks) - 1
        ev = {"event": "chunk", "token_ids": ids[pos:pos + n], "finish_reason": "length" if last else None}
        pos += n
        out, reason = b.on_chunk(ev)
        if out is not None:
            responses.append(out)
            if text_input:
                own += out["text_output"][0].decode()
            pp += post.text_output(out["output_ids"], out["context_ids"], out["finish_reason"],
                                   out["text_trim"])[0].decode()
            sent += int(out["num_output_tokens"][0])
        if reason:
            return own, pp, reason, sent, b.stopped_early, responses
    raise AssertionError("no final response")


def _expected(tok, ids, stops, min_tokens):
    """vLLM's rule: the earliest occurrence (completed at or after min_tokens ids) cuts the text."""
    detok = StreamDetokenizer(tok)
    full = detok.decode(ids)
    best = None
    for s in stops:
        at = full.find(s)
        while at >= 0:
            n = next(k for k in range(1, len(ids) + 1) if len(detok.decode(ids[:k]).rstrip("\ufffd")) >= at + len(s))
            if n >= min_tokens:
                best = at if best is None else min(best, at)
                break
            at = full.find(s, at + 1)
    return (full, False) if best is None else (full[:best], True)


def _chunkings(n, rng, count):
    yield [1] * n
    yield [n]
    for _ in range(count):
        cuts = sorted(rng.sample(range(1, n), rng.randint(1, min(8, n - 1))))
        yield [b - a for a, b in zip([0] + cuts, cuts + [n])]


def test_stops_inside_ids_across_ids_and_multibyte_stream_exactly(tok):
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    rng = random.Random(0)
    # substrings of the text: starting / ending inside ids, spanning several ids, multi-byte characters
    stops_list = [["\n\n"], ["range("], ["é 東"], ["🙂"], ["京"], ["  # d"], ["ai"], ["(i)", "print"],
                  ["zzz"], ["\n\n\n", "return"], ["e"], ["def"]]
    for _ in range(8):
        a = rng.randrange(len(TEXT) - 4)
        stops_list.append([TEXT[a:a + rng.randint(1, 6)]])
    for stops in stops_list:
        for min_tokens in (0, 9):
            want, hit = _expected(tok, ids, stops, min_tokens)
            for chunks in _chunkings(len(ids), rng, 6):
                own, pp, reason, sent, early, responses = _stream(tok, ids, [0, 5], stops, chunks, min_tokens)
                assert own == want, (stops, chunks, own, want)
                assert pp == want, (stops, chunks, pp, want)  # the ensemble's stateless postprocessing
                assert reason == ("stop" if hit else "length")
                if hit:
                    assert sent <= len(ids)  # ids after the one completing the stop are not sent
                # only the final response may trim, and no response is empty except possibly the last
                assert all(int(r["text_trim"][0]) == 0 for r in responses[:-1])


def test_non_streamed_and_ids_only_requests(tok):
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    want, _ = _expected(tok, ids, ["café"], 0)
    own, pp, reason, *_ = _stream(tok, ids, [0, 5], ["café"], [3, 4, len(ids) - 7], stream=False)
    assert own == pp == want and reason == "stop"
    _, pp, reason, *_ = _stream(tok, ids, [0, 5], ["café"], [2] * (len(ids) // 2) + [1] * (len(ids) % 2),
                                text_input=False)  # the ensemble sends input_ids to v4flash
    assert pp == want and reason == "stop"


def test_held_back_prefix_is_released_when_the_stop_does_not_follow(tok):
    m = StopMatcher(StreamDetokenizer(tok), ("\n\nreturn",))
    ids = tok.encode("x\n\nprint", add_special_tokens=False).ids
    n_x = len(tok.encode("x", add_special_tokens=False).ids)
    m.push(ids[:n_x])
    assert m.releasable() == n_x
    nl = tok.encode("x\n\n", add_special_tokens=False).ids
    m2 = StopMatcher(StreamDetokenizer(tok), ("\n\nreturn",))
    m2.push(nl)
    assert m2.releasable() < len(nl)  # "\n\n" may begin the stop string: held
    m.push(ids[n_x:])
    assert m.match is None and m.releasable() == len(ids)  # "\n\nprint": released


def test_deliberate_leak_is_caught(tok, monkeypatch):
    # NEGATIVE CONTROL: a matcher that releases everything (no hold-back) leaks the start of a stop
    # string into earlier responses, which the exactness check above must see.
    monkeypatch.setattr(StopMatcher, "releasable", lambda self: len(self.ids))
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    want, _ = _expected(tok, ids, ["range("], 0)
    own, *_ = _stream(tok, ids, [0, 5], ["range("], [1] * len(ids))
    assert own != want
