"""Admission by headroom: a process learns what a call costs and refuses the one it can't carry."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from benchmarks.client import CallClient, make_offer
from rtc_server import headroom as headroom_module
from rtc_server.engine_factory import EngineFactory
from rtc_server.headroom import Headroom, HeadroomSettings
from tests.conftest import start_server


class FakeTime:
    """``time.monotonic`` and ``time.process_time`` a test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0
        self.cpu = 0.0

    def monotonic(self) -> float:
        return self.now

    def process_time(self) -> float:
        return self.cpu

    def run(self, seconds: float, cores: float, room: Headroom, step: float = 0.1) -> None:
        for _ in range(round(seconds / step)):
            self.now += step
            self.cpu += cores * step
            room._sample_cpu()


def test_the_cost_of_a_call_is_learned_and_admission_follows_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = FakeTime()
    monkeypatch.setattr(headroom_module, "time", clock)
    room = Headroom(HeadroomSettings(cpu_limit=0.6, prior_call_cpu=0.15))
    assert room.refusal() is None, "a process with no call always takes one"
    clock.run(6, 0.1, room)  # idle: 0.1 core
    room.calls = 2
    clock.run(6, 0.5, room)  # two calls: 0.2 core each above the idle 0.1
    assert room.call_cpu == pytest.approx(0.2, abs=0.01)
    assert room.cpu_cores == pytest.approx(0.5, abs=0.01)
    refusal = room.refusal()  # 0.5 + 0.2 > 0.6
    assert refusal is not None and "0.20" in refusal.reason and refusal.retry_after_s > 0
    room.calls = 1
    clock.run(6, 0.3, room)
    assert room.refusal() is None  # 0.3 + 0.2 <= 0.6
    snapshot = room.snapshot()
    assert snapshot["call_cpu_measured"] and snapshot["calls"] == 1


def test_a_shared_engine_that_does_not_keep_up_closes_admission() -> None:
    room = Headroom(HeadroomSettings(cpu_limit=64.0, held_limit=0.1))
    room.calls = 1
    room.note_speech(1000, 10)
    room.note_speech(1100, 40)  # 30 of the last 100 speech instants held
    refusal = room.refusal(engine_shared=True)
    assert refusal is not None and "keeping up" in refusal.reason
    # One engine per call (the CPU renderer): another call's engine says nothing of the next.
    assert room.refusal(engine_shared=False) is None


async def test_at_capacity_a_new_call_gets_503_and_the_running_call_goes_on(
    engine_factory: EngineFactory, cache_dir: Path
) -> None:
    # A budget no second call fits in: the first call is always taken, the second refused.
    server, runner = await start_server(engine_factory, cache_dir, headroom=True, cpu_limit=0.01)
    client = CallClient(server.url, record_video=True, decode_video=False)
    try:
        await client.connect()
        await client.wait_channel_open()
        await client.wait_state("listening", 10)
        await client.say("The first call goes on while the server turns the next one away.")
        await client.wait_state("speaking", 10)
        frames_before = len(client.received.video)
        async with aiohttp.ClientSession() as http:
            offer = {"sdp": await make_offer(), "type": "offer"}
            async with http.post(server.url + "/offer", json=offer) as resp:
                body = await resp.json()
                assert resp.status == 503, body
                assert body["error"]["code"] == "at_capacity"
                assert int(resp.headers["Retry-After"]) > 0
                assert "no room" in body["error"]["message"]
            async with http.get(server.url + "/readyz") as resp:
                ready = await resp.json()
                assert ready["sessions"] == 1 and ready["cpu_limit"] == 0.01
                assert {"loop_lag_ms", "cpu_cores", "call_cpu"} <= set(ready)
            async with http.get(server.url + "/metrics") as resp:
                text = await resp.text()
                assert 'avatar_rtc_calls_refused_total{reason="headroom"} 1.0' in text
                assert "avatar_rtc_event_loop_lag_seconds" in text
        assert len(server.manager.sessions) == 1, "the refused offer left no session behind"
        await asyncio.sleep(1.0)
        # The running call was not touched: its speech video keeps coming, frame after frame.
        assert len(client.received.video) - frames_before >= 15
        assert client.session_id in server.manager.sessions
        assert not [e for e in client.events if e.get("type") == "error"]
    finally:
        await client.close()
        await runner.cleanup()
