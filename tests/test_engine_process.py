"""One engine process renders for several media workers: their calls share its batches, the
frames come back through shared memory, and a dead engine process fails the calls' engines."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from musetalk_core.engine import MuseTalkEngine
from musetalk_core.engine_client import EngineClient
from musetalk_core.frame_ring import FrameRing, SlotsExhausted
from musetalk_core.loading import load_musetalk
from musetalk_core.runtime import MuseTalkRuntime
from musetalk_core.tiny import build_random_weights
from musetalk_core.types import EngineError
from musetalk_core.warp_avatar import builtin_portrait
from tests.test_musetalk_engine import speak, tone
from tests.test_workers import _children
from tests.waiting import probe_until, wait_until

ROOT = Path(__file__).resolve().parents[1]


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_weights(tmp_path_factory.mktemp("engine-weights") / "musetalk")


@pytest.fixture(scope="module")
def material_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-material")


def _start(weights: Path, cache: Path, socket: Path) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "musetalk_core.engine_server",
            "--socket",
            str(socket),
            "--weights-dir",
            str(weights),
            "--cache-dir",
            str(cache),
            "--device",
            "cpu",
            "--batch",
            "8",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert process.stdout is not None
    line = process.stdout.readline()  # blocks until the models are warm (or it died)
    assert line.strip() == "ready", f"engine process said {line!r}, exit {process.poll()}"
    return process


@pytest.fixture
def engine_process(weights: Path, material_cache: Path, tmp_path: Path) -> Iterator[Path]:
    socket = tmp_path / "engine.sock"
    process = _start(weights, material_cache, socket)
    try:
        yield socket
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)


@pytest.fixture(scope="module")
def local(weights: Path, material_cache: Path) -> Iterator[MuseTalkRuntime]:
    """The same release and avatar in this process: the frames a call renders alone."""
    loaded = load_musetalk(weights, builtin_portrait(), cache_dir=material_cache, device="cpu")
    runtime = loaded.runtime(max_batch=8)
    yield runtime
    runtime.close()


async def test_two_workers_calls_share_batches_and_get_their_own_frames(
    engine_process: Path, local: MuseTalkRuntime
) -> None:
    before = _shm()
    async with asyncio.timeout(30):
        first = await EngineClient.connect(engine_process)
        second = await EngineClient.connect(engine_process)
    a = MuseTalkEngine(first, frame_wait=30.0, start_wait=30.0)
    b = MuseTalkEngine(second, frame_wait=30.0, start_wait=30.0)
    assert a.frame_size == local.frame_size and a.fps == 25 and a.latency > 0.12
    idle = first.idle_frames
    assert len(idle) == len(local.avatar.frames)
    assert all(np.array_equal(x, y) for x, y in zip(idle, local.avatar.frames, strict=True))
    loud, other = tone(0.6, 150, seed=1), tone(0.6, 400, seed=2)
    got_a, got_b = await asyncio.gather(speak(a, loud, 7), speak(b, other, 7))
    assert a.degraded_frames == b.degraded_frames == 0
    stats = await first.stats()
    assert stats["workers"] == 2 and stats["calls"] == 2
    assert stats["mixed_batches"] >= 1, stats  # frames of both workers in one batch
    assert stats["dropped_frames"] == 0
    x1, y1, x2, y2 = local.avatar.face_boxes[0]
    for got, pcm in ((got_a, loud), (got_b, other)):
        alone = local.render_now(pcm)
        assert len(got) == len(alone)
        for frame, own in zip(got, alone, strict=True):
            face = frame.image[y1:y2, x1:x2].astype(int)
            assert np.abs(face - own[y1:y2, x1:x2]).max() <= 1
    await a.aclose()
    await b.aclose()
    # Each call's close went over its own worker's connection: the engine may read this
    # request before the other worker's close.
    await probe_until(first.stats, lambda st: st["calls"] == 0, 10, "the closed calls closed", 0.1)
    await first.aclose()
    await second.aclose()
    assert _shm() <= before, "shared memory left behind"


async def test_a_dead_engine_process_fails_its_calls(
    weights: Path, material_cache: Path, tmp_path: Path
) -> None:
    before = _shm()
    socket = tmp_path / "engine.sock"
    process = _start(weights, material_cache, socket)
    try:
        async with asyncio.timeout(30):
            client = await EngineClient.connect(socket)
        engine = MuseTalkEngine(client, frame_wait=30.0, start_wait=30.0)
        frames = engine.frames()
        assert not (await anext(frames)).speaking
        process.kill()
        with pytest.raises(EngineError, match="engine process is gone"):
            async with asyncio.timeout(10):
                while True:
                    await anext(frames)
        await client.aclose()
    finally:
        process.kill()
        process.wait(30)
    # Killed, it could not unlink its avatar segment: its resource tracker does, once it sees
    # the process gone (the worker ring's name was unlinked as soon as both sides had it).
    await wait_until(lambda: _shm() <= before, 10, lambda: f"left behind: {_shm() - before}")


def _engine_sockets(front_pid: int) -> dict[int, Path]:
    """The front's engine processes: pid -> the socket it serves (from its command line)."""
    found = {}
    for pid in _children(front_pid):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"musetalk_core.engine_server" in argv:
                found[pid] = Path(argv[argv.index(b"--socket") + 1].decode())
    return found


