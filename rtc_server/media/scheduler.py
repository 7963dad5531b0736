"""Presents the engine's (frame, audio) pairs on the session clock.

Unit k (one video frame and its 1/fps of audio) is due at ``k / fps`` of session time. Whichever
track reaches k first takes the next pair from the engine for it, so audio and video of one
pair always share one media instant. When the engine has nothing ready at that instant the unit
is filler (the last image, silence): a slow engine delays speech, it never tears it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from musetalk_core.types import AudioChunk, AvatarFrame, LipSyncEngine

logger = logging.getLogger(__name__)

MAX_HISTORY_S = 30
"""Longest a pair waits for a lagging track before it is dropped."""


@dataclass(slots=True)
class SchedulerStats:
    units: int = 0
    """Units presented (video frame instants)."""
    speaking_units: int = 0
    filler_units: int = 0
    """Units the engine had not delivered in time."""
    video_sent: int = 0
    video_dropped: int = 0
    """Video frames skipped because the video track fell behind the clock."""


class AVScheduler:
    """Pulls pairs from a LipSyncEngine ahead of time and hands them to both tracks by index."""

    def __init__(
        self,
        engine: LipSyncEngine,
        *,
        lead_frames: int = 3,
        on_unit: Callable[[int, AvatarFrame, bool], None] | None = None,
        on_video: Callable[[int], None] | None = None,
    ) -> None:
        self.engine = engine
        self.fps = engine.fps
        self.samples_per_unit = engine.sample_rate // engine.fps
        self.stats = SchedulerStats()
        self._lead = max(1, lead_frames)
        self._ready: collections.deque[AvatarFrame] = collections.deque()
        self._space = asyncio.Event()
        self._generation = 0
        self._idle_generation = 0
        self._units: dict[int, AvatarFrame] = {}
        self._position: dict[str, int] = {}
        """The latest instant each consumer asked for."""
        self._next_unit = 0
        self._on_unit = on_unit
        self._on_video = on_video
        self._task: asyncio.Task[None] | None = None
        self._silence = AudioChunk(np.zeros(self.samples_per_unit, np.int16), engine.sample_rate)
        self._last_image: np.ndarray | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._pull(), name="av-scheduler")

    async def _pull(self) -> None:
        frames = self.engine.frames()
        try:
            while True:
                while len(self._ready) >= self._lead:
                    self._space.clear()
                    await self._space.wait()
                generation, idle_generation = self._generation, self._idle_generation
                try:
                    frame = await anext(frames)
                except StopAsyncIteration:
                    return
                # A pair made before clear() (speech) or flush_idle() (filler) dropped its kind.
                if frame.speaking and generation != self._generation:
                    continue
                if not frame.speaking and idle_generation != self._idle_generation:
                    continue
                self._ready.append(frame)
        except asyncio.CancelledError:
            raise
        except Exception:
            # Rule 5: the engine failing must not end the call; filler keeps both tracks alive.
            logger.exception("lip-sync engine failed; presenting filler from now on")

    def unit(self, k: int, consumer: str = "audio") -> AvatarFrame:
        """The pair presented at instant k; assigned on first request, never blocking.

        ``consumer`` ("audio" or "video") says which track asks: a pair is kept until both
        tracks have passed it, so either may lag the other. Audio walks every instant; video
        may skip ahead, and a pair it asks for after audio dropped it comes back as filler.
        """
        self._position[consumer] = max(k, self._position.get(consumer, k))
        unit = self._units.get(k)
        if unit is None and k < self._next_unit:
            return self._filler()
        if unit is None:
            self._assign_through(k)
            unit = self._units[k]
        self._evict()
        return unit

    def register(self, consumer: str) -> None:
        """A track that will ask for pairs: none is dropped before it has passed them."""
        self._position.setdefault(consumer, -1)

    def _evict(self) -> None:
        passed = min(self._position.values())
        # A consumer that stopped asking must not hold pairs forever: keep 30 s at most.
        passed = max(passed, self._next_unit - MAX_HISTORY_S * self.fps)
        for old in [i for i in self._units if i < passed]:
            del self._units[old]
        if len(self._units) > 2 * self.fps and "video" in self._position:
            # Audio lags far behind (an overloaded sender): keep its sound, not the images.
            video = self._position["video"]
            for i, u in self._units.items():
                if i < video and u.image is not self._last_image:
                    self._units[i] = AvatarFrame(
                        self._last_image if self._last_image is not None else u.image,
                        u.audio,
                        u.speaking,
                        u.segment_id,
                    )

    def _assign_through(self, k: int) -> None:
        while self._next_unit <= k:
            index = self._next_unit
            self._next_unit += 1
            filler = not self._ready
            if filler:
                unit = self._filler()
                self.stats.filler_units += 1
            else:
                unit = self._ready.popleft()
                self._space.set()
            self._last_image = unit.image
            self._units[index] = unit
            self.stats.units += 1
            if unit.speaking:
                self.stats.speaking_units += 1
            if self._on_unit is not None:
                self._on_unit(index, unit, filler)

    def note_video(self, dropped: int) -> None:
        """The video track sent one frame after skipping ``dropped`` late ones."""
        self.stats.video_sent += 1
        self.stats.video_dropped += dropped
        if self._on_video is not None:
            self._on_video(dropped)

    def _filler(self) -> AvatarFrame:
        image = self._last_image
        if image is None:
            w, h = self.engine.frame_size
            image = np.zeros((h, w, 3), np.uint8)
        return AvatarFrame(image=image, audio=self._silence, speaking=False, segment_id=-1)

    def clear(self) -> None:
        """Barge-in: drop pairs rendered ahead and queued audio; the next unit is idle."""
        self._generation += 1
        self.engine.clear()
        self._ready.clear()
        self._space.set()
        for index in [i for i in self._units if i >= self._next_unit]:
            del self._units[index]

    def flush_idle(self) -> None:
        """Speech is coming: drop idle pairs rendered ahead, so it does not queue behind them.

        Saves up to ``lead_frames`` frame periods on the reply's first frame.
        """
        self._idle_generation += 1
        kept = [f for f in self._ready if f.speaking]
        self._ready.clear()
        self._ready.extend(kept)
        self._space.set()

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
