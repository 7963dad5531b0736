"""Cloud providers against local servers that speak each vendor's wire protocol."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import socket
import wave
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np
import pytest
from openai import AsyncOpenAI

from benchmarks.vendor_standin import (
    CHAT,
    ELEVENLABS,
    ELEVENLABS_KEY,
    OPENAI_KEY,
    SPEECH,
    TRANSCRIPTIONS,
    Reply,
    VendorServer,
    chat_chunk,
    elevenlabs_error,
    elevenlabs_line,
    openai_error,
    split,
    sse,
    tone,
)
from rtc_server.providers.base import LLM, STT, TTS, ChatMessage, ProviderError
from rtc_server.providers.elevenlabs_tts import DEFAULT_VOICE_ID, ElevenLabsTTS
from rtc_server.providers.http import (
    DEFAULT_POLICY,
    HTTPPolicy,
    parse_retry_after,
    status_error,
    vendor_detail,
)
from rtc_server.providers.openai_llm import OpenAILLM, SSEDecoder
from rtc_server.providers.openai_sdk import OPENAI_BASE_URL, openai_client
from rtc_server.providers.openai_stt import OpenAISTT
from rtc_server.providers.openai_tts import OpenAITTS

FAST = HTTPPolicy(
    connect_timeout_s=1.0,
    read_timeout_s=0.3,
    total_timeout_s=5.0,
    max_attempts=3,
    backoff_initial_s=0.001,
    backoff_max_s=0.002,
    max_retry_after_s=0.05,
)
MESSAGES = [ChatMessage("user", "Hi!")]
UTTERANCE = (np.sin(np.arange(4000) / 5) * 3000).astype(np.int16)  # 0.25 s at 16 kHz
WAIT_S = 2.0  # upper bound for things that happen "at once"; only reached on failure


@pytest.fixture
async def server() -> AsyncIterator[VendorServer]:
    async with VendorServer() as vendor:
        yield vendor
        assert vendor.violations == []


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


_clients: list[AsyncOpenAI] = []


def _openai(
    api_key: str, base_url: str = OPENAI_BASE_URL, policy: HTTPPolicy = DEFAULT_POLICY
) -> AsyncOpenAI:
    """An SDK client for the OpenAI providers of one test, closed after it."""
    client = openai_client(api_key, base_url, policy)
    _clients.append(client)
    return client


@pytest.fixture(autouse=True)
async def _close_openai_clients() -> AsyncIterator[None]:
    yield
    while _clients:
        await _clients.pop().close()


# --- one table drives the behaviour every provider shares ---------------------------------------


@dataclass
class Case:
    id: str
    route: str
    error: Callable[..., Reply]
    make: Callable[[aiohttp.ClientSession, VendorServer, HTTPPolicy, str | None], Any]
    run: Callable[[Any], Awaitable[Any]]
    expected: Callable[[VendorServer], Any]
    stream: Callable[[Any], AsyncGenerator[Any, None]] | None = None
    """Opens the provider's output stream (streaming providers only)."""
    first_piece: Callable[[], bytes] | None = None
    """A body piece that makes the stream yield one item at once."""
    last_pieces: tuple[bytes, ...] = ()
    """What properly ends a stream of such pieces."""


async def _text(llm: OpenAILLM) -> list[str]:
    return [delta async for delta in llm.stream(MESSAGES)]


async def _audio(tts: OpenAITTS | ElevenLabsTTS) -> bytes:
    return b"".join([chunk.pcm.tobytes() async for chunk in tts.synthesize("Hello there.")])


CASES = [
    Case(
        "openai-stt",
        TRANSCRIPTIONS,
        openai_error,
        lambda s, v, p, k: OpenAISTT(_openai(k or OPENAI_KEY, v.openai_base, p), policy=p),
        lambda stt: stt.transcribe(UTTERANCE, 16_000),
        lambda v: v.transcript,
    ),
    Case(
        "openai-llm",
        CHAT,
        openai_error,
        lambda s, v, p, k: OpenAILLM(_openai(k or OPENAI_KEY, v.openai_base, p), policy=p),
        _text,
        lambda v: v.reply_deltas,
        stream=lambda llm: llm.stream(MESSAGES),
        first_piece=lambda: sse(chat_chunk("", role=True)) + sse(chat_chunk("Hello")),
        last_pieces=(sse(chat_chunk(finish="stop")), sse("[DONE]")),
    ),
    Case(
        "openai-tts",
        SPEECH,
        openai_error,
        lambda s, v, p, k: OpenAITTS(_openai(k or OPENAI_KEY, v.openai_base, p), policy=p),
        _audio,
        lambda v: tone(v.speech_seconds, 24_000),
        stream=lambda tts: tts.synthesize("Hello there."),
        first_piece=lambda: tone(0.1, 24_000),
    ),
    Case(
        "elevenlabs-tts",
        ELEVENLABS,
        elevenlabs_error,
        lambda s, v, p, k: ElevenLabsTTS(
            s, api_key=k or ELEVENLABS_KEY, base_url=v.elevenlabs_base, policy=p
        ),
        _audio,
        lambda v: tone(v.speech_seconds, 24_000),
        stream=lambda tts: tts.synthesize("Hello there."),
        first_piece=lambda: elevenlabs_line(tone(0.1, 24_000)),
    ),
]
STREAMING = [case for case in CASES if case.stream is not None]
all_cases = pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
streaming_cases = pytest.mark.parametrize("case", STREAMING, ids=lambda c: c.id)