async def _engine_stats(socket: Path) -> dict[str, Any]:
    async with asyncio.timeout(30):
        client = await EngineClient.connect(socket)
    try:
        return await client.stats()
    finally:
        await client.aclose()


@pytest.mark.timeout(420)
async def test_a_front_with_two_workers_renders_every_call_in_one_engine_process(
    weights: Path, tmp_path: Path
) -> None:
    from tests.test_workers import _connect, _metric, _spawn_front, _stop

    log = tmp_path / "front.log"
    url, front = await _spawn_front(
        log,
        "--engine",
        "musetalk",
        "--musetalk-device",
        "cpu",
        "--musetalk-batch",
        "8",
        "--weights-dir",
        str(weights),
        "--cache-dir",
        str(tmp_path / "cache"),
    )
    callers = []
    try:
        (pid, socket), *more = _engine_sockets(front.pid).items()
        assert not more, "one engine process for one device"
        callers = [await _connect(url) for _ in range(2)]
        # Two workers and this test's own connection; each call opened its line to the engine.
        stats = await probe_until(
            lambda: _engine_stats(socket), lambda st: st["calls"] >= 2, 30, "two calls opened"
        )
        assert stats["workers"] == 3 and stats["calls"] == 2, stats
        text = "Both calls speak at the same time, so their frames share one batch."
        await asyncio.gather(*(c.say(text) for c in callers))
        await asyncio.gather(*(c.wait_state("speaking", 60) for c in callers))
        await probe_until(
            lambda: _engine_stats(socket),
            lambda st: st["mixed_batches"] >= 1,
            120,
            "a batch holding both workers' frames",
        )
        # The engine process dies: the calls go on (the CPU engine takes them over), it is
        # started again, and the workers connect to the new one.
        os.kill(pid, signal.SIGKILL)

        async def new_engine_workers() -> int:
            restarted = [s for p, s in _engine_sockets(front.pid).items() if p != pid]
            with contextlib.suppress(OSError, TimeoutError, EngineError):
                return int((await _engine_stats(restarted[0]))["workers"]) if restarted else 0
            return 0

        await probe_until(
            new_engine_workers,
            lambda workers: workers >= 3,
            180,
            lambda: f"the engine process back, both workers on it:\n{log.read_text()}",
            1.0,
        )
        assert all(c.pc.connectionState == "connected" for c in callers)
        assert "MuseTalk engine process on cpu died" in log.read_text()
        assert (await _metric(url, "avatar_rtc_engine_restarts_total")) == {"": 1.0}
    finally:
        for caller in callers:
            await caller.close()
        await _stop(front)
    assert not _engine_sockets(front.pid)


def test_frame_ring_slots_go_round_and_a_closed_ring_takes_nothing() -> None:
    ring = FrameRing.create(2, (4, 4, 3))
    try:
        reader = FrameRing.attach(ring.name, 2, (4, 4, 3))
        ring.unlink()  # both have it mapped: the name can go
        images = [np.full((4, 4, 3), v, np.uint8) for v in (7, 9)]
        slots = ring.put(images, timeout=0)
        assert [int(reader.copy(s)[0, 0, 0]) for s in slots] == [7, 9]
        with pytest.raises(SlotsExhausted):
            ring.put(images[:1], timeout=0.05)  # both slots still held by the reader
        ring.release(slots[:1])
        assert ring.put(images[1:], timeout=0) == slots[:1]
        reader.close()
    finally:
        ring.close()
    assert ring.put(images, timeout=1) == []
