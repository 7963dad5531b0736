"""``bench encode``: one avatar clip through our x264 settings, aiortc's defaults and VP8."""

from __future__ import annotations

import fractions
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import av
import cv2
import numpy as np
from aiortc.codecs.base import Decoder, Encoder
from aiortc.codecs.h264 import H264Decoder, H264Encoder, h264_depayload
from aiortc.codecs.vpx import Vp8Decoder, Vp8Encoder, vp8_depayload
from aiortc.jitterbuffer import JitterFrame

from benchmarks.clip import Clip
from benchmarks.report import progress, summary, table
from musetalk_core.i420 import rgb_to_i420
from rtc_server.media.h264 import TunedH264Encoder


@dataclass(frozen=True)
class Codec:
    name: str
    make_encoder: Callable[[], Encoder]
    make_decoder: Callable[[], Decoder]
    depayload: Callable[[bytes], bytes]
    i420: bool = False
    """Frames handed over in I420 (musetalk_core.i420, as the warp engine makes them), the
    whole-frame conversion timed with the encode; else RGB, converted by libswscale inside."""


CODECS = (
    Codec("h264-ours", TunedH264Encoder, H264Decoder, h264_depayload),
    Codec("h264-ours-i420", TunedH264Encoder, H264Decoder, h264_depayload, i420=True),
    Codec("h264-aiortc-default", H264Encoder, H264Decoder, h264_depayload),
    Codec("vp8-aiortc-default", Vp8Encoder, Vp8Decoder, vp8_depayload),
)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float32) - b.astype(np.float32)) ** 2))
    return 99.0 if mse == 0 else 10 * np.log10(255.0**2 / mse)


SSIM_EVERY = 10
"""SSIM costs ~20 ms a frame: every tenth frame is scored."""


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    from skimage.metrics import structural_similarity

    return float(structural_similarity(a, b, channel_axis=2, data_range=255))  # type: ignore[no-untyped-call]


