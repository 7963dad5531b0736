"""The seam between lip-sync engines and the media server: numpy-only data types."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

__all__ = [
    "AudioChunk",
    "AvatarError",
    "AvatarFrame",
    "AvatarRtcError",
    "EngineError",
    "LipSyncEngine",
    "NoFaceError",
    "PhonemeSpan",
    "phonemes_after",
]


class AvatarRtcError(Exception):
    """The root of every error avatar-rtc raises on purpose (the tree: docs/ARCHITECTURE.md,
    "Errors"). A bare ``RuntimeError`` or ``AssertionError`` from our code is a bug."""


class EngineError(AvatarRtcError, RuntimeError):
    """A lip-sync engine that cannot go on (its inference failed, it was closed)."""


class AvatarError(AvatarRtcError, ValueError):
    """A portrait could not be loaded or prepared."""


class NoFaceError(AvatarError):
    """No frontal face was found in the portrait."""


@dataclass(frozen=True, slots=True)
class PhonemeSpan:
    """One phoneme of synthesized speech and when it sounds, in seconds from its chunk's start."""

    phoneme: str
    """As the voice's phonemizer writes it: espeak-ng IPA for Piper ("m", "ˈ", "aɪ" is two)."""
    start: float
    end: float


def phonemes_after(spans: tuple[PhonemeSpan, ...], seconds: float) -> tuple[PhonemeSpan, ...]:
    """``spans`` from ``seconds`` on, on a clock that starts there (a span cut by it starts at
    0): the phonemes of audio whose first ``seconds`` were dropped."""
    return tuple(
        PhonemeSpan(s.phoneme, max(0.0, s.start - seconds), s.end - seconds)
        for s in spans
        if s.end > seconds
    )


@dataclass(frozen=True, slots=True)
class AudioChunk:
    """Mono int16 PCM."""

    pcm: np.ndarray
    """int16, shape (samples,)."""
    sample_rate: int
    """Hz."""
    phonemes: tuple[PhonemeSpan, ...] = ()
    """The phonemes the audio says, from the voice's own timing, covering it end to end; empty
    when the source gives none (a cloud voice without timings, a caller's microphone)."""

    @property
    def duration(self) -> float:
        return len(self.pcm) / self.sample_rate


@dataclass(frozen=True, slots=True)
class AvatarFrame:
    """One video frame and exactly the 1/fps of audio it animates."""

    image: np.ndarray
    """uint8 RGB, shape (height, width, 3); or I420, shape (height * 3 // 2, width), from an
    engine that makes the encoder's own pixel format (musetalk_core.i420)."""
    audio: AudioChunk
    """Exactly 1/fps seconds at the engine's sample_rate; silence on idle frames."""
    speaking: bool
    """False for idle filler frames."""
    segment_id: int
    """The utterance this frame belongs to; -1 for idle frames."""


@runtime_checkable
class LipSyncEngine(Protocol):
    """Audio in, paired (video frame, audio slice) out, at a fixed fps.

    ``frames()`` never ends while the engine is open: when no audio is queued it yields idle
    frames. It may run ahead of real time; pacing is the consumer's job, and a consumer that
    stops pulling holds the engine back.
    """

    @property
    def fps(self) -> int: ...

    @property
    def sample_rate(self) -> int:
        """Rate of the audio pushed in and paired out (48 kHz for WebRTC)."""
        ...

    @property
    def frame_size(self) -> tuple[int, int]:
        """(width, height) of every image."""
        ...

    @property
    def latency(self) -> float:
        """Seconds from push_audio to the frame that carries that audio being ready."""
        ...

    async def push_audio(self, chunk: AudioChunk, segment_id: int) -> None:
        """Queue speech audio (at ``sample_rate``) for utterance ``segment_id``."""
        ...

    async def end_segment(self, segment_id: int) -> None:
        """No more audio for ``segment_id``: pad its last partial frame and flush it."""
        ...

    def clear(self) -> None:
        """Drop queued audio at once; the next frame is idle."""
        ...

    def frames(self) -> AsyncIterator[AvatarFrame]: ...

    async def aclose(self) -> None: ...
