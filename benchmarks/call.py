"""``bench call``: an in-process server and aiortc callers; what a receiver sees of N says."""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from benchmarks.analysis import frame_intervals_ms, lip_sync, loud_frames
from benchmarks.client import CallClient
from benchmarks.report import progress, summary
from rtc_server.app import MANAGER, create_app
from rtc_server.config import ServerConfig
from rtc_server.engine_factory import EngineFactory, load_engine_factory

SAYS = (
    "Hello there, it is good to see you today.",
    "The quick brown fox jumps over the lazy dog.",
    "I can speak, blink and move my mouth in time with my voice.",
    "Every word you hear was rendered on this machine, frame by frame.",
    "Thank you for calling, and have a wonderful afternoon.",
)


async def _server(
    factory: EngineFactory | None = None, **settings: Any
) -> tuple[str, web.AppRunner, Any]:
    """The server in this process on a free 127.0.0.1 port, with ``settings`` as config fields
    (the LLM ``echo`` unless they name one)."""
    cache = Path(tempfile.gettempdir()) / "avatar-rtc-bench"
    settings.setdefault("llm", "echo")
    config = ServerConfig.of(cache_dir=cache, ice_addresses=("127.0.0.1",), **settings)
    factory = factory or load_engine_factory(config)
    app = create_app(config, engine_loader=lambda: factory)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    while not app[MANAGER].ready:
        await asyncio.sleep(0.05)
    return f"http://127.0.0.1:{runner.addresses[0][1]}", runner, factory


def video_sent_late_s(runner: web.AppRunner) -> float:
    """How long after its instant the server of ``runner`` sends each video frame on purpose
    (``MediaSettings.video_send_delay_s``): what a measurement by arrival takes off."""
    app = runner.app
    assert app is not None
    return float(app[MANAGER].config.media.video_send_delay_s)


async def _measure(says: int, url: str | None) -> dict[str, Any]:
    runner = None
    mouth_box = None
    late = 0.0
    if url is None:
        url, runner, factory = await _server()
        mouth_box = factory.mouth_box
        late = video_sent_late_s(runner)
    client = CallClient(url)
    offsets: list[dict[str, float]] = []
    speaking: list[list[float]] = []
    """Video arrivals while each say's speech arrived, from its first loud audio frame to its
    last (the picture changes every frame there; a still idle avatar is sent at 4 fps on
    purpose, and the moments before the speech and after it, counted in before, made the
    rate depend on how long the synthesis took: 19.996 fps in one clean-clone run)."""
    try:
        started = time.monotonic()
        await client.connect()
        while not client.received.video:
            await asyncio.sleep(0.005)
        first_frame_ms = (client.received.video[0][0] - started) * 1000
        await client.wait_channel_open()
        for i in range(says):
            v0, a0 = len(client.received.video), len(client.received.audio)
            await client.say(SAYS[i % len(SAYS)])
            await client.wait_state("speaking", timeout=10)
            await client.wait_state("listening", timeout=30)
            progress(f"say {i + 1}/{says}")
            await asyncio.sleep(0.2)
            video = client.received.video[v0:]
            audio = client.received.audio[a0:]
            loud = loud_frames([p for _, _, p in audio]).tolist() if audio else []
            voiced = [a for (a, _, _), is_loud in zip(audio, loud, strict=True) if is_loud]
            if voiced:
                speaking.append([a for a, _, _ in video if voiced[0] <= a <= voiced[-1]])
            if mouth_box is not None:
                result = lip_sync(video, audio, mouth_box, video_sent_late_s=late)
                offsets.append({"offset_ms": result.offset_ms, "correlation": result.correlation})
    finally:
        await client.close()
        if runner is not None:
            await runner.cleanup()
    intervals = [x for arrivals in speaking for x in frame_intervals_ms(arrivals).tolist()]
    return {
        "connect_to_first_frame_ms": first_frame_ms,
        "receiver_fps": len(intervals) / (sum(intervals) / 1000) if intervals else 0.0,
        "frame_interval_ms": summary(intervals),
        "frame_interval_ms_samples": intervals,
        "lipsync": offsets,
        "lipsync_offset_ms": summary([o["offset_ms"] for o in offsets]),
    }


def run(says: int, url: str | None = None) -> dict[str, Any]:
    return asyncio.run(_measure(says, url))
