"""Audio is the master clock: an engine that falls to half real time does not touch the speech.

A real call (aiortc caller, the whole server in-process). The reply is a beep track: a 40 ms
1 kHz beep every 0.48 s, each on a frame boundary, as the TTS's audio. The engine flashes the
frame that carries each beep's onset and renders at half real time through a burst in the
middle of the reply. The caller must hear every beep exactly where the track has it (no
silence inserted, the span unchanged), keep getting video while the picture is held, and see
the flashes back on their beeps once the burst is over.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path

import numpy as np

from benchmarks.analysis import beep_onsets, flash_onsets, frame_times
from benchmarks.client import CallClient
from musetalk_core.segments import SegmentQueue
from musetalk_core.types import AudioChunk, AvatarFrame
from rtc_server.engine_factory import EngineFactory
from tests.conftest import start_server

RATE = 48_000
FPS = 25
N = RATE // FPS
PIECES = 150
"""6 s of reply."""
BEEP_EVERY = 12
"""Pieces between beep onsets: 0.48 s."""
BURST = range(20, 60)
"""Speaking frames rendered at half real time: 40 frames over 3.2 s, from about 0.8 s into the
reply to about 4 s (pieces 20-100); the pieces it skips meanwhile play over the held picture."""
OPUS_DECODER_DELAY_S = 312 / RATE


def beep_track() -> np.ndarray:
    t = np.arange(N) / RATE
    beep = (np.sin(2 * np.pi * 1000.0 * t) * 12000).astype(np.int16)
    track = np.zeros(PIECES * N, np.int16)
    for piece in range(0, PIECES, BEEP_EVERY):
        track[piece * N : (piece + 1) * N] = beep
    return track


class BeepTTS:
    """Any text is spoken as the beep track, in one chunk."""

    name = "beeps"
    sample_rate = RATE

    async def synthesize(
        self, text: str, *, previous_text: str = ""
    ) -> AsyncGenerator[AudioChunk, None]:
        yield AudioChunk(beep_track(), RATE)


class BurstEngine:
    """Flashes the frame of each beep's onset; renders ``BURST`` at half real time."""

    fps = FPS
    sample_rate = RATE
    frame_size = (128, 128)
    latency = 1 / FPS

    def __init__(self) -> None:
        self._queue = SegmentQueue(N)
        self._dark = np.full((128, 128, 3), 40, np.uint8)
        self._flash = np.full((128, 128, 3), 235, np.uint8)
        self.speaking_frames = 0
        self.closed = False

    async def push_audio(self, chunk: AudioChunk, segment_id: int) -> None:
        self._queue.push(chunk.pcm, segment_id)

    async def end_segment(self, segment_id: int) -> None:
        self._queue.end(segment_id)

    def clear(self) -> None:
        self._queue.clear()

    async def frames(self) -> AsyncIterator[AvatarFrame]:
        silence = AudioChunk(np.zeros(N, np.int16), RATE)
        previous_loud = False
        while not self.closed:
            piece = self._queue.next_piece()
            if piece is None:
                await asyncio.sleep(1 / FPS / 4)
                yield AvatarFrame(self._dark, silence, False, -1)
                continue
            if self.speaking_frames in BURST:
                await asyncio.sleep(2 / FPS)  # half real time
            else:
                await asyncio.sleep(0)
            self.speaking_frames += 1
            loud = bool(np.abs(piece.pcm).max() > 3000)
            image = self._flash if loud and not previous_loud else self._dark
            previous_loud = loud
            audio = AudioChunk(piece.pcm, RATE)
            yield AvatarFrame(image, audio, True, piece.segment_id)

    async def aclose(self) -> None:
        self.closed = True


async def test_half_real_time_engine_neither_delays_nor_tears_the_speech(
    cache_dir: Path,
) -> None:
    engines: list[BurstEngine] = []

    def create() -> BurstEngine:
        engines.append(BurstEngine())
        return engines[-1]

    factory = EngineFactory("burst", "test", create)
    server, runner = await start_server(factory, cache_dir)
    assert server.manager.providers is not None
    server.manager.providers = dataclasses.replace(server.manager.providers, tts=BeepTTS())
    client = CallClient(server.url)
    try:
        await client.connect()
        await client.wait_channel_open()
        await client.wait_state("listening", 10)
        audio_start, video_start = len(client.received.audio), len(client.received.video)
        await client.say("beeps")
        await client.wait_state("speaking", 10)
        await client.wait_state("listening", 30)
        await asyncio.sleep(0.5)
        audio = client.received.audio[audio_start:]
        video = client.received.video[video_start:]
        session = next(iter(server.manager.sessions.values()))
        stats = dataclasses.replace(session.scheduler.stats)
    finally:
        await client.close()
        await runner.cleanup()
        engines.clear()

    # The speech: every beep where the track has it, on the sender's timeline (RTP time).
    at = frame_times(audio, RATE)
    pcm = np.concatenate([p for _, _, p in audio])
    beeps = beep_onsets(at, pcm) - OPUS_DECODER_DELAY_S
    expected = np.arange(0, PIECES, BEEP_EVERY) * N / RATE
    assert len(beeps) == len(expected), beeps
    # No silence inserted anywhere: each beep follows the last by exactly the track's 0.48 s,
    # and the reply lasts exactly as long as the track.
    intervals = np.diff(beeps)
    assert np.all(np.abs(intervals - BEEP_EVERY / FPS) <= 0.020), intervals.round(3)
    span = beeps[-1] - beeps[0]
    assert abs(span - expected[-1]) <= 0.020, (span, expected[-1])

    # The burst happened, and the picture was held meanwhile, the video kept coming.
    assert stats.held_units >= 30 and stats.stale_frames >= 20, stats
    vt = frame_times(video, 90_000, server.video_sent_late_s)
    during = (vt >= beeps[0]) & (vt <= beeps[-1])
    assert during.sum() >= 0.8 * span * FPS, f"{during.sum()} frames over {span:.2f} s"

    # After the burst the flashes are back on their beeps.
    flashes = flash_onsets(vt, [img for _, _, img in video])
    after = beeps[beeps >= beeps[0] + 110 / FPS]  # from piece 110 on, long after the burst
    offsets = [(flashes[np.argmin(np.abs(flashes - b))] - b) * 1000 for b in after if flashes.size]
    assert len(offsets) == len(after) >= 3, (flashes, after)
    assert all(abs(o) <= 40 for o in offsets), offsets
    # Before the burst too: the first two beeps.
    first = [(flashes[np.argmin(np.abs(flashes - b))] - b) * 1000 for b in beeps[:2]]
    assert all(abs(o) <= 40 for o in first), first
