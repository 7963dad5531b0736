"""The caller's microphone, received with as little delay as the network allows."""

from __future__ import annotations

import av
import numpy as np
from aiortc import RTCRtpTransceiver
from aiortc.jitterbuffer import JitterBuffer

from rtc_server.aiortc_compat import decode_on_loop, set_receiver_jitter_buffer

MIC_PREFETCH = 1
"""Packets aiortc waits for after an audio frame before releasing it (its default is 4)."""


def low_latency_audio(transceiver: RTCRtpTransceiver, prefetch: int = MIC_PREFETCH) -> None:
    """Release microphone frames after ``prefetch`` later packets instead of aiortc's 4.

    aiortc's audio jitter buffer is sized for playing audio out smoothly: it holds 80 ms. We
    only listen (VAD, STT, barge-in), where every millisecond held is reaction time lost, and
    a late or reordered packet costs a 20 ms glitch in what the VAD hears, nothing more.
    """
    if transceiver.kind != "audio":
        raise ValueError("low_latency_audio is for audio receivers")
    set_receiver_jitter_buffer(transceiver, JitterBuffer(capacity=16, prefetch=prefetch))
    # And decoded on the loop as it arrives, without a round trip through a decoder thread.
    decode_on_loop(transceiver)


class MicDownsampler:
    """Microphone frames (aiortc hands Opus decoded at 48 kHz stereo) to mono int16 at ``rate``.

    libswresample keeps its filter state across frames, so 20 ms pieces join without seams.
    """

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self._resampler = av.AudioResampler(format="s16", layout="mono", rate=rate)

    def __call__(self, frame: av.AudioFrame) -> np.ndarray:
        out = [f.to_ndarray().reshape(-1) for f in self._resampler.resample(frame)]
        return np.concatenate(out) if out else np.zeros(0, np.int16)
