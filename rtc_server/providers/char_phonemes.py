"""Phoneme timing from a voice's character timing (ElevenLabs' alignments).

ElevenLabs streams, with its audio, when each character of the text is spoken. Mouths need
phonemes: each word is phonemized with the espeak-ng phonemizer Piper ships (the same symbols
the bundled voice reports, cached per word), and its phonemes share the word's span evenly, the
marks without a shape of their own (stress, length) taking none. What lies between words
(spaces, punctuation, a pause) is rest, ``_``. Words are cut at anything but letters, digits and
apostrophes; a word is timed once its last character is known (the next character is not part of
it, or the stream ended), so the timing known so far always ends at a word's edge.

Costs about a tenth of a millisecond per new word on this machine (``bench visemes``), nothing
for a word seen before.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from musetalk_core.types import PhonemeSpan
from musetalk_core.visemes import viseme_of

if TYPE_CHECKING:
    from piper.phonemize_espeak import EspeakPhonemizer

__all__ = ["CharacterTiming", "phonemize_word"]

_lock = threading.Lock()


@functools.lru_cache(maxsize=4096)
def phonemize_word(word: str, voice: str = "en-us") -> tuple[str, ...]:
    """The espeak-ng phonemes of one word (as Piper writes them); () when it has none."""
    with _lock:  # espeak-ng is one global state per process
        sentences = _phonemizer().phonemize(voice, word)
    return tuple(p for sentence in sentences for p in sentence if p.strip() and p not in ".,;:!?")


@functools.cache
def _phonemizer() -> EspeakPhonemizer:
    from piper.phonemize_espeak import EspeakPhonemizer

    return EspeakPhonemizer()


def _in_word(ch: str) -> bool:
    return ch.isalnum() or ch in "'’"


class CharacterTiming:
    """Character timings in, as they stream; phoneme spans out, on the stream's clock.

    :meth:`add` takes the characters of one message with their start and end times (seconds
    from the stream's start); :meth:`spans` gives the phonemes known so far, ending at
    :attr:`known_until`; :meth:`finish` times the last word.
    """

    def __init__(self, voice: str = "en-us") -> None:
        self.voice = voice
        self._chars: list[tuple[str, float, float]] = []
        """Characters of the word in progress (not yet known to be whole)."""
        self._spans: list[PhonemeSpan] = []
        self.known_until = 0.0
        """Seconds of the stream whose phonemes are known."""

    def add(self, chars: Sequence[str], starts: Sequence[float], ends: Sequence[float]) -> None:
        if not (len(chars) == len(starts) == len(ends)):
            raise ValueError("characters and their times differ in number")
        for ch, a, b in zip(chars, starts, ends, strict=True):
            a, b = float(a), float(b)
            if _in_word(ch):
                self._chars.append((ch, a, b))
                continue
            self._close_word()
            self._rest_until(max(a, b))

    def finish(self, end: float | None = None) -> None:
        """The stream ended (at ``end`` seconds, if known): the last word is whole."""
        self._close_word()
        if end is not None:
            self._rest_until(end)

    def take(self) -> list[PhonemeSpan]:
        """The spans timed since the last take."""
        out, self._spans = self._spans, []
        return out

    def _close_word(self) -> None:
        if not self._chars:
            return
        word = "".join(c for c, _, _ in self._chars)
        start, end = self._chars[0][1], max(b for _, _, b in self._chars)
        self._chars = []
        self._rest_until(start)
        start = max(start, self.known_until)
        phonemes = [p for p in phonemize_word(word.lower(), self.voice) if viseme_of(p)]
        if not phonemes or end <= start:
            self._rest_until(end)
            return
        step = (end - start) / len(phonemes)
        for i, p in enumerate(phonemes):
            a = start + i * step
            b = end if i == len(phonemes) - 1 else start + (i + 1) * step
            self._spans.append(PhonemeSpan(p, a, b))
        self.known_until = end

    def _rest_until(self, t: float) -> None:
        if t <= self.known_until:
            return
        last = self._spans[-1] if self._spans else None
        if last is not None and last.phoneme == "_" and last.end == self.known_until:
            self._spans[-1] = PhonemeSpan("_", last.start, t)
        else:
            self._spans.append(PhonemeSpan("_", self.known_until, t))
        self.known_until = t