@all_cases
async def test_success(case: Case, server: VendorServer, session: aiohttp.ClientSession) -> None:
    provider = case.make(session, server, FAST, None)
    assert await case.run(provider) == case.expected(server)
    assert len(server.seen(case.route)) == 1


@all_cases
async def test_wrong_key_fails_at_once_with_a_clear_error(
    case: Case,
    server: VendorServer,
    session: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    provider = case.make(session, server, FAST, "sk-wrong")
    with pytest.raises(ProviderError) as info:
        await case.run(provider)
    error = info.value
    assert (error.code, error.status, error.retryable) == ("unauthorized", 401, False)
    assert "rejected the API key (401)" in str(error)
    assert "sk-wrong" not in str(error)  # OpenAI echoes the key back; we blank it out
    assert "sk-wrong" not in caplog.text
    assert len(server.seen(case.route)) == 1


@all_cases
async def test_429_and_5xx_are_retried(
    case: Case, server: VendorServer, session: aiohttp.ClientSession
) -> None:
    server.script(
        case.route, case.error(429, "slow down", retry_after="0"), case.error(500, "oops")
    )
    provider = case.make(session, server, FAST, None)
    assert await case.run(provider) == case.expected(server)
    assert len(server.seen(case.route)) == 3


@all_cases
async def test_exhausted_retries_raise_a_retryable_error(
    case: Case, server: VendorServer, session: aiohttp.ClientSession
) -> None:
    server.script(case.route, *[case.error(503, "overloaded")] * 3)
    provider = case.make(session, server, FAST, None)
    with pytest.raises(ProviderError) as info:
        await case.run(provider)
    assert (info.value.code, info.value.status, info.value.retryable) == (
        "server_error",
        503,
        True,
    )
    assert "overloaded" in str(info.value)
    assert len(server.seen(case.route)) == 3


@all_cases
async def test_other_4xx_are_final(
    case: Case, server: VendorServer, session: aiohttp.ClientSession
) -> None:
    server.script(case.route, case.error(400, "bad voice"))
    with pytest.raises(ProviderError) as info:
        await case.run(case.make(session, server, FAST, None))
    assert (info.value.code, info.value.retryable) == ("bad_request", False)
    assert len(server.seen(case.route)) == 1


@all_cases
async def test_timeout(case: Case, server: VendorServer, session: aiohttp.ClientSession) -> None:
    policy = HTTPPolicy(read_timeout_s=0.1, max_attempts=2, backoff_initial_s=0.001)
    server.script(case.route, *[Reply(delay_s=0.5)] * 2)
    with pytest.raises(ProviderError) as info:
        await case.run(case.make(session, server, policy, None))
    assert (info.value.code, info.value.retryable) == ("timeout", True)
    assert len(server.seen(case.route)) == 2


@all_cases
async def test_unreachable_server(case: Case, session: aiohttp.ClientSession) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    nobody = VendorServer()
    nobody.url = f"http://127.0.0.1:{port}"
    with pytest.raises(ProviderError) as info:
        await case.run(case.make(session, nobody, FAST, None))
    assert (info.value.code, info.value.retryable) == ("connection", True)


@all_cases
async def test_one_connection_serves_sequential_requests(
    case: Case, server: VendorServer, session: aiohttp.ClientSession
) -> None:
    server.script(case.route, case.error(401, "nope"))  # an error answer must not cost the socket
    provider = case.make(session, server, FAST, None)
    with pytest.raises(ProviderError):
        await case.run(provider)
    for _ in range(3):
        assert await case.run(provider) == case.expected(server)
    assert len(server.seen(case.route)) == 4
    assert server.connections == 1


@all_cases
async def test_a_redirect_is_not_followed(
    case: Case, server: VendorServer, session: aiohttp.ClientSession
) -> None:
    moved = Reply(status=307, headers={"Location": f"{server.url}/elsewhere"}, body=b"")
    server.script(case.route, moved)
    with pytest.raises(ProviderError) as info:
        await case.run(case.make(session, server, FAST, None))
    assert (info.value.code, info.value.status, info.value.retryable) == (
        "bad_request",
        307,
        False,
    )
    assert len(server.requests) == 1


@pytest.mark.parametrize("case", CASES[:3], ids=lambda c: c.id)
async def test_openai_without_a_key_sends_no_authorization(
    case: Case, server: VendorServer, session: aiohttp.ClientSession
) -> None:
    # A local compatible server needs no key: nothing, not a placeholder, goes as a bearer.
    provider = case.make(session, server, FAST, None)
    keyless = type(provider)(_openai("", server.openai_base, FAST), policy=FAST)
    with pytest.raises(ProviderError):  # the stand-in insists on its key
        await case.run(keyless)
    (request,) = server.seen(case.route)
    assert "Authorization" not in request.headers


@all_cases
async def test_secrets_in_server_messages_are_never_logged(
    case: Case,
    server: VendorServer,
    session: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    key = OPENAI_KEY if case.error is openai_error else ELEVENLABS_KEY
    server.script(case.route, *[case.error(500, f"cannot serve key {key}")] * 3)
    with pytest.raises(ProviderError) as info:
        await case.run(case.make(session, server, FAST, None))
    assert "cannot serve key ***" in str(info.value)
    assert key not in str(info.value)
    assert "retry 2 of 2" in caplog.text
    assert key not in caplog.text


# --- streaming: incremental, cancellable, final once output was given ---------------------------


@streaming_cases
async def test_first_item_arrives_before_the_body_ends(
    case: Case, server: VendorServer, session: aiohttp.ClientSession
) -> None:
    assert case.stream is not None and case.first_piece is not None
    gate = asyncio.Event()
    pieces = [case.first_piece(), case.first_piece(), *case.last_pieces]
    server.script(case.route, Reply(pieces=pieces, gate=gate))
    provider = case.make(session, server, FAST, None)
    async with aclosing(case.stream(provider)) as items:
        first = await asyncio.wait_for(anext(items), WAIT_S)  # the server is waiting on `gate`
        gate.set()
        rest = [item async for item in items]
    assert first is not None and rest


@streaming_cases
async def test_closing_the_stream_closes_the_connection(
    case: Case, server: VendorServer, session: aiohttp.ClientSession
) -> None:
    assert case.stream is not None and case.first_piece is not None
    server.script(case.route, Reply(pieces=[case.first_piece()], endless=True))
    items = case.stream(case.make(session, server, FAST, None))
    await asyncio.wait_for(anext(items), WAIT_S)
    await items.aclose()  # barge-in
    await asyncio.wait_for(server.hung_up.wait(), WAIT_S)


@streaming_cases
async def test_cancelling_the_consumer_closes_the_connection(
    case: Case, server: VendorServer, session: aiohttp.ClientSession
) -> None:
    assert case.stream is not None and case.first_piece is not None
    got_one = asyncio.Event()
    server.script(case.route, Reply(pieces=[case.first_piece()], endless=True))
    provider = case.make(session, server, FAST, None)
    open_stream = case.stream

    async def consume() -> None:
        async with aclosing(open_stream(provider)) as items:
            async for _ in items:
                got_one.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(got_one.wait(), WAIT_S)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(server.hung_up.wait(), WAIT_S)


@streaming_cases
async def test_disconnect_mid_stream_is_final(
    case: Case, server: VendorServer, session: aiohttp.ClientSession
) -> None:
    assert case.stream is not None and case.first_piece is not None
    server.script(case.route, Reply(pieces=[case.first_piece()], disconnect=True))
    received = []
    with pytest.raises(ProviderError) as info:
        async with aclosing(case.stream(case.make(session, server, FAST, None))) as items:
            async for item in items:
                received.append(item)
    assert received  # what came before the break was delivered
    assert (info.value.code, info.value.retryable) == ("connection", False)
    assert "after part of the answer" in str(info.value)
    assert len(server.seen(case.route)) == 1  # nothing is said twice


@streaming_cases
async def test_disconnect_before_any_output_is_retried(
    case: Case, server: VendorServer, session: aiohttp.ClientSession
) -> None:
    server.script(case.route, Reply(pieces=[], disconnect=True))
    assert await case.run(case.make(session, server, FAST, None)) == case.expected(server)
    assert len(server.seen(case.route)) == 2


@streaming_cases
async def test_stall_mid_stream_times_out_as_final(
    case: Case, server: VendorServer, session: aiohttp.ClientSession
) -> None:
    assert case.stream is not None and case.first_piece is not None
    policy = HTTPPolicy(read_timeout_s=0.1, backoff_initial_s=0.001)
    server.script(case.route, Reply(pieces=[case.first_piece(), case.first_piece()], stall_s=1.0))
    with pytest.raises(ProviderError) as info:
        async with aclosing(case.stream(case.make(session, server, policy, None))) as items:
            async for _ in items:
                pass
    assert (info.value.code, info.value.retryable) == ("timeout", False)
    assert len(server.seen(case.route)) == 1


@streaming_cases
async def test_a_trickling_stream_is_cut_at_the_total_timeout(
    case: Case, server: VendorServer, session: aiohttp.ClientSession
) -> None:
    # Every piece comes within the read timeout, but the whole body would take 2 s.
    assert case.stream is not None and case.first_piece is not None
    policy = HTTPPolicy(read_timeout_s=1.0, total_timeout_s=0.3, backoff_initial_s=0.001)
    server.script(case.route, Reply(pieces=[case.first_piece()] * 40, pace_s=0.05))
    received = []
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(ProviderError) as info:
        async with aclosing(case.stream(case.make(session, server, policy, None))) as items:
            async for item in items:
                received.append(item)
    assert received and loop.time() - start < 1.0
    assert (info.value.code, info.value.retryable) == ("timeout", False)
    assert len(server.seen(case.route)) == 1


# --- OpenAI chat completions --------------------------------------------------------------------


async def test_llm_request_follows_the_chat_completions_protocol(
    server: VendorServer, session: aiohttp.ClientSession
) -> None:
    llm = OpenAILLM(_openai(OPENAI_KEY, server.openai_base + "/", FAST), policy=FAST)
    assert await _text(llm) == server.reply_deltas
    (request,) = server.seen(CHAT)
    assert request.path == "/v1/chat/completions"
    assert request.headers["Authorization"] == f"Bearer {OPENAI_KEY}"
    assert request.headers["Accept"] == "text/event-stream"
    assert request.headers["Content-Type"] == "application/json"
    body = request.json
    assert body["model"] == "gpt-4o-mini" and body["stream"] is True
    assert body["messages"][0] == {"role": "system", "content": llm.system_prompt}
    assert body["messages"][1:] == [{"role": "user", "content": "Hi!"}]
    # Not api.openai.com: the field every compatible server (vLLM, Ollama, llama.cpp) reads.
    assert body["max_tokens"] == 200 and "max_completion_tokens" not in body
    assert "temperature" not in body


async def test_llm_options(server: VendorServer, session: aiohttp.ClientSession) -> None:
    llm = OpenAILLM(
        _openai(OPENAI_KEY, server.openai_base, FAST),
        model="llama3.2",
        system_prompt="Be brief.",
        max_tokens=64,
        token_limit_field="max_completion_tokens",
        temperature=0.3,
        policy=FAST,
    )
    own_system = [ChatMessage("system", "Speak French."), *MESSAGES]
    assert [d async for d in llm.stream(own_system)] == server.reply_deltas
    body = server.seen(CHAT)[0].json
    assert body["model"] == "llama3.2" and body["temperature"] == 0.3
    assert body["max_completion_tokens"] == 64 and "max_tokens" not in body
    assert body["messages"][0] == {"role": "system", "content": "Speak French."}
    assert len(body["messages"]) == 2


def test_llm_uses_max_completion_tokens_with_openai() -> None:
    # Newer OpenAI models reject max_tokens. Nothing is sent: the client is never used.
    llm = OpenAILLM(_openai("sk-x"))
    assert llm.token_limit_field == "max_completion_tokens"
    assert llm._body(MESSAGES)["max_completion_tokens"] == 200


async def test_llm_reassembles_lines_split_across_reads(
    server: VendorServer, session: aiohttp.ClientSession
) -> None:
    stream = b"".join(
        [
            b": keep-alive\n\n",
            sse(chat_chunk("", role=True)).replace(b"\n", b"\r\n"),
            sse(chat_chunk("Caf\u00e9 ")),
            b"event: message\nid: 7\nretry: 100\n" + sse(chat_chunk("\U0001f600")),
            sse(chat_chunk(finish="stop")),
            sse({"id": "x", "object": "chat.completion.chunk", "choices": [], "usage": {}}),
            sse("[DONE]"),
        ]
    )
    server.script(CHAT, Reply(pieces=split(stream, [3, 1, 7])))  # cuts UTF-8 and CRLF pairs
    llm = OpenAILLM(_openai(OPENAI_KEY, server.openai_base, FAST), policy=FAST)
    assert await _text(llm) == ["Caf\u00e9 ", "\U0001f600"]


def test_sse_decoder_byte_by_byte() -> None:
    decoder = SSEDecoder()
    raw = (
        b': hi\n\ndata: {"a":\ndata: 1}\n\n'
        b"event: error\ndata: x\n\n"
        b'error: {"code": 500}\ndata: tail'
    )
    events = [event for byte in raw for event in decoder.feed(bytes([byte]))]
    events += list(decoder.close())
    assert [(e.event, e.data) for e in events] == [
        ("", '{"a":\n1}'),
        ("error", "x"),
        ("error", '{"code": 500}\ntail'),
    ]


async def test_llm_malformed_json_before_output_is_retried(
    server: VendorServer, session: aiohttp.ClientSession
) -> None:
    server.script(CHAT, *[Reply(pieces=[b"data: {not json\n\n"])] * 3)
    llm = OpenAILLM(_openai(OPENAI_KEY, server.openai_base, FAST), policy=FAST)
    with pytest.raises(ProviderError) as info:
        await _text(llm)
    assert (info.value.code, info.value.retryable) == ("bad_response", True)
    assert len(server.seen(CHAT)) == 3


async def test_llm_malformed_json_after_output_is_final(
    server: VendorServer, session: aiohttp.ClientSession
) -> None:
    server.script(CHAT, Reply(pieces=[sse(chat_chunk("Hi")), b"data: {not json\n\n"]))
    llm = OpenAILLM(_openai(OPENAI_KEY, server.openai_base, FAST), policy=FAST)
    received = []
    with pytest.raises(ProviderError) as info:
        async for delta in llm.stream(MESSAGES):
            received.append(delta)
    assert received == ["Hi"]
    assert (info.value.code, info.value.retryable) == ("bad_response", False)
    assert len(server.seen(CHAT)) == 1


@pytest.mark.parametrize(
    ("piece", "retryable", "attempts"),
    [
        # OpenAI: an error object in place of a chunk.
        (sse({"error": {"message": "The server had an error", "type": "server_error"}}), True, 3),
        # vLLM: {"object": "error", ...} with an HTTP-like code.
        (sse({"object": "error", "message": "bad prompt", "code": 400}), False, 1),
        # llama.cpp: a non-standard "error:" line.
        (b'error: {"code": 500, "message": "slot failed", "type": "server_error"}\n\n', True, 3),
    ],
    ids=["openai", "vllm", "llama.cpp"],
)
async def test_llm_error_in_the_stream(
    piece: bytes,
    retryable: bool,
    attempts: int,
    server: VendorServer,
    session: aiohttp.ClientSession,
) -> None:
    server.script(CHAT, *[Reply(pieces=[piece])] * 3)
    llm = OpenAILLM(_openai(OPENAI_KEY, server.openai_base, FAST), policy=FAST)
    with pytest.raises(ProviderError) as info:
        await _text(llm)
    assert (info.value.code, info.value.retryable) == ("vendor_error", retryable)
    assert "reported an error in the stream" in str(info.value)
    assert len(server.seen(CHAT)) == attempts


async def test_llm_stream_cut_before_done(
    server: VendorServer, session: aiohttp.ClientSession
) -> None:
    llm = OpenAILLM(_openai(OPENAI_KEY, server.openai_base, FAST), policy=FAST)
    # A finish_reason without [DONE] is a complete answer; neither is a truncated one.
    server.script(CHAT, Reply(pieces=[sse(chat_chunk("Hi")), sse(chat_chunk(finish="stop"))]))
    assert await _text(llm) == ["Hi"]
    server.script(CHAT, Reply(pieces=[sse(chat_chunk("Hi"))]))
    with pytest.raises(ProviderError) as info:
        await _text(llm)
    assert info.value.code == "bad_response" and "before [DONE]" in str(info.value)


async def test_llm_accepts_a_server_that_does_not_stream(
    server: VendorServer, session: aiohttp.ClientSession
) -> None:
    completion = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi!"}}]}
    server.script(CHAT, Reply(body=json.dumps(completion).encode()))
    llm = OpenAILLM(_openai(OPENAI_KEY, server.openai_base, FAST), policy=FAST)
    assert await _text(llm) == ["Hi!"]


# --- OpenAI transcription -----------------------------------------------------------------------


async def test_stt_request_is_a_multipart_wav_upload(
    server: VendorServer, session: aiohttp.ClientSession
) -> None:
    stt = OpenAISTT(_openai(OPENAI_KEY, server.openai_base, FAST), policy=FAST)
    assert await stt.transcribe(UTTERANCE, 16_000) == server.transcript
    (request,) = server.seen(TRANSCRIPTIONS)
    assert request.path == "/v1/audio/transcriptions"
    assert request.headers["Authorization"] == f"Bearer {OPENAI_KEY}"
    assert request.headers["Content-Type"].startswith("multipart/form-data; boundary=")
    form = request.form
    assert (form["model"], form["response_format"], form["language"]) == (
        "gpt-4o-mini-transcribe",
        "json",
        "en",
    )
    assert form["file"]["filename"].endswith(".wav")
    assert form["file"]["content_type"] == "audio/wav"
    with wave.open(io.BytesIO(form["file"]["data"])) as wav:
        params = (wav.getnchannels(), wav.getsampwidth(), wav.getframerate())
        assert params == (1, 2, 16_000)
        samples = np.frombuffer(wav.readframes(wav.getnframes()), "<i2")
    np.testing.assert_array_equal(samples, UTTERANCE)


async def test_stt_options(server: VendorServer, session: aiohttp.ClientSession) -> None:
    stt = OpenAISTT(
        _openai(OPENAI_KEY, server.openai_base, FAST),
        model="whisper-1",
        language=None,
        prompt="Avatar, WebRTC",
        policy=FAST,
    )
    await stt.transcribe(UTTERANCE, 48_000)
    form = server.seen(TRANSCRIPTIONS)[0].form
    assert form["model"] == "whisper-1" and form["prompt"] == "Avatar, WebRTC"
    assert "language" not in form


@pytest.mark.parametrize(
    "reply",
    [
        Reply(body=b"<html>Bad gateway</html>", content_type="text/html"),
        Reply(body=b'{"transcript": "hi"}'),
        Reply(body=b'["hi"]'),
    ],
    ids=["html", "no-text", "not-an-object"],
)
async def test_stt_malformed_body(
    reply: Reply, server: VendorServer, session: aiohttp.ClientSession
) -> None:
    server.script(TRANSCRIPTIONS, reply, reply, reply)
    stt = OpenAISTT(_openai(OPENAI_KEY, server.openai_base, FAST), policy=FAST)
    with pytest.raises(ProviderError) as info:
        await stt.transcribe(UTTERANCE, 16_000)
    assert (info.value.code, info.value.retryable) == ("bad_response", True)
    assert len(server.seen(TRANSCRIPTIONS)) == 3


async def test_stt_skips_empty_audio_and_rejects_wrong_samples(
    server: VendorServer, session: aiohttp.ClientSession
) -> None:
    stt = OpenAISTT(_openai(OPENAI_KEY, server.openai_base, FAST), policy=FAST)
    assert await stt.transcribe(np.zeros(0, np.int16), 16_000) == ""
    with pytest.raises(ValueError, match="int16"):
        await stt.transcribe(np.zeros(160, np.float32), 16_000)
    assert server.requests == []


async def test_openai_quota_429_is_not_retried(
    server: VendorServer, session: aiohttp.ClientSession
) -> None:
    quota = openai_error(429, "You exceeded your current quota", code="insufficient_quota")
    server.script(TRANSCRIPTIONS, quota)
    stt = OpenAISTT(_openai(OPENAI_KEY, server.openai_base, FAST), policy=FAST)
    with pytest.raises(ProviderError) as info:
        await stt.transcribe(UTTERANCE, 16_000)
    assert (info.value.code, info.value.retryable) == ("quota_exceeded", False)
    assert len(server.seen(TRANSCRIPTIONS)) == 1


# --- OpenAI speech ------------------------------------------------------------------------------


async def test_openai_tts_streams_24khz_pcm(
    server: VendorServer, session: aiohttp.ClientSession
) -> None:
    tts = OpenAITTS(_openai(OPENAI_KEY, server.openai_base, FAST), policy=FAST)
    chunks = [chunk async for chunk in tts.synthesize("Hello there.")]
    (request,) = server.seen(SPEECH)
    assert request.path == "/v1/audio/speech"
    assert request.headers["Authorization"] == f"Bearer {OPENAI_KEY}"
    assert request.json == {
        "model": "gpt-4o-mini-tts",
        "input": "Hello there.",
        "voice": "alloy",
        "response_format": "pcm",
    }
    assert tts.sample_rate == 24_000
    _assert_chunks(chunks, 24_000, tone(server.speech_seconds, 24_000))


async def test_openai_tts_options(server: VendorServer, session: aiohttp.ClientSession) -> None:
    tts = OpenAITTS(
        _openai(OPENAI_KEY, server.openai_base, FAST),
        voice="coral",
        instructions="Warm and upbeat.",
        speed=1.25,
        policy=FAST,
    )
    await _audio(tts)
    tts_1 = OpenAITTS(
        _openai(OPENAI_KEY, server.openai_base, FAST),
        model="tts-1",
        instructions="Warm and upbeat.",
        policy=FAST,
    )
    await _audio(tts_1)
    first, second = (request.json for request in server.seen(SPEECH))
    assert first["voice"] == "coral" and first["speed"] == 1.25
    assert first["instructions"] == "Warm and upbeat."
    assert second["model"] == "tts-1" and "instructions" not in second  # tts-1 rejects them


@pytest.mark.parametrize(
    ("case", "reply"),
    [
        (CASES[2], Reply(pieces=[b"\x01\x02\x03"])),
        (CASES[2], Reply(body=b'{"ok": true}')),
        (CASES[2], Reply(pieces=[])),
        (CASES[3], Reply(body=b"<html>oops</html>", content_type="text/html")),
    ],
    ids=["odd-bytes", "json", "empty", "html"],
)
async def test_tts_malformed_body_before_output(
    case: Case, reply: Reply, server: VendorServer, session: aiohttp.ClientSession
) -> None:
    server.script(case.route, reply, reply, reply)
    with pytest.raises(ProviderError) as info:
        await case.run(case.make(session, server, FAST, None))
    assert (info.value.code, info.value.retryable) == ("bad_response", True)
    assert len(server.seen(case.route)) == 3


async def test_tts_odd_byte_count_after_output_is_final(
    server: VendorServer, session: aiohttp.ClientSession
) -> None:
    server.script(SPEECH, Reply(pieces=[tone(0.1, 24_000), b"\x01"]))
    tts = OpenAITTS(_openai(OPENAI_KEY, server.openai_base, FAST), policy=FAST)
    received = []
    with pytest.raises(ProviderError) as info:
        async for chunk in tts.synthesize("Hi"):
            received.append(chunk)
    assert received and "odd PCM byte count" in str(info.value)
    assert (info.value.code, info.value.retryable) == ("bad_response", False)


async def test_tts_skips_blank_text(server: VendorServer, session: aiohttp.ClientSession) -> None:
    for tts in (
        OpenAITTS(_openai(OPENAI_KEY, server.openai_base)),
        ElevenLabsTTS(session, api_key=ELEVENLABS_KEY, base_url=server.elevenlabs_base),
    ):
        assert [chunk async for chunk in tts.synthesize("  \n")] == []
    assert server.requests == []


# --- ElevenLabs ---------------------------------------------------------------------------------


async def test_elevenlabs_request_follows_the_stream_protocol(
    server: VendorServer, session: aiohttp.ClientSession
) -> None:
    tts = ElevenLabsTTS(
        session, api_key=ELEVENLABS_KEY, base_url=server.elevenlabs_base, policy=FAST
    )
    chunks = [chunk async for chunk in tts.synthesize("Hello there.")]
    (request,) = server.seen(ELEVENLABS)
    assert request.path == f"/v1/text-to-speech/{DEFAULT_VOICE_ID}/stream/with-timestamps"
    assert request.query == {"output_format": "pcm_24000"}
    assert request.headers["xi-api-key"] == ELEVENLABS_KEY
    assert "Authorization" not in request.headers
    assert request.json == {"text": "Hello there.", "model_id": "eleven_flash_v2_5"}
    _assert_chunks(chunks, 24_000, tone(server.speech_seconds, 24_000))


async def test_elevenlabs_output_format_sets_the_rate(
    server: VendorServer, session: aiohttp.ClientSession
) -> None:
    tts = ElevenLabsTTS(
        session,
        api_key=ELEVENLABS_KEY,
        base_url=server.elevenlabs_base,
        voice_id="voice/with odd chars",
        model_id="eleven_turbo_v2_5",
        output_format="pcm_16000",
        policy=FAST,
    )
    assert tts.sample_rate == 16_000
    # (Several words: a word's audio waits for the word's end, when its timing is known.)
    chunks = [chunk async for chunk in tts.synthesize("Hi there, all.")]
    _assert_chunks(chunks, 16_000, tone(server.speech_seconds, 16_000))
    (request,) = server.seen(ELEVENLABS)
    assert request.raw_path == (
        "/v1/text-to-speech/voice%2Fwith%20odd%20chars/stream/with-timestamps"
    )
    assert request.query == {"output_format": "pcm_16000"}
    assert request.json["model_id"] == "eleven_turbo_v2_5"


async def test_elevenlabs_sends_previous_text_only_when_there_is_some(
    server: VendorServer, session: aiohttp.ClientSession
) -> None:
    tts = ElevenLabsTTS(
        session, api_key=ELEVENLABS_KEY, base_url=server.elevenlabs_base, policy=FAST
    )
    for previous in ("Hello there.", "", " \n"):
        _ = [chunk async for chunk in tts.synthesize("How are you?", previous_text=previous)]
    with_context, without, blank = (request.json for request in server.seen(ELEVENLABS))
    assert with_context == {
        "text": "How are you?",
        "model_id": "eleven_flash_v2_5",
        "previous_text": "Hello there.",
    }
    assert "previous_text" not in without and "previous_text" not in blank
    assert "next_text" not in with_context  # the next sentence is not known yet


def test_elevenlabs_rejects_compressed_formats() -> None:
    with pytest.raises(ValueError, match="raw PCM"):
        ElevenLabsTTS(None, api_key="k", output_format="mp3_44100_128")  # type: ignore[arg-type]


async def test_elevenlabs_quota_is_not_retried(
    server: VendorServer, session: aiohttp.ClientSession
) -> None:
    server.script(ELEVENLABS, elevenlabs_error(401, "Quota exceeded.", code="quota_exceeded"))
    tts = ElevenLabsTTS(
        session, api_key=ELEVENLABS_KEY, base_url=server.elevenlabs_base, policy=FAST
    )
    with pytest.raises(ProviderError) as info:
        await _audio(tts)
    assert (info.value.code, info.value.retryable) == ("quota_exceeded", False)
    assert "Quota exceeded." in str(info.value)


def _assert_chunks(chunks: list[Any], rate: int, expected: bytes) -> None:
    assert len(chunks) > 1  # streamed, not one body-sized chunk
    assert all(c.sample_rate == rate and c.pcm.dtype == np.int16 for c in chunks)
    assert all(len(c.pcm) >= rate // 50 for c in chunks[:-1])  # >= 20 ms but maybe the last
    assert b"".join(c.pcm.tobytes() for c in chunks) == expected


# --- the shared HTTP layer ----------------------------------------------------------------------


async def test_retry_after_is_honoured_up_to_the_cap(
    server: VendorServer, session: aiohttp.ClientSession
) -> None:
    loop = asyncio.get_running_loop()
    policy = HTTPPolicy(backoff_initial_s=0.001, max_retry_after_s=0.5)
    stt = OpenAISTT(_openai(OPENAI_KEY, server.openai_base, policy), policy=policy)
    server.script(TRANSCRIPTIONS, openai_error(429, "wait", retry_after_ms="150"))
    start = loop.time()
    await stt.transcribe(UTTERANCE, 16_000)
    assert loop.time() - start >= 0.15
    server.script(TRANSCRIPTIONS, openai_error(429, "wait", retry_after="3600"))
    start = loop.time()
    await stt.transcribe(UTTERANCE, 16_000)
    assert 0.5 <= loop.time() - start < 1.5


@pytest.mark.parametrize(
    ("status", "code", "retryable"),
    [
        (400, "bad_request", False),
        (401, "unauthorized", False),
        (403, "unauthorized", False),
        (404, "bad_request", False),
        (408, "timeout", True),
        (409, "bad_request", False),
        (422, "bad_request", False),
        (429, "rate_limited", True),
        (500, "server_error", True),
        (502, "server_error", True),
        (503, "server_error", True),
        (504, "server_error", True),
    ],
)
def test_status_mapping(status: int, code: str, retryable: bool) -> None:
    error = status_error("p", "Vendor", status, b'{"error": {"message": "why"}}', {})
    assert (error.code, error.retryable, error.status) == (code, retryable, status)
    assert str(error).startswith("p: ") and f"({status}): why" in str(error)


def test_retry_after_parsing() -> None:
    assert parse_retry_after({}) is None
    assert parse_retry_after({"Retry-After": "2"}) == 2.0
    assert parse_retry_after({"retry-after-ms": "250", "Retry-After": "1"}) == 0.25
    date = "Wed, 21 Oct 2015 07:28:10 GMT"
    assert parse_retry_after({"Retry-After": date}, now=1445412480.0) == 10.0
    assert parse_retry_after({"Retry-After": "soon"}) is None
    error = status_error("p", "V", 503, b"", {"Retry-After": "1"})
    assert error.retry_after_s == 1.0


def test_retry_delay() -> None:
    policy = HTTPPolicy(backoff_initial_s=0.1, backoff_max_s=0.3, jitter=0, max_retry_after_s=2)
    assert [policy.retry_delay_s(n) for n in (1, 2, 3, 4)] == [0.1, 0.2, 0.3, 0.3]
    assert policy.retry_delay_s(1, retry_after_s=0.0) == 0.0
    assert policy.retry_delay_s(1, retry_after_s=60) == 2


@pytest.mark.parametrize(
    ("body", "detail"),
    [
        (b'{"error": {"message": "m", "type": "t", "code": "c"}}', ("m", "c")),
        (b'{"detail": {"status": "invalid_api_key", "message": "m"}}', ("m", "invalid_api_key")),
        (b'{"detail": [{"loc": ["body"], "msg": "field required"}]}', ("field required", None)),
        (
            b'{"object": "error", "message": "m", "type": "BadRequestError"}',
            ("m", "BadRequestError"),
        ),
        (b'{"error": "plain"}', ("plain", None)),
        (b"<html>502</html>", ("<html>502</html>", None)),
    ],
)
def test_vendor_detail(body: bytes, detail: tuple[str, str | None]) -> None:
    assert vendor_detail(body) == detail


@pytest.mark.parametrize(
    "kwargs",
    [
        {"read_timeout_s": 0},
        {"max_attempts": 0},
        {"backoff_initial_s": 3, "backoff_max_s": 1},
        {"jitter": -1},
    ],
)
def test_policy_validation(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        HTTPPolicy(**kwargs)  # type: ignore[arg-type]


def test_providers_satisfy_the_protocols(session: aiohttp.ClientSession) -> None:
    # Checked by mypy: each assignment fails type-checking if a signature drifts from base.py.
    stt: STT = OpenAISTT(_openai("k"))
    llm: LLM = OpenAILLM(_openai("k"))
    voices: list[TTS] = [OpenAITTS(_openai("k")), ElevenLabsTTS(session, api_key="k")]
    assert [stt.name, llm.name, *(tts.name for tts in voices)] == [
        "openai",
        "openai",
        "openai",
        "elevenlabs",
    ]
    assert [tts.sample_rate for tts in voices] == [24_000, 24_000]
