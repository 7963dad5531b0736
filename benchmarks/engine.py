"""``bench engine``: per-frame cost of a lip-sync engine, speaking and idle."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from benchmarks.clip import PARAGRAPH, engine_factory
from benchmarks.report import summary
from musetalk_core.types import AudioChunk
from rtc_server.media.resample import resample_int16
from rtc_server.providers.piper_tts import PiperTTS


async def _measure(frames: int, framing: str) -> dict[str, Any]:
    factory = engine_factory(framing=framing)
    tts = PiperTTS.load()
    engine = factory.create()
    speech = []
    async for chunk in tts.synthesize(PARAGRAPH):
        pcm = resample_int16(chunk.pcm, chunk.sample_rate, engine.sample_rate)
        # With its phonemes, as a call's speech reaches the engine.
        speech.append(AudioChunk(pcm, engine.sample_rate, chunk.phonemes))
    samples: dict[str, list[float]] = {"speaking": [], "idle": []}
    cpu: dict[str, float] = {"speaking": 0.0, "idle": 0.0}
    first_frame_ms = 0.0
    try:
        stream = engine.frames()
        while len(samples["speaking"]) < frames or len(samples["idle"]) < frames:
            if len(samples["speaking"]) < frames and engine.queued_seconds < 0.2:  # type: ignore[attr-defined]
                for chunk in speech:
                    await engine.push_audio(chunk, 0)
            pushed = time.perf_counter()
            c0 = time.process_time()
            frame = await anext(stream)
            wall = (time.perf_counter() - pushed) * 1000
            used = (time.process_time() - c0) * 1000
            if not first_frame_ms:
                first_frame_ms = wall
            kind = "speaking" if frame.speaking else "idle"
            samples[kind].append(wall)
            if len(samples[kind]) <= frames:
                cpu[kind] += used
    finally:
        await engine.aclose()
    # The warp engine reuses mouths it drew: the paragraph comes round again, so say how many.
    patches = getattr(engine, "patches", None)
    return {
        "mouths": None if patches is None else {"reused": patches.hits, "drawn": patches.misses},
        "engine": factory.name,
        "frame_size": list(engine.frame_size),
        "first_frame_ms": first_frame_ms,
        "speaking_ms": summary(samples["speaking"][:frames]),
        "idle_ms": summary(samples["idle"][:frames]),
        "fps_capacity": 1000 / summary(samples["speaking"][:frames])["p50"],
        # Whole-process CPU (render, blend, audio analysis, the thread hand-off) per frame.
        "speaking_cpu_ms_per_frame": cpu["speaking"] / frames,
        "idle_cpu_ms_per_frame": cpu["idle"] / frames,
        "raw": {k: v[:frames] for k, v in samples.items()},
    }


def _timed(fn: Any, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def landmark_timing(rounds: int = 10, video_frames: int = 50) -> dict[str, Any]:
    """What avatar preparation spends finding the face mesh, models loaded: one picture, and
    one frame of a video (tracked from the previous frame)."""
    import numpy as np

    from benchmarks.portraits import grace_hopper
    from musetalk_core import landmarks
    from musetalk_core.warp_avatar import builtin_portrait

    pictures = {"built-in 512x512": builtin_portrait()}
    hopper = grace_hopper()
    if hopper is not None:
        pictures["grace_hopper 512x600"] = hopper
    landmarks.find_landmarks(pictures["built-in 512x512"])  # loads the models
    per_picture = {
        name: summary(_timed(lambda img=img: landmarks.find_landmarks(img), rounds))
        for name, img in pictures.items()
    }
    base = pictures["built-in 512x512"]
    clip = [np.roll(base, shift=(k % 7, k % 11), axis=(0, 1)) for k in range(video_frames)]
    t0 = time.perf_counter()
    landmarks.track_landmarks(clip)
    per_frame = (time.perf_counter() - t0) * 1000 / video_frames
    return {"picture_ms": per_picture, "video_frame_ms": per_frame}


def run(frames: int, framing: str = "head") -> dict[str, Any]:
    result = asyncio.run(_measure(frames, framing))
    result["landmarks"] = landmark_timing()
    return result
