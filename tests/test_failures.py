"""Parts failing in the middle of a turn: every call survives.

test_cloud_call.py covers providers that fail before answering (a rejected key, a TTS down
for good, STT refusing); test_fallback.py an engine that raises mid-sentence. Here the
failures come *during* the answer, after part of it was already spoken: the LLM's event stream
stalls, turns to garbage or breaks off after its first sentence; the TTS stream stalls, breaks
off or sends a torn sample mid-sentence; the STT answers garbage; the lip-sync engine raises,
runs slower than real time or stalls. Each time the caller gets an ``error`` event, hears what
was already said and then the apology (or, for the engine, every word over a still image),
and the next turn works in the same call. Several faults are injected one after another into
one call, which is the harder test.
"""

from __future__ import annotations

import asyncio
import collections
import json
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks.analysis import loud_frames, voiced_span
from benchmarks.client import CallClient
from benchmarks.vendor_standin import (
    CHAT,
    ELEVENLABS,
    ELEVENLABS_KEY,
    OPENAI_KEY,
    TRANSCRIPTIONS,
    Reply,
    VendorServer,
    chat_stream,
    elevenlabs_line,
    tone,
)
from rtc_server.engine_factory import EngineFactory
from rtc_server.media.resilient_engine import STALL_S
from tests.conftest import LiveServer, start_server
from tests.reliability import trials

READ_TIMEOUT_S = 1.0
"""The servers' provider read timeout here: how long a stalled stream is waited for."""
TONE_HZ = 220  # what the vendor stand-ins' TTS says (benchmarks/vendor_standin.tone)


def tone_share(pcm: np.ndarray) -> float:
    """How much of a frame's energy is the vendors' 220 Hz tone (1.0: nothing else)."""
    x = pcm.astype(np.float64)
    energy = float((x**2).sum())
    if energy == 0:
        return 0.0
    t = np.arange(len(x)) / 48_000
    c, s = x @ np.cos(2 * math.pi * TONE_HZ * t), x @ np.sin(2 * math.pi * TONE_HZ * t)
    return float(2 * (c**2 + s**2) / len(x) / energy)


@dataclass
class Heard:
    tone_s: float
    """Loud audio that was the cloud TTS's tone: the reply's own words."""
    voice_s: float
    """Other loud audio: the local voice (the apology)."""


def heard(client: CallClient, start: int) -> Heard:
    frames = [p for _, _, p in client.received.audio[start:]]
    if not frames:
        return Heard(0.0, 0.0)
    loud = loud_frames(frames)
    tone_frames = np.array([tone_share(p) > 0.8 for p in frames]) & loud
    return Heard(tone_frames.sum() * 0.02, (loud & ~tone_frames).sum() * 0.02)


@pytest.fixture
async def vendor() -> AsyncIterator[VendorServer]:
    async with VendorServer(speech_seconds=1.0) as server:
        yield server


async def _cloud_server(
    engine_factory: EngineFactory, cache_dir: Path, vendor: VendorServer, **config: object
) -> tuple[LiveServer, Any]:
    return await start_server(
        engine_factory,
        cache_dir,
        openai_api_key=OPENAI_KEY,
        openai_base_url=vendor.openai_base,
        elevenlabs_api_key=ELEVENLABS_KEY,
        elevenlabs_base_url=vendor.elevenlabs_base,
        provider_attempts=2,
        provider_backoff_s=0.01,
        provider_read_timeout_s=READ_TIMEOUT_S,
        **config,
    )


async def _call(server: LiveServer) -> CallClient:
    client = CallClient(server.url, record_video=False)
    await client.connect()
    await client.wait_channel_open()
    await client.wait_state("listening", 10)
    return client


async def _settled_audio() -> None:
    """Let the last reply's packets arrive and be decoded."""
    await asyncio.sleep(0.5)


