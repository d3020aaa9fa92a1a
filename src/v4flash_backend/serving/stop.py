"""Stop strings (vLLM's `stop`, TRT-LLM's `stop_words`) on the streamed text, exactly.

The detokenizer lives on the serving side (the `v4flash` Triton model; rank 0 has no tokenizer), so
stop strings are matched here, on the text of the generated ids, and the serving side ends the
request (finish_reason "stop", the engine request cancelled). vLLM's semantics
(vllm/v1/engine/detokenizer.py, `check_stop_strings`): the earliest occurrence ends the output,
the stop string itself is not part of it, and occurrences completed before `min_tokens` tokens
are ignored.

Streaming exactly means no piece of a stop string is ever sent: while the text ends in a proper
prefix of some stop string, the ids that produced that tail are held back (`releasable`). The
ensemble's postprocessing step is stateless and decodes whole ids, and a stop string can start or
end inside an id, so the last response of a stopped request also says how many characters to cut
from the end of its text (`trim`): the stop string and whatever the last id decodes to after it.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass

from .detok import StreamDetokenizer


@dataclass
class StopMatch:
    num_tokens: int  # generated ids up to and including the one that completes the stop string
    start: int  # character offset of the stop string in the generated text
    trim: int  # characters after `start` in the full decode of the first num_tokens ids


class StopMatcher:
    """Feed the generated ids as they come (`push`); `match` is set once a stop string occurs."""

    def __init__(self, detok: StreamDetokenizer, stops: tuple[str, ...], min_tokens: int = 0):
        self.detok = detok
        self.stops = tuple(s for s in stops if s)
        self.longest = max((len(s) for s in self.stops), default=0)
        self.min_tokens = min_tokens
        self.ids: list[int] = []
        self.text = ""  # text of self.ids, less a trailing unfinished character
        self.ends: list[int] = []  # ends[k]: len(text) once ids[:k + 1] are decoded
        self.match: StopMatch | None = None
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace") if detok.byte_level else None

    def push(self, new_ids) -> StopMatch | None:
        if self.match is not None:
            return self.match
        first_new_char = len(self.text)
        for t in new_ids:
            self.ids.append(int(t))
            if self._utf8 is not None:
                self.text += self._utf8.decode(self.detok._bytes([int(t)]), final=False)
            else:
                self.text = self.detok._stable_text(self.ids)
            self.ends.append(len(self.text))
        # an occurrence must end in the new text; it may start up to longest - 1 characters before
        self.match = self._find(max(0, first_new_char - self.longest + 1))
        return self.match

    def _find(self, since: int) -> StopMatch | None:
        best = None
        for s in self.stops:
            at = self.text.find(s, since)
            while at >= 0:
                n = self._tokens_through(at + len(s))
                if n >= self.min_tokens:
                    if best is None or at < best[0]:
                        best = (at, n)
                    break
                at = self.text.find(s, at + 1)  # completed before min_tokens: ignored, as vLLM does
        if best is None:
            return None
        at, n = best
        full = self.detok.decode(self.ids[:n])  # what a final response decodes the first n ids to
        return StopMatch(num_tokens=n, start=at, trim=max(0, len(full) - at))

    def _tokens_through(self, end: int) -> int:
        """The number of ids whose text reaches character offset `end`."""
        for k, e in enumerate(self.ends):
            if e >= end:
                return k + 1
        return len(self.ends)

    def releasable(self) -> int:
        """How many leading ids can be sent now: those whose text ends before the earliest tail
        of the text that is a proper prefix of a stop string."""
        if self.match is not None:
            return self.match.num_tokens
        hold = len(self.text)
        for j in range(max(0, len(self.text) - self.longest + 1), len(self.text)):
            tail = self.text[j:]
            if any(len(tail) < len(s) and s.startswith(tail) for s in self.stops):
                hold = j
                break
        n = 0
        while n < len(self.ends) and self.ends[n] <= hold:
            n += 1
        # ids whose bytes are still an unfinished character add no text yet; they may go out (the
        # detokenizer holds those bytes back too), unless what follows them is held
        return n
