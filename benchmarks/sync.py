"""``bench sync``: the A/V offset of a call, exactly, with the ``sync-test`` engine.

The server's engine flashes the frame and beeps the audio on the same media instant once a
second. An aiortc caller records both streams, timed by packet arrival on the sender's RTP
timeline; the offset is each flash's time minus its beep's (positive: video later).
``--video-delay-ms`` makes the engine put its beeps that much before their flashes, a known
offset the measurement must recover.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from benchmarks.analysis import beep_onsets, flash_onsets, paired_offsets_ms, stream_times
from benchmarks.call import _server
from benchmarks.client import CallClient
from benchmarks.report import progress, summary
from musetalk_core.synctest import SyncTestEngine
from rtc_server.engine_factory import VIDEO_FPS, EngineFactory
from rtc_server.media.clock import AUDIO_RATE

OPUS_DECODER_DELAY_S = 312 / 48_000
"""libopus hands back decoded audio 312 samples after the RTP time it belongs to."""


def sync_test_factory(video_delay_ms: float = 0.0) -> EngineFactory:
    """Per-call sync-test engines whose beeps come ``video_delay_ms`` before their flashes."""
    return EngineFactory(
        "sync-test",
        "bench",
        lambda: SyncTestEngine(
            fps=VIDEO_FPS, sample_rate=AUDIO_RATE, video_delay_ms=video_delay_ms
        ),
    )


async def _measure(seconds: float, video_delay_ms: float, url: str | None) -> dict[str, Any]:
    runner = None
    if url is None:
        url, runner, _ = await _server(sync_test_factory(video_delay_ms))
    elif video_delay_ms:
        raise ValueError("--video-delay-ms works on the in-process server only")
    client = CallClient(url)
    try:
        await client.connect()
        progress(f"recording {seconds:.0f} s of flashes and beeps")
        await asyncio.sleep(seconds)
        video = list(client.received.video)
        audio = list(client.received.audio)
    finally:
        await client.close()
        if runner is not None:
            await runner.cleanup()
    vt = stream_times([a for a, _, _ in video], [t for _, t, _ in video], 90_000)
    at = stream_times([a for a, _, _ in audio], [t for _, t, _ in audio], 48_000)
    flashes = flash_onsets(vt, [img for _, _, img in video])
    beeps = beep_onsets(at, np.concatenate([p for _, _, p in audio])) - OPUS_DECODER_DELAY_S
    offsets = paired_offsets_ms(flashes, beeps)
    return {
        "injected_video_delay_ms": video_delay_ms,
        "flashes": int(flashes.size),
        "beeps": int(beeps.size),
        "offset_ms": summary(offsets.tolist()),
        "offsets_ms": offsets.tolist(),
    }


def run(
    seconds: float = 6.0, video_delay_ms: float = 0.0, url: str | None = None
) -> dict[str, Any]:
    """``url``: a running server started with ``--engine sync-test``."""
    return asyncio.run(_measure(seconds, video_delay_ms, url))
