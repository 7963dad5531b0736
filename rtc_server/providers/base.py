"""Provider seams: small protocols returning async iterators."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from musetalk_core.types import AudioChunk


class TTS(Protocol):
    """Text in, mono int16 audio out, one chunk per sentence or finer, as soon as it is ready."""

    @property
    def sample_rate(self) -> int: ...

    def synthesize(self, text: str) -> AsyncIterator[AudioChunk]: ...
