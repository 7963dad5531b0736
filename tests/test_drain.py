"""Graceful shutdown of a real ``avatar-rtc serve`` process: SIGTERM drains, then it exits 0."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from benchmarks.client import CallClient, make_offer
from benchmarks.latency import spawn_server

DRAIN_S = 6.0
SLACK_S = 4.0
"""Closing the last call, the HTTP server and the thread pools after the drain."""


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[tuple[str, asyncio.subprocess.Process, Path]]:
    log_path = tmp_path / "server.log"
    with log_path.open("wb") as log:
        url, process = await spawn_server("--drain-timeout-s", str(DRAIN_S), log=log)
        try:
            yield url, process, log_path
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()


async def _get(url: str) -> tuple[int, dict, dict]:  # type: ignore[type-arg]
    async with aiohttp.ClientSession() as http:
        async with http.get(url) as resp:
            return resp.status, await resp.json(content_type=None), dict(resp.headers)


async def _frames_keep_coming(caller: CallClient, seconds: float = 1.0) -> int:
    """Video frames received over ``seconds``. An idle avatar's still picture is sent every
    0.25 s (rtc_server/media/tracks.py STILL_REPEAT_S): 4 a second."""
    before = len(caller.received.video)
    await asyncio.sleep(seconds)
    return len(caller.received.video) - before


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:]


async def _exit_code(process: asyncio.subprocess.Process, timeout: float, log: Path) -> int:
    try:
        return await asyncio.wait_for(process.wait(), timeout)
    except TimeoutError:
        raise AssertionError(f"still running after {timeout} s; log:\n{_tail(log)}") from None


async def test_sigterm_lets_running_calls_finish_then_exits(
    server: tuple[str, asyncio.subprocess.Process, Path],
) -> None:
    url, process, log = server
    caller = CallClient(url, record_video=False)
    try:
        await caller.connect()
        await caller.wait_channel_open()
        assert await _frames_keep_coming(caller) >= 3

        process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        await asyncio.sleep(0.3)

        # Not ready any more, still alive; new calls are turned away with a retry hint.
        status, body, _ = await _get(url + "/readyz")
        assert status == 503 and body["error"]["code"] == "draining"
        status, _, _ = await _get(url + "/healthz")
        assert status == 200
        sdp = await make_offer()
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/offer", json={"sdp": sdp, "type": "offer"}) as resp:
                body = await resp.json()
                assert resp.status == 503 and body["error"]["code"] == "draining"
                assert int(resp.headers["Retry-After"]) >= 1

        # The running call goes on: video arrives, and a say is spoken.
        assert await _frames_keep_coming(caller) >= 3
        await caller.say("Still here while the server drains.")
        await caller.wait_state("speaking", 10)
        assert process.returncode is None

        # At the drain timeout the call is ended (the caller is told why), and the process exits.
        code = await _exit_code(process, DRAIN_S + SLACK_S, log)
        elapsed = time.monotonic() - signalled
        assert code == 0
        assert DRAIN_S - 0.5 <= elapsed <= DRAIN_S + SLACK_S, elapsed
        error = await caller.wait_event(lambda e: e.get("type") == "error", 2)
        assert error["code"] == "shutting_down"
    finally:
        await caller.close()


async def test_sigterm_exits_as_soon_as_the_last_call_ends(
    server: tuple[str, asyncio.subprocess.Process, Path],
) -> None:
    url, process, log = server
    caller = CallClient(url, record_video=False)
    try:
        session_id = await caller.connect()
        await caller.wait_channel_open()
        process.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.5)
        assert process.returncode is None
        async with aiohttp.ClientSession() as http:
            async with http.delete(f"{url}/sessions/{session_id}") as resp:
                assert resp.status == 204
        hung_up = time.monotonic()
        assert await _exit_code(process, SLACK_S, log) == 0
        assert time.monotonic() - hung_up < DRAIN_S - 1
    finally:
        await caller.close()


async def test_sigterm_without_calls_exits_at_once(
    server: tuple[str, asyncio.subprocess.Process, Path],
) -> None:
    _, process, log = server
    process.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    assert await _exit_code(process, SLACK_S, log) == 0
    assert time.monotonic() - signalled < 3.0


async def test_a_second_sigterm_cuts_the_drain_short(
    server: tuple[str, asyncio.subprocess.Process, Path],
) -> None:
    url, process, log = server
    caller = CallClient(url, record_video=False)
    try:
        await caller.connect()
        await caller.wait_channel_open()
        process.send_signal(signal.SIGTERM)
        await asyncio.sleep(1.0)
        assert process.returncode is None  # draining: the call holds the process
        process.send_signal(signal.SIGTERM)
        second = time.monotonic()
        assert await _exit_code(process, SLACK_S, log) == 0
        assert time.monotonic() - second < DRAIN_S - 2
        error = await caller.wait_event(lambda e: e.get("type") == "error", 2)
        assert error["code"] == "shutting_down"
    finally:
        await caller.close()
