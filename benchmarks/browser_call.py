"""``bench browser``: a call in Debian's Chromium: connect to first frame, fps, A/V offset.

The server runs in-process on 127.0.0.1; run it inside a network namespace holding only ``lo``
(``unshare -n``) to be sure nothing leaves the machine. The A/V offset is measured inside the
page as benchmarks/browser.py describes, once per say.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import generate_latest

from benchmarks.browser import (
    call_stats,
    chromium_missing,
    chromium_page,
    collect_sync_probe,
    install_sync_probe,
    measure_sync,
    page_now,
    say_from_page,
    start_call,
    video_motion,
    wait_for_audio_buffer_to_settle,
    wait_for_sender_reports,
    wait_for_state,
    with_test_hooks,
)
from benchmarks.call import SAYS, _server, video_sent_late_s
from benchmarks.report import progress, summary
from benchmarks.server_readings import delay_summary, server_delay_buckets
from rtc_server.app import MANAGER

FIRST_FRAME_JS = """
() => {
  window.__benchStart = performance.now();
  const video = document.getElementById("remote");
  video.requestVideoFrameCallback((now, meta) => {
    window.__benchFirstFrame = meta.presentationTime ?? now;
  });
}
"""


async def _measure(
    says: int, url: str | None, mouth_box: tuple[int, int, int, int] | None
) -> dict[str, Any]:
    missing = chromium_missing()
    if missing:
        raise RuntimeError(missing)
    runner = None
    if url is None:
        url, runner, factory = await _server()
        mouth_box = factory.mouth_box
    if mouth_box is None:
        raise ValueError("with --url, give the avatar's --mouth-box (prepare-avatar prints it)")
    try:
        with tempfile.TemporaryDirectory() as profile:
            async with chromium_page(Path(profile), bypass_csp=True) as page:
                await page.goto(with_test_hooks(f"{url}/"))
                await page.evaluate(FIRST_FRAME_JS)
                await start_call(page, f"{url}/", navigate=False)
                await page.wait_for_function("() => window.__benchFirstFrame !== undefined")
                first_ms = await page.evaluate(
                    "() => window.__benchFirstFrame - window.__benchStart"
                )
                await wait_for_sender_reports(page, 2)
                await wait_for_audio_buffer_to_settle(page)
                await asyncio.sleep(3.0)
                await install_sync_probe(page, mouth_box)
                segments = []
                before = await call_stats(page)
                for i in range(says):
                    start = await page_now(page)
                    await say_from_page(page, SAYS[i % len(SAYS)])
                    await wait_for_state(page, "speaking", timeout_s=10)
                    await wait_for_state(page, "listening", timeout_s=30)
                    segments.append((start, await page_now(page)))
                    progress(f"say {i + 1}/{says}")
                after = await call_stats(page)
                probe = await collect_sync_probe(page)
    finally:
        if runner is not None:
            await runner.cleanup()
    report = measure_sync(probe, after, segments)
    v0, v1 = before["video"], after["video"]
    seconds = (v1["timestamp"] - v0["timestamp"]) / 1000
    offsets = [s.estimate.offset_ms for s in report.segments]
    return {
        "connect_to_first_frame_ms": first_ms,
        "decoded_fps": (v1["framesDecoded"] - v0["framesDecoded"]) / seconds,
        "codec": v1.get("mimeType"),
        "decoder": v1.get("decoderImplementation"),
        "av_offset_ms": summary(offsets),
        "av_offset_per_say_ms": offsets,
        "correlation_per_say": [s.estimate.peak for s in report.segments],
        "wire_ms_per_say": [s.wire_ms for s in report.segments],
        "overall": report.summary(),
        "median_abs_offset_ms": float(np.median(np.abs(offsets))),
    }


def run(
    says: int, url: str | None = None, mouth_box: tuple[int, int, int, int] | None = None
) -> dict[str, Any]:
    return asyncio.run(_measure(says, url, mouth_box))


async def _measure_sync(seconds: float, video_delay_ms: float) -> dict[str, Any]:
    """The sync-test engine's flashes and beeps, as Chromium presents and plays them."""
    from benchmarks.sync import sync_test_factory

    missing = chromium_missing()
    if missing:
        raise RuntimeError(missing)
    url, runner, _ = await _server(sync_test_factory(video_delay_ms))
    late_ms = video_sent_late_s(runner) * 1000
    w, h = 512, 512
    try:
        with tempfile.TemporaryDirectory() as profile:
            async with chromium_page(Path(profile), bypass_csp=True) as page:
                await start_call(page, f"{url}/")
                await wait_for_sender_reports(page, 2)
                await wait_for_audio_buffer_to_settle(page)
                await asyncio.sleep(3.0)
                # The whole frame is the "mouth": a flash is all the motion there is.
                await install_sync_probe(page, (0, 0, w, h))
                progress(f"recording {seconds:.0f} s of flashes and beeps in Chromium")
                await asyncio.sleep(seconds)
                stats = await call_stats(page)
                probe = await collect_sync_probe(page)
    finally:
        await runner.cleanup()
    report = measure_sync(probe, stats)
    return {
        "injected_video_delay_ms": video_delay_ms,
        # measure_sync's sign: + = audio heard after the video; as an offset of the video
        # against the audio (bench sync's sign) that is the negative.
        "offset_ms": -report.heard.estimate.offset_ms,
        # The same without Chromium's buffering (its jitter buffers and audio sink, from its
        # own stats): what the server put on the wire, less the delay it sends its video with
        # on purpose. It varies less than the heard offset on a loaded machine, where
        # Chromium's buffering moves from call to call.
        "wire_offset_ms": -report.heard.wire_ms - late_ms,
        "video_sent_late_ms": late_ms,
        "correlation": report.heard.estimate.peak,
        "overall": report.summary(),
    }


