"""Call limits: idle calls are closed, over-long says and typed turns are refused."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from benchmarks.client import CallClient
from rtc_server.cli import build_parser, main
from rtc_server.config import ServerConfig
from rtc_server.engine_factory import EngineFactory
from tests.conftest import LiveServer, start_server
from tests.waiting import holds_within


@pytest.fixture
async def idle_server(engine_factory: EngineFactory, cache_dir: Path) -> AsyncIterator[LiveServer]:
    server, runner = await start_server(engine_factory, cache_dir, idle_timeout_s=2.0)
    try:
        yield server
    finally:
        await runner.cleanup()


async def _connected(server: LiveServer) -> CallClient:
    caller = CallClient(server.url, record_video=False)
    await caller.connect()
    await caller.wait_channel_open()
    await caller.wait_state("listening", 5)
    return caller


async def _gone(server: LiveServer, session_id: str, timeout: float = 5.0) -> bool:
    return await holds_within(lambda: session_id not in server.manager.sessions, timeout)


def _errors(caller: CallClient) -> list[dict[str, object]]:
    return [e for e in caller.events if e.get("type") == "error"]


async def test_an_idle_call_is_told_and_closed(idle_server: LiveServer) -> None:
    # The caller's microphone sends silence: no speech, no text, no say.
    connected_at = time.monotonic()
    caller = await _connected(idle_server)
    try:
        error = await caller.wait_event(lambda e: e.get("type") == "error", 10)
        waited = time.monotonic() - connected_at
        assert error["code"] == "idle_timeout" and error["message"]
        assert waited >= 1.9, f"closed after {waited:.2f} s, before the 2 s idle timeout"
        assert await _gone(idle_server, caller.session_id)
    finally:
        await caller.close()


async def test_says_and_speaking_keep_a_call_open(idle_server: LiveServer) -> None:
    caller = await _connected(idle_server)
    try:
        # A say every 1.2 s for 4 s (twice the idle timeout): never idle.
        for _ in range(4):
            await caller.say("Hi.")
            await asyncio.sleep(1.2)
        assert not _errors(caller), caller.events
        # Typed text on the data channel counts too (the echo LLM answers it).
        caller.channel.send(json.dumps({"type": "text", "text": "Hello there."}))
        await caller.wait_state("thinking", 5)
        # A reply longer than the idle timeout is not idleness: the count starts when the
        # avatar is back to listening.
        await caller.say(
            "This sentence is long enough to keep the avatar talking for a good few seconds, "
            "well past the idle timeout of this server."
        )
        await caller.wait_state("speaking", 10)
        spoke_at = time.monotonic()
        await caller.wait_event(lambda e: e == {"type": "state", "state": "listening"}, 30)
        listening_at = time.monotonic()
        assert listening_at - spoke_at > 2.0, "the reply was too short to test this"
        assert not _errors(caller), caller.events
        error = await caller.wait_event(lambda e: e.get("type") == "error", 10)
        assert error["code"] == "idle_timeout"
        assert time.monotonic() - listening_at >= 1.9
        assert await _gone(idle_server, caller.session_id)
    finally:
        await caller.close()


async def test_idle_timeout_zero_never_closes(
    engine_factory: EngineFactory, cache_dir: Path
) -> None:
    server, runner = await start_server(engine_factory, cache_dir, idle_timeout_s=0)
    caller = await _connected(server)
    try:
        session = server.manager.sessions[caller.session_id]
        assert [t for t in session._tasks if t.get_name().endswith("call-limit")]
        assert not [t for t in session._tasks if t.get_name().endswith("idle-limit")]
    finally:
        await caller.close()
        await runner.cleanup()


async def test_over_long_say_is_refused_over_http_and_the_data_channel(
    engine_factory: EngineFactory, cache_dir: Path
) -> None:
    server, runner = await start_server(engine_factory, cache_dir, max_say_chars=40)
    caller = await _connected(server)
    say_url = f"{server.url}/sessions/{caller.session_id}/say"
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(say_url, json={"text": "x" * 41}) as resp:
                body = await resp.json()
                assert resp.status == 413
                assert body == {
                    "error": {"code": "text_too_long", "message": body["error"]["message"]}
                }
                assert "40" in body["error"]["message"]
        for kind in ("say", "text"):
            caller.channel.send(json.dumps({"type": kind, "text": "y" * 41}))
            error = await caller.wait_event(lambda e: e.get("type") == "error", 5)
            assert error["code"] == "text_too_long"
        # The call is still up, and texts at the limit are spoken.
        assert caller.session_id in server.manager.sessions
        caller.channel.send(json.dumps({"type": "say", "text": "z" * 39 + "."}))
        await caller.wait_state("speaking", 10)
        await caller.wait_state("listening", 20)
        await caller.say("Exactly forty characters long, this is!!")
        await caller.wait_state("speaking", 10)
    finally:
        await caller.close()
        await runner.cleanup()


def test_limit_flags_and_environment() -> None:
    args = build_parser({}).parse_args(["serve"])
    assert (args.idle_timeout_s, args.max_say_chars) == (300.0, 2000)
    env = {"AVATAR_RTC_IDLE_TIMEOUT_S": "0", "AVATAR_RTC_MAX_SAY_CHARS": "500"}
    args = build_parser(env).parse_args(["serve"])
    assert (args.idle_timeout_s, args.max_say_chars) == (0.0, 500)
    args = build_parser(env).parse_args(["serve", "--max-say-chars", "9"])
    assert args.max_say_chars == 9


@pytest.mark.parametrize(
    ("field", "value"),
    [("idle_timeout_s", -1.0), ("max_say_chars", 0), ("drain_timeout_s", -5.0)],
)
def test_bad_limits_are_refused(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        ServerConfig.of(**{field: value})


def test_bad_limit_flags_stop_start_up(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--max-say-chars", "0", "--cache-dir", str(tmp_path)], {}) == 2
    assert "max_say_chars" in capsys.readouterr().err
