"""The ``sync-test`` engine: a flash and a beep on the same media instant, once a period.

A deployment check for A/V sync: whatever sits between this server and a viewer (network,
jitter buffers, the player), the distance between the flash seen and the beep heard is the
A/V offset there. Speech pushed in (a say) plays over a plain frame, so the call still works.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import numpy as np

from musetalk_core.segments import SegmentQueue
from musetalk_core.types import AudioChunk, AvatarFrame

BEEP_HZ = 1000.0
BEEP_S = 0.040
"""As long as the flash (one frame), so the two edges of each line up in a cross-correlation."""


class SyncTestEngine:
    """LipSyncEngine that flashes white with a 1 kHz beep every ``period_s`` seconds.

    ``video_delay_ms`` shifts the beeps earlier than their flashes by that much (sample exact),
    as if the video were that late: a known offset to check a measurement against.
    """

    def __init__(
        self,
        *,
        size: tuple[int, int] = (512, 512),
        fps: int = 25,
        sample_rate: int = 48_000,
        period_s: float = 1.0,
        video_delay_ms: float = 0.0,
    ) -> None:
        if sample_rate % fps:
            raise ValueError("sample_rate must be a multiple of fps")
        self._size = size
        self._fps = fps
        self._rate = sample_rate
        self._n = sample_rate // fps
        self._period = max(1, round(period_s * fps))
        self._delay = round(video_delay_ms / 1000 * sample_rate)
        w, h = size
        self._dark = np.full((h, w, 3), 40, np.uint8)
        self._flash = np.full((h, w, 3), 235, np.uint8)
        t = np.arange(round(BEEP_S * sample_rate)) / sample_rate
        self._beep = (np.sin(2 * np.pi * BEEP_HZ * t) * 12000).astype(np.int16)
        self._speech = SegmentQueue(self._n)
        self._closed = False

    @property
    def fps(self) -> int:
        return self._fps

    @property
    def sample_rate(self) -> int:
        return self._rate

    @property
    def frame_size(self) -> tuple[int, int]:
        return self._size

    @property
    def latency(self) -> float:
        return 1 / self._fps

    async def push_audio(self, chunk: AudioChunk, segment_id: int) -> None:
        if chunk.sample_rate != self._rate:
            raise ValueError(f"audio at {chunk.sample_rate} Hz; this engine takes {self._rate} Hz")
        self._speech.push(chunk.pcm, segment_id)

    async def end_segment(self, segment_id: int) -> None:
        self._speech.end(segment_id)

    def clear(self) -> None:
        self._speech.clear()

    def _pattern_audio(self, k: int) -> np.ndarray:
        """Samples [k*n, (k+1)*n) of the endless beep track."""
        n = self._n
        out = np.zeros(n, np.int16)
        start = k * n
        period = self._period * n
        # The beep of flash frame f starts at sample f*n - delay; check the two nearest flashes.
        first = (start + self._delay) // period * period
        for onset in (first - self._delay, first + period - self._delay):
            lo, hi = max(onset, start), min(onset + len(self._beep), start + n)
            if lo < hi:
                out[lo - start : hi - start] = self._beep[lo - onset : hi - onset]
        return out

    async def frames(self) -> AsyncGenerator[AvatarFrame, None]:
        k = 0
        while not self._closed:
            await asyncio.sleep(0)
            piece = self._speech.next_piece()
            if piece is not None:
                audio = AudioChunk(piece.pcm, self._rate)
                yield AvatarFrame(self._dark, audio, True, piece.segment_id)
            else:
                image = self._flash if k % self._period == 0 else self._dark
                audio = AudioChunk(self._pattern_audio(k), self._rate)
                yield AvatarFrame(image, audio, False, -1)
            k += 1

    async def aclose(self) -> None:
        self._closed = True
