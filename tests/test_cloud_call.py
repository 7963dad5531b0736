"""A call whose LLM and TTS are cloud providers, served by local vendor stand-ins.

The call must never die of a provider: a failure becomes an ``error`` event and a spoken
apology in the local voice.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from benchmarks.client import CallClient
from benchmarks.vendor_standin import (
    CHAT,
    ELEVENLABS,
    ELEVENLABS_KEY,
    OPENAI_KEY,
    Reply,
    VendorServer,
    chat_stream,
)
from rtc_server.engine_factory import EngineFactory
from rtc_server.speech import PREVIOUS_TEXT_CHARS, recent_text
from tests.conftest import LiveServer, start_server


@pytest.fixture
async def vendor() -> AsyncIterator[VendorServer]:
    async with VendorServer(speech_seconds=1.0) as server:
        yield server


@pytest.fixture
async def cloud_server(
    engine_factory: EngineFactory, cache_dir: Path, vendor: VendorServer
) -> AsyncIterator[LiveServer]:
    server, runner = await start_server(
        engine_factory,
        cache_dir,
        llm="openai",
        tts="elevenlabs",
        stt="local",
        openai_api_key=OPENAI_KEY,
        openai_base_url=vendor.openai_base,
        elevenlabs_api_key=ELEVENLABS_KEY,
        elevenlabs_base_url=vendor.elevenlabs_base,
        # Quick retries, so the test does not sit through production backoff.
        provider_attempts=2,
        provider_backoff_s=0.01,
    )
    try:
        yield server
    finally:
        await runner.cleanup()


async def _call(server: LiveServer) -> CallClient:
    client = CallClient(server.url)
    await client.connect()
    await client.wait_channel_open()
    await client.wait_state("listening", 5)
    return client


async def test_typed_turn_through_cloud_llm_and_tts(
    cloud_server: LiveServer, vendor: VendorServer
) -> None:
    assert [c.name for c in cloud_server.manager.choices] == ["local", "openai", "elevenlabs"]
    client = await _call(cloud_server)
    try:
        client.channel.send('{"type": "text", "text": "hello avatar"}')
        await client.wait_state("speaking", 10)
        turn = await client.wait_event(lambda e: e.get("type") == "turn", 20)
        parts = [e["text"] for e in client.events if e.get("type") == "response"]
        assert parts == ["Hello there!", "How can I help?"]
        assert turn["metrics"]["first_audio_out_ms"] > 0
    finally:
        await client.close()
    chat = vendor.seen(CHAT)[0].json
    assert chat["messages"][0]["role"] == "system"
    assert chat["messages"][-1] == {"role": "user", "content": "hello avatar"}
    first, second = (request.json for request in vendor.seen(ELEVENLABS))  # one a sentence
    # The second sentence is spoken as the continuation of the first; the first starts fresh.
    assert first["text"] == "Hello there!" and "previous_text" not in first
    assert second["text"] == "How can I help?" and second["previous_text"] == "Hello there!"


async def test_each_sentence_is_spoken_after_the_reply_so_far(
    cloud_server: LiveServer, vendor: VendorServer
) -> None:
    vendor.script(
        CHAT,
        Reply(
            pieces=chat_stream(["The sun is out today. ", "Let us go for a walk. ", "Bring a hat."])
        ),
    )
    client = await _call(cloud_server)
    try:
        client.channel.send('{"type": "text", "text": "what now?"}')
        await client.wait_event(lambda e: e.get("type") == "turn", 20)
    finally:
        await client.close()
    sent = [(r.json["text"], r.json.get("previous_text")) for r in vendor.seen(ELEVENLABS)]
    assert sent == [
        ("The sun is out today.", None),
        ("Let us go for a walk.", "The sun is out today."),
        ("Bring a hat.", "The sun is out today. Let us go for a walk."),
    ]


def test_the_reply_so_far_is_capped_at_a_word() -> None:
    assert recent_text("  Short enough.  ") == "Short enough."
    words = " ".join(f"word{i}" for i in range(400))  # ~3000 characters
    tail = recent_text(words)
    assert len(tail) <= PREVIOUS_TEXT_CHARS and words.endswith(tail)
    assert tail.split()[0] in words.split()  # starts at a whole word
    assert len(tail) > PREVIOUS_TEXT_CHARS - 10
    assert recent_text("abcdef ghij", limit=6) == "ghij"  # cut mid-word: from the next
    assert recent_text("abcde fghij", limit=6) == "fghij"  # cut at the space
    assert recent_text("今日はいい天気ですね", limit=4) == "気ですね"  # no spaces: as cut


async def test_llm_rejecting_the_key_gets_an_error_and_an_apology(
    cloud_server: LiveServer, vendor: VendorServer
) -> None:
    vendor.script(CHAT, Reply(status=401))
    client = await _call(cloud_server)
    try:
        client.channel.send('{"type": "text", "text": "hello"}')
        error = await client.wait_event(lambda e: e.get("type") == "error", 10)
        assert error["code"] == "unauthorized"
        # The apology is spoken in the local voice even though ElevenLabs is the TTS.
        await client.wait_state("speaking", 10)
        await client.wait_state("listening", 15)
    finally:
        await client.close()
    assert len(vendor.seen(CHAT)) == 1  # a rejected key is not retried
    assert vendor.seen(ELEVENLABS) == []


async def test_tts_failing_after_retries_degrades_to_the_local_voice(
    cloud_server: LiveServer, vendor: VendorServer
) -> None:
    vendor.script(ELEVENLABS, *[Reply(status=503) for _ in range(10)])
    client = await _call(cloud_server)
    try:
        client.channel.send('{"type": "text", "text": "hello"}')
        error = await client.wait_event(lambda e: e.get("type") == "error", 10)
        assert error["code"] == "server_error"
        await client.wait_state("speaking", 10)
        await client.wait_state("listening", 15)
        # The call goes on: the next turn works once the vendor recovers.
        vendor.unscript(ELEVENLABS)
        client.channel.send('{"type": "say", "text": "Back again."}')
        await client.wait_state("speaking", 10)
    finally:
        await client.close()
    assert len(vendor.seen(ELEVENLABS)) >= 2  # retried before giving up
    say = vendor.seen(ELEVENLABS)[-1].json
    assert say["text"] == "Back again." and "previous_text" not in say


async def test_first_sentence_plays_while_the_llm_is_still_writing(
    cloud_server: LiveServer, vendor: VendorServer
) -> None:
    import asyncio

    pieces = chat_stream(["Hello there, my friend. ", "How are", " you today?"])
    more = asyncio.Event()
    # The model sends its first sentence, then stalls until the test lets it go on.
    vendor.script(CHAT, Reply(pieces=[pieces[0] + pieces[1], *pieces[2:]], gate=more))
    client = await _call(cloud_server)
    try:
        client.channel.send('{"type": "text", "text": "hi"}')
        await client.wait_state("speaking", 10)
        # Heard before the model wrote another word: the first sentence is already playing.
        parts = [e["text"] for e in client.events if e.get("type") == "response"]
        assert parts == ["Hello there,"]  # ("my friend." is short: it waits for company)
        more.set()
        await client.wait_event(lambda e: e.get("type") == "turn", 20)
        parts = [e["text"] for e in client.events if e.get("type") == "response"]
        assert parts == ["Hello there,", "my friend. How are you today?"]
    finally:
        await client.close()


async def test_speech_recognition_failing_gets_an_error_and_an_apology(
    engine_factory: EngineFactory, cache_dir: Path, vendor: VendorServer
) -> None:
    from benchmarks.clip import speech_pcm
    from benchmarks.latency import connect_caller
    from benchmarks.vendor_standin import TRANSCRIPTIONS

    # The vendor's own words name the account: they go to the log, not to the caller.
    detail = b'{"error": {"message": "key sk-proj-42 of org-acme revoked", "code": "bad_key"}}'
    # Every request is refused: the early transcript at a pause in the speech may come first,
    # and a refusal it used up would let the turn's own transcription through.
    refusal = Reply(status=401, body=detail, content_type="application/json")
    vendor.script(TRANSCRIPTIONS, refusal, refusal, refusal)
    server, runner = await start_server(
        engine_factory,
        cache_dir,
        stt="openai",
        openai_api_key=OPENAI_KEY,
        openai_base_url=vendor.openai_base,
        provider_attempts=2,
        provider_backoff_s=0.01,
    )
    try:
        client, mic = await connect_caller(server.url)
        try:
            mic.play(await speech_pcm("What is the capital of France?"))
            error = await client.wait_event(lambda e: e.get("type") == "error", 20)
            assert error["code"] == "unauthorized" and "speech recognition" in error["message"]
            assert "org-acme" not in json.dumps(client.events), error
            await client.wait_state("speaking", 10)  # the apology, in the local voice
            await client.wait_state("listening", 15)
        finally:
            await client.close()
    finally:
        await runner.cleanup()
    # One request, not retried: a rejected key stays rejected. (The early transcript at the
    # speech pause may add one more before the turn ends.)
    assert 1 <= len(vendor.seen(TRANSCRIPTIONS)) <= 2
    assert not any(e.get("type") == "transcript" for e in client.events)
