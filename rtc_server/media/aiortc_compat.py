"""Every place the server reaches into aiortc 1.x beyond its public API, in one module.

Each function says what it changes and why; ``tests/test_media_units.py`` pins that aiortc
still behaves as assumed, so an aiortc upgrade that breaks one fails a test, not a call.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable

import numpy as np
from aiortc import RTCRtpCodecParameters, RTCRtpSender, RTCRtpTransceiver, rtp
from aiortc.codecs.base import Encoder
from aiortc.jitterbuffer import JitterBuffer
from aiortc.rtcrtpsender import RTCEncodedFrame
from av import AudioFrame

AIORTC_AUDIO_LEVEL = rtp.compute_audio_level_dbov
"""aiortc's own audio-level function, kept before :func:`use_fast_audio_level` replaces it."""

__all__ = [
    "audio_level_dbov",
    "negotiated_codec",
    "samples_level_dbov",
    "send_encoded_audio",
    "set_receiver_jitter_buffer",
    "set_sender_encoder",
    "use_fast_audio_level",
]


def set_sender_encoder(sender: RTCRtpSender, encoder: Encoder) -> None:
    """Make ``sender`` encode with ``encoder``; call after negotiation, before it starts.

    aiortc creates its encoder lazily on the first frame only if none is set, so a preset one
    is kept.
    """
    sender._RTCRtpSender__encoder = encoder  # type: ignore[attr-defined]


def set_receiver_jitter_buffer(transceiver: RTCRtpTransceiver, buffer: JitterBuffer) -> None:
    """Replace the jitter buffer of ``transceiver``'s receiver."""
    transceiver.receiver._RTCRtpReceiver__jitter_buffer = buffer  # type: ignore[attr-defined]


def negotiated_codec(transceiver: RTCRtpTransceiver) -> str | None:
    """The MIME type negotiated for ``transceiver`` (after the local description is set)."""
    codecs = transceiver._codecs
    return str(codecs[0].mimeType) if codecs else None


def audio_level_dbov(frame: AudioFrame) -> int:
    """RFC 6465's audio level of an s16 frame, as ``aiortc.rtp.compute_audio_level_dbov``.

    aiortc computes it in a Python loop over every sample of every outgoing audio frame (960
    a frame, 50 frames a second per call): about 6 % of the server's active CPU on idle calls.
    The same arithmetic in numpy gives the same integer.
    """
    return samples_level_dbov(np.frombuffer(memoryview(frame.planes[0]), np.int16)[: frame.samples])


def samples_level_dbov(samples: np.ndarray) -> int:
    """RFC 6465's audio level of int16 samples (mono, or interleaved): -127 for silence."""
    if not samples.size:
        return -127
    x = samples.astype(np.float64)
    rms = math.sqrt(float(np.dot(x, x)) / (samples.size * 32767 * 32767))
    if rms <= 0:
        return -127
    return round(min(0.0, max(-127.0, 20 * math.log10(rms))))


EncodedSource = Callable[[], Awaitable[tuple[bytes, int, int]]]
"""Gives the next encoded audio frame: (payload, RTP time, RFC 6465 level)."""


def send_encoded_audio(sender: RTCRtpSender, source: EncodedSource) -> None:
    """Have ``sender`` send the frames ``source`` gives, already encoded, with their levels.

    aiortc's sender reads its track, then encodes each frame on an executor thread and waits
    for it (a thread hand-off both ways every 20 ms); it sends packets a track hands it as
    they are, but without their audio level. This sender's next frame comes from ``source``
    instead, level included; its track is no longer read. Only this sender changes.
    """

    async def next_encoded_frame(codec: RTCRtpCodecParameters) -> RTCEncodedFrame | None:
        payload, timestamp, level = await source()
        if not sender._enabled:  # as aiortc: a disabled sender drops what it is given
            return None
        return RTCEncodedFrame([payload], timestamp, level)

    sender._next_encoded_frame = next_encoded_frame  # type: ignore[method-assign]


def use_fast_audio_level() -> None:
    """Have every aiortc sender of this process compute audio levels with numpy."""
    rtp.compute_audio_level_dbov = audio_level_dbov
