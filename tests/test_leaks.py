"""Calls come and go: 20 in a row leave no tasks, threads or file descriptors behind."""

from __future__ import annotations

import asyncio
import gc
import os
import threading

import aiohttp
from aiortc import RTCPeerConnection

from benchmarks.client import CallClient
from musetalk_core.warp_engine import WarpEngine
from rtc_server.session import AvatarSession
from tests.conftest import LiveServer
from tests.waiting import holds_within, wait_until


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def _one_call(server: LiveServer, end_by_delete: bool) -> None:
    client = CallClient(server.url)
    try:
        session_id = await client.connect()
        await holds_within(lambda: len(client.received.video) >= 3, 10.0)
        assert client.received.video, "no video arrived"
        if end_by_delete:
            async with aiohttp.ClientSession() as http:
                async with http.delete(f"{server.url}/sessions/{session_id}") as resp:
                    assert resp.status == 204
    finally:
        await client.close()
    # A caller that just hangs up is noticed too (DTLS close), without a DELETE.
    await wait_until(lambda: session_id not in server.manager.sessions, 10.0, "call reaped")


POOL_PREFIXES = ("asyncio_", "avatar-rtc_", "avatar-rtc-stt_")


def _pooled(thread: threading.Thread) -> bool:
    return thread.name.startswith(POOL_PREFIXES)


def _alive(cls: type) -> int:
    return sum(1 for o in gc.get_objects() if isinstance(o, cls))


async def _settle() -> dict[str, int]:
    for _ in range(10):
        await asyncio.sleep(0.1)
        gc.collect()
    return {
        "tasks": len(asyncio.all_tasks()),
        # Pool threads start lazily up to a fixed cap (asyncio's default executor, where aiortc
        # encodes; our own pools): reaching the cap is no leak, any other new thread is.
        "threads outside pools": sum(1 for t in threading.enumerate() if not _pooled(t)),
        "fds": _fds(),
        "sessions": _alive(AvatarSession),
        "peer connections": _alive(RTCPeerConnection),
        "engines": _alive(WarpEngine),
    }


async def test_twenty_calls_leave_nothing_behind(live_server: LiveServer) -> None:
    # Two warm-up calls: thread pools and caches reach their steady size first.
    for i in range(2):
        await _one_call(live_server, end_by_delete=bool(i % 2))
    before = await _settle()
    for i in range(20):
        await _one_call(live_server, end_by_delete=bool(i % 2))
    after = await _settle()
    assert not live_server.manager.sessions
    grown = {k: (before[k], after[k]) for k in before if after[k] > before[k]}
    assert not grown, f"grew after 20 calls (before, after): {grown}"
    # Compared with the baseline like the rest: an earlier module's objects may still be
    # waiting for the collector; none of these 20 calls' may be left.
    assert after["sessions"] <= before["sessions"] and after["engines"] <= before["engines"]
    pooled = [t.name for t in threading.enumerate() if _pooled(t)]
    assert len(pooled) <= min(32, (os.cpu_count() or 1) + 4) + 2, pooled
