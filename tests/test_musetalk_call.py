"""A full call with ``--engine musetalk`` on CPU: tiny random weights, the real scheduler.

Tiny MuseTalk on two CPU cores renders a few frames a second, far from real time, so this
checks the plumbing and the audio-first pacing, not the frame rate: the call runs at 25 fps,
the reply is heard in full, and the frames MuseTalk managed to render are the ones shown.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from benchmarks.client import CallClient
from musetalk_core.engine import MuseTalkEngine
from musetalk_core.tiny import build_random_weights
from rtc_server.config import EngineSettings, ServerConfig
from rtc_server.engine_factory import EngineFactory, load_engine_factory
from rtc_server.media.resilient_engine import ResilientEngine
from tests.conftest import start_server


@pytest.fixture(scope="module")
def musetalk_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineFactory]:
    base = tmp_path_factory.mktemp("musetalk-call")
    weights = build_random_weights(base / "weights")
    factory = load_engine_factory(
        ServerConfig.of(
            engine=EngineSettings(
                name="musetalk", weights_dir=weights, musetalk_device="cpu", musetalk_batch=4
            ),
            cache_dir=base / "cache",
        )
    )
    yield factory
    if factory.close is not None:
        factory.close()


async def test_a_call_with_the_musetalk_engine(
    musetalk_factory: EngineFactory, cache_dir: Path
) -> None:
    assert musetalk_factory.name == "musetalk", musetalk_factory.reason
    assert "cpu float32" in musetalk_factory.reason
    server, runner = await start_server(musetalk_factory, cache_dir)
    client = CallClient(server.url)
    try:
        await client.connect()
        await client.wait_channel_open()
        await client.wait_state("listening", timeout=10)
        session = server.manager.sessions[client.session_id]
        engine = session.engine
        assert isinstance(engine, ResilientEngine)
        inner = engine.engine
        assert isinstance(inner, MuseTalkEngine)
        start = len(client.received.video)
        audio_start = len(client.received.audio)
        await client.say("Hello there, this is the muse talk engine.")
        await client.wait_state("speaking", timeout=60)
        await client.wait_state("listening", timeout=60)
        await asyncio.sleep(0.3)
        video = client.received.video[start:]
        audio = client.received.audio[audio_start:]
        # On CPU even tiny MuseTalk is slower than real time: the caller may hear that the
        # animation fell behind (the picture skips ahead), and of nothing else going wrong.
        errors = [e["code"] for e in client.events if e.get("type") == "error"]
        assert set(errors) <= {"engine_behind"}, errors
    finally:
        await client.close()
        await runner.cleanup()
    assert client.video_codec() == "video/H264"
    # While the reply plays every instant goes out (an idle still picture is sent every
    # 0.25 s only, so the frames are counted between the first and last loud audio).
    loud_at = [a for a, _, p in audio if np.sqrt(np.mean(p.astype(np.float64) ** 2)) > 300]
    arrivals = np.asarray([a for a, _, _ in video])
    speaking = arrivals[(arrivals >= loud_at[0]) & (arrivals <= loud_at[-1])]
    span = loud_at[-1] - loud_at[0]
    assert len(speaking) / span >= 20, f"{len(speaking)} frames in {span:.1f} s"
    pcm = np.concatenate([p for _, _, p in audio]).astype(np.float64)
    loud = np.sqrt(np.mean(pcm**2))
    assert loud > 300, "the reply's audio reached the caller"
    # MuseTalk's own faces made it into the call, and what it could not render in time was
    # shown as the idle image rather than holding the voice back.
    assert inner.rendered_frames > 0
    assert session.scheduler.stats.speaking_units > 0
    print(
        f"speaking frames {session.scheduler.stats.speaking_units}, rendered "
        f"{inner.rendered_frames}, shown idle {inner.degraded_frames}"
    )


async def test_broken_weights_fall_back_to_warp_and_tell_the_caller(
    cache_dir: Path, tmp_path: Path
) -> None:
    factory = load_engine_factory(
        ServerConfig.of(
            engine=EngineSettings(name="musetalk", weights_dir=tmp_path / "missing"),
            cache_dir=cache_dir,
        )
    )
    assert factory.name == "warp"
    server, runner = await start_server(factory, cache_dir)
    client = CallClient(server.url)
    try:
        await client.connect()
        await client.wait_channel_open()
        event = await client.wait_event(lambda e: e.get("type") == "error", timeout=10)
        assert event["code"] == "engine_fallback"
        assert "no MuseTalk weights directory" in event["message"]
        await client.say("Still talking.")
        await client.wait_state("speaking", timeout=10)
    finally:
        await client.close()
        await runner.cleanup()
