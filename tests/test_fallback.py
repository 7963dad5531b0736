"""Audio first: when the lip-sync engine dies mid-sentence, the sentence is still heard."""

from __future__ import annotations

import asyncio

import numpy as np

from musetalk_core.types import AudioChunk
from rtc_server.media.clock import ManualClock
from rtc_server.media.resilient_engine import ResilientEngine
from rtc_server.media.scheduler import AVScheduler, Unit
from tests.fakes import CountingEngine


async def _units(scheduler: AVScheduler, n: int, first: int = 0) -> list[Unit]:
    """Units first..n-1 as both tracks take them, a few loop turns apart."""
    out = []
    for k in range(first, n):
        for _ in range(4):
            await asyncio.sleep(0)
        scheduler.unit(k, "audio")
        out.append(scheduler.unit(k, "video"))
    return out


async def test_speech_survives_an_engine_failure() -> None:
    inner = CountingEngine()
    inner.fail_after = 6  # dies after six frames, mid-utterance
    failures: list[BaseException] = []
    engine = ResilientEngine(inner, on_failure=failures.append)
    scheduler = AVScheduler(engine, ManualClock(), lead_frames=2)
    speech = (np.arange(1920 * 10 + 500) % 5000 + 1).astype(np.int16)  # 10.26 frames
    await scheduler.push_audio(AudioChunk(speech, 48_000), segment_id=3)
    await scheduler.end_segment(3)
    scheduler.start()
    units = await _units(scheduler, 20)
    await scheduler.aclose()

    heard = np.concatenate([u.audio.pcm for u in units if u.speaking])
    assert len(failures) == 1 and engine.failed is not None
    # Every sample said once, in order, the last frame padded; then silence.
    assert np.array_equal(heard[: len(speech)], speech)
    assert not heard[len(speech) :].any() and len(heard) == 11 * 1920
    assert [u.segment_id for u in units if u.speaking] == [3] * 11
    # After the failure the video is a still image.
    assert len({id(u.image) for u in units[8:]}) == 1


async def test_clear_and_later_speech_after_a_failure() -> None:
    inner = CountingEngine()
    inner.fail_after = 0
    engine = ResilientEngine(inner)
    scheduler = AVScheduler(engine, ManualClock(), lead_frames=2)
    scheduler.start()
    await scheduler.push_audio(AudioChunk(np.ones(1920 * 5, np.int16), 48_000), 0)
    await _units(scheduler, 2)
    scheduler.clear()
    await scheduler.push_audio(AudioChunk(np.full(1920 * 2, 7, np.int16), 48_000), 1)
    await scheduler.end_segment(1)
    units = await _units(scheduler, 12, first=2)
    spoken = [u for u in units if u.speaking]
    assert [u.segment_id for u in spoken] == [1, 1]
    assert all((u.audio.pcm == 7).all() for u in spoken)
    await scheduler.aclose()


class BreaksWhileSpeaking:
    """A real engine that raises on its fifth speaking frame."""

    def __init__(self, engine) -> None:  # type: ignore[no-untyped-def]
        self._engine = engine

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._engine, name)

    async def frames(self):  # type: ignore[no-untyped-def]
        speaking = 0
        async for frame in self._engine.frames():
            speaking += frame.speaking
            if speaking == 5:
                raise RuntimeError("GPU fell off the bus")
            yield frame


async def test_a_call_whose_engine_breaks_still_speaks(engine_factory, cache_dir) -> None:  # type: ignore[no-untyped-def]
    from dataclasses import replace

    from benchmarks.analysis import loud_frames
    from benchmarks.client import CallClient
    from tests.conftest import start_server

    breaking = replace(engine_factory, create=lambda: BreaksWhileSpeaking(engine_factory.create()))
    server, runner = await start_server(breaking, cache_dir)
    client = CallClient(server.url)
    try:
        await client.connect()
        await client.wait_channel_open()
        await client.wait_state("listening", 5)
        start = len(client.received.audio)
        video_start = len(client.received.video)
        await client.say("The engine breaks right now, but you still hear every word I say.")
        error = await client.wait_event(lambda e: e.get("type") == "error", 10)
        assert error["code"] == "engine_failed"
        await client.wait_state("listening", 20)
        audio = client.received.audio[start:]
        video = client.received.video[video_start:]
    finally:
        await client.close()
        await runner.cleanup()
    loud_seconds = loud_frames([p for _, _, p in audio]).sum() * 0.020
    assert loud_seconds > 2.0, "the sentence was not heard after the engine failed"
    # The video goes on, its mouth frozen (up to the codec refining the still picture) while
    # the words play: a working engine moves it by 5-20 levels a frame here.
    from benchmarks.analysis import mouth_motion

    assert breaking.mouth_box is not None and len(video) > 75
    motion = mouth_motion([v for _, _, v in video], breaking.mouth_box)
    # The engine dies 0.2 s into a 4 s sentence: in the second half the mouth stays still, but
    # for the encoder refining the picture now and then (a moving mouth averages 5-20 here).
    second_half = motion[len(motion) // 2 :]
    assert len(second_half) > 40 and second_half.mean() < 1.0, motion.round(1)


async def test_a_fallback_engine_takes_over_mid_utterance() -> None:
    """MuseTalk falling over mid-sentence hands the rest of the sentence to warp."""
    inner = CountingEngine()
    inner.fail_after = 4
    replacements: list[CountingEngine] = []

    def fallback() -> CountingEngine:
        replacements.append(CountingEngine())
        return replacements[-1]

    failures: list[BaseException] = []
    engine = ResilientEngine(inner, on_failure=failures.append, fallback=fallback)
    scheduler = AVScheduler(engine, ManualClock(), lead_frames=2)
    speech = (np.arange(1920 * 10 + 500) % 5000 + 1).astype(np.int16)
    await scheduler.push_audio(AudioChunk(speech, 48_000), segment_id=3)
    await scheduler.end_segment(3)
    scheduler.start()
    units = await _units(scheduler, 20)
    heard = np.concatenate([u.audio.pcm for u in units if u.speaking])
    assert len(failures) == 1 and engine.replaced and engine.failed is None
    assert len(replacements) == 1 and inner.closed
    assert np.array_equal(heard[: len(speech)], speech), "every sample once, in order"
    assert len(heard) == 11 * 1920
    # The replacement animates the rest: moving images (its frame counter), not a still.
    after = [u for u in units if u.speaking][4:]
    assert len(after) == 7
    assert len({int(u.image[0, 0, 0]) for u in after if u.image is not None}) >= 6
    # A later utterance goes to the replacement too.
    await scheduler.push_audio(AudioChunk(np.full(1920 * 2, 9, np.int16), 48_000), 4)
    await scheduler.end_segment(4)
    more = await _units(scheduler, 30, first=20)
    assert [u.segment_id for u in more if u.speaking] == [4, 4]
    assert replacements[0].pushed_segments[-1] == 4
    await scheduler.aclose()
