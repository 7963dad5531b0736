"""Thin aiortc tracks: wait on the session clock, take the scheduled pair, stamp it."""

from __future__ import annotations

import fractions
import math

import av
import numpy as np
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from rtc_server.media.clock import AUDIO_PTIME, AUDIO_RATE, VIDEO_RATE, MediaClock
from rtc_server.media.opus import EncodedAudio, ReplyOpusEncoder
from rtc_server.media.scheduler import AVScheduler

AUDIO_TIME_BASE = fractions.Fraction(1, AUDIO_RATE)
VIDEO_TIME_BASE = fractions.Fraction(1, VIDEO_RATE)


class AvatarAudioTrack(MediaStreamTrack):
    """20 ms s16 mono frames at 48 kHz, gap-free: every instant gets audio, silence if idle.

    aiortc's Opus RTP timestamps count the samples delivered, so a skipped frame would shift
    audio against video for the rest of the call.

    :meth:`recv_encoded` gives the same frames encoded (Opus, on the event loop), for a sender
    that takes them so (``aiortc_compat.send_encoded_audio``).
    """

    kind = "audio"

    def __init__(
        self,
        clock: MediaClock,
        scheduler: AVScheduler,
        *,
        from_now: bool = False,
        start_after_s: float = 0.0,
    ) -> None:
        """``from_now``: the first frame is the clock's instant when the track is first asked
        (a track that takes over from an ended one: the call resumed on a new peer connection),
        not the clock's first. ``start_after_s``: the first frame is that much later than the
        first request (see ``MediaSettings.audio_start_s``); no speech is placed before it."""
        super().__init__()
        self._clock = clock
        self._scheduler = scheduler
        self._from_now = from_now
        self._start_after_s = start_after_s
        self._index: int | None = None
        """The next frame's index; None until the track has started."""
        # Speech waits to be placed until a track that may start later knows its start.
        scheduler.audio_from(None if from_now or start_after_s > 0 else 0)
        scheduler.register("audio")
        self._per_unit = round(1 / (scheduler.fps * AUDIO_PTIME))
        self._samples = int(AUDIO_RATE * AUDIO_PTIME)
        if scheduler.engine.sample_rate != AUDIO_RATE:
            raise ValueError(f"engine sample rate {scheduler.engine.sample_rate} != {AUDIO_RATE}")
        self._encoder: ReplyOpusEncoder | None = None

    def encode_with(self, encoder: ReplyOpusEncoder) -> None:
        """The encoder of :meth:`recv_encoded`."""
        self._encoder = encoder

    async def recv(self) -> av.AudioFrame:
        pcm, pts = await self._next()
        frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = AUDIO_RATE
        frame.pts = pts
        frame.time_base = AUDIO_TIME_BASE
        return frame

    def _start(self) -> int:
        """The first frame's index, at the first request: ``start_after_s`` from then."""
        now = self._clock.now() if self._from_now or self._start_after_s > 0 else 0.0
        unit = math.ceil((now + self._start_after_s) * self._scheduler.fps - 1e-6)
        self._scheduler.audio_from(unit)
        return unit * self._per_unit

    async def recv_encoded(self) -> EncodedAudio:
        """The next frame as its Opus packet, RTP time and level (see :meth:`encode_with`)."""
        if self._encoder is None:
            raise RuntimeError("recv_encoded needs an encoder: call encode_with first")
        pcm, pts = await self._next()
        return self._encoder.encode_samples(pcm, pts)

    async def _next(self) -> tuple[np.ndarray, int]:
        """The next frame's samples and its time in samples, at its instant on the clock."""
        if self.readyState != "live":
            raise MediaStreamError
        if self._index is None:
            self._index = self._start()
        index = self._index
        self._index += 1
        await self._clock.sleep_until(index * AUDIO_PTIME)
        unit_index, part = divmod(index, self._per_unit)
        unit = self._scheduler.unit(unit_index, "audio")
        pcm = unit.audio.pcm[part * self._samples : (part + 1) * self._samples]
        return pcm, index * self._samples


STILL_REPEAT_S = 0.25
"""While the avatar is idle and its picture does not change, a frame goes out this often only.
The receiver keeps showing the last frame; each repeat costs an x264 encode of ~3-4 ms and its
packets, so a still avatar costs a sixth of what 25 fps would. A repeat at least this often
bounds how long a receiver that lost a packet waits for the frame that repairs it."""


class AvatarVideoTrack(MediaStreamTrack):
    """fps video; a frame that is late for its instant is dropped, never the audio.

    A frame is taken ``scheduler.video_lead_s`` before its instant, so that the sender can encode
    it ahead and send it at the instant (``aiortc_compat.send_at_media_time``).

    Idle instants whose image is the very frame sent last are skipped for up to
    ``STILL_REPEAT_S`` (an unchanged picture is the same array: engines and the scheduler's
    held image reuse it). Speech instants always go out, so a talking face stays at fps.
    """

    kind = "video"

    def __init__(
        self,
        clock: MediaClock,
        scheduler: AVScheduler,
        still_repeat_s: float = STILL_REPEAT_S,
    ) -> None:
        super().__init__()
        self._clock = clock
        self._scheduler = scheduler
        self._next = 0
        scheduler.register("video")
        self._ticks = VIDEO_RATE // scheduler.fps
        self._still_units = max(1, round(still_repeat_s * scheduler.fps))
        self._last_image: object = None
        self._last_frame: av.VideoFrame | None = None
        self._last_sent = -self._still_units

    async def recv(self) -> av.VideoFrame:
        if self.readyState != "live":
            raise MediaStreamError
        fps = self._scheduler.fps
        while True:
            # Skip to the current instant when the sender fell behind (slow encode, busy loop).
            current = math.floor(self._clock.now() * fps) if self._clock.started else 0
            index = max(self._next, current)
            dropped = index - self._next
            self._next = index + 1
            # Taken (and encoded) the scheduler's lead before the instant; sent at it.
            await self._clock.sleep_until(index / fps - self._scheduler.video_lead_s)
            unit = self._scheduler.unit(index, "video")
            image = unit.image
            assert image is not None  # resolved for the video track
            still = image is self._last_image and not unit.speaking
            if still and index - self._last_sent < self._still_units:
                self._scheduler.note_still(dropped)
                continue
            break
        self._scheduler.note_video(dropped)
        # A still picture's repeats are one frame object, made once: encoders only read it,
        # and each is done with it before the next recv.
        frame = self._last_frame
        if not still or frame is None:
            # A 2-D image is I420 already (musetalk_core.i420): the encoder takes it as it is.
            frame = av.VideoFrame.from_ndarray(
                image, format="yuv420p" if image.ndim == 2 else "rgb24"
            )
        self._last_image, self._last_frame, self._last_sent = image, frame, index
        frame.pts = index * self._ticks
        frame.time_base = VIDEO_TIME_BASE
        return frame
