"""Audio first: if the lip-sync engine fails, the speech goes on over a still avatar.

``ResilientEngine`` wraps any LipSyncEngine and keeps its own copy of the speech pushed into
it, consumed frame by frame in step with the engine's speaking frames. When the engine raises,
the copy is what is left to say. With a ``fallback`` (MuseTalk falls back to ``warp``) the
copy goes to a fresh fallback engine, which animates the rest of the call; without one, or if
the fallback fails too, the copy is paired with the last idle image and played on. Either way
the caller always hears the answer (ARCHITECTURE §5 rule 5). The failure is reported once.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncGenerator, Callable

import numpy as np

from musetalk_core.types import AudioChunk, AvatarFrame, LipSyncEngine

logger = logging.getLogger(__name__)


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
        while True:
            inner = self.engine.frames()
            while self.failed is None:
                try:
                    frame = await anext(inner)
                except StopAsyncIteration:
                    return
                except Exception as exc:
                    if await self._replace(exc):
                        break
                    self._fail(exc)
                    break
                if frame.speaking:
                    self._speech.drop_frame(frame.segment_id)
                else:
                    self._still = frame.image  # a closed mouth, for the frames after a failure
                yield frame
            if self.failed is not None:
                break
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
