"""``bench encode``: one avatar clip through our x264 settings, aiortc's defaults and VP8."""

from __future__ import annotations

import fractions
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import av
import numpy as np
from aiortc.codecs.base import Decoder, Encoder
from aiortc.codecs.h264 import H264Decoder, H264Encoder, h264_depayload
from aiortc.codecs.vpx import Vp8Decoder, Vp8Encoder, vp8_depayload
from aiortc.jitterbuffer import JitterFrame

from benchmarks.clip import Clip
from benchmarks.report import progress, summary
from rtc_server.media.h264 import TunedH264Encoder


@dataclass(frozen=True)
class Codec:
    name: str
    make_encoder: Callable[[], Encoder]
    make_decoder: Callable[[], Decoder]
    depayload: Callable[[bytes], bytes]


CODECS = (
    Codec("h264-ours", TunedH264Encoder, H264Decoder, h264_depayload),
    Codec("h264-aiortc-default", H264Encoder, H264Decoder, h264_depayload),
    Codec("vp8-aiortc-default", Vp8Encoder, Vp8Decoder, vp8_depayload),
)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float32) - b.astype(np.float32)) ** 2))
    return 99.0 if mse == 0 else 10 * np.log10(255.0**2 / mse)


def run_codec(codec: Codec, clip: Clip) -> dict[str, Any]:
    encoder, decoder = codec.make_encoder(), codec.make_decoder()
    cpu_ms, wall_ms, quality = [], [], []
    total_bytes = 0
    for i, image in enumerate(clip.images):
        frame = av.VideoFrame.from_ndarray(image, format="rgb24")
        frame.pts = i * (90_000 // clip.fps)
        frame.time_base = fractions.Fraction(1, 90_000)
        c0, w0 = time.process_time(), time.perf_counter()
        payloads, timestamp = encoder.encode(frame)
        cpu_ms.append((time.process_time() - c0) * 1000)
        wall_ms.append((time.perf_counter() - w0) * 1000)
        total_bytes += sum(len(p) for p in payloads)
        data = b"".join(codec.depayload(p) for p in payloads)
        for decoded in decoder.decode(JitterFrame(data=data, timestamp=timestamp)):
            assert isinstance(decoded, av.VideoFrame)
            quality.append(psnr(decoded.to_ndarray(format="rgb24"), image))
    seconds = len(clip.images) / clip.fps
    return {
        "codec": codec.name,
        "frames": len(clip.images),
        "cpu_ms": summary(cpu_ms),
        "wall_ms": summary(wall_ms),
        "kbps": total_bytes * 8 / seconds / 1000,
        "psnr_db": summary(quality),
        "cpu_ms_samples": cpu_ms,
    }


def run(clip: Clip, rounds: int = 1) -> list[dict[str, Any]]:
    """Codecs interleaved round by round, so machine noise hits them alike."""
    results: dict[str, list[dict[str, Any]]] = {c.name: [] for c in CODECS}
    for r in range(rounds):
        for codec in CODECS:
            results[codec.name].append(run_codec(codec, clip))
            progress(f"round {r + 1}/{rounds}: {codec.name}")
    merged = []
    for codec in CODECS:
        runs = results[codec.name]
        cpu = [s for r in runs for s in r["cpu_ms_samples"]]
        merged.append(
            {
                "codec": codec.name,
                "frames": sum(r["frames"] for r in runs),
                "cpu_ms": summary(cpu),
                "wall_ms_p50": float(np.median([r["wall_ms"]["p50"] for r in runs])),
                "kbps": float(np.median([r["kbps"] for r in runs])),
                "psnr_db": float(np.median([r["psnr_db"]["mean"] for r in runs])),
                "cpu_ms_samples": cpu,
            }
        )
    return merged
