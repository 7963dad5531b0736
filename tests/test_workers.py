"""``avatar-rtc serve --workers 2``: real front and worker processes, real aiortc callers.

Each server here is one front and two model-loading workers on 127.0.0.1 (ICE too).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import socket
import ssl
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import cv2
import numpy as np
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.client import CallClient, make_offer
from rtc_server.cli import build_parser
from rtc_server.workers.front import merge_metrics
from rtc_server.workers.pool import HUNG_AFTER_S
from tests.test_tls import self_signed

ROOT = Path(__file__).resolve().parent.parent
READY_S = 240.0
"""Two workers loading their models on a busy 2-core machine: generous."""
DRAIN_S = 20.0
"""The drain timeout of the draining front: everything the test does with its two calls after
SIGTERM (checks, a say on each, about 8 s on an idle machine) must fit in it; at 6 s a busy run
ended the calls before their says were spoken."""
SLACK_S = 6.0

Server = tuple[str, asyncio.subprocess.Process, Path]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _spawn_front(
    log_path: Path,
    *args: str,
    tls: ssl.SSLContext | None = None,
    env: dict[str, str] | None = None,
) -> tuple[str, asyncio.subprocess.Process]:
    port = _free_port()
    with log_path.open("wb") as log:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "rtc_server",
            "serve",
            "--workers",
            "2",
            "--port",
            str(port),
            "--ice-address",
            "127.0.0.1",
            *args,
            cwd=ROOT,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=log,
            env=None if env is None else {**os.environ, **env},
        )
    url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    try:
        await _wait_ready(url, process, log_path, tls=tls)
    except BaseException:
        await _stop(process)
        raise
    return url, process


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found += [int(c) for c in (task / "children").read_text().split()]
    return found


async def _stop(process: asyncio.subprocess.Process) -> None:
    """SIGTERM (the front kills a worker that has not drained 15 s after the 30 s drain);
    whatever is still there after that is killed, workers included."""
    workers = _children(process.pid) if process.returncode is None else []
    if process.returncode is None:
        process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), 60)
        except TimeoutError:
            process.kill()
            await process.wait()
    for pid in workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-4000:]


async def _get(url: str, tls: ssl.SSLContext | None = None) -> tuple[int, Any, dict[str, str]]:
    async with aiohttp.ClientSession() as http:
        async with http.get(url, ssl=tls or True) as resp:
            return resp.status, await resp.json(content_type=None), dict(resp.headers)


async def _wait_ready(
    url: str,
    process: asyncio.subprocess.Process | None = None,
    log: Path | None = None,
    tls: ssl.SSLContext | None = None,
) -> dict[str, Any]:
    deadline = time.monotonic() + READY_S
    last: Any = None
    while time.monotonic() < deadline:
        if process is not None and process.returncode is not None:
            raise AssertionError(
                f"the server exited ({process.returncode}):\n{_tail(log or Path())}"
            )
        try:
            status, last, _ = await _get(url + "/readyz", tls)
            if status == 200:
                assert isinstance(last, dict)
                return last
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.25)
    raise AssertionError(f"not ready in {READY_S} s: {last}")


def _by_worker(ready: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {w["worker"]: w for w in ready["workers"]}


async def _metric(url: str, sample: str) -> dict[str, float]:
    """``sample``'s value per worker label, from the front's /metrics (which must parse)."""
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/metrics") as resp:
            assert resp.status == 200
            text = await resp.text()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == sample:
                values[s.labels.get("worker", "")] = s.value
    return values


async def _connect(url: str) -> CallClient:
    caller = CallClient(url, record_video=False)
    try:
        await caller.connect()
        await caller.wait_channel_open(20)
        await caller.wait_state("listening", 20)
    except BaseException:
        await caller.close()
        raise
    return caller


MOVING = 5
"""Video RTP packets in 2 s that show a call going on (about 50 when the machine is idle, fewer
when it is busy); a call whose worker is gone gets none."""


async def _video_packets(caller: CallClient) -> int:
    stats = await caller.pc.getStats()
    return sum(
        int(getattr(s, "packetsReceived", 0))
        for s in stats.values()
        if s.type == "inbound-rtp" and getattr(s, "kind", "") == "video"
    )


async def _packets_in(caller: CallClient, seconds: float = 2.0) -> int:
    """Video packets that reached ``caller`` in ``seconds`` (counted as they arrive, not as the
    caller manages to decode them)."""
    before = await _video_packets(caller)
    await asyncio.sleep(seconds)
    return await _video_packets(caller) - before


async def _request(
    method: str, url: str, tls: ssl.SSLContext | None = None, **kwargs: Any
) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http:
        async with http.request(method, url, ssl=tls or True, **kwargs) as resp:
            text = await resp.text()
            return resp.status, (await resp.json(content_type=None)) if text else None


async def _placed(url: str, expected_total: int) -> dict[int, dict[str, Any]]:
    """The workers' view once they hold ``expected_total`` calls together."""
    for _ in range(100):
        workers = _by_worker(await _wait_ready(url))
        if sum(w["sessions"] for w in workers.values()) == expected_total:
            return workers
        await asyncio.sleep(0.1)
    raise AssertionError(f"the workers never held {expected_total} calls: {workers}")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def front(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Server]:
    log = tmp_path_factory.mktemp("workers") / "front.log"
    url, process = await _spawn_front(log)
    try:
        yield url, process, log
    finally:
        await _stop(process)


