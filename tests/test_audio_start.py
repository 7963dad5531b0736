"""A peer connection's audio starts ``MediaSettings.audio_start_s`` after it was first asked.

A browser plays a call's audio only once the first video frame is shown; audio that arrived
before waits in its jitter buffer, which then drains by ~10 ms a second, so the first seconds
were played late against the picture. The avatar is silent while the audio has not started:
speech is placed no earlier, so none of it goes unheard.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from benchmarks.client import CallClient
from musetalk_core.types import AudioChunk
from rtc_server.config import ConfigError, ServerConfig
from rtc_server.engine_factory import EngineFactory
from rtc_server.media.clock import ManualClock
from rtc_server.media.scheduler import AVScheduler
from rtc_server.media.tracks import AvatarAudioTrack
from tests.conftest import start_server
from tests.fakes import CountingEngine
from tests.waiting import wait_until

N = 1920
"""Samples per unit (48 kHz, 25 fps)."""


def _speech(units: int) -> np.ndarray:
    return (np.arange(N * units) % 7001 + 1).astype(np.int16)


async def _heard(
    audio: AvatarAudioTrack, clock: ManualClock, frames: int
) -> list[tuple[int, np.ndarray]]:
    """``frames`` frames of ``audio`` (pts, samples), moving the clock on as each is due."""
    out = []
    for _ in range(frames):
        task = asyncio.ensure_future(audio.recv())
        while not task.done():
            clock.advance(0.005)
            await asyncio.sleep(0)
        frame = task.result()
        assert frame.pts is not None
        out.append((frame.pts, frame.to_ndarray()[0]))
    return out


async def test_the_audio_starts_later_and_speech_waits_for_it() -> None:
    clock = ManualClock()
    scheduler = AVScheduler(CountingEngine(), clock)  # engine latency 40 ms: one unit
    audio = AvatarAudioTrack(clock, scheduler, start_after_s=0.3)
    scheduler.start()
    speech = _speech(5)
    # Pushed at session time 0: without the later start it would play from unit 1.
    await scheduler.push_audio(AudioChunk(speech, 48_000), segment_id=0)
    await scheduler.end_segment(0)
    frames = await _heard(audio, clock, 20)
    # First asked at 5 ms (the test's first step): 0.305 s is unit 7.6, so unit 8 (0.32 s).
    assert frames[0][0] == 8 * N
    assert [pts for pts, _ in frames] == [8 * N + 960 * i for i in range(20)]
    # The speech was placed once the audio's start was known, and plays whole from then.
    heard = np.concatenate([pcm for _, pcm in frames])
    at = np.flatnonzero(heard)[0]
    assert at % N == 0 and np.array_equal(heard[at : at + 5 * N], speech)
    assert not heard[at + 5 * N :].any()
    await scheduler.aclose()


async def test_speech_is_placed_no_earlier_than_the_audio_start() -> None:
    clock = ManualClock()
    scheduler = AVScheduler(CountingEngine(), clock)
    audio = AvatarAudioTrack(clock, scheduler, start_after_s=0.3)
    scheduler.start()
    first = asyncio.ensure_future(audio.recv())
    await asyncio.sleep(0)  # first asked at 0: its first frame is unit 8 (0.32 s)
    assert not first.done()
    speech = _speech(3)
    await scheduler.push_audio(AudioChunk(speech, 48_000), segment_id=0)
    await scheduler.end_segment(0)
    units = [scheduler.unit(k, "video") for k in range(14)]
    # The video goes on meanwhile; the speech starts with the audio, not at unit 1.
    assert [u.speaking for u in units] == [False] * 8 + [True] * 3 + [False] * 3
    clock.advance(0.33)
    assert (await asyncio.wait_for(first, 1)).pts == 8 * N
    await scheduler.aclose()


async def test_a_new_audio_track_holds_speech_until_it_is_first_asked() -> None:
    """A resumed call's track: its peer connection may take seconds to connect; speech queued
    meanwhile is placed once the track starts, after its own start delay."""
    clock = ManualClock()
    scheduler = AVScheduler(CountingEngine(), clock)
    scheduler.start()
    first = AvatarAudioTrack(clock, scheduler)
    await _heard(first, clock, 10)  # the first peer's audio ran 0.2 s
    first.stop()
    resumed = AvatarAudioTrack(clock, scheduler, from_now=True, start_after_s=0.3)
    speech = _speech(3)
    await scheduler.push_audio(AudioChunk(speech, 48_000), segment_id=0)
    await scheduler.end_segment(0)
    clock.advance(2.0)  # the new peer connects
    # Meanwhile the video of the new peer goes on: nothing plays that no audio would carry.
    now_unit = int(clock.now() * 25)
    assert not any(scheduler.unit(k, "video").speaking for k in range(now_unit))
    asked = clock.now()
    frames = await _heard(resumed, clock, 20)
    start_unit, part = divmod(frames[0][0], N)
    assert part == 0, "the new track starts on a unit"
    # The first instant 0.3 s after it was first asked (within a unit and the test's step).
    assert 0.3 <= start_unit / 25 - asked <= 0.3 + 0.04 + 0.005
    heard = np.concatenate([pcm for _, pcm in frames])
    at = np.flatnonzero(heard)[0]
    assert at % N == 0 and np.array_equal(heard[at : at + 3 * N], speech)
    await scheduler.aclose()


def test_the_audio_start_is_a_media_setting_of_at_most_2_s() -> None:
    assert ServerConfig.of().media.audio_start_s == 0.6  # the default
    assert ServerConfig.of(audio_start_s=0.0).media.audio_start_s == 0.0
    for wrong in (-0.1, 2.5):
        with pytest.raises(ConfigError, match="audio_start_s"):
            ServerConfig.of(audio_start_s=wrong)


async def _first_audio_media_time(client: CallClient) -> float:
    """Media time of the first audio packet against the first video frame's (0), by the
    sender reports, which both carry the call's clock."""
    await wait_until(
        lambda: (
            {k for k, *_ in client.sender_reports} == {"audio", "video"}
            and client.first_arrival("audio") is not None
        ),
        10.0,
        "both streams and a sender report of each",
    )
    video = client.reported_time("video", client.rtp_of("video", 0), 90_000)
    audio = client.reported_time("audio", client.rtp_of("audio", 0), 48_000)
    assert video is not None and audio is not None
    return audio - video


