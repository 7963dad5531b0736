"""One clock per session: both tracks wait on it, so audio and video leave together."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

AUDIO_RATE = 48_000
"""Hz of the PCM handed to aiortc's Opus encoder."""
AUDIO_PTIME = 0.020
"""Seconds per audio frame; aiortc's Opus RTP timestamps need exactly 20 ms frames."""
AUDIO_SAMPLES = int(AUDIO_RATE * AUDIO_PTIME)
VIDEO_RATE = 90_000
"""RTP video clock, Hz."""


class MediaClock(Protocol):
    """Monotonic session time in seconds, starting at 0 on the first ``start()``: what the
    scheduler and the tracks run on (``MonotonicClock`` in a call, ``ManualClock`` in tests)."""

    @property
    def started(self) -> bool: ...

    def start(self) -> None: ...

    def now(self) -> float: ...

    async def sleep_until(self, t: float) -> None: ...


class MonotonicClock:
    """Session time read from ``time.monotonic``; starts when the first track asks for media."""

    def __init__(self) -> None:
        self._t0: float | None = None

    @property
    def started(self) -> bool:
        return self._t0 is not None

    def start(self) -> None:
        if self._t0 is None:
            self._t0 = time.monotonic()

    def now(self) -> float:
        if self._t0 is None:
            return 0.0
        return time.monotonic() - self._t0

    def to_monotonic(self, t: float) -> float:
        """The ``time.monotonic`` instant of session time ``t``."""
        self.start()
        assert self._t0 is not None
        return self._t0 + t

    async def sleep_until(self, t: float) -> None:
        self.start()
        delay = t - self.now()
        if delay > 0:
            await asyncio.sleep(delay)


class ManualClock:
    """A clock tests move by hand; ``sleep_until`` returns once ``advance`` passes ``t``."""

    def __init__(self) -> None:
        self._now = 0.0
        self._changed = asyncio.Event()

    @property
    def started(self) -> bool:
        return True

    def start(self) -> None:
        pass

    def now(self) -> float:
        return self._now

    def advance(self, dt: float) -> None:
        self._now += dt
        self._changed.set()
        self._changed = asyncio.Event()

    async def sleep_until(self, t: float) -> None:
        while self._now < t:
            await self._changed.wait()