@pytest.fixture
async def draining_front(tmp_path: Path) -> AsyncIterator[Server]:
    log = tmp_path / "front.log"
    url, process = await _spawn_front(log, "--drain-timeout-s", str(DRAIN_S))
    try:
        yield url, process, log
    finally:
        await _stop(process)


@pytest.mark.timeout(420)
@pytest.mark.asyncio(loop_scope="module")
async def test_say_and_delete_reach_the_worker_that_holds_the_call(front: Server) -> None:
    url, _, _ = front
    a = await _connect(url)
    b: CallClient | None = None
    try:
        worker_a = next(i for i, w in (await _placed(url, 1)).items() if w["sessions"] == 1)
        b = await _connect(url)
        placed = await _placed(url, 2)
        # The least-loaded worker took the second call.
        assert all(w["sessions"] == 1 for w in placed.values()), placed
        (worker_b,) = set(placed) - {worker_a}

        await a.say("This reaches the first call only.")
        await a.wait_state("speaking", 30)
        utterances = await _metric(url, "avatar_rtc_utterances_total")
        assert utterances == {str(worker_a): 1.0, str(worker_b): 0.0}, utterances
        assert not [e for e in b.events if e.get("state") == "speaking"]

        status, _ = await _request("DELETE", f"{url}/sessions/{b.session_id}")
        assert status == 204
        sessions: dict[str, float] = {}
        for _ in range(100):
            sessions = await _metric(url, "avatar_rtc_sessions")
            if sessions.get(str(worker_b)) == 0.0:
                break
            await asyncio.sleep(0.1)
        assert sessions == {str(worker_a): 1.0, str(worker_b): 0.0}, sessions
        status, body = await _request("DELETE", f"{url}/sessions/{b.session_id}")
        assert status == 404 and body["error"]["code"] == "unknown_session"
        status, body = await _request(
            "POST", f"{url}/sessions/{b.session_id}/say", json={"text": "gone"}
        )
        assert status == 404 and body["error"]["code"] == "unknown_session"
        assert await _packets_in(a) >= MOVING  # the other call goes on
        await a.wait_state("listening", 30)
    finally:
        for caller in (a, b):
            if caller is not None:
                await _request("DELETE", f"{url}/sessions/{caller.session_id}")
                await caller.close()
    await _placed(url, 0)
    # HEAD through the front tells the length a GET would give, as a worker does.
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/") as got, http.head(url + "/") as head:
            body = await got.read()
            assert head.status == 200 and int(head.headers["Content-Length"]) == len(body) > 0


