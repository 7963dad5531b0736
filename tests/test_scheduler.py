"""The scheduler and tracks: one clock, pairs kept together, audio never starves or skips."""

from __future__ import annotations

import asyncio

import numpy as np

from musetalk_core.types import AudioChunk, LipSyncEngine
from rtc_server.media.clock import ManualClock, MonotonicClock
from rtc_server.media.scheduler import AVScheduler
from rtc_server.media.tracks import AvatarAudioTrack, AvatarVideoTrack
from tests.fakes import CountingEngine


async def _filled(scheduler: AVScheduler, n: int) -> None:
    for _ in range(200):
        if len(scheduler._ready) >= n:
            return
        await asyncio.sleep(0)


def test_fake_engine_satisfies_the_protocol() -> None:
    assert isinstance(CountingEngine(), LipSyncEngine)


async def test_both_tracks_get_the_same_pair_for_one_instant() -> None:
    engine = CountingEngine()
    scheduler = AVScheduler(engine, lead_frames=3)
    scheduler.start()
    speech = (np.arange(1920 * 4) % 1000 + 1).astype(np.int16)
    await engine.push_audio(AudioChunk(speech, 48_000), segment_id=0)
    await _filled(scheduler, 3)
    clock = MonotonicClock()
    audio = AvatarAudioTrack(clock, scheduler)
    video = AvatarVideoTrack(clock, scheduler)
    frames = [await video.recv() for _ in range(3)]
    pcm = [await audio.recv() for _ in range(6)]
    for k in range(3):
        # The engine's k-th pair: image value k, audio speech[k * 1920 : (k + 1) * 1920].
        assert frames[k].to_ndarray(format="rgb24")[0, 0, 0] == k
        halves = np.concatenate([pcm[2 * k].to_ndarray()[0], pcm[2 * k + 1].to_ndarray()[0]])
        assert np.array_equal(halves, speech[k * 1920 : (k + 1) * 1920])
    assert scheduler.stats.speaking_units == 3
    # Timestamps: video in 1/90000, audio in 1/48000, both from the same instant.
    assert [f.pts for f in frames] == [0, 3600, 7200]
    assert [f.pts for f in pcm] == [0, 960, 1920, 2880, 3840, 4800]
    assert all(f.samples == 960 and f.format.name == "s16" for f in pcm)
    await scheduler.aclose()


async def test_audio_never_starves_when_the_engine_is_empty() -> None:
    engine = CountingEngine()
    scheduler = AVScheduler(engine, lead_frames=2)  # never started: nothing is ever ready
    audio = AvatarAudioTrack(MonotonicClock(), scheduler)
    frames = [await audio.recv() for _ in range(10)]
    assert [f.pts for f in frames] == [960 * i for i in range(10)]
    assert all(not f.to_ndarray().any() for f in frames)
    assert scheduler.stats.filler_units == 5


async def test_tracks_wait_on_the_clock() -> None:
    engine = CountingEngine()
    scheduler = AVScheduler(engine)
    clock = ManualClock()
    audio = AvatarAudioTrack(clock, scheduler)  # type: ignore[arg-type]
    first = asyncio.ensure_future(audio.recv())
    await asyncio.sleep(0)
    assert first.done()  # instant 0 is due at once
    second = asyncio.ensure_future(audio.recv())
    await asyncio.sleep(0.01)
    assert not second.done()
    clock.advance(0.019)
    await asyncio.sleep(0)
    assert not second.done()
    clock.advance(0.002)
    await asyncio.wait_for(second, 1)


async def test_late_video_is_dropped_audio_is_not() -> None:
    engine = CountingEngine()
    scheduler = AVScheduler(engine)
    scheduler.start()
    clock = MonotonicClock()
    video = AvatarVideoTrack(clock, scheduler)
    audio = AvatarAudioTrack(clock, scheduler)
    await video.recv()
    await asyncio.sleep(0.2)  # the video sender stalls for 5 frame periods
    frame = await video.recv()
    assert frame.pts >= 4 * 3600
    assert scheduler.stats.video_dropped >= 3
    # Audio still walks every 20 ms instant in order, catching up without a gap.
    pts = [(await audio.recv()).pts for _ in range(12)]
    assert pts == [960 * i for i in range(12)]
    await scheduler.aclose()


async def test_clear_drops_queued_speech_at_once() -> None:
    engine = CountingEngine()
    scheduler = AVScheduler(engine, lead_frames=3)
    scheduler.start()
    await engine.push_audio(AudioChunk(np.ones(1920 * 50, np.int16), 48_000), segment_id=0)
    await _filled(scheduler, 3)
    assert scheduler.unit(0).speaking
    scheduler.clear()
    await _filled(scheduler, 1)
    assert not scheduler.unit(1).speaking
    assert not any(scheduler.unit(k).speaking for k in range(2, 6))
    await scheduler.aclose()


async def test_engine_failure_degrades_to_filler() -> None:
    engine = CountingEngine()
    engine.fail_after = 3
    scheduler = AVScheduler(engine, lead_frames=2)
    scheduler.start()
    for _ in range(20):
        await asyncio.sleep(0)
    units = [scheduler.unit(k) for k in range(8)]
    assert all(u.audio.pcm.shape == (1920,) for u in units)
    assert scheduler.stats.filler_units >= 5
    # Filler repeats the last image rather than going black.
    assert np.array_equal(units[-1].image, units[2].image)
    await scheduler.aclose()


async def test_flush_idle_lets_speech_overtake_filler() -> None:
    engine = CountingEngine()
    scheduler = AVScheduler(engine, lead_frames=3)
    scheduler.start()
    await _filled(scheduler, 3)  # three idle pairs rendered ahead
    await engine.push_audio(AudioChunk(np.ones(1920 * 5, np.int16), 48_000), segment_id=0)
    scheduler.flush_idle()
    await _filled(scheduler, 3)
    assert scheduler.unit(0).speaking
    await scheduler.aclose()


async def test_a_lagging_audio_track_keeps_every_pair() -> None:
    engine = CountingEngine()
    scheduler = AVScheduler(engine, lead_frames=2)
    scheduler.register("audio")
    scheduler.register("video")
    speech = (np.arange(1920 * 200) % 7000 + 1).astype(np.int16)
    await engine.push_audio(AudioChunk(speech, 48_000), segment_id=0)
    scheduler.start()
    got = []
    # Video runs 150 instants (6 s) ahead of audio; audio must still get every pair in order.
    for k in range(200):
        for _ in range(5):
            await asyncio.sleep(0)
        scheduler.unit(k, "video")
        if k >= 150:
            got.append(scheduler.unit(k - 150, "audio").audio.pcm)
        if k == 180:
            # While audio lags, the pairs video has shown keep their sound, not their images.
            shown = [u for i, u in scheduler._units.items() if i < k]
            assert len(shown) > 100 and len({id(u.image) for u in shown}) <= 2
    for k in range(50, 200):
        got.append(scheduler.unit(k, "audio").audio.pcm)
    heard = np.concatenate(got)
    speaking = heard[heard != 0]
    assert np.array_equal(speaking, speech[: len(speaking)])
    assert len(scheduler._units) <= 2
    await scheduler.aclose()


async def test_video_asking_for_a_dropped_pair_gets_filler() -> None:
    engine = CountingEngine()
    scheduler = AVScheduler(engine, lead_frames=2)
    scheduler.start()
    for k in range(10):
        await asyncio.sleep(0)
        scheduler.unit(k, "audio")
        scheduler.unit(k, "video")
    unit = scheduler.unit(3, "video")
    assert not unit.speaking and not unit.audio.pcm.any()
    await scheduler.aclose()