async def test_over_a_real_call_the_audio_begins_after_the_video(
    engine_factory: EngineFactory, cache_dir: Path
) -> None:
    server, runner = await start_server(engine_factory, cache_dir)  # the default: 0.6 s
    client = CallClient(server.url)
    try:
        await client.connect()
        started = await _first_audio_media_time(client)
        # 0.6 s after the audio was first asked, on the next instant; the audio and video
        # senders start together, within a few instants on a busy machine.
        assert 0.6 <= started <= 0.6 + 0.2, started
        apart = client.first_arrival("audio") - client.first_arrival("video")  # type: ignore[operator]
        assert apart > 0.4, apart
    finally:
        await client.close()
        await runner.cleanup()


async def test_no_sender_report_goes_out_before_the_audio_starts(
    engine_factory: EngineFactory, cache_dir: Path
) -> None:
    """aiortc's RTCP loop reports 0.5-1.5 s after the transport starts; an audio track that
    starts 2 s later has sent nothing then, and a report of NTP 0 would be the receiver's
    mapping of the stream (a clean clone once saw the audio 4e9 s before the video)."""
    server, runner = await start_server(engine_factory, cache_dir, audio_start_s=2.0)
    client = CallClient(server.url)
    try:
        await client.connect()
        started = await _first_audio_media_time(client)
        assert 2.0 <= started <= 2.0 + 0.2, started
        assert all(ntp != 0 for kind, _, ntp, _ in client.sender_reports), client.sender_reports
    finally:
        await client.close()
        await runner.cleanup()