@pytest.mark.timeout(420)
@pytest.mark.asyncio(loop_scope="module")
async def test_a_killed_worker_ends_its_calls_only_and_is_restarted(front: Server) -> None:
    url, _, log = front
    await _placed(url, 0)
    restarts_before = (await _metric(url, "avatar_rtc_worker_restarts_total"))[""]
    a = await _connect(url)
    b: CallClient | None = None
    c: CallClient | None = None
    try:
        placed = await _placed(url, 1)
        worker_a = next(i for i, w in placed.items() if w["sessions"] == 1)
        pid_a = placed[worker_a]["pid"]
        b = await _connect(url)
        placed = await _placed(url, 2)
        (worker_b,) = set(placed) - {worker_a}
        assert placed[worker_b]["sessions"] == 1

        os.kill(pid_a, signal.SIGKILL)
        await asyncio.sleep(1.0)
        # The killed worker's call is over: no more video, its routes are gone.
        assert await _packets_in(a) == 0
        status, body = await _request(
            "POST", f"{url}/sessions/{a.session_id}/say", json={"text": "anyone?"}
        )
        assert status == 404 and body["error"]["code"] == "unknown_session", body
        assert "stopped" in body["error"]["message"]
        # The other worker's call is untouched.
        assert await _packets_in(b) >= MOVING
        await b.say("The other worker is still here.")
        await b.wait_state("speaking", 30)
        assert not [e for e in b.events if e.get("type") == "error"], b.events

        # Logged, counted, restarted; then a new call works on the new worker.
        restarts = await _metric(url, "avatar_rtc_worker_restarts_total")
        assert restarts[""] == restarts_before + 1
        assert f"worker {worker_a} (pid {pid_a}) died (signal 9)" in log.read_text()
        workers = _by_worker(await _wait_ready(url))
        assert workers[worker_a]["pid"] != pid_a
        assert workers[worker_b]["pid"] == placed[worker_b]["pid"]
        c = await _connect(url)
        placed = await _placed(url, 2)
        assert placed[worker_a]["sessions"] == 1 and placed[worker_b]["sessions"] == 1
        assert await _packets_in(c) >= MOVING
        await c.say("Hello from the restarted worker.")
        await c.wait_state("speaking", 30)
        await c.wait_state("listening", 30)
    finally:
        for caller in (a, b, c):
            if caller is not None:
                await _request("DELETE", f"{url}/sessions/{caller.session_id}")
                await caller.close()
    await _placed(url, 0)


@pytest.mark.timeout(420)
@pytest.mark.asyncio(loop_scope="module")
async def test_a_hung_worker_is_killed_and_restarted(front: Server) -> None:
    url, _, log = front
    await _placed(url, 0)
    hangs_before = (await _metric(url, "avatar_rtc_worker_hangs_total"))[""]
    workers = _by_worker(await _wait_ready(url))
    index = min(workers)
    pid = workers[index]["pid"]
    os.kill(pid, signal.SIGSTOP)  # alive, but answering nothing: a stuck event loop
    try:
        deadline = time.monotonic() + HUNG_AFTER_S + 30
        while f"worker {index} (pid {pid}) answered no status" not in log.read_text():
            assert time.monotonic() < deadline, "the stopped worker was never noticed"
            await asyncio.sleep(0.5)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    assert (await _metric(url, "avatar_rtc_worker_hangs_total"))[""] == hangs_before + 1
    # Killed and started again: a new process that takes calls.
    for _ in range(int(READY_S / 0.5)):
        workers = _by_worker(await _wait_ready(url))
        if workers[index]["pid"] != pid:
            break
        await asyncio.sleep(0.5)
    assert workers[index]["pid"] != pid, workers
    callers = [await _connect(url), await _connect(url)]
    try:
        placed = await _placed(url, 2)
        assert all(w["sessions"] == 1 for w in placed.values()), placed
        assert all([await _packets_in(c) >= MOVING for c in callers])
    finally:
        for caller in callers:
            await _request("DELETE", f"{url}/sessions/{caller.session_id}")
            await caller.close()
    await _placed(url, 0)