async def _next_turn_works(client: CallClient, server: LiveServer) -> None:
    """A normal typed turn after the faults: the vendor's reply, spoken, in the same call."""
    first, start = len(client.events), len(client.received.audio)
    client.channel.send(json.dumps({"type": "text", "text": "are you still there"}))
    await client.wait_event(lambda e: e.get("type") == "turn", 20)
    await client.wait_state("listening", 15)
    await _settled_audio()
    assert heard(client, start).tone_s >= 1.5  # both sentences, 1 s each
    later = client.events[first:]
    assert [e["text"] for e in later if e.get("type") == "response"] == [
        "Hello there!",
        "How can I help?",
    ]
    assert not [e for e in later if e.get("type") == "error"]
    assert client.session_id in server.manager.sessions


async def _failing_turn(
    client: CallClient, text: str, code: str
) -> tuple[Heard, dict[str, float | int | str]]:
    """Type ``text``; the provider fails: the ``code`` error event comes, then the turn ends
    (with its metrics) once what was heard and the apology played. What was heard, and the
    record's figures."""
    start = len(client.received.audio)
    sent = time.monotonic()
    client.channel.send(json.dumps({"type": "text", "text": text}))
    error = await client.wait_event(lambda e: e.get("type") == "error", 15)
    error_s = time.monotonic() - sent
    assert error["code"] == code, error
    await client.wait_event(lambda e: e.get("type") == "turn", 20)
    await client.wait_state("listening", 15)
    await _settled_audio()
    got = heard(client, start)
    figures: dict[str, float | int | str] = {
        "error": code,
        "error_after_s": round(error_s, 2),
        "heard_reply_s": round(got.tone_s, 2),
        "heard_apology_s": round(got.voice_s, 2),
    }
    return got, figures


LLM_NOTE = (
    "first sentence heard, error event, apology in the local voice; "
    f"read timeout {READ_TIMEOUT_S:.0f} s here (15 s by default)"
)
FIRST = "The first sentence is complete. "
"""What the LLM says before its stream fails: a whole sentence, spoken at once."""

LLM_FAULTS: dict[str, tuple[Callable[[bytes], Reply], str]] = {
    "LLM stream stalls after the first sentence": (
        lambda first: Reply(pieces=[first], stall_s=60),
        "timeout",
    ),
    "LLM stream sends a malformed chunk after the first sentence": (
        lambda first: Reply(pieces=[first, b'data: {"choices": [{"delta": \n\n']),
        "bad_response",
    ),
    "LLM connection drops after the first sentence": (
        lambda first: Reply(pieces=[first], disconnect=True),
        "connection",
    ),
}


async def test_llm_failing_mid_reply(
    engine_factory: EngineFactory, cache_dir: Path, vendor: VendorServer
) -> None:
    server, runner = await _cloud_server(
        engine_factory, cache_dir, vendor, llm="openai", tts="elevenlabs", stt="local"
    )
    pieces = chat_stream([FIRST, "And this one never comes."])
    first = pieces[0] + pieces[1]
    client = await _call(server)
    try:
        for fault, (reply, code) in LLM_FAULTS.items():
            with trials(fault, area="provider", note=LLM_NOTE) as t, t.trial():
                vendor.script(CHAT, reply(first))
                events = len(client.events)
                got, t.figures = await _failing_turn(client, "tell me two things", code)
                said = [e["text"] for e in client.events[events:] if e.get("type") == "response"]
                assert said == [FIRST.strip()], said
                assert got.tone_s >= 0.7, f"{fault}: the first sentence was not heard ({got})"
                assert got.voice_s >= 0.8, f"{fault}: no apology in the local voice ({got})"
                assert client.session_id in server.manager.sessions
        await _next_turn_works(client, server)
    finally:
        await client.close()
        await runner.cleanup()
    assert not vendor.violations


TTS_NOTE = "the part sent before the failure heard, error event, apology in the local voice"
TTS_PART = elevenlabs_line(tone(0.3, 24_000))  # a line of the stream with timestamps
"""The part of the first sentence the TTS sends before failing."""

TTS_FAULTS: dict[str, tuple[Reply, str]] = {
    "TTS stream stalls mid-sentence": (Reply(pieces=[TTS_PART], stall_s=60), "timeout"),
    "TTS connection drops mid-sentence": (
        Reply(pieces=[TTS_PART], disconnect=True),
        "connection",
    ),
    "TTS sends a torn sample (odd byte count) mid-sentence": (
        Reply(pieces=[TTS_PART, elevenlabs_line(b"\x01")]),
        "bad_response",
    ),
}


