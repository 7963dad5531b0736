"""Calls whose model hears and speaks (``--conversation openai-realtime``), against a local
stand-in of the Realtime API (benchmarks/realtime_standin.py) over a real WebRTC call."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks.analysis import Frame, lip_sync, pcm_by_rtp_time
from benchmarks.client import CallClient
from benchmarks.clip import speech_pcm
from benchmarks.latency import connect_caller
from benchmarks.realtime_standin import KEY, RATE, RealtimeStandIn
from rtc_server.engine_factory import VIDEO_FPS, EngineFactory
from rtc_server.media.resample import resample_int16
from tests.conftest import LiveServer, start_server
from tests.waiting import wait_until

QUESTION = "What is the capital of France?"
REPLY = "The capital of France is Paris. It lies on the river Seine."
FRAME_MS = 1000 / VIDEO_FPS
"""One video frame: the grain of what the caller was shown and heard."""


def _loud(pcm: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.abs(pcm.astype(np.int32)) > 328)  # -40 dBFS


async def _server(
    engine_factory: EngineFactory, cache_dir: Path, standin: RealtimeStandIn, **config: object
) -> tuple[LiveServer, object]:
    return await start_server(
        engine_factory,
        cache_dir,
        mode="openai-realtime",
        openai_api_key=KEY,
        openai_base_url=standin.base_url,
        **config,
    )


@pytest.fixture
async def reply_pcm() -> np.ndarray:
    return await speech_pcm(REPLY, RATE)


@pytest.fixture
async def standin(reply_pcm: np.ndarray) -> AsyncIterator[RealtimeStandIn]:
    async with RealtimeStandIn(reply_pcm, REPLY, heard=QUESTION) as server:
        yield server


@pytest.fixture
async def realtime_server(
    engine_factory: EngineFactory, cache_dir: Path, standin: RealtimeStandIn
) -> AsyncIterator[LiveServer]:
    server, runner = await _server(engine_factory, cache_dir, standin)
    try:
        yield server
    finally:
        await runner.cleanup()  # type: ignore[attr-defined]


@dataclass
class _Asked:
    """A spoken question and what the caller got back: the call's events, the turn event, and
    the audio and video from before the reply to its end."""

    question: np.ndarray
    events: list[dict[str, Any]]
    turn: dict[str, Any]
    audio: list[Frame]
    video: list[Frame]


async def _ask(server: LiveServer, standin: RealtimeStandIn) -> _Asked:
    """The caller says QUESTION, is told the transcript and hears the reply."""
    question = await speech_pcm(QUESTION)
    client, mic = await connect_caller(server.url)
    try:
        await wait_until(lambda: len(standin.connections) == 1, 10, "the call connected")
        # From before the reply: its first packets may come before the state event.
        audio_from = len(client.received.audio)
        video_from = len(client.received.video)
        mic.play(question)
        transcript = await client.wait_event(lambda e: e.get("type") == "transcript", 20)
        assert transcript["text"] == QUESTION
        await client.wait_state("speaking", 10)
        turn = await client.wait_event(lambda e: e.get("type") == "turn", 30)
        await asyncio.sleep(0.3)
        audio = client.received.audio[audio_from:]
        video = client.received.video[video_from:]
    finally:
        await client.close()
    return _Asked(question, client.events, turn, audio, video)


def _answered(
    server: LiveServer, standin: RealtimeStandIn, asked: _Asked, reply_pcm: np.ndarray
) -> None:
    """The question was heard whole and the reply came: its transcript as response events,
    its audio whole, lip-synced."""
    conn = standin.connections[0]
    # The caller's speech went as it was heard, whole: the committed turn holds the question
    # (its sound from first to last sample) and not much more than the VAD's hang-over after it.
    assert len(conn.committed) == 1
    said = _loud(resample_int16(asked.question, 48_000, RATE))
    got = _loud(conn.committed[0])
    assert abs((got[-1] - got[0]) - (said[-1] - said[0])) / RATE < 0.1
    # The transcript, as response events, sentence by sentence.
    parts = [e["text"] for e in asked.events if e.get("type") == "response"]
    assert " ".join(parts) == REPLY
    assert asked.turn["metrics"]["first_audio_out_ms"] > 0
    # The reply reached the caller whole: from its first sound to its last, as long as the
    # service's audio.
    pcm = pcm_by_rtp_time(asked.audio)
    spoken, reference = _loud(pcm), _loud(resample_int16(reply_pcm, RATE, 48_000))
    spoken_s = (spoken[-1] - spoken[0]) / 48_000
    reference_s = (reference[-1] - reference[0]) / 48_000
    assert abs(spoken_s - reference_s) <= 0.04, (spoken_s, reference_s)
    # And the mouth follows it.
    box = server.manager.engine_factory.mouth_box  # type: ignore[union-attr]
    assert box is not None
    result = lip_sync(asked.video, asked.audio, box, video_sent_late_s=server.video_sent_late_s)
    print(f"lip-sync: offset {result.offset_ms:+.0f} ms, correlation {result.correlation:.2f}")
    assert result.correlation >= 0.5
    assert abs(result.offset_ms) <= 40


async def test_a_spoken_question_gets_a_transcript_and_a_lip_synced_spoken_reply(
    realtime_server: LiveServer, standin: RealtimeStandIn, reply_pcm: np.ndarray
) -> None:
    names = [(c.slot, c.name) for c in realtime_server.manager.choices]
    assert names[:2] == [("stt", "openai-realtime"), ("llm", "openai-realtime")]
    asked = await _ask(realtime_server, standin)
    assert standin.violations == []
    conn = standin.connections[0]
    assert conn.model == "gpt-realtime"
    session = conn.session
    assert session is not None and session["audio"]["input"]["turn_detection"] is None
    assert session["audio"]["input"]["transcription"] == {"model": "gpt-4o-mini-transcribe"}
    assert len(conn.sent("input_audio_buffer.append")) >= 10  # streamed, not sent at the end
    _answered(realtime_server, standin, asked, reply_pcm)


async def test_service_turns_a_spoken_question_is_ended_and_answered_by_the_service(
    engine_factory: EngineFactory, cache_dir: Path, standin: RealtimeStandIn, reply_pcm: np.ndarray
) -> None:
    server, runner = await _server(engine_factory, cache_dir, standin, realtime_turns="service")
    try:
        asked = await _ask(server, standin)
    finally:
        await runner.cleanup()
    assert standin.violations == [] and standin.errors == []
    assert not any(e.get("type") == "error" for e in asked.events), asked.events
    conn = standin.connections[0]
    assert conn.session is not None
    assert conn.session["audio"]["input"]["turn_detection"] == {"type": "server_vad"}
    # The service heard the turn end and answered it: we neither committed nor asked.
    assert conn.sent("input_audio_buffer.commit") == []
    assert conn.sent("response.create") == []
    assert len(conn.speech) == 1 and conn.responses == 1
    _answered(server, standin, asked, reply_pcm)


def _tone(seconds: float) -> np.ndarray:
    """A steady voiced sound: every 10 ms of it is loud, so the cut is sharp to find."""
    t = np.arange(int(seconds * RATE)) / RATE
    wave = sum(np.sin(2 * np.pi * 180 * k * t) / k for k in range(1, 6))
    return (wave / np.abs(wave).max() * 8000).astype(np.int16)


async def _barge_in(
    engine_factory: EngineFactory, cache_dir: Path, **config: object
) -> tuple[RealtimeStandIn, list[dict[str, object]], list[Frame]]:
    """A spoken question, and the caller speaking again 1.5 s into the reply (a steady tone of
    8 s); returns the stand-in, the call's events and the audio the caller got."""
    async with RealtimeStandIn(_tone(8.0), "La " * 40, pace=1.5) as standin:
        server, runner = await _server(engine_factory, cache_dir, standin, **config)
        try:
            question = await speech_pcm(QUESTION)
            client, mic = await connect_caller(server.url)
            try:
                # From before the reply: its first packets may come before the state event.
                audio_from = len(client.received.audio)
                mic.play(question)
                await client.wait_state("speaking", 20)
                await asyncio.sleep(1.5)
                mic.play(await speech_pcm("Stop, please."))  # the caller barges in
                await client.wait_state("listening", 10)
                await wait_until(
                    lambda: standin.connections[0].truncates, 5, "the service got a truncate"
                )
                # What the caller said is answered.
                await client.wait_state("speaking", 20)
                await asyncio.sleep(0.3)
                audio = client.received.audio[audio_from:]
            finally:
                await client.close()
        finally:
            await runner.cleanup()
    assert standin.violations == []
    return standin, client.events, audio