async def test_sigterm_drains_every_worker_then_exits(draining_front: Server) -> None:
    url, process, log = draining_front
    a = await _connect(url)
    b: CallClient | None = None
    try:
        b = await _connect(url)
        placed = await _placed(url, 2)
        assert all(w["sessions"] == 1 for w in placed.values()), placed
        pids = [w["pid"] for w in placed.values()]

        process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        await asyncio.sleep(0.5)
        status, body, _ = await _get(url + "/readyz")
        assert status == 503 and body["error"]["code"] == "draining"
        status, _, _ = await _get(url + "/healthz")
        assert status == 200
        status, body = await _request(
            "POST", url + "/offer", json={"sdp": await make_offer(), "type": "offer"}
        )
        assert status == 503 and body["error"]["code"] == "draining"

        # Both calls, one on each worker, go on and are still reachable through the front.
        for caller in (a, b):
            assert await _packets_in(caller) >= MOVING
            await caller.say("Still here while every worker drains.")
            await caller.wait_state("speaking", 30)
        await a.wait_state("listening", 30)
        status, _ = await _request("DELETE", f"{url}/sessions/{a.session_id}")
        assert status == 204
        assert process.returncode is None  # b holds its worker, and the front waits for it

        try:
            code = await asyncio.wait_for(process.wait(), DRAIN_S + SLACK_S)
        except TimeoutError:
            raise AssertionError(f"still running; log:\n{_tail(log)}") from None
        elapsed = time.monotonic() - signalled
        assert code == 0
        assert DRAIN_S - 0.5 <= elapsed <= DRAIN_S + SLACK_S, elapsed
        error = await b.wait_event(lambda e: e.get("type") == "error", 5)
        assert error["code"] == "shutting_down"
        for pid in pids:
            with pytest.raises(ProcessLookupError):  # exited, and reaped by the front
                os.kill(pid, 0)
    finally:
        await a.close()
        if b is not None:
            await b.close()