async def test_tts_failing_mid_sentence(
    engine_factory: EngineFactory, cache_dir: Path, vendor: VendorServer
) -> None:
    server, runner = await _cloud_server(
        engine_factory, cache_dir, vendor, llm="openai", tts="elevenlabs", stt="local"
    )
    client = await _call(server)
    try:
        for fault, (reply, code) in TTS_FAULTS.items():
            with trials(fault, area="provider", note=TTS_NOTE) as t, t.trial():
                vendor.script(ELEVENLABS, reply)
                got, t.figures = await _failing_turn(client, "hello", code)
                # The 0.3 s that came before the failure were played, then the apology.
                assert got.tone_s >= 0.2, f"{fault}: the sentence's start was not heard ({got})"
                assert got.tone_s <= 0.5, f"{fault}: more tone than was sent ({got})"
                assert got.voice_s >= 0.8, f"{fault}: no apology in the local voice ({got})"
        await _next_turn_works(client, server)
    finally:
        await client.close()
        await runner.cleanup()
    assert not vendor.violations


STT_NOTE = (
    "retried once, then an error event and the apology; the next question was transcribed "
    "and answered in the same call"
)


async def test_stt_answering_garbage(
    engine_factory: EngineFactory, cache_dir: Path, vendor: VendorServer
) -> None:
    from benchmarks.clip import speech_pcm
    from benchmarks.latency import connect_caller

    fault = "STT answers garbage JSON (200)"
    with trials(fault, area="provider", note=STT_NOTE) as t, t.trial():
        garbage = Reply(body=b'{"text": "what\'s the', content_type="application/json")
        vendor.script(TRANSCRIPTIONS, *[garbage] * 6)
        server, runner = await _cloud_server(engine_factory, cache_dir, vendor, stt="openai")
        question = await speech_pcm("What is the capital of France?")
        try:
            client, mic = await connect_caller(server.url)
            try:
                mic.play(question)
                error = await client.wait_event(lambda e: e.get("type") == "error", 20)
                assert error["code"] == "bad_response", error
                assert "speech recognition" in error["message"]
                await client.wait_state("speaking", 10)  # the apology, in the local voice
                await client.wait_state("listening", 15)
                assert not any(e.get("type") == "transcript" for e in client.events)
                tries = len(vendor.seen(TRANSCRIPTIONS))
                # The vendor recovers: the caller asks again and is answered.
                vendor.unscript(TRANSCRIPTIONS)
                mic.play(question)
                transcript = await client.wait_event(lambda e: e.get("type") == "transcript", 20)
                assert transcript["text"] == vendor.transcript
                await client.wait_event(lambda e: e.get("type") == "turn", 20)
                assert client.session_id in server.manager.sessions
            finally:
                await client.close()
        finally:
            await runner.cleanup()
        assert tries >= 2  # a malformed answer is worth one more try
        t.figures = {"error": "bad_response", "requests": tries}


