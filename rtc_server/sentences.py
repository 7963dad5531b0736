"""Cutting a stream of LLM text deltas into sentences, each spoken as soon as it is complete."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass

# A sentence ends at . ! ? (or …) followed by white space, unless the word is a common
# abbreviation or a single initial ("Dr. Smith", "J. R. R."), or a number goes on ("3.14").
_END = re.compile(r"[.!?…]+[\"')\]]*\s+")
# The first piece of a reply may also end at a clause: the caller hears the answer begin
# while the rest of the sentence is still being synthesized.
_CLAUSE = re.compile(r"[,;:]\s+")
_ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof sr jr st vs etc e.g i.e approx no fig inc ltd co".split()
)
# A first piece cut after a number of words does not end on a word that leans on the next one
# ("The capital of" | "France is Paris."): the voice would drop its pitch mid-phrase.
_LEANING = frozenset(
    "a an the of to in on at by for from with and or but as is are was were be has have had "
    "do does not no my your our their his her its this that these those than very so if".split()
)
_WORD = re.compile(r"\S+(?=\s)")


MAX_PIECE_CHARS = 240
"""Longest piece of text handed to TTS at once. Piper synthesizes a piece in one go and cannot
be interrupted inside it; an unpunctuated 2,000-character text was 385 s of audio and over a
minute of CPU. At this length a piece is at most ~15 s of speech and well under a second of
synthesis, so barge-in and hang-up stay prompt."""

_BREAKS = (re.compile(r"[.!?…][\"')\]]*\s"), re.compile(r"[,;:]\s"), re.compile(r"\s"))


def _cut(text: str, max_chars: int) -> int:
    """Where to end a piece of ``text`` no longer than ``max_chars``: after the last sentence
    end that fits, else the last clause, else the last space (past a third of the way), else
    at the limit."""
    window = text[: max_chars + 1]
    for pattern in _BREAKS:
        ends = [m.end() for m in pattern.finditer(window) if max_chars // 3 < m.end() <= max_chars]
        if ends:
            return ends[-1]
    return max_chars


def bounded_pieces(text: str, max_chars: int = MAX_PIECE_CHARS) -> list[str]:
    """``text`` cut into pieces of at most ``max_chars`` (see :func:`_cut`)."""
    pieces: list[str] = []
    rest = text.strip()
    while len(rest) > max_chars:
        cut = _cut(rest, max_chars)
        pieces.append(rest[:cut].strip())
        rest = rest[cut:].lstrip()
    if rest:
        pieces.append(rest)
    return pieces


@dataclass(frozen=True, slots=True)
class FirstWords:
    """A reply's first piece cut after its first words, for a slow LLM: one whose sentence
    takes longer to write than its first words take to speak."""

    words: int = 4
    """Whole words before the cut (or the first word after them that does not lean on the
    next), when no sentence or clause ended sooner."""
    min_rate: float = 10.0
    """Deltas a second (about tokens) the LLM must be writing at, over those words. Slower
    (a model shared by several calls), the rest of the sentence would not be written and
    voiced before the first words are spoken, and the caller would hear a gap mid-sentence:
    the piece then waits for its sentence, as without the cut."""


class SentenceSplitter:
    """Feed text deltas; get back every sentence they complete. ``flush`` gives the rest."""

    def __init__(
        self,
        *,
        min_chars: int = 12,
        first_clause_chars: int | None = 8,
        first_words: FirstWords | None = None,
        first_piece: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._buffer = ""
        self._min_chars = min_chars
        """Shorter pieces ("Yes." "Hi!") wait for the next sentence: one TTS call is cheaper."""
        self._first_clause_chars = first_clause_chars
        """None: never cut at a clause. Else the first piece may end at , ; : when this long."""
        self._first_words = first_words
        """None: the first piece waits for a sentence or clause end."""
        self._first_piece = first_piece
        """The first piece another splitter cut from the same stream (a speculation's,
        rtc_server/speculation.py): cut there, whatever the pace of this reading of it."""
        self._clock = clock
        self._first_delta_at: float | None = None
        self._deltas = 0
        self._first = True

    def feed(self, delta: str) -> list[str]:
        self._buffer += delta
        if delta:
            self._deltas += 1
            if self._first_delta_at is None:
                self._first_delta_at = self._clock()
        pieces: list[str] = []
        start = 0
        if self._first and self._first_piece is not None:
            start = self._given_first_piece(pieces)
        if self._first and self._first_piece is None and self._first_clause_chars is not None:
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
        if self._first and self._first_piece is None and self._first_words is not None:
            cut = self._first_words_end()
            if cut is not None:
                pieces.append(self._buffer[:cut].strip())
                start = cut
                self._first = False
        self._buffer = self._buffer[start:]
        while len(self._buffer.strip()) > MAX_PIECE_CHARS:
            # No sentence end for a long while: speak what fits rather than wait for one.
            self._buffer = self._buffer.lstrip()
            cut = _cut(self._buffer, MAX_PIECE_CHARS)
            pieces.append(self._buffer[:cut].strip())
            self._buffer = self._buffer[cut:]
            self._first = False
        return pieces

    def _given_first_piece(self, pieces: list[str]) -> int:
        """Cut the given first piece once the buffer holds it and what follows; forget it if
        the text turns out otherwise. Where the rest of the buffer starts."""
        assert self._first_piece is not None
        text = self._buffer.lstrip()
        if text.startswith(self._first_piece) and len(text) > len(self._first_piece):
            pieces.append(self._first_piece)
            self._first = False
            return len(self._buffer) - len(text) + len(self._first_piece)
        if not self._first_piece.startswith(text):
            self._first_piece = None  # another text: the usual rules
        return 0

    def _first_words_end(self) -> int | None:
        """Where the first piece ends by its words, if the buffer holds enough of them and
        the LLM writes them fast enough."""
        rule = self._first_words
        assert rule is not None
        for count, word in enumerate(_WORD.finditer(self._buffer), 1):
            bare = word.group().strip(".,;:!?…\"'()[]").lower()
            if count >= rule.words and bare not in _LEANING:
                return word.end() if self._writes_fast(rule.min_rate) else None
        return None

    def _writes_fast(self, min_rate: float) -> bool:
        assert self._first_delta_at is not None
        elapsed = self._clock() - self._first_delta_at
        return elapsed <= 0 or (self._deltas - 1) / elapsed >= min_rate

    def flush(self) -> list[str]:
        """What is left, in pieces of at most ``MAX_PIECE_CHARS`` (none when nothing is)."""
        rest, self._buffer = self._buffer.strip(), ""
        self._first = True
        return bounded_pieces(rest)
