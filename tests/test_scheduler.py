"""The scheduler and tracks: one clock, audio the master, the picture held or skipped."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest

from musetalk_core.segments import SegmentQueue
from musetalk_core.types import AudioChunk, AvatarFrame, LipSyncEngine, PhonemeSpan
from rtc_server.aiortc_compat import audio_level_dbov
from rtc_server.media.clock import ManualClock, MonotonicClock
from rtc_server.media.opus import ReplyOpusEncoder
from rtc_server.media.scheduler import AVScheduler
from rtc_server.media.tracks import AvatarAudioTrack, AvatarVideoTrack
from tests.fakes import CountingEngine

N = 1920
"""Samples per unit (48 kHz, 25 fps)."""


async def _settle(rounds: int = 50) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)


def _speech(frames: int, seed: int = 1) -> np.ndarray:
    """Distinct non-zero samples, so every piece can be told apart."""
    return (np.arange(N * frames) % 7001 + seed).astype(np.int16)


class GatedEngine:
    """Speaking frames only when the test releases them; idle frames otherwise.

    A speech image carries the first sample of the audio it shows in its first pixels, so a
    test can tell which piece's picture went out at which instant (see ``_shows``).
    """

    def __init__(self) -> None:
        self.queue = SegmentQueue(N)
        self.gate = asyncio.Semaphore(0)
        self.closed = False
        self.pushed: list[AudioChunk] = []

    fps = 25
    sample_rate = 48_000
    frame_size = (4, 4)
    latency = 0.04

    async def push_audio(self, chunk: AudioChunk, segment_id: int) -> None:
        self.pushed.append(chunk)
        self.queue.push(chunk.pcm, segment_id)

    async def end_segment(self, segment_id: int) -> None:
        self.queue.end(segment_id)

    def clear(self) -> None:
        self.queue.clear()

    def release(self, n: int) -> None:
        for _ in range(n):
            self.gate.release()

    async def frames(self) -> AsyncIterator[AvatarFrame]:
        idle = np.zeros((4, 4, 3), np.uint8)
        while not self.closed:
            if not self.queue.pending:
                await asyncio.sleep(0)
                yield AvatarFrame(idle, AudioChunk(np.zeros(N, np.int16), 48_000), False, -1)
                continue
            await self.gate.acquire()
            piece = self.queue.next_piece()
            if piece is None:
                continue
            image = np.full((4, 4, 3), 255, np.uint8)
            first = int(piece.pcm[0])
            image[0, 0, 0], image[0, 1, 0], image[0, 2, 0] = (
                piece.segment_id,
                first // 256,
                first % 256,
            )
            yield AvatarFrame(image, AudioChunk(piece.pcm, 48_000), True, piece.segment_id)

    async def aclose(self) -> None:
        self.closed = True


def _shows(image: np.ndarray | None, speech: np.ndarray) -> tuple[int, int] | None:
    """The (segment, piece) a GatedEngine speech image shows; None for idle images."""
    assert image is not None
    if image[1, 1, 0] != 255:
        return None
    first = int(image[0, 1, 0]) * 256 + int(image[0, 2, 0])
    starts = [int(speech[j * N]) for j in range(len(speech) // N)]
    return int(image[0, 0, 0]), starts.index(first)


def test_fakes_satisfy_the_protocol() -> None:
    assert isinstance(CountingEngine(), LipSyncEngine)
    assert isinstance(GatedEngine(), LipSyncEngine)


async def test_speech_is_placed_after_the_engine_latency_and_both_tracks_share_a_unit() -> None:
    engine = CountingEngine()  # latency 40 ms: one unit
    clock = MonotonicClock()
    scheduler = AVScheduler(engine, clock, lead_frames=3)
    audio = AvatarAudioTrack(clock, scheduler)
    video = AvatarVideoTrack(clock, scheduler)
    scheduler.start()
    speech = _speech(3)
    await scheduler.push_audio(AudioChunk(speech, 48_000), segment_id=0)
    await scheduler.end_segment(0)
    await _settle()
    frames = [await video.recv() for _ in range(4)]
    pcm = [await audio.recv() for _ in range(8)]
    heard = np.concatenate([f.to_ndarray()[0] for f in pcm])
    # Unit 0 is idle (the engine's latency), units 1-3 play the speech, untouched and in order.
    assert not heard[:N].any()
    assert np.array_equal(heard[N:], speech)
    # Each speech unit shows the engine's frame for that piece: CountingEngine counts frames,
    # and the three speaking frames were its consecutive ones.
    values = [int(f.to_ndarray(format="rgb24")[0, 0, 0]) for f in frames[1:]]
    assert values == [values[0], values[0] + 1, values[0] + 2]
    assert scheduler.stats.speaking_units == 3 and scheduler.stats.held_units == 0
    # Timestamps: video in 1/90000, audio in 1/48000, both from the same instant.
    assert [f.pts for f in frames] == [0, 3600, 7200, 10800]
    assert [f.pts for f in pcm] == [960 * i for i in range(8)]
    assert all(f.samples == 960 and f.format.name == "s16" for f in pcm)
    await scheduler.aclose()


async def test_the_audio_track_encodes_as_the_encoder_would_for_aiortc() -> None:
    """``recv_encoded`` (the sender's source, encoded on the loop) gives the bytes, RTP times
    and levels of the same encoder fed the track's frames as aiortc feeds them."""
    speech = np.concatenate([_speech(3), np.zeros(N * 10, np.int16)])  # speech, then silence
    runs = []
    for encoded_by_track in (True, False):
        engine = CountingEngine()
        clock = MonotonicClock()
        scheduler = AVScheduler(engine, clock, lead_frames=3)
        audio = AvatarAudioTrack(clock, scheduler)
        encoder = ReplyOpusEncoder(silence_warmup=2)
        audio.encode_with(encoder)
        scheduler.start()
        await scheduler.push_audio(AudioChunk(speech, 48_000), segment_id=0)
        await scheduler.end_segment(0)
        await _settle()
        sent = []
        for _ in range(len(speech) // 960 + 2):
            if encoded_by_track:
                sent.append(tuple(await audio.recv_encoded()))
            else:
                frame = await audio.recv()
                (payload,), timestamp = encoder.encode(frame)
                sent.append((payload, timestamp, audio_level_dbov(frame)))
        runs.append((sent, encoder.encoded, encoder.replayed))
        await scheduler.aclose()
    (by_track, encoded, replayed), by_sender = runs
    assert by_track == by_sender[0] and (encoded, replayed) == by_sender[1:]
    assert [timestamp for _, timestamp, _ in by_track] == [960 * i for i in range(len(by_track))]
    levels = [level for _, _, level in by_track]
    assert levels[0] == -127 and max(levels) > -40 and levels[-1] == -127  # idle, speech, idle
    assert replayed > 0 and encoded > 6  # the speech was coded, the long silence replayed


async def test_recv_encoded_needs_an_encoder() -> None:
    scheduler = AVScheduler(CountingEngine(), lead_frames=2)
    with pytest.raises(RuntimeError, match="encode_with"):
        await AvatarAudioTrack(MonotonicClock(), scheduler).recv_encoded()


async def test_audio_never_starves_when_the_engine_gives_nothing() -> None:
    engine = CountingEngine()
    scheduler = AVScheduler(engine, lead_frames=2)  # never started: no frame ever arrives
    audio = AvatarAudioTrack(MonotonicClock(), scheduler)
    frames = [await audio.recv() for _ in range(10)]
    assert [f.pts for f in frames] == [960 * i for i in range(10)]
    assert all(not f.to_ndarray().any() for f in frames)
    assert scheduler.stats.idle_held == 5


async def test_speech_plays_whole_when_the_engine_renders_none_of_it() -> None:
    engine = GatedEngine()  # the gate stays shut: no speaking frame is ever rendered
    clock = ManualClock()
    scheduler = AVScheduler(engine, clock)
    scheduler.start()
    speech = _speech(10)
    await scheduler.push_audio(AudioChunk(speech, 48_000), 3)
    await scheduler.end_segment(3)
    units = [scheduler.unit(k, "video") for k in range(14)]
    got = np.concatenate([u.audio.pcm for u in units])
    start = 1  # latency 40 ms at session time 0
    assert np.array_equal(got[start * N : (start + 10) * N], speech)
    assert not got[: start * N].any() and not got[(start + 10) * N :].any()
    assert [u.speaking for u in units] == [False] + [True] * 10 + [False] * 3
    # The picture is held on the last image presented, never black.
    assert scheduler.stats.held_units == 10
    assert all(u.image is units[0].image for u in units[1:11])
    await scheduler.aclose()


async def test_a_late_engine_is_held_then_moved_ahead_into_sync() -> None:
    engine = GatedEngine()
    clock = ManualClock()
    scheduler = AVScheduler(engine, clock)
    scheduler.start()
    speech = _speech(14)
    # One phoneme per piece, named by its index, so the catch-up's hand-over can be read.
    phonemes = tuple(PhonemeSpan(chr(97 + j), 0.04 * j, 0.04 * (j + 1)) for j in range(14))
    await scheduler.push_audio(AudioChunk(speech, 48_000, phonemes), 0)
    await scheduler.end_segment(0)
    await _settle()
    shown: list[tuple[int, int] | None] = []

    async def frame(k: int) -> None:
        clock.advance(1 / 25)
        shown.append(_shows(scheduler.unit(k, "video").image, speech))
        await _settle()  # a frame period: the engine renders on into the room made

    # Pieces 0-1 are rendered in time; then the engine stalls for 4 units; then it renders
    # everything it owes at once (a burst of slowness, then catching up).
    engine.release(2)
    await _settle()
    for k in range(1, 7):
        await frame(k)
    engine.release(20)
    await _settle(200)
    for k in range(7, 14):
        await frame(k)
    # Units 1-2 show pieces 0-1; units 3-6 hold piece 1's image. Piece 2 then arrives four
    # instants late: the engine is moved ahead to the clock (speech from piece 7 on, the
    # first instant it can still make), unit 7 holds, and from unit 8 on every unit shows its
    # own piece again: back in sync.
    assert shown[:2] == [(0, 0), (0, 1)]
    assert shown[2:7] == [(0, 1)] * 5
    assert shown[7:] == [(0, k - 1) for k in range(8, 14)]
    assert scheduler.stats.resyncs == 1 and scheduler.stats.stale_frames == 1
    assert scheduler.stats.held_units == 5
    # The engine got the speech again from piece 7 on, with its phonemes on a clock that
    # starts there: the mouth of piece 7 is shaped by piece 7's phoneme.
    assert engine.pushed[0].phonemes == phonemes
    handed_on = engine.pushed[-1]
    assert len(handed_on.pcm) == 7 * N
    assert [s.phoneme for s in handed_on.phonemes] == [chr(97 + j) for j in range(7, 14)]
    assert handed_on.phonemes[0].start == 0.0
    assert abs(handed_on.phonemes[0].end - 0.04) < 1e-9
    await scheduler.aclose()


async def test_a_tts_that_is_late_leaves_its_own_gap_and_speech_resumes_after_latency() -> None:
    engine = CountingEngine()
    clock = ManualClock()
    scheduler = AVScheduler(engine, clock)
    scheduler.start()
    first, second = _speech(2, seed=1), _speech(2, seed=9)
    await scheduler.push_audio(AudioChunk(first, 48_000), 0)
    await _settle()
    units = [scheduler.unit(k, "video") for k in range(5)]  # unit 1-2 play, 3-4: nothing yet
    clock.advance(5 / 25)
    await scheduler.push_audio(AudioChunk(second, 48_000), 0)
    await scheduler.end_segment(0)
    await _settle()
    units += [scheduler.unit(k, "video") for k in range(5, 9)]
    played = [False, True, True, False, False, False, True, True, False]
    assert [u.speaking for u in units] == played
    got = np.concatenate([u.audio.pcm for u in units if u.speaking])
    assert np.array_equal(got, np.concatenate([first, second]))
    assert [u.index for u in units if u.speaking] == [0, 1, 2, 3]
    await scheduler.aclose()


async def test_tracks_wait_on_the_clock() -> None:
    engine = CountingEngine()
    clock = ManualClock()
    scheduler = AVScheduler(engine, clock)
    audio = AvatarAudioTrack(clock, scheduler)
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
    clock = MonotonicClock()
    scheduler = AVScheduler(engine, clock)
    scheduler.start()
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
    clock = ManualClock()
    scheduler = AVScheduler(engine, clock, lead_frames=3)
    scheduler.start()
    await scheduler.push_audio(AudioChunk(np.ones(N * 50, np.int16), 48_000), segment_id=0)
    await _settle()
    assert scheduler.unit(1).speaking
    scheduler.clear()
    await _settle()
    assert not any(scheduler.unit(k).speaking for k in range(2, 8))
    assert not scheduler.speech_pending
    # Audio of the cleared segment that was still being synthesized is not played either.
    await scheduler.push_audio(AudioChunk(np.ones(N * 5, np.int16), 48_000), segment_id=0)
    assert not any(scheduler.unit(k).speaking for k in range(8, 14))
    await scheduler.aclose()


async def test_engine_failure_keeps_the_speech_and_the_last_image() -> None:
    engine = CountingEngine()
    engine.fail_after = 3
    clock = ManualClock()
    scheduler = AVScheduler(engine, clock, lead_frames=2)
    scheduler.start()
    await _settle()
    speech = _speech(5)
    await scheduler.push_audio(AudioChunk(speech, 48_000), 0)
    await scheduler.end_segment(0)
    units = [scheduler.unit(k, "video") for k in range(8)]
    assert all(u.audio.pcm.shape == (N,) for u in units)
    assert np.array_equal(np.concatenate([u.audio.pcm for u in units if u.speaking]), speech)
    # The picture repeats the last image rather than going black.
    assert units[-1].image is units[2].image or np.array_equal(units[-1].image, units[2].image)
    await scheduler.aclose()


async def test_a_lagging_audio_track_keeps_every_piece() -> None:
    engine = CountingEngine()
    clock = ManualClock()
    scheduler = AVScheduler(engine, clock, lead_frames=2)
    scheduler.register("audio")
    scheduler.register("video")
    speech = _speech(200)
    await scheduler.push_audio(AudioChunk(speech, 48_000), segment_id=0)
    scheduler.start()
    got = []
    # Video runs 150 instants (6 s) ahead of audio; audio must still get every piece in order.
    for k in range(200):
        for _ in range(5):
            await asyncio.sleep(0)
        scheduler.unit(k, "video")
        if k >= 150:
            got.append(scheduler.unit(k - 150, "audio").audio.pcm)
        if k == 180:
            # While audio lags, the units video has shown keep their sound, not their images.
            shown = [u for i, u in scheduler._units.items() if i < k]
            assert len(shown) > 100 and len({id(u.image) for u in shown}) <= 2
    for k in range(50, 202):
        got.append(scheduler.unit(k, "audio").audio.pcm)
    heard = np.concatenate(got)
    assert np.array_equal(heard[heard != 0], speech)
    assert len(scheduler._units) <= 3
    await scheduler.aclose()


async def test_video_asking_for_a_dropped_unit_gets_filler() -> None:
    engine = CountingEngine()
    scheduler = AVScheduler(engine, ManualClock(), lead_frames=2)
    scheduler.start()
    for k in range(10):
        await asyncio.sleep(0)
        scheduler.unit(k, "audio")
        scheduler.unit(k, "video")
    unit = scheduler.unit(3, "video")
    assert not unit.speaking and not unit.audio.pcm.any() and unit.image is not None
    await scheduler.aclose()


async def test_audio_of_another_rate_is_refused() -> None:
    scheduler = AVScheduler(CountingEngine(), ManualClock())
    try:
        await scheduler.push_audio(AudioChunk(np.zeros(160, np.int16), 16_000), 0)
    except ValueError as exc:
        assert "16000" in str(exc)
    else:
        raise AssertionError("16 kHz audio was accepted")


async def _recv_on(track: AvatarVideoTrack, clock: ManualClock) -> tuple[int, object]:
    """The next frame ``track`` sends and its pts, moving ``clock`` an instant at a time."""
    task = asyncio.ensure_future(track.recv())
    while True:
        await _settle()
        if task.done():
            return task.result().pts, task.result()
        clock.advance(0.04)


async def test_a_still_picture_repeats_sparsely_converted_once_and_speech_goes_every_frame() -> (
    None
):
    engine = GatedEngine()
    clock = ManualClock()
    scheduler = AVScheduler(engine, clock, lead_frames=3)
    video = AvatarVideoTrack(clock, scheduler, still_repeat_s=0.2)  # every 5th instant
    scheduler.start()
    await _settle()
    sent = [await _recv_on(video, clock) for _ in range(4)]
    # The idle face (one array) goes out at instants 0, 5, 10, 15, as one frame object.
    assert [pts for pts, _ in sent] == [0, 5 * 3600, 10 * 3600, 15 * 3600]
    assert all(frame is sent[0][1] for _, frame in sent)
    assert scheduler.stats.video_still == 12
    # Speech: every instant goes out, each a frame of its own.
    speech = _speech(4)
    await scheduler.push_audio(AudioChunk(speech, 48_000), segment_id=0)
    await scheduler.end_segment(0)
    engine.release(4)
    talking = [await _recv_on(video, clock) for _ in range(5)]
    frames = [f for _, f in talking]
    instants = [pts // 3600 for pts, _ in talking]
    assert instants == list(range(instants[0], instants[0] + 5)) and instants[0] > 15
    assert len({id(f) for f in frames}) == 5 and frames[0] is not sent[0][1]
    await scheduler.aclose()


class StarvedEngine:
    """Takes speech and never has a whole frame of it: idle frames only, each one counted."""

    fps = 25
    sample_rate = 48_000
    frame_size = (4, 4)
    latency = 0.04

    def __init__(self) -> None:
        self.asked = 0

    async def push_audio(self, chunk: AudioChunk, segment_id: int) -> None:
        pass

    async def end_segment(self, segment_id: int) -> None:
        pass

    def clear(self) -> None:
        pass

    async def frames(self) -> AsyncIterator[AvatarFrame]:
        idle = np.zeros((4, 4, 3), np.uint8)
        while True:
            await asyncio.sleep(0)
            self.asked += 1
            yield AvatarFrame(idle, AudioChunk(np.zeros(N, np.int16), 48_000), False, -1)

    async def aclose(self) -> None:
        pass


async def test_an_engine_waiting_for_speech_is_not_asked_for_idle_frames_in_a_spin() -> None:
    engine = StarvedEngine()
    scheduler = AVScheduler(engine, lead_frames=2)
    scheduler.start()
    try:
        # Half a frame of speech: a run of speech starts, the engine has no frame of it yet.
        await scheduler.push_audio(AudioChunk(_speech(1)[: N // 2], 48_000), 0)
        before = engine.asked
        await asyncio.sleep(0.4)
        # About one idle frame per frame time (10 in 0.4 s), not one per turn of the loop.
        assert engine.asked - before <= 20, engine.asked - before
        # More speech handed over: the engine is asked again at once, not a frame time later.
        asked = engine.asked
        await scheduler.push_audio(AudioChunk(_speech(1)[N // 2 :], 48_000), 0)
        await _settle()
        assert engine.asked > asked
    finally:
        await scheduler.aclose()