class Misbehaving:
    """A real engine (warp) that, from its fifth speaking frame, raises, slows or stalls.

    ``burst`` is slow only through the first utterance (a burst of load that passes).
    """

    def __init__(self, engine: Any, how: str) -> None:
        self._engine = engine
        self.how = how
        self.speaking_frames: collections.Counter[int] = collections.Counter()
        """Speaking frames it yielded, per segment."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def frames(self) -> AsyncIterator[Any]:
        async for frame in self._engine.frames():
            if frame.speaking:
                self.speaking_frames[frame.segment_id] += 1
                first = frame.segment_id == min(self.speaking_frames)
                if sum(self.speaking_frames.values()) >= 5:
                    if self.how == "raises":
                        raise RuntimeError("CUDA error: an illegal memory access was encountered")
                    if self.how == "slow" or (self.how == "burst" and first):
                        await asyncio.sleep(0.065)  # with rendering, ~0.6x real time
                    if self.how == "stalls":
                        await asyncio.Event().wait()
            yield frame


ENGINE_NOTES = {
    "raises": "the words went on over a still image; the next say was heard in full",
    "slow": "the speech played on the clock, not torn by silence; the picture was held "
    "and the engine moved ahead to the clock whenever it fell behind; the next say was heard "
    "in full",
    "burst": "the picture was held through the burst; the next say, after it, was "
    "animated frame for frame again",
    "stalls": f"the words went on over the held image; after {STALL_S:.0f} s without a frame "
    "the engine counted as failed; the next say was heard in full",
}
ENGINE_FAULTS = {
    "raises": ("lip-sync engine raises mid-utterance", "engine_failed"),
    "slow": ("lip-sync engine renders at 0.6x real time", "engine_behind"),
    "burst": ("lip-sync engine falls behind for one utterance", "engine_behind"),
    "stalls": ("lip-sync engine stalls mid-utterance", "engine_failed"),
}
SAYS = (
    "The animation gives up now, but you still hear every word I say.",
    "And the next sentence is heard in full as well.",
)


async def test_engine_failing_mid_utterance(engine_factory: EngineFactory, cache_dir: Path) -> None:
    from benchmarks.clip import speech_pcm

    order = iter(ENGINE_FAULTS)
    engines: list[Misbehaving] = []

    def create() -> Misbehaving:
        engines.append(Misbehaving(engine_factory.create(), next(order)))
        return engines[-1]

    # Each say as the bundled voice speaks it: how long its words last, end to end.
    expected = []
    for text in SAYS:
        pcm = await speech_pcm(text)
        first, last = voiced_span(pcm, 48_000)
        expected.append((last - first) / 48_000)
    server, runner = await start_server(replace(engine_factory, create=create), cache_dir)
    try:
        for how, (_, code) in ENGINE_FAULTS.items():
            fault, notes = ENGINE_FAULTS[how][0], f"error {code}; {ENGINE_NOTES[how]}"
            with trials(fault, area="engine", note=notes) as t, t.trial():
                client = await _call(server)
                engine = engines[-1]
                try:
                    spans = []
                    for i, text in enumerate(SAYS):
                        start, video = len(client.received.audio), len(client.received.video)
                        events = len(client.events)
                        await client.say(text)
                        await client.wait_state("speaking", 10)
                        await client.wait_state("listening", 30)
                        await _settled_audio()
                        errors = [e for e in client.events[events:] if e.get("type") == "error"]
                        assert [e["code"] for e in errors] == ([code] if i == 0 else [])
                        loud = np.flatnonzero(
                            loud_frames([p for _, _, p in client.received.audio[start:]])
                        )
                        assert loud.size, f"{how}: say {i + 1} was not heard"
                        spans.append((loud[-1] - loud[0] + 1) * 0.02)
                        # The video went on (a still image, or the face), at about 25 fps.
                        assert len(client.received.video) - video > 20
                    assert client.session_id in server.manager.sessions
                finally:
                    await client.close()
                # Every word heard, and not torn apart by silence: each say lasts as long as its
                # words, whatever the engine did (the speech is on the clock, not on the engine).
                assert spans[0] <= expected[0] * 1.15, (how, spans, expected)
                assert spans[1] <= expected[1] * 1.15, (how, spans, expected)
                assert spans[0] >= expected[0] * 0.85 and spans[1] >= expected[1] * 0.85
                # A slow engine keeps animating, moved ahead to the clock where it fell
                # behind; after a passing burst it renders every frame of the next say again.
                animated = sorted(engine.speaking_frames.items())[1:]
                animated_frames = sum(n for _, n in animated)
                if how == "burst":
                    assert animated_frames >= expected[1] * 25 * 0.9, engine.speaking_frames
                elif how == "slow":
                    assert 0 < animated_frames < expected[1] * 25, engine.speaking_frames
                else:
                    assert animated_frames == 0, (how, engine.speaking_frames)
                t.figures = {
                    "error": code,
                    "speech_s": round(spans[0], 2),
                    "words_s": round(expected[0], 2),
                    "next_say_s": round(spans[1], 2),
                    "next_say_animated_frames": animated_frames,
                }
    finally:
        await runner.cleanup()
        # aiohttp's middleware cache keeps the last apps, and with them our factory, alive:
        # the engines must not stay reachable from it (test_leaks counts them).
        engines.clear()
