"""Admission by headroom: a process learns what a call costs and refuses the one it can't carry."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from benchmarks.client import CallClient, make_offer
from rtc_server import headroom as headroom_module
from rtc_server.engine_factory import EngineFactory
from rtc_server.headroom import (
    Headroom,
    HeadroomSettings,
    MachineCpu,
    WorkerLoad,
    machine_refusal,
)
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
    # The CPU in use is what decides here (a speaking call's cost: the next test).
    settings = HeadroomSettings(cpu_limit=0.6, prior_call_cpu=0.15, prior_speaking_call_cpu=0.2)
    room = Headroom(settings)
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


def test_the_local_models_cpu_counts_as_the_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeTime()
    monkeypatch.setattr(headroom_module, "time", clock)
    model = FakeTime()  # the model process's CPU seconds, moved by hand like the server's
    settings = HeadroomSettings(cpu_limit=0.6, prior_call_cpu=0.15, prior_speaking_call_cpu=0.2)
    room = Headroom(settings)
    room.helper_cpu = model.process_time
    clock.run(6, 0.1, room)  # idle: the server 0.1 core, the model nothing
    room.calls = 1
    for _ in range(60):  # one call: the server 0.15 core, the model writing its reply 0.3
        model.cpu += 0.3 * 0.1
        clock.run(0.1, 0.15, room)
    assert room.cpu_cores == pytest.approx(0.45, abs=0.01)
    assert room.call_cpu == pytest.approx(0.35, abs=0.01)
    assert room.refusal() is not None  # 0.45 + 0.35 > 0.6; the server's own 0.15 would fit


def test_calls_are_admitted_for_what_they_cost_when_they_all_speak(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = FakeTime()
    monkeypatch.setattr(headroom_module, "time", clock)
    room = Headroom(HeadroomSettings(cpu_limit=1.0, prior_speaking_call_cpu=0.5))
    units = speaking = 0

    def run(seconds: float, cores: float, share: float) -> None:
        # 30 instants a second a call, ``share`` of them speech; sampled as the process does.
        nonlocal units, speaking
        for _ in range(round(seconds / 0.1)):
            clock.now += 0.1
            clock.cpu += cores * 0.1
            units += 3 * room.calls
            speaking += round(3 * room.calls * share)
            room._sample_cpu()
            room.note_speech(speaking, 0, units)

    run(6, 0.1, 0.0)  # no call: 0.1 core
    room.calls = 2
    run(6, 0.2, 0.0)  # two listening calls: 0.05 core each
    assert room.refusal() is not None, "the prior: 0.1 + 3 x 0.5 speaking > 1.0"
    run(6, 0.6, 1.0)  # both speak: 0.25 core each
    assert room.speaking_call_cpu == pytest.approx(0.25, abs=0.01)
    run(6, 0.4, 0.5)  # one speaks, one listens: the same costs
    assert room.speaking_call_cpu == pytest.approx(0.25, abs=0.01)
    room.calls = 3
    run(6, 0.25, 0.0)  # three listening: 0.25 cores in use, room for a fourth by that alone
    assert room.cpu_cores + room.call_cpu <= 1.0
    refusal = room.refusal()  # but four speaking need 0.1 + 4 x 0.25 = 1.1 > 1.0
    assert refusal is not None and "4 calls speaking at once" in refusal.reason, refusal
    assert room.snapshot()["speaking_call_cpu_measured"]
    room.calls = 2
    run(6, 0.2, 0.0)
    assert room.refusal() is None  # 0.1 + 3 x 0.25 = 0.85


def test_calls_that_came_before_an_idle_window_are_charged_with_the_baseline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = FakeTime()
    monkeypatch.setattr(headroom_module, "time", clock)
    room = Headroom(HeadroomSettings(cpu_limit=1.0))
    room.calls = 2  # from the start: the process never idled a window
    for i in range(60):
        clock.now += 0.1
        clock.cpu += 0.6 * 0.1  # both speak: 0.6 core, the baseline in it
        room._sample_cpu()
        room.note_speech(6 * (i + 1), 0, 6 * (i + 1))
    snapshot = room.snapshot()
    assert snapshot["idle_cpu"] is None and snapshot["speaking_call_cpu_measured"]
    assert room.speaking_call_cpu == pytest.approx(0.3, abs=0.01)
    assert room.call_cpu == pytest.approx(0.3, abs=0.01)


def _stat(path: Path, user: int, system: int, idle: int, iowait: int = 0) -> None:
    """A /proc/stat whose cpu0 and cpu2 lines have these tick counts each; cpu1 (a CPU this
    process may not run on) is all busy, and the all-cores line says so."""
    mine = f"{user} 0 {system} {idle} {iowait} 0 0 0 0 0"
    path.write_text(
        f"cpu  {2 * user + 99999} 0 {2 * system} {2 * idle} {2 * iowait} 0 0 0 0 0\n"
        f"cpu0 {mine}\ncpu1 99999 0 0 0 0 0 0 0 0 0\ncpu2 {mine}\nintr 1 2 3\n"
    )


def test_the_machines_busy_cores_are_read_from_proc_stat(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import os

    clock = FakeTime()
    monkeypatch.setattr(headroom_module, "time", clock)
    tick = os.sysconf("SC_CLK_TCK")
    stat = tmp_path / "stat"
    no_quota = str(tmp_path / "cpu.max")
    machine = MachineCpu(window_s=10.0, path=str(stat), cpus={0, 2}, quota_path=no_quota)
    _stat(stat, 1000, 500, 9000, 100)
    machine.sample()
    assert machine.busy_cores is None, "one sample is no rate"
    clock.now += 5.0
    # Over 5 s, on each of the two CPUs it may run on: 3 s of user and system time, idle and
    # iowait aside (cpu1's are not counted: another container's, say).
    _stat(stat, 1000 + 2 * tick, 500 + tick, 9000 + tick, 100 + tick // 2)
    machine.sample()
    assert machine.busy_cores == pytest.approx(6.0 / 5.0)
    # Under a CPU quota the CPUs' other tenants do not take from what the quota grants.
    quota = tmp_path / "quota.max"
    quota.write_text("150000 100000\n")
    capped = MachineCpu(path=str(stat), cpus={0, 2}, quota_path=str(quota))
    capped.sample()
    clock.now += 1.0
    capped.sample()
    assert capped.capped and capped.busy_cores is None
    quota.write_text("max 100000\n")
    assert not MachineCpu(path=str(stat), quota_path=str(quota)).capped
    # Where it cannot be read (not Linux), it says nothing rather than a guess.
    gone = MachineCpu(path=str(tmp_path / "missing"))
    gone.sample()
    gone.sample()
    assert gone.busy_cores is None
    # The real one reads on this machine.
    real = MachineCpu()
    real.sample()
    clock.now += 1.0
    real.sample()
    assert real.busy_cores is not None and real.busy_cores >= 0.0


class FixedMachine(MachineCpu):
    def __init__(self, busy: float) -> None:
        super().__init__()
        self.busy = busy

    @property
    def busy_cores(self) -> float | None:
        return self.busy


def test_a_process_alone_counts_what_the_rest_of_the_machine_uses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = FakeTime()
    monkeypatch.setattr(headroom_module, "time", clock)
    settings = HeadroomSettings(cpu_limit=1.8, prior_speaking_call_cpu=0.25)
    machine = FixedMachine(0.3)
    room = Headroom(settings, machine)
    clock.run(6, 0.05, room)  # idle
    room.calls = 3
    clock.run(6, 0.2, room)
    # 0.05 + 4 x 0.25 = 1.05 for four calls speaking, and the rest of the machine 0.1 core.
    assert room.others_cpu == pytest.approx(0.1, abs=0.01)
    assert room.refusal() is None
    machine.busy = 1.2  # another program takes a core: 1.05 + 1.0 > 1.8
    refusal = room.refusal()
    assert refusal is not None and "rest of the machine uses 1.00" in refusal.reason, refusal
    assert room.snapshot()["others_cpu"] == pytest.approx(1.0, abs=0.01)
    # A worker judges its own calls only (its front judges the machine).
    worker = Headroom(settings)
    clock.run(6, 0.05, worker)
    worker.calls = 3
    clock.run(6, 0.2, worker)
    assert worker.refusal() is None and worker.snapshot()["others_cpu"] is None


def test_the_front_refuses_a_call_the_machine_has_no_room_for() -> None:
    def worker(calls: int, cpu: float) -> WorkerLoad:
        return WorkerLoad(calls, cpu, idle_cpu=0.05, speaking_call_cpu=0.21, cpu_limit=0.9)

    assert machine_refusal([worker(0, 0.05), worker(0, 0.05)], 1.5) is None, "the first call"
    # Four calls on one worker, three on the other, which by its own judgement takes a
    # fourth (0.05 + 4 x 0.21 = 0.89 <= 0.9).
    calls = [worker(4, 0.5), worker(3, 0.4)]
    # All speaking, with the new one: 0.1 + 7 x 0.21 + 0.21 = 1.78 of the 1.8 the workers
    # may use together: it fits while nothing else runs ...
    assert machine_refusal(calls, 0.9) is None
    # ... and not when the rest of the machine (callers, another program) uses 0.3 core.
    refusal = machine_refusal(calls, 1.2)
    assert refusal is not None and "8 calls speaking at once" in refusal.reason, refusal
    assert "the rest of the machine uses 0.30" in refusal.reason and refusal.retry_after_s > 0
    # Unknown machine use (not Linux): the workers' own needs still count.
    assert machine_refusal([worker(4, 0.5), worker(4, 0.5)], None) is not None


def test_a_shared_engine_that_does_not_keep_up_closes_admission() -> None:
    room = Headroom(HeadroomSettings(cpu_limit=64.0, held_limit=0.1))
    room.calls = 1
    room.note_speech(1000, 10, 2000)
    room.note_speech(1100, 40, 2200)  # 30 of the last 100 speech instants held
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
                assert {"loop_lag_ms", "cpu_cores", "call_cpu", "speaking_call_cpu"} <= set(ready)
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