def run_sync(seconds: float, video_delay_ms: float) -> dict[str, Any]:
    return asyncio.run(_measure_sync(seconds, video_delay_ms))


FLASH_BOX = (224, 224, 64, 64)
"""Where the fresh-call probe looks for the sync-test engine's flashes (the whole frame
flashes): a small box, for the probe reads back every frame it looks at, which a whole
512 x 512 frame makes a load of its own on a small machine."""

FIRST_SECONDS_SERVERS: dict[str, dict[str, Any]] = {
    "default": {},
    "sent reports": {"sender_reports": "sent"},
    "audio with the video": {"audio_start_s": 0.0},
    "video sent at its instant": {"video_send_delay_s": 0.0},
}
"""The servers ``bench sync --browser --fresh-calls`` can compare: media settings changed from
the defaults (``MediaSettings``): aiortc's own sender reports; the audio started with the video
instead of 0.6 s after it; each video frame sent at its instant instead of 25 ms after it."""


async def _measure_first_seconds(
    calls: int, seconds: int, servers: tuple[str, ...]
) -> dict[str, Any]:
    """Fresh calls with the sync-test engine, the offset measured in Chromium second by second
    from the first frame played (one flash and beep a second): how soon its lip-sync holds.
    ``calls`` per server of ``FIRST_SECONDS_SERVERS`` named in ``servers``."""
    from benchmarks.sync import sync_test_factory

    missing = chromium_missing()
    if missing:
        raise RuntimeError(missing)
    # The calls take turns between the servers.
    running = [await _server(sync_test_factory(), **FIRST_SECONDS_SERVERS[s]) for s in servers]
    per_call: list[dict[str, Any]] = []
    try:
        for n in range(calls * len(running)):
            mode = servers[n % len(running)]
            url, runner, _ = running[n % len(running)]
            late_ms = video_sent_late_s(runner) * 1000
            sent_before = _send_delays(runner)
            with tempfile.TemporaryDirectory() as profile:
                async with chromium_page(Path(profile), bypass_csp=True) as page:
                    await page.goto(with_test_hooks(f"{url}/"))
                    clicked = await page_now(page)
                    await start_call(page, f"{url}/", navigate=False)
                    # From the first frame played (the probe needs the call), for as long.
                    await install_sync_probe(page, FLASH_BOX)
                    playing = await page_now(page)
                    # The last flash's window ends 0.45 s past it; its audio plays out and the
                    # probe posts its levels (every 85 ms) later still: with 0.05 s to spare a
                    # flash at the very end was measured on a cut window (-78 ms, once in 100).
                    await asyncio.sleep(seconds + 1.0)
                    stats = await call_stats(page)
                    probe = await collect_sync_probe(page)
                    await page.evaluate("() => window.avatarCall.stop()")  # hung up, not lost
            windows = [(f - 450.0, f + 450.0) for f in _flashes(probe, playing, seconds)]
            report = measure_sync(probe, stats, windows)
            offsets = [
                {
                    "second": round((windows[i][0] + 450.0 - playing) / 1000.0, 2),
                    "offset_ms": -w.estimate.offset_ms,
                    "wire_offset_ms": -w.wire_ms - late_ms,
                    "correlation": w.estimate.peak,
                    "frames": w.estimate.frames,
                    # Chromium's buffering in the window: the audio jitter buffer (mean) and
                    # the video's arrival -> display (median).
                    "audio_buffer_ms": w.audio_buffer_ms,
                    "video_display_ms": w.video_display_ms,
                }
                for i, w in enumerate(report.segments)
            ]
            sent_after = _send_delays(runner)
            per_call.append(
                {
                    "server": mode,
                    "first_frame_ms": playing - clicked,
                    "seconds": offsets,
                    # How late past when they were due the server sent this call's frames:
                    # how many, and the bucket bounds (ms) their p50 and p99 fell under.
                    "server_send_delay_ms": {
                        kind: delay_summary(sent_before[kind], sent_after[kind])
                        for kind in ("audio", "video")
                    },
                }
            )
            shown = " ".join(f"{o['offset_ms']:+.0f}" for o in offsets)
            progress(f"call {n + 1} ({mode}): {shown} ms")
    finally:
        for _, runner, _ in running:
            await runner.cleanup()
    f = {"calls": calls, "seconds": seconds, "servers": list(servers), "per_call": per_call}
    return {**f, "summary": first_seconds_summary(f)}