def run_codec(codec: Codec, clip: Clip) -> dict[str, Any]:
    encoder, decoder = codec.make_encoder(), codec.make_decoder()
    cpu_ms, wall_ms, quality, structure = [], [], [], []
    total_bytes = 0
    for i, image in enumerate(clip.images):
        c0, w0 = time.process_time(), time.perf_counter()
        if codec.i420:
            frame = av.VideoFrame.from_ndarray(rgb_to_i420(image), format="yuv420p")
        else:
            frame = av.VideoFrame.from_ndarray(image, format="rgb24")
        frame.pts = i * (90_000 // clip.fps)
        frame.time_base = fractions.Fraction(1, 90_000)
        payloads, timestamp = encoder.encode(frame)
        cpu_ms.append((time.process_time() - c0) * 1000)
        wall_ms.append((time.perf_counter() - w0) * 1000)
        total_bytes += sum(len(p) for p in payloads)
        data = b"".join(codec.depayload(p) for p in payloads)
        for decoded in decoder.decode(JitterFrame(data=data, timestamp=timestamp)):
            assert isinstance(decoded, av.VideoFrame)
            rgb = decoded.to_ndarray(format="rgb24")
            quality.append(psnr(rgb, image))
            if i % SSIM_EVERY == 0:
                structure.append(ssim(rgb, image))
    seconds = len(clip.images) / clip.fps
    return {
        "codec": codec.name,
        "frames": len(clip.images),
        "cpu_ms": summary(cpu_ms),
        "wall_ms": summary(wall_ms),
        "kbps": total_bytes * 8 / seconds / 1000,
        "psnr_db": summary(quality),
        "ssim": summary(structure),
        "cpu_ms_samples": cpu_ms,
    }


def run_jpeg(clip: Clip, quality: int) -> dict[str, Any]:
    """Every frame as its own JPEG (what a websocket "MJPEG" avatar stream sends)."""
    cpu_ms, psnrs, structure = [], [], []
    total_bytes = 0
    for i, image in enumerate(clip.images):
        bgr = cv2.cvtColor(image, cv2.COLOR_RGB2BGR)
        c0 = time.process_time()
        ok, data = cv2.imencode(".jpg", bgr, [cv2.IMWRITE_JPEG_QUALITY, quality])
        cpu_ms.append((time.process_time() - c0) * 1000)
        if not ok:
            raise RuntimeError("JPEG encoding failed")
        total_bytes += len(data)
        back = cv2.imdecode(data, cv2.IMREAD_COLOR)
        if back is None:
            raise RuntimeError("JPEG decoding failed")
        decoded = cv2.cvtColor(back, cv2.COLOR_BGR2RGB)
        psnrs.append(psnr(decoded, image))
        if i % SSIM_EVERY == 0:
            structure.append(ssim(decoded, image))
    return {
        "codec": f"jpeg-q{quality}",
        "frames": len(clip.images),
        "cpu_ms": summary(cpu_ms),
        "kbps": total_bytes * 8 / (len(clip.images) / clip.fps) / 1000,
        "psnr_db": summary(psnrs),
        "ssim": summary(structure),
        "cpu_ms_samples": cpu_ms,
    }


def jpeg_at_equal_quality(clip: Clip, target_psnr_db: float) -> dict[str, Any]:
    """The lowest JPEG quality whose mean PSNR reaches ``target_psnr_db`` (bisection)."""
    sample = Clip(clip.images[::5], clip.audio, clip.speaking[::5], clip.fps, clip.mouth_box)
    lo, hi = 5, 100
    while lo < hi:
        mid = (lo + hi) // 2
        if run_jpeg(sample, mid)["psnr_db"]["mean"] >= target_psnr_db:
            hi = mid
        else:
            lo = mid + 1
    return run_jpeg(clip, lo)


def compare_framings(clips: dict[str, Clip], rounds: int = 1) -> list[dict[str, Any]]:
    """Our H.264 (from RGB and from I420) on the same speech rendered with each framing
    (``--framing head`` and ``full``), interleaved round by round; the face's width over the
    frame's from a face mesh found in a decoded frame."""
    from musetalk_core.framing import face_fraction

    ours = CODECS[:2]
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {
        (f, c.name): [] for f in clips for c in ours
    }
    for r in range(rounds):
        for framing, clip in clips.items():
            for codec in ours:
                runs[(framing, codec.name)].append(run_codec(codec, clip))
                progress(f"round {r + 1}/{rounds}: {framing} {codec.name}")
    rows = []
    for (framing, name), done in runs.items():
        clip = clips[framing]
        height, width = clip.images[0].shape[:2]
        cpu = [s for d in done for s in d["cpu_ms_samples"]]
        rows.append(
            {
                "framing": framing,
                "size": f"{width}x{height}",
                "face_fraction": face_fraction(clip.images[len(clip.images) // 4]),
                "codec": name,
                "frames": sum(d["frames"] for d in done),
                "cpu_ms": summary(cpu),
                "wall_ms_p50": float(np.median([d["wall_ms"]["p50"] for d in done])),
                "kbps": float(np.median([d["kbps"] for d in done])),
                "psnr_db": float(np.median([d["psnr_db"]["mean"] for d in done])),
                "ssim": float(np.median([d["ssim"]["mean"] for d in done])),
                "cpu_ms_samples": cpu,
            }
        )
    return rows


def framings_command(frames: int, rounds: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``bench encode --framing both``: both clips rendered, compared, the table printed."""
    from benchmarks.clip import engine_factory, render_clip_sync

    clips = {
        f: render_clip_sync(frames, factory=engine_factory(framing=f)) for f in ("full", "head")
    }
    results = compare_framings(clips, rounds=rounds)
    head = ["framing", "size", "face width", "codec", "CPU ms p50", "CPU ms p95", "kbps", "PSNR dB"]
    rows = [
        [r["framing"], r["size"], r["face_fraction"], r["codec"], r["cpu_ms"]["p50"]]
        + [r["cpu_ms"]["p95"], r["kbps"], r["psnr_db"]]
        for r in results
    ]
    print(table(head, rows))
    return {"frames": frames, "rounds": rounds, "framing": "both"}, results


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
                "ssim": float(np.median([r["ssim"]["mean"] for r in runs])),
                "cpu_ms_samples": cpu,
            }
        )
    ours = merged[0]
    jpeg = jpeg_at_equal_quality(clip, ours["psnr_db"])
    progress(f"JPEG at equal quality: {jpeg['codec']}")
    merged.append(
        {
            "codec": jpeg["codec"],
            "frames": jpeg["frames"],
            "cpu_ms": jpeg["cpu_ms"],
            "wall_ms_p50": jpeg["cpu_ms"]["p50"],
            "kbps": jpeg["kbps"],
            "psnr_db": jpeg["psnr_db"]["mean"],
            "ssim": jpeg["ssim"]["mean"],
            "cpu_ms_samples": jpeg["cpu_ms_samples"],
            "bandwidth_vs_h264_ours": jpeg["kbps"] / ours["kbps"],
        }
    )
    return merged
