"""Cutting a stream of LLM text deltas into sentences, each spoken as soon as it is complete."""

from __future__ import annotations

import re

# A sentence ends at . ! ? (or …) followed by white space, unless the word is a common
# abbreviation or a single initial ("Dr. Smith", "J. R. R."), or a number goes on ("3.14").
_END = re.compile(r"[.!?…]+[\"')\]]*\s+")
# The first piece of a reply may also end at a clause: the caller hears the answer begin
# while the rest of the sentence is still being synthesized.
_CLAUSE = re.compile(r"[,;:]\s+")
_ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof sr jr st vs etc e.g i.e approx no fig inc ltd co".split()
)


class SentenceSplitter:
    """Feed text deltas; get back every sentence they complete. ``flush`` gives the rest."""

    def __init__(self, *, min_chars: int = 12, first_clause_chars: int | None = 8) -> None:
        self._buffer = ""
        self._min_chars = min_chars
        """Shorter pieces ("Yes." "Hi!") wait for the next sentence: one TTS call is cheaper."""
        self._first_clause_chars = first_clause_chars
        """None: never cut at a clause. Else the first piece may end at , ; : when this long."""
        self._first = True

    def feed(self, delta: str) -> list[str]:
        self._buffer += delta
        pieces: list[str] = []
        start = 0
        if self._first and self._first_clause_chars is not None:
            clause = _CLAUSE.search(self._buffer)
            end = _END.search(self._buffer)
            if clause and (end is None or clause.start() < end.start()):
                candidate = self._buffer[: clause.end()].strip()
                if len(candidate) >= self._first_clause_chars:
                    pieces.append(candidate)
                    start = clause.end()
                    self._first = False
        for match in _END.finditer(self._buffer, start):
            candidate = self._buffer[start : match.end()].strip()
            last_word = candidate.rstrip(".!?…\"')]").rsplit(maxsplit=1)[-1:] or [""]
            word = last_word[0].lower()
            if word in _ABBREVIATIONS or (len(word) == 1 and word.isalpha()):
                continue
            if len(candidate) < self._min_chars:
                continue
            pieces.append(candidate)
            start = match.end()
            self._first = False
        self._buffer = self._buffer[start:]
        return pieces

    def flush(self) -> str:
        rest, self._buffer = self._buffer.strip(), ""
        self._first = True
        return rest