def _send_delays(runner: Any) -> dict[str, dict[float, float] | None]:
    """The in-process server's ``avatar_rtc_frame_send_delay_seconds`` by kind, as bench load
    reads it from a server's /metrics."""
    text = generate_latest(runner.app[MANAGER].metrics.registry).decode()
    return {kind: server_delay_buckets(text, kind) for kind in ("audio", "video")}


def _flashes(probe: Any, start_ms: float, seconds: int) -> list[float]:
    """When the sync-test engine's flashes were shown in the first ``seconds`` from
    ``start_ms`` (page ms): the frames whose change stands out, one a second at most."""
    shown_ms, motion = video_motion(probe)
    inside = (shown_ms >= start_ms + 450) & (shown_ms <= start_ms + seconds * 1000.0)
    if not inside.any():
        return []
    level = 0.5 * float(motion[inside].max())
    found: list[float] = []
    for t, m in zip(shown_ms[inside], motion[inside], strict=True):
        if m >= level and (not found or t - found[-1] > 600):
            found.append(float(t))
    return found


def run_first_seconds(
    calls: int, seconds: int, servers: tuple[str, ...] = ("default",)
) -> dict[str, Any]:
    """``calls`` per server named in ``servers`` (keys of ``FIRST_SECONDS_SERVERS``)."""
    return asyncio.run(_measure_first_seconds(calls, seconds, servers))


IN_SYNC_MS = 45.0
"""The bound a settled call's A/V offset is held to in Chromium (tests/test_browser.py): the
fresh calls' summary counts the flashes within it."""


def first_seconds_summary(f: dict[str, Any], bound_ms: float = IN_SYNC_MS) -> list[dict[str, Any]]:
    """Per server of a ``bench sync --browser --fresh-calls`` run: how many calls had their
    first flash within ``bound_ms``, how many flashes of all were, and the offsets furthest
    from 0 either way (None without a flash). A call none of whose flashes were found counts as
    a call whose first flash was not within the bound."""
    out = []
    for server in f["servers"]:
        calls = [c for c in f["per_call"] if c["server"] == server]
        offsets = [o["offset_ms"] for c in calls for o in c["seconds"]]
        within = [abs(o) <= bound_ms for o in offsets]
        first = [
            bool(c["seconds"]) and abs(c["seconds"][0]["offset_ms"]) <= bound_ms for c in calls
        ]
        out.append(
            {
                "server": server,
                "calls": len(calls),
                "first_flash_within": sum(first),
                "flashes_within": sum(within),
                "flashes": len(offsets),
                "lowest_ms": min(offsets, default=None),
                "highest_ms": max(offsets, default=None),
                "bound_ms": bound_ms,
            }
        )
    return out


def first_seconds_summary_table(f: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """Headers and rows of :func:`first_seconds_summary`: a server a row."""
    rows = [
        [s["server"], s["calls"], f"{s['first_flash_within']} / {s['calls']}"]
        + [f"{s['flashes_within']} / {s['flashes']}", s["lowest_ms"], s["highest_ms"]]
        for s in f["summary"]
    ]
    bound = f"{IN_SYNC_MS:g}"
    head = ["server", "calls", f"flash 1 within +-{bound} ms", f"flashes within +-{bound} ms"]
    return [*head, "lowest ms", "highest ms"], rows


def first_seconds_table(f: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """Headers and rows of ``bench sync --browser --fresh-calls``: a call a row."""
    width = max((len(c["seconds"]) for c in f["per_call"]), default=0)
    rows = [
        [n + 1, c["server"], c["first_frame_ms"]]
        + [o["offset_ms"] for o in c["seconds"]]
        + [float("nan")] * (width - len(c["seconds"]))
        for n, c in enumerate(f["per_call"])
    ]
    flashes = [f"flash {i + 1}" for i in range(width)]
    return ["call", "server", "first frame ms", *flashes], rows
