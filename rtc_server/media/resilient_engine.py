"""Audio first: if the lip-sync engine fails, the speech goes on over a still avatar.

``ResilientEngine`` wraps any LipSyncEngine and keeps its own copy of the speech pushed into
it, consumed frame by frame in step with the engine's speaking frames. When the engine raises,
the copy is what is left to say. With a ``fallback`` (MuseTalk falls back to ``warp``) the
copy goes to a fresh fallback engine, which animates the rest of the call; without one, or if
the fallback fails too, the copy is paired with the last idle image and played on. Either way
the caller always hears the answer. The failure is reported once.

An engine that renders slower than real time is not this module's concern: the scheduler
plays the speech on the clock whatever the engine does, holds the picture, and moves an engine
that fell behind ahead to the clock (rtc_server/media/scheduler.py). One that yields nothing
for ``STALL_S`` while it has speech to render has stalled: a failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable

import numpy as np

from musetalk_core.segments import SegmentQueue
from musetalk_core.types import AudioChunk, AvatarFrame, EngineError, LipSyncEngine

logger = logging.getLogger(__name__)

STALL_S = 2.0
"""No frame for this long while there is speech to render is a stall."""


class EngineStalled(EngineError):
    """The engine rendered nothing for ``STALL_S`` while it had speech to render."""


class ResilientEngine:
    """A LipSyncEngine that survives its inner engine: see the module docstring."""

    def __init__(
        self,
        engine: LipSyncEngine,
        *,
        on_failure: Callable[[BaseException], None] | None = None,
        fallback: Callable[[], LipSyncEngine] | None = None,
        stall_s: float = STALL_S,
    ) -> None:
        self.engine = engine
        self.stall_s = stall_s
        """No frame for this long while there is speech to render is a stall."""
        self.failed: BaseException | None = None
        self.on_failure = on_failure
        self.fallback = fallback
        """Makes the engine that takes over after a failure (once per call)."""
        self.replaced = False
        """True once the fallback engine has taken over."""
        self._speech = SegmentQueue(engine.sample_rate // engine.fps)
        self._still: np.ndarray | None = None

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
        self._speech.push_chunk(chunk, segment_id)
        if self.failed is None:
            try:
                await self.engine.push_audio(chunk, segment_id)
            except Exception as exc:
                self._fail(exc)

    async def end_segment(self, segment_id: int) -> None:
        self._speech.end(segment_id)
        if self.failed is None:
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
        while self.failed is None:
            inner = self.engine.frames()
            while self.failed is None:
                pending = self._speech.pending
                try:
                    if pending:
                        # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a
                        # cancellation that arrives as the frame does, and the call's close
                        # then waits for ever on the scheduler's task.
                        async with asyncio.timeout(self.stall_s):
                            frame = await anext(inner)
                    else:
                        frame = await anext(inner)
                except StopAsyncIteration:
                    return
                except Exception as exc:
                    if pending and isinstance(exc, TimeoutError):
                        exc = EngineStalled(
                            f"the lip-sync engine rendered nothing in {self.stall_s} s"
                        )
                    if await self._replace(exc):
                        break
                    self._fail(exc)
                    break
                if frame.speaking:
                    self._speech.skip(frame.segment_id)
                else:
                    self._still = frame.image  # a closed mouth, for the frames after a failure
                yield frame
        async with contextlib.aclosing(self._audio_first()) as units:
            async for unit in units:
                yield unit

    async def _audio_first(self) -> AsyncGenerator[AvatarFrame, None]:
        """The copy of the speech over the last idle image; silence when there is none."""
        w, h = self.frame_size
        still = self._still if self._still is not None else np.zeros((h, w, 3), np.uint8)
        silence = np.zeros(self.sample_rate // self.fps, np.int16)
        while True:
            # Yield to the loop: the consumer paces us, but must get to run between frames.
            await asyncio.sleep(0)
            piece = self._speech.next_piece()
            if piece is None:
                yield AvatarFrame(still, AudioChunk(silence, self.sample_rate), False, -1)
            else:
                audio = AudioChunk(piece.pcm, self.sample_rate)
                yield AvatarFrame(still, audio, True, piece.segment_id)

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
        for segment_id, taken, pcm, ended in self._speech.remaining():
            if len(pcm):
                phonemes = self._speech.phonemes_from(segment_id, taken)
                chunk = AudioChunk(pcm, self.sample_rate, phonemes)
                await replacement.push_audio(chunk, segment_id)
            if ended:
                await replacement.end_segment(segment_id)
        if self.on_failure is not None:
            self.on_failure(exc)
        return True

    async def aclose(self) -> None:
        try:
            await self.engine.aclose()
        except Exception:
            logger.exception("lip-sync engine failed to close")
