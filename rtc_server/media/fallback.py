"""Audio first: if the lip-sync engine fails, the speech goes on over a still avatar.

``ResilientEngine`` wraps any LipSyncEngine and keeps its own copy of the speech pushed into
it, consumed frame by frame in step with the engine's speaking frames. When the engine raises,
the copy is what is left to say. With a ``fallback`` (MuseTalk falls back to ``warp``) the
copy goes to a fresh fallback engine, which animates the rest of the call; without one, or if
the fallback fails too, the copy is paired with the last idle image and played on. Either way
the caller always hears the answer (ARCHITECTURE §5 rule 5). The failure is reported once.

An engine that renders speech slower than real time would tear the words apart: every
instant it misses is filled with silence (measured: a sentence of 3.7 s came out over 5.9 s
from an engine at 0.6x real time; with 8 calls at once on 2 cores, half the speaking instants
of warp were silence). While it has speech to render, the time it takes per frame is watched
over ``SLOW_WINDOW`` frames. Fallen behind, it is left out: its queued speech is dropped, the
copy plays over a still image, and it gets speech again only after ``BEHIND_RETRY_S`` and at
a moment with none to render (a burst of load passes, the call keeps its animation). One
that yields nothing for ``STALL_S`` while it has speech to render has stalled: a failure.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable

import numpy as np

from musetalk_core.types import AudioChunk, AvatarFrame, LipSyncEngine

logger = logging.getLogger(__name__)

SLOW_WINDOW = 10
"""Frames over which the engine's speed is judged while it renders speech."""
SLOW_FACTOR = 1.25
"""Taking longer than this many frame periods per frame, over the window, is too slow."""
STALL_S = 2.0
"""No frame for this long while there is speech to render is a stall."""
BEHIND_RETRY_S = 30.0
"""An engine that fell behind is left out at least this long."""


class EngineBehind(RuntimeError):
    """The engine renders speech slower than real time."""


class EngineStalled(RuntimeError):
    """The engine rendered nothing for ``STALL_S`` while it had speech to render."""


class _Speech:
    """Speech audio per segment, taken out in frame-sized pieces."""

    def __init__(self, frame_samples: int) -> None:
        self.frame_samples = frame_samples
        self.segments: collections.deque[tuple[int, bytearray, list[bool]]] = collections.deque()

    def push(self, pcm: np.ndarray, segment_id: int) -> None:
        if not self.segments or self.segments[-1][0] != segment_id or self.segments[-1][2][0]:
            self.segments.append((segment_id, bytearray(), [False]))
        self.segments[-1][1].extend(pcm.astype(np.int16).tobytes())

    def end(self, segment_id: int) -> None:
        for seg, _, ended in self.segments:
            if seg == segment_id:
                ended[0] = True

    def drop_frame(self, segment_id: int) -> None:
        """The engine played one frame of ``segment_id``: forget that much of the copy."""
        while self.segments and self.segments[0][0] != segment_id:
            self.segments.popleft()  # a segment the engine finished: its padding is gone too
        if self.segments:
            del self.segments[0][1][: 2 * self.frame_samples]

    def next_frame(self) -> tuple[int, np.ndarray] | None:
        """The next full frame of speech (the last one of an ended segment padded)."""
        n = 2 * self.frame_samples
        while self.segments:
            seg, data, ended = self.segments[0]
            if len(data) >= n or (ended[0] and data):
                piece = bytes(data[:n]).ljust(n, b"\0")
                del data[:n]
                return seg, np.frombuffer(piece, np.int16).copy()
            if not ended[0]:
                return None
            self.segments.popleft()
        return None

    def clear(self) -> None:
        self.segments.clear()

    def pending(self) -> bool:
        """Is there speech the engine has not presented yet?"""
        return any(data for _, data, _ in self.segments)


class _Pace:
    """How long the engine takes per frame while it has speech to render."""

    def __init__(self, fps: int) -> None:
        self.fps = fps
        self.waits: collections.deque[float] = collections.deque(maxlen=SLOW_WINDOW)

    def took(self, seconds: float, speaking: bool) -> EngineBehind | None:
        """Count one frame; an error once the window is slower than real time allows."""
        if not speaking:
            self.waits.clear()
            return None
        self.waits.append(seconds)
        total = sum(self.waits)
        if len(self.waits) < SLOW_WINDOW or total <= SLOW_FACTOR * SLOW_WINDOW / self.fps:
            return None
        return EngineBehind(
            f"the lip-sync engine renders {SLOW_WINDOW / total:.1f} frames a second, "
            f"under the {self.fps} of real time"
        )


