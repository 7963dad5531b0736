"""Cutting a stream of LLM text deltas into sentences, each spoken as soon as it is complete."""

from __future__ import annotations

import re

# A sentence ends at . ! ? (or …) followed by white space, unless the word is a common
# abbreviation or a single initial ("Dr. Smith", "J. R. R."), or a number goes on ("3.14").
_END = re.compile(r"[.!?…]+[\"')\]]*\s+")
_ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof sr jr st vs etc e.g i.e approx no fig inc ltd co".split()
)


class SentenceSplitter:
    """Feed text deltas; get back every sentence they complete. ``flush`` gives the rest."""

    def __init__(self, *, min_chars: int = 12) -> None:
        self._buffer = ""
        self._min_chars = min_chars
        """Shorter pieces ("Yes." "Hi!") wait for the next sentence: one TTS call is cheaper."""

    def feed(self, delta: str) -> list[str]:
        self._buffer += delta
        sentences: list[str] = []
        start = 0
        for match in _END.finditer(self._buffer):
            candidate = self._buffer[start : match.end()].strip()
            last_word = candidate.rstrip(".!?…\"')]").rsplit(maxsplit=1)[-1:] or [""]
            word = last_word[0].lower()
            if word in _ABBREVIATIONS or (len(word) == 1 and word.isalpha()):
                continue
            if len(candidate) < self._min_chars:
                continue
            sentences.append(candidate)
            start = match.end()
        self._buffer = self._buffer[start:]
        return sentences

    def flush(self) -> str:
        rest, self._buffer = self._buffer.strip(), ""
        return rest
