"""The caller's microphone, received with as little delay as the network allows."""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import av
import numpy as np
from aiortc import RTCRtpCodecParameters, RTCRtpTransceiver
from aiortc.codecs import get_decoder
from aiortc.jitterbuffer import JitterBuffer

from rtc_server.aiortc_compat import decode_on_loop, set_receiver_jitter_buffer
from rtc_server.media.libopus import OpusError, OpusMonoDecoder
from rtc_server.media.resample import StreamResampler

logger = logging.getLogger(__name__)

MIC_PREFETCH = 1
"""Packets aiortc waits for after an audio frame before releasing it (its default is 4)."""


def low_latency_audio(
    transceiver: RTCRtpTransceiver, rate: int, prefetch: int = MIC_PREFETCH
) -> None:
    """Release microphone frames after ``prefetch`` later packets instead of aiortc's 4, and
    hand them to the track's ``recv()`` as :class:`MicAudio` at ``rate`` (:class:`MicDecoder`).

    aiortc's audio jitter buffer is sized for playing audio out smoothly: it holds 80 ms. We
    only listen (VAD, STT, barge-in), where every millisecond held is reaction time lost, and
    a late or reordered packet costs a 20 ms glitch in what the VAD hears, nothing more.
    """
    if transceiver.kind != "audio":
        raise ValueError("low_latency_audio is for audio receivers")
    set_receiver_jitter_buffer(transceiver, JitterBuffer(capacity=16, prefetch=prefetch))
    # And decoded on the loop as it arrives, without a round trip through a decoder thread.
    decode_on_loop(transceiver, MicDecoder(rate))


class MicAudio(NamedTuple):
    """One received frame of the caller's microphone."""

    samples: np.ndarray
    """Mono int16 at ``rate``."""
    rate: int


class ToRate:
    """:class:`MicAudio` as int16 at ``rate``: as it is when decoded at that rate, else
    resampled as one stream (a speech-to-speech call decodes at 24 kHz; its VAD hears 16)."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self._resampler: StreamResampler | None = None

    def __call__(self, audio: MicAudio) -> np.ndarray:
        if audio.rate == self.rate:
            return audio.samples
        if self._resampler is None or self._resampler.src_rate != audio.rate:
            self._resampler = StreamResampler(audio.rate, self.rate)
        return self._resampler.feed(audio.samples)


class MicDecoder:
    """The caller's encoded frames as mono int16 at ``rate``, the rate the call listens at.

    Opus (what browsers send) is decoded by libopus straight to mono at that rate: no stereo
    48 kHz frame to mix and resample, 50 times a second a call. Other codecs (G.711 from a
    client that offers nothing else) go through aiortc's decoder, then :class:`MicDownsampler`.
    A frame that cannot be decoded is logged and skipped: the VAD hears a 20 ms gap.
    """

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self._opus: OpusMonoDecoder | None = None
        self._other: tuple[str, Any, MicDownsampler] | None = None

    def __call__(self, codec: RTCRtpCodecParameters, encoded_frame: Any) -> list[MicAudio]:
        try:
            if codec.name.lower() == "opus":
                if self._opus is None:
                    self._opus = OpusMonoDecoder(self.rate)
                return [MicAudio(self._opus.decode(encoded_frame.data), self.rate)]
            if self._other is None or self._other[0] != codec.name:
                self._other = (codec.name, get_decoder(codec), MicDownsampler(self.rate))
            _, decoder, downsample = self._other
            frames = decoder.decode(encoded_frame)
            return [
                MicAudio(downsample(f), self.rate) for f in frames if isinstance(f, av.AudioFrame)
            ]
        except (OpusError, av.FFmpegError) as exc:
            logger.warning("the caller's %s frame could not be decoded: %s", codec.name, exc)
            return []


class MicDownsampler:
    """Microphone frames (aiortc hands Opus decoded at 48 kHz stereo) to mono int16 at ``rate``.

    The channels are averaged, then one :class:`StreamResampler` for the whole call (the same
    filter as every other stream of ours) joins the 20 ms pieces without seams.
    """

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self._resampler: StreamResampler | None = None

    def __call__(self, frame: av.AudioFrame) -> np.ndarray:
        if self._resampler is None or self._resampler.src_rate != frame.sample_rate:
            self._resampler = StreamResampler(frame.sample_rate, self.rate)
        return self._resampler.feed(mono_samples(frame))


def mono_samples(frame: av.AudioFrame) -> np.ndarray:
    """One audio frame's samples, mono, on the int16 scale (float64): channels averaged."""
    data = frame.to_ndarray()
    channels = len(frame.layout.channels)
    if frame.format.is_planar:
        rows = [data[c] for c in range(channels)]
    else:  # interleaved
        flat = data.reshape(-1)
        rows = [flat[c::channels] for c in range(channels)]
    mono: np.ndarray = rows[0].astype(np.float64)
    for row in rows[1:]:
        mono += row
    if channels > 1:
        mono /= channels
    if data.dtype.kind == "f":
        mono *= 32768.0
    return mono
