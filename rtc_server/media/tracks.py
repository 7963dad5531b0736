"""Thin aiortc tracks: wait on the session clock, take the scheduled pair, stamp it."""

from __future__ import annotations

import fractions
import math

import av
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from rtc_server.media.clock import AUDIO_PTIME, AUDIO_RATE, VIDEO_RATE, MonotonicClock
from rtc_server.media.scheduler import AVScheduler

AUDIO_TIME_BASE = fractions.Fraction(1, AUDIO_RATE)
VIDEO_TIME_BASE = fractions.Fraction(1, VIDEO_RATE)


class AvatarAudioTrack(MediaStreamTrack):
    """20 ms s16 mono frames at 48 kHz, gap-free: every instant gets audio, silence if idle.

    aiortc's Opus RTP timestamps count the samples delivered, so a skipped frame would shift
    audio against video for the rest of the call.
    """

    kind = "audio"

    def __init__(self, clock: MonotonicClock, scheduler: AVScheduler) -> None:
        super().__init__()
        self._clock = clock
        self._scheduler = scheduler
        self._index = 0
        scheduler.register("audio")
        self._per_unit = round(1 / (scheduler.fps * AUDIO_PTIME))
        self._samples = int(AUDIO_RATE * AUDIO_PTIME)
        if scheduler.engine.sample_rate != AUDIO_RATE:
            raise ValueError(f"engine sample rate {scheduler.engine.sample_rate} != {AUDIO_RATE}")

    async def recv(self) -> av.AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        index = self._index
        self._index += 1
        await self._clock.sleep_until(index * AUDIO_PTIME)
        unit_index, part = divmod(index, self._per_unit)
        unit = self._scheduler.unit(unit_index, "audio")
        pcm = unit.audio.pcm[part * self._samples : (part + 1) * self._samples]
        frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = AUDIO_RATE
        frame.pts = index * self._samples
        frame.time_base = AUDIO_TIME_BASE
        return frame


class AvatarVideoTrack(MediaStreamTrack):
    """fps video; a frame that is late for its instant is dropped, never the audio."""

    kind = "video"

    def __init__(self, clock: MonotonicClock, scheduler: AVScheduler) -> None:
        super().__init__()
        self._clock = clock
        self._scheduler = scheduler
        self._next = 0
        scheduler.register("video")
        self._ticks = VIDEO_RATE // scheduler.fps

    async def recv(self) -> av.VideoFrame:
        if self.readyState != "live":
            raise MediaStreamError
        fps = self._scheduler.fps
        # Skip to the current instant when the sender fell behind (slow encode, busy loop).
        current = math.floor(self._clock.now() * fps) if self._clock.started else 0
        index = max(self._next, current)
        self._scheduler.note_video(index - self._next)
        self._next = index + 1
        await self._clock.sleep_until(index / fps)
        image = self._scheduler.unit(index, "video").image
        assert image is not None  # resolved for the video track
        frame = av.VideoFrame.from_ndarray(image, format="rgb24")
        frame.pts = index * self._ticks
        frame.time_base = VIDEO_TIME_BASE
        return frame
