"""x264 settings for real-time talking-head video, plugged into aiortc's H.264 sender.

aiortc's own encoder uses x264's "medium" preset (subme 7, 3 reference frames) on two sliced
threads, at a fixed average bitrate. Encode time turns into A/V sync error (aiortc pairs NTP
with *send* time) and into CPU per call, so we encode with "ultrafast" on one thread per call,
at constant quality (CRF) capped at the sender's target bitrate. Measured on the avatar clip
(`avatar-rtc bench encode`, docs/DECISIONS.md): 3.0 ms of CPU a frame at p50 instead of 3.7 ms
for our earlier "veryfast" at ABR and 6.6 ms for aiortc's default, at about the same PSNR for
fewer bits. The keyframe interval stays at 10 s: on a mostly still talking head every extra
IDR costs more than it is worth (2 s doubled the idle bitrate), and a receiver that loses a
packet asks for one with a PLI anyway.
"""

from __future__ import annotations

import fractions
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import av
from aiortc.codecs.h264 import H264Encoder


@dataclass(frozen=True, slots=True)
class X264Settings:
    preset: str = "ultrafast"
    tune: str = "zerolatency"
    keyint: int = 250
    """Frames between keyframes (10 s at 25 fps)."""
    threads: int = 1
    """One encode thread per call: calls scale across cores instead of fighting for them."""
    fps: int = 25
    crf: int = 17
    """Constant quality, capped at the sender's target bitrate (VBV): a still or slowly moving
    face costs what it needs, not the whole budget. Under plain ABR x264 kept spending the
    target on refining an unchanged picture (~4 KB a frame, 0.85 Mbit/s for a still avatar)."""
    vbv_s: float = 0.5
    """VBV buffer in seconds of the target bitrate: how far a keyframe may burst above it."""

    def options(self, bitrate: int | None = None) -> dict[str, str]:
        options = {
            "level": "31",
            "preset": self.preset,
            "tune": self.tune,
            "g": str(self.keyint),
            "keyint_min": str(self.keyint),
            "threads": str(self.threads),
            "crf": str(self.crf),
        }
        if bitrate:
            options["maxrate"] = str(bitrate)
            options["bufsize"] = str(int(bitrate * self.vbv_s))
        return options


class TunedH264Encoder(H264Encoder):
    """aiortc's H264Encoder with our x264 settings; packetization and REMB handling unchanged."""

    def __init__(
        self,
        settings: X264Settings | None = None,
        on_encode: Callable[[float], None] | None = None,
    ) -> None:
        super().__init__()
        self.settings = settings or X264Settings()
        self._on_encode = on_encode

    def _encode_frame(self, frame: av.VideoFrame, force_keyframe: bool) -> Iterator[bytes]:
        codec = self.codec
        if (
            codec is None
            or frame.width != codec.width
            or frame.height != codec.height
            or abs(self.target_bitrate - (codec.bit_rate or 0)) > 0.1 * (codec.bit_rate or 0)
        ):
            # Same rebuild rule as the parent; creating it here means the parent keeps ours.
            self.buffer_data = b""
            self.buffer_pts = None
            codec = av.CodecContext.create("libx264", "w")
            codec.width = frame.width
            codec.height = frame.height
            codec.bit_rate = self.target_bitrate
            codec.pix_fmt = "yuv420p"
            codec.framerate = fractions.Fraction(self.settings.fps, 1)
            codec.time_base = fractions.Fraction(1, self.settings.fps)
            codec.options = self.settings.options(self.target_bitrate)
            codec.profile = "Baseline"
            self.codec = codec
        if self._on_encode is None:
            yield from super()._encode_frame(frame, force_keyframe)
            return
        start = time.thread_time()
        nals = list(super()._encode_frame(frame, force_keyframe))
        self._on_encode(time.thread_time() - start)
        yield from nals