async def test_access_rules_hold_through_the_front(tmp_path: Path) -> None:
    """Tokens, origins, the rate limit and the calls per client and per token, over HTTPS
    (TLS ends at the front)."""
    key = "front-test-key-0123456789abcdefghij"
    key_path = tmp_path / "api-key"
    key_path.write_text(key + "\n")  # as `openssl rand -hex 32 > file` leaves it
    log = tmp_path / "front.log"
    cert_file, key_file = self_signed(tmp_path)
    tls = ssl.create_default_context(cafile=str(cert_file))
    url, process = await _spawn_front(
        log,
        "--api-key-file",
        str(key_path),
        "--cert-file",
        str(cert_file),
        "--key-file",
        str(key_file),
        "--max-calls-per-client",
        "1",
        tls=tls,
    )
    request = functools.partial(_request, tls=tls)
    try:
        offer = {"sdp": await make_offer(), "type": "offer"}
        status, body = await request("POST", url + "/offer", json=offer)
        assert status == 401 and body["error"]["code"] == "unauthorized"
        auth = {"Authorization": f"Bearer {key}"}
        status, body = await request("POST", url + "/token", headers=auth, json={})
        assert status == 200
        token = {"Authorization": f"Bearer {body['token']}"}
        status, body = await request("POST", url + "/offer", json=offer, headers=token)
        assert status == 200, body
        session = body["session_id"]
        # The session's routes take only its own token, wherever the call lives.
        status, other = await request("POST", url + "/token", headers=auth, json={})
        assert status == 200
        wrong = {"Authorization": f"Bearer {other['token']}"}
        # One live call per token, and here one per client: counted by the front for the
        # whole server, whichever worker would take the next call.
        for headers in (token, wrong):
            status, body = await request("POST", url + "/offer", json=offer, headers=headers)
            assert status == 429 and body["error"]["code"] == "too_many_calls", body
        say = f"{url}/sessions/{session}/say"
        status, body = await request("POST", say, json={"text": "hi"}, headers=wrong)
        assert status == 401, body
        status, _ = await request("POST", say, json={"text": "hi"}, headers=token)
        assert status == 202
        # Origins: another page is refused; the server's own (https, as the caller sees it,
        # while the worker behind is reached over plain HTTP) is not.
        evil = {**token, "Origin": "https://evil.example"}
        status, body = await request("POST", url + "/offer", json=offer, headers=evil)
        assert status == 403 and body["error"]["code"] == "origin_not_allowed"
        own = {"Origin": url}
        status, _ = await request("POST", say, json={"text": "hi"}, headers={**token, **own})
        assert status == 202
        # The internal status route is not reachable from outside.
        status, _ = await request("GET", url + "/_worker/status")
        assert status == 404
        # The security headers, on the pages the workers serve and the front's own answers;
        # a host name the server does not answer for is refused at the front.
        async with aiohttp.ClientSession() as http:
            for path in ("/static/index.html", "/_worker/status", "/healthz"):
                async with http.get(url + path, ssl=tls) as resp:
                    assert resp.headers["Referrer-Policy"] == "no-referrer", path
                    assert "frame-ancestors 'self'" in resp.headers["Content-Security-Policy"]
            rebound = {"Host": "rebound.example"}
            async with http.get(url + "/static/index.html", ssl=tls, headers=rebound) as resp:
                assert resp.status == 421, await resp.text()
        # One rate limit for the whole server (the default: bursts of 20, one more a second),
        # whichever worker a request reaches (/token goes to each in turn) and whatever
        # X-Forwarded-For a client claims. A bucket per worker would let about 40 through.
        statuses = await asyncio.gather(
            *(
                request(
                    "POST",
                    url + "/token",
                    headers={**auth, "X-Forwarded-For": f"203.0.113.{i}"},
                    json={},
                )
                for i in range(45)
            )
        )
        codes = [s for s, _ in statuses]
        assert set(codes) == {200, 429}, codes
        assert codes.count(200) <= 26, codes
        status, _ = await request("DELETE", f"{url}/sessions/{session}", headers=token)
        assert status == 204
        await asyncio.sleep(1.1)  # the rate limit's next token
        status, body = await request("POST", url + "/offer", json=offer, headers=wrong)
        assert status == 200, body  # the ended call no longer counts
    finally:
        await _stop(process)
    assert process.returncode == 0


@pytest.mark.parametrize("workers", ["1", "2"], ids=["one process", "front and workers"])
async def test_metrics_and_readiness_details_on_a_listener_of_their_own(
    tmp_path: Path, workers: str
) -> None:
    internal_port = _free_port()
    url, process = await _spawn_front(
        tmp_path / "server.log", "--workers", workers, "--metrics-port", str(internal_port)
    )
    internal = f"http://127.0.0.1:{internal_port}"
    try:
        status, body, _ = await _get(url + "/readyz")
        assert (status, body) == (200, {"status": "ready"})  # for probes: nothing more
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/metrics") as resp:
                assert resp.status == 404
            async with http.get(internal + "/metrics") as resp:
                assert resp.status == 200
                assert "avatar_rtc_sessions" in await resp.text()
        # Each process that serves calls froze what it loaded (rtc_server/memory.py).
        frozen = await _metric(internal, "avatar_rtc_gc_frozen_objects")
        assert len(frozen) == int(workers) and all(n > 10_000 for n in frozen.values()), frozen
        status, details, _ = await _get(internal + "/readyz")
        assert status == 200 and details["status"] == "ready" and len(details) > 1, details
        if workers == "2":
            assert len(details["workers"]) == 2
    finally:
        await _stop(process)
    assert process.returncode == 0


