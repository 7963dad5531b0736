"""Vanished callers: a caller killed mid-call (no DELETE, no DTLS close) is reaped within 30 s.

The callers run in processes of their own (tests/caller_process.py) and get SIGKILL, so
nothing more leaves them: no BYE, no DTLS close alert, no SCTP abort. Left to aioice, such a
call ends only when ICE consent expires: 6 unanswered checks about 5 s apart, measured at
29.5 and 32.8 s here, over the 30 s budget half of the time. The session's peer watchdog
(nothing received for ``PEER_SILENCE_S``) ends it sooner, for a caller with a microphone
and for a text-only one, whose only traffic is RTCP reports and the data channel; a live
text-only caller on the same server must outlast it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import resource
import signal
import sys
import time
from pathlib import Path

import aiohttp

from rtc_server.engine_factory import EngineFactory
from rtc_server.session import PEER_SILENCE_S
from tests.conftest import start_server
from tests.reliability import trials
from tests.test_leaks import _settle

ROOT = Path(__file__).resolve().parent.parent
REAP_BUDGET_S = 30.0


def rss_mb() -> float:
    """Resident memory of this process now, in MB: what it holds, not what the allocator keeps
    cached (collected and trimmed first, as the server does once its calls have ended)."""
    import gc

    from rtc_server.memory import MALLOC_TRIM

    gc.collect()
    if MALLOC_TRIM is not None:
        MALLOC_TRIM(0)
    with open("/proc/self/statm") as fh:
        pages = int(fh.read().split()[1])
    return pages * resource.getpagesize() / 1e6


async def spawn_caller(
    url: str, *, text_only: bool = False
) -> tuple[asyncio.subprocess.Process, str]:
    """A caller in its own process, connected and receiving video; returns it and its session."""
    args = [sys.executable, "-m", "tests.caller_process", url]
    process = await asyncio.create_subprocess_exec(
        *args,
        *(["--text-only"] if text_only else []),
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    assert process.stdout is not None
    try:
        line = await asyncio.wait_for(process.stdout.readline(), 60)
    except TimeoutError:
        process.kill()
        raise
    info = json.loads(line or b"{}")
    assert "session_id" in info, f"the caller did not connect: {info}"
    # A text-only caller sends no RTP at all: only RTCP and the data channel speak for it.
    assert info["sending"] == ([] if text_only else ["audio"])
    return process, info["session_id"]


async def _three_callers(url: str) -> list[tuple[asyncio.subprocess.Process, str]]:
    """One caller with a microphone, two text-only."""
    return await asyncio.gather(
        spawn_caller(url), spawn_caller(url, text_only=True), spawn_caller(url, text_only=True)
    )


async def test_killed_callers_are_reaped_and_leave_nothing_behind(
    engine_factory: EngineFactory, cache_dir: Path
) -> None:
    with trials(
        "caller killed without DELETE (SIGKILL: no BYE, no DTLS close)",
        area="peer",
        note=(
            f"peer watchdog: nothing received for {PEER_SILENCE_S:.0f} s; aioice's consent "
            "check alone took 29.5-32.8 s; a live text-only caller outlasted it; tasks, "
            "threads, fds, sessions, peer connections, engines back to baseline"
        ),
    ) as t:
        server, runner = await start_server(engine_factory, cache_dir)
        sessions = server.manager.sessions
        processes: list[asyncio.subprocess.Process] = []
        try:
            # Warm-up: the same three calls, hung up properly, so thread pools, caches and the
            # allocator reach their size for three calls at once before the baseline.
            warm = await _three_callers(server.url)
            processes = [p for p, _ in warm]
            async with aiohttp.ClientSession() as http:
                for process, sid in warm:
                    async with http.delete(f"{server.url}/sessions/{sid}") as resp:
                        assert resp.status == 204
                    process.kill()
                    await process.wait()
            before = await _settle()
            rss_before = rss_mb()

            started = await _three_callers(server.url)
            processes = [p for p, _ in started]
            (mic, mic_id), (text, text_id), (live, live_id) = started
            connected_at = time.monotonic()
            assert {mic_id, text_id, live_id} <= set(sessions)
            await asyncio.sleep(1.0)

            killed_at = time.monotonic()
            for process in (mic, text):
                process.send_signal(signal.SIGKILL)
            for process in (mic, text):
                await process.wait()
            reaped: dict[str, float] = {}
            while len(reaped) < 2 and time.monotonic() - killed_at < REAP_BUDGET_S + 10:
                for sid in (mic_id, text_id):
                    if sid not in reaped and sid not in sessions:
                        reaped[sid] = time.monotonic() - killed_at
                await asyncio.sleep(0.1)
            for sid, who in ((mic_id, "the caller with a microphone"), (text_id, "text only")):
                took = reaped.get(sid)
                late = took is None or took > REAP_BUDGET_S
                t.judge([f"{who}: reaped after {took} s"] if late else [], who)  # a trial each
            assert set(reaped) == {mic_id, text_id}, f"not reaped in {REAP_BUDGET_S + 10:.0f} s"
            assert max(reaped.values()) <= REAP_BUDGET_S, reaped

            # The silent but live text-only caller is still in its call, past the silence limit.
            await asyncio.sleep(max(0.0, connected_at + PEER_SILENCE_S + 3 - time.monotonic()))
            assert live.returncode is None and live_id in sessions
            async with aiohttp.ClientSession() as http:
                async with http.delete(f"{server.url}/sessions/{live_id}") as resp:
                    assert resp.status == 204
            live.kill()
            await live.wait()

            after = await _settle()
            rss_growth = rss_mb() - rss_before
            assert not sessions
            grown = {k: (before[k], after[k]) for k in before if after[k] > before[k]}
            assert not grown, f"grew after the killed calls (before, after): {grown}"
            # Compared with the baseline, as test_leaks does: an earlier module's peer connections
            # may still be on their way out when this one starts; ours must all be gone.
            assert after["sessions"] == 0
            assert after["peer connections"] <= before["peer connections"]
            assert after["engines"] <= before["engines"]
            assert rss_growth < 30, f"RSS grew {rss_growth:.1f} MB over three killed calls"
        finally:
            for process in processes:
                if process.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        process.kill()
                    await process.wait()
            await runner.cleanup()
        t.figures = {
            "reap_s_with_mic": round(reaped[mic_id], 1),
            "reap_s_text_only": round(reaped[text_id], 1),
            "rss_growth_mb": round(rss_growth, 1),
        }