def _heard_ms(audio: list[Frame]) -> int:
    """What the caller heard of the reply: the steady tone's sound from its start to where it
    stopped (the first silence of 100 ms or more), counted in 10 ms windows, so that a moment
    the service's audio came late (a short silence in it) is not counted as heard."""
    pcm = pcm_by_rtp_time(audio)
    loud = _loud(pcm)
    gaps = np.flatnonzero(np.diff(loud) > 4_800)
    end = loud[gaps[0]] if gaps.size else loud[-1]
    windows = pcm[loud[0] : end + 1][: (end + 1 - loud[0]) // 480 * 480].reshape(-1, 480)
    sounding = np.abs(windows.astype(np.int32)).max(axis=1) > 328
    return 10 * int(sounding.sum())


def _truncated_at_what_was_heard(standin: RealtimeStandIn, audio: list[Frame]) -> None:
    truncate = standin.connections[0].truncates[0]
    heard_ms = _heard_ms(audio)
    print(f"truncated at {truncate.audio_end_ms} ms; the caller heard {heard_ms:.0f} ms")
    assert 1000 < heard_ms < 4000
    assert abs(truncate.audio_end_ms - heard_ms) <= FRAME_MS + 20  # a frame, and Opus' edge


async def test_barge_in_cancels_and_truncates_at_what_the_caller_heard(
    engine_factory: EngineFactory, cache_dir: Path
) -> None:
    standin, _, audio = await _barge_in(engine_factory, cache_dir)
    conn = standin.connections[0]
    assert conn.cancels >= 1  # the service was still writing the reply: it was stopped
    _truncated_at_what_was_heard(standin, audio)


async def test_service_turns_barge_in_the_service_cancels_and_we_truncate_at_what_was_heard(
    engine_factory: EngineFactory, cache_dir: Path
) -> None:
    standin, events, audio = await _barge_in(engine_factory, cache_dir, realtime_turns="service")
    conn = standin.connections[0]
    # The service heard the caller and cancelled its response itself; our cancel, sent as we
    # heard of it, came after and was refused (response_cancel_not_active): harmless, so the
    # caller was told of no error, and what they said was answered.
    assert conn.vad_cancels == 1 and conn.cancels == 1
    assert standin.errors == ["response_cancel_not_active"]
    assert not any(e.get("type") == "error" for e in events), events
    assert conn.sent("input_audio_buffer.commit") == [] and conn.sent("response.create") == []
    assert len(conn.speech) == 2 and conn.responses == 2
    _truncated_at_what_was_heard(standin, audio)


async def _hears_the_apology(client: CallClient) -> None:
    """The apology plays in the local voice (the state may have been speaking already, when
    the reply failed mid-way), then the call listens."""
    audio_from = len(client.received.audio)
    await client.wait_state("listening", 20)
    sound = _loud(np.concatenate([p for _, _, p in client.received.audio[audio_from:]]))
    assert sound.size and (sound[-1] - sound[0]) / 48_000 > 1.5, "no apology was heard"


async def _typed_turn(client: CallClient, text: str = "hello") -> None:
    client.skip_events()
    client.channel.send(f'{{"type": "text", "text": "{text}"}}')


@pytest.mark.parametrize(
    ("failure", "code"),
    [
        ("close", "connection"),
        ("error", "server_error"),
        ("rate_limit", "rate_limited"),
        ("bad_audio", "bad_response"),
    ],
)
async def test_a_failed_response_gets_an_error_an_apology_and_a_working_next_turn(
    realtime_server: LiveServer, standin: RealtimeStandIn, failure: str, code: str
) -> None:
    standin.fail_next(failure)
    client = CallClient(realtime_server.url)
    try:
        await client.connect()
        await client.wait_channel_open()
        await client.wait_state("listening", 5)
        await _typed_turn(client)
        error = await client.wait_event(lambda e: e.get("type") == "error", 15)
        assert error["code"] == code, error
        assert "the reply failed" in error["message"]
        await _hears_the_apology(client)
        # The call goes on, and the next turn is answered (over a new connection when the
        # service hung up).
        since = len(client.events)
        await _typed_turn(client, "again")
        await client.wait_state("speaking", 15)
        await client.wait_event(lambda e: e.get("type") == "turn", 30)
        assert not any(e.get("type") == "error" for e in client.events[since:])
    finally:
        await client.close()
    assert standin.violations == []
    assert len(standin.connections) == (2 if failure == "close" else 1)
    if failure == "bad_audio":
        # The rest of a reply that cannot be played was not left to run on the service.
        assert standin.connections[0].cancels == 1
    if failure == "close":
        # The new session was told the conversation so far before the new turn.
        items = [e["item"] for e in standin.connections[1].sent("conversation.item.create")]
        assert [(i["role"], i["content"][0]["text"]) for i in items][:1] == [("user", "hello")]


async def test_a_refused_connection_gets_an_error_and_the_next_turn_connects(
    realtime_server: LiveServer, standin: RealtimeStandIn
) -> None:
    standin.refuse = [503, 503]  # the call's own connection at its start, then the turn's
    client = CallClient(realtime_server.url)
    try:
        await client.connect()
        await client.wait_channel_open()
        await client.wait_state("listening", 5)
        await wait_until(lambda: len(standin.refuse) == 1, 10, "the call tried to connect")
        await _typed_turn(client)
        error = await client.wait_event(lambda e: e.get("type") == "error", 15)
        assert error["code"] == "server_error", error
        await _hears_the_apology(client)
        await _typed_turn(client, "again")
        await client.wait_event(lambda e: e.get("type") == "turn", 30)
    finally:
        await client.close()
    assert len(standin.connections) == 1 and standin.refuse == []


async def test_a_long_call_renews_its_session_with_the_conversation_carried_over(
    engine_factory: EngineFactory, cache_dir: Path, standin: RealtimeStandIn
) -> None:
    server, runner = await _server(engine_factory, cache_dir, standin, realtime_session_s=1.0)
    try:
        client = CallClient(server.url)
        try:
            await client.connect()
            await client.wait_channel_open()
            await client.wait_state("listening", 5)
            await _typed_turn(client, "first question")
            await client.wait_event(lambda e: e.get("type") == "turn", 30)
            await asyncio.sleep(1.0)  # past the session's age: renewed at the next turn
            await _typed_turn(client, "second question")
            await client.wait_event(lambda e: e.get("type") == "turn", 30)
        finally:
            await client.close()
    finally:
        await runner.cleanup()
    assert standin.violations == []
    assert len(standin.connections) == 2
    items = [e["item"] for e in standin.connections[1].sent("conversation.item.create")]
    said = [(i["role"], i["content"][0]["text"]) for i in items]
    assert said == [("user", "first question"), ("assistant", REPLY), ("user", "second question")]
