"""Real fakes (no mocks): a deterministic lip-sync engine for media-path tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np

from musetalk_core.segments import SegmentQueue
from musetalk_core.types import AudioChunk, AvatarFrame


class CountingEngine:
    """Frames whose pixel value is the frame count; audio passed through in 1/fps slices."""

    def __init__(self, *, fps: int = 25, sample_rate: int = 48_000, size: int = 16) -> None:
        self._fps = fps
        self._rate = sample_rate
        self._size = size
        self._queue = SegmentQueue(sample_rate // fps)
        self._count = 0
        self.closed = False
        self.fail_after: int | None = None
        self.pushed_segments: list[int] = []
        self.pushed: list[AudioChunk] = []

    @property
    def fps(self) -> int:
        return self._fps

    @property
    def sample_rate(self) -> int:
        return self._rate

    @property
    def frame_size(self) -> tuple[int, int]:
        return (self._size, self._size)

    @property
    def latency(self) -> float:
        return 1 / self._fps

    async def push_audio(self, chunk: AudioChunk, segment_id: int) -> None:
        self._queue.push(chunk.pcm, segment_id)
        self.pushed_segments.append(segment_id)
        self.pushed.append(chunk)

    async def end_segment(self, segment_id: int) -> None:
        self._queue.end(segment_id)

    def clear(self) -> None:
        self._queue.clear()

    async def frames(self) -> AsyncIterator[AvatarFrame]:
        n = self._rate // self._fps
        while not self.closed:
            await asyncio.sleep(0)
            if self.fail_after is not None and self._count >= self.fail_after:
                raise RuntimeError("engine blew up")
            image = np.full((self._size, self._size, 3), self._count % 256, np.uint8)
            self._count += 1
            piece = self._queue.next_piece()
            if piece is not None:
                yield AvatarFrame(image, AudioChunk(piece.pcm, self._rate), True, piece.segment_id)
            else:
                yield AvatarFrame(image, AudioChunk(np.zeros(n, np.int16), self._rate), False, -1)

    async def aclose(self) -> None:
        self.closed = True