@pytest.mark.timeout(300)
async def test_the_front_refuses_a_call_the_machine_has_no_room_for(tmp_path: Path) -> None:
    """Each worker judges its own calls only: with one call on the first, the second (no call)
    would take the next. The front judges the machine: the first worker's call and the new
    one, both speaking, do not fit the workers' limits together (0.01 core each here)."""
    log = tmp_path / "front.log"
    url, process = await _spawn_front(
        log, "--cpu-limit", "0.01", env={"AVATAR_RTC_NO_HEADROOM": "0"}
    )
    first = None
    try:
        first = await _connect(url)
        await _placed(url, 1)
        async with aiohttp.ClientSession() as http:
            offer = {"sdp": await make_offer(), "type": "offer"}
            async with http.post(url + "/offer", json=offer) as resp:
                body = await resp.json()
                assert resp.status == 503, body
                assert body["error"]["code"] == "at_capacity"
                assert "on this machine" in body["error"]["message"], body
                assert "2 calls speaking at once" in body["error"]["message"], body
                assert int(resp.headers["Retry-After"]) > 0
        assert (await _metric(url, "avatar_rtc_machine_refusals_total")) == {"": 1.0}
        status, ready, _ = await _get(url + "/readyz")
        machine = ready["machine"]
        assert status == 200 and machine["cpu_limit"] == 0.02, ready
        assert machine["busy_cores"] is not None and machine["all_speaking_cpu"] > 0, ready
        assert [w["sessions"] for w in ready["workers"]] in ([1, 0], [0, 1]), ready
        assert all(w["cpu_limit"] == 0.01 and w["speaking_call_cpu"] > 0 for w in ready["workers"])
        # The running call goes on.
        assert await _packets_in(first) >= MOVING
    finally:
        if first is not None:
            await first.close()
        await _stop(process)


async def test_a_bad_portrait_stops_start_up_before_serving(tmp_path: Path) -> None:
    blank = tmp_path / "wall.png"
    cv2.imwrite(str(blank), np.full((256, 256, 3), 200, np.uint8))
    port = _free_port()
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "rtc_server",
        "serve",
        "--workers",
        "2",
        "--port",
        str(port),
        "--avatar",
        str(blank),
        "--cache-dir",
        str(tmp_path),
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode == 2
    assert b"no frontal face" in err
    assert b"serving on" not in out
    assert err.count(b"worker 1") == 0  # the first worker's check stopped it all


def test_workers_flag_and_its_environment_variable() -> None:
    assert build_parser({}).parse_args(["serve"]).workers == 0  # one per core
    env = {"AVATAR_RTC_WORKERS": "3"}
    assert build_parser(env).parse_args(["serve"]).workers == 3
    assert build_parser(env).parse_args(["serve", "--workers", "1"]).workers == 1


def test_merged_metrics_label_each_worker_and_keep_families_whole() -> None:
    one = (
        "# HELP avatar_rtc_sessions Calls currently open.\n"
        "# TYPE avatar_rtc_sessions gauge\n"
        "avatar_rtc_sessions 2.0\n"
        "# HELP avatar_rtc_turn_stage_seconds Time per stage.\n"
        "# TYPE avatar_rtc_turn_stage_seconds histogram\n"
        'avatar_rtc_turn_stage_seconds_bucket{le="0.1",stage="stt"} 1.0\n'
        'avatar_rtc_turn_stage_seconds_count{stage="stt"} 1.0\n'
    )
    two = one.replace("avatar_rtc_sessions 2.0", "avatar_rtc_sessions 5.0")
    merged = merge_metrics([(0, one), (1, two)])
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    assert set(families) == {"avatar_rtc_sessions", "avatar_rtc_turn_stage_seconds"}
    sessions = {s.labels["worker"]: s.value for s in families["avatar_rtc_sessions"].samples}
    assert sessions == {"0": 2.0, "1": 5.0}
    buckets = [s for s in families["avatar_rtc_turn_stage_seconds"].samples if "le" in s.labels]
    assert sorted(s.labels["worker"] for s in buckets) == ["0", "1"]
    assert all(s.labels["stage"] == "stt" for s in buckets)
    assert merged.count("# TYPE avatar_rtc_sessions gauge") == 1