class ResilientEngine:
    """A LipSyncEngine that survives its inner engine: see the module docstring."""

    def __init__(
        self,
        engine: LipSyncEngine,
        *,
        on_failure: Callable[[BaseException], None] | None = None,
        fallback: Callable[[], LipSyncEngine] | None = None,
    ) -> None:
        self.engine = engine
        self.failed: BaseException | None = None
        self.on_failure = on_failure
        self.fallback = fallback
        """Makes the engine that takes over after a failure (once per call)."""
        self.replaced = False
        """True once the fallback engine has taken over."""
        self._speech = _Speech(engine.sample_rate // engine.fps)
        self._still: np.ndarray | None = None
        self.behind = 0
        """Times the engine fell behind real time."""
        self._left_out_until: float | None = None
        """Set while the engine is left out for having fallen behind."""

    @property
    def fps(self) -> int:
        return self.engine.fps

    @property
    def sample_rate(self) -> int:
        return self.engine.sample_rate

    @property
    def frame_size(self) -> tuple[int, int]:
        return self.engine.frame_size

    @property
    def latency(self) -> float:
        return self.engine.latency if self.failed is None else 1 / self.fps

    def _fail(self, exc: BaseException) -> None:
        if self.failed is None:
            self.failed = exc
            logger.error("lip-sync engine failed; speech goes on over a still image", exc_info=exc)
            if self.on_failure is not None:
                self.on_failure(exc)

    async def push_audio(self, chunk: AudioChunk, segment_id: int) -> None:
        self._speech.push(chunk.pcm, segment_id)
        if self.failed is None and self._left_out_until is None:
            try:
                await self.engine.push_audio(chunk, segment_id)
            except Exception as exc:
                self._fail(exc)

    async def end_segment(self, segment_id: int) -> None:
        self._speech.end(segment_id)
        if self.failed is None and self._left_out_until is None:
            try:
                await self.engine.end_segment(segment_id)
            except Exception as exc:
                self._fail(exc)

    def clear(self) -> None:
        self._speech.clear()
        if self.failed is None:
            try:
                self.engine.clear()
            except Exception as exc:
                self._fail(exc)

    async def frames(self) -> AsyncGenerator[AvatarFrame, None]:
        while True:
            inner = self.engine.frames()
            pace = _Pace(self.fps)
            while self.failed is None:
                if self._left_out_until is not None:
                    async with contextlib.aclosing(self._audio_first()) as units:
                        async for unit in units:
                            yield unit
                            if self._may_return():
                                break
                    pace = _Pace(self.fps)
                    continue
                pending = self._speech.pending()
                asked = time.monotonic()
                try:
                    if pending:
                        frame = await asyncio.wait_for(anext(inner), STALL_S)
                    else:
                        frame = await anext(inner)
                except StopAsyncIteration:
                    return
                except Exception as exc:
                    if pending and isinstance(exc, TimeoutError):
                        exc = EngineStalled(f"the lip-sync engine rendered nothing in {STALL_S} s")
                    if await self._replace(exc):
                        break
                    self._fail(exc)
                    break
                if (behind := pace.took(time.monotonic() - asked, pending)) is not None:
                    # This frame is not presented: its speech plays from the copy instead.
                    self._fall_behind(behind)
                    continue
                if frame.speaking:
                    self._speech.drop_frame(frame.segment_id)
                else:
                    self._still = frame.image  # a closed mouth, for the frames after a failure
                yield frame
            if self.failed is not None:
                break
        async with contextlib.aclosing(self._audio_first()) as units:
            async for unit in units:
                yield unit

    def _fall_behind(self, exc: EngineBehind) -> None:
        """Leave the engine out for a while; the caller hears of it the first time."""
        self.behind += 1
        logger.warning("%s: speech goes on over a still image for %.0f s", exc, BEHIND_RETRY_S)
        self._left_out_until = time.monotonic() + BEHIND_RETRY_S
        try:
            self.engine.clear()  # its queued speech is played from the copy
        except Exception as failure:
            self._fail(failure)
            return
        if self.behind == 1 and self.on_failure is not None:
            self.on_failure(exc)

    def _may_return(self) -> bool:
        """Give the engine that fell behind speech again? Only with none to render now."""
        assert self._left_out_until is not None
        if time.monotonic() < self._left_out_until or self._speech.pending():
            return False
        self._left_out_until = None
        return True

    async def _audio_first(self) -> AsyncGenerator[AvatarFrame, None]:
        """The copy of the speech over the last idle image; silence when there is none."""
        w, h = self.frame_size
        still = self._still if self._still is not None else np.zeros((h, w, 3), np.uint8)
        silence = np.zeros(self.sample_rate // self.fps, np.int16)
        while True:
            # Yield to the loop: the consumer paces us, but must get to run between frames.
            await asyncio.sleep(0)
            speech = self._speech.next_frame()
            if speech is None:
                yield AvatarFrame(still, AudioChunk(silence, self.sample_rate), False, -1)
            else:
                segment_id, pcm = speech
                yield AvatarFrame(still, AudioChunk(pcm, self.sample_rate), True, segment_id)

    async def _replace(self, exc: BaseException) -> bool:
        """Hand the call to the fallback engine, with the speech not yet presented."""
        if self.fallback is None or self.replaced:
            return False
        try:
            replacement = self.fallback()
        except Exception:
            logger.exception("the fallback lip-sync engine failed to start")
            return False
        logger.error("lip-sync engine failed; the fallback engine takes over", exc_info=exc)
        failed, self.engine, self.replaced = self.engine, replacement, True
        try:
            await failed.aclose()
        except Exception:
            logger.exception("the failed lip-sync engine failed to close")
        for segment_id, data, ended in list(self._speech.segments):
            if data:
                pcm = np.frombuffer(bytes(data), np.int16)
                await replacement.push_audio(AudioChunk(pcm, self.sample_rate), segment_id)
            if ended[0]:
                await replacement.end_segment(segment_id)
        if self.on_failure is not None:
            self.on_failure(exc)
        return True

    async def aclose(self) -> None:
        try:
            await self.engine.aclose()
        except Exception:
            logger.exception("lip-sync engine failed to close")
