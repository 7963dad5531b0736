"""The call page in Debian's Chromium against the in-process server, all on 127.0.0.1.

The first test drives the page like a user (Start, type, Send, Stop) and checks getStats; the
second measures the A/V offset inside the page (tests/browser.py has the method and clocks); the
third covers a denied microphone, an HTTP error and Interrupt.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest
from playwright.async_api import Page, expect

from benchmarks.browser import (
    ENVELOPE_MS,
    call_stats,
    chromium_missing,
    chromium_page,
    collect_sync_probe,
    estimate_offset,
    install_sync_probe,
    measure_sync,
    page_now,
    say_from_page,
    start_call,
    wait_for_audio_buffer_to_settle,
    wait_for_sender_reports,
    wait_for_state,
    window_rms,
)
from benchmarks.browser_call import IN_SYNC_MS
from rtc_server.engine_factory import EngineFactory
from rtc_server.media.tracks import STILL_REPEAT_S
from signaling.access import TokenSigner
from tests.conftest import LiveServer, start_server
from tests.waiting import holds_within

needs_chromium = pytest.mark.skipif(chromium_missing() is not None, reason=chromium_missing() or "")

GREETING = "Hello there, I am your avatar. How can I help you today?"
SYNC_TEXTS = (
    "Hello there, I am your avatar. How can I help you today?",
    "The quick brown fox jumps over the lazy dog, and then it runs away.",
    "Peter Piper picked a peck of pickled peppers. Where is the peck he picked?",
)
MAX_OFFSET_MS = IN_SYNC_MS
MIN_PEAK = 0.3
SYNC_SETTLE_S = 3.0
"""Once the browser has two sender reports per stream, Chromium's lip-sync still needs a few of
its once-a-second updates to move the playout delays."""


async def audio_levels_while(page: Page, seconds: float) -> list[float]:
    """inbound-rtp audio audioLevel sampled every 100 ms for ``seconds``."""
    levels = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        levels.append(float((await call_stats(page))["audio"].get("audioLevel", 0.0)))
        await asyncio.sleep(0.1)
    return levels


@pytest.mark.browser
@needs_chromium
async def test_call_page_plays_the_avatar(live_server: LiveServer, tmp_path: Path) -> None:
    """Start, H.264 decoded as sent, audio flowing, and speaking -> listening after a say."""
    started = time.monotonic()
    async with chromium_page(tmp_path / "profile") as page:
        # The page works under its own Content-Security-Policy: Chromium logs each refusal.
        refused: list[str] = []
        page.on("console", lambda m: refused.append(m.text) if "Security Policy" in m.text else 0)
        session_id = await start_call(page, f"{live_server.url}/")
        assert session_id in live_server.manager.sessions
        status = page.get_by_role("status")
        await expect(status).to_have_text("Listening")

        await say_from_page(page, GREETING)
        await expect(status).to_have_text("Speaking", timeout=10_000)
        scheduler = live_server.manager.sessions[session_id].scheduler
        stats = scheduler.stats
        sent0, dropped0 = stats.video_sent, stats.video_dropped
        before = await call_stats(page)
        levels = await audio_levels_while(page, 3.0)
        after = await call_stats(page)
        sent1, dropped1 = stats.video_sent, stats.video_dropped
        await expect(status).to_have_text("Listening", timeout=20_000)
        states = await page.evaluate("() => window.avatarCall.states")
        overlay_codec = await page.locator('[data-stat="codec"]').text_content()

        await page.get_by_role("button", name="Stop").click()
        await expect(status).to_contain_text("Call ended")
        await holds_within(lambda: session_id not in live_server.manager.sessions, 5.0)
    elapsed = time.monotonic() - started
    assert not refused, refused

    video0, video1 = before["video"], after["video"]
    seconds = (video1["timestamp"] - video0["timestamp"]) / 1000
    fps = (video1["framesDecoded"] - video0["framesDecoded"]) / seconds
    audio0, audio1 = before["audio"], after["audio"]
    print(
        f"\nbrowser call: {fps:.1f} fps decoded over {seconds:.1f} s while speaking, "
        f"framesPerSecond {video1.get('framesPerSecond')}, codec {video1['mimeType']} "
        f"({video1.get('decoderImplementation')}), max audioLevel {max(levels):.3f}, "
        f"states {states}, {elapsed:.1f} s"
    )
    assert video1["mimeType"] == "video/H264"
    assert overlay_codec == "video/H264"
    # While the avatar speaks the server keeps the speaking cadence: every instant of the
    # window (25 a second) went out, or was skipped as late and counted (under load the video
    # adapts to the audio's clock; how often is the bench's business, not this test's). The
    # page decodes nearly every frame sent, and the picture moves: far above the rate a still
    # idle avatar is repeated at.
    sent_fps = (sent1 - sent0) / seconds
    instants_per_s = (sent1 + dropped1 - sent0 - dropped0) / seconds
    assert instants_per_s >= 0.9 * scheduler.fps, (instants_per_s, sent_fps)
    assert fps >= 0.9 * sent_fps, (fps, sent_fps)
    assert sent_fps > 2 / STILL_REPEAT_S, (sent_fps, dropped1 - dropped0)
    # Chromium reports its own rate too (the overlay shows it); a one-second snapshot, so the
    # rate itself is judged over the window above (the snapshot read 19 in a busy run).
    assert video1.get("framesPerSecond", 0) > 0
    assert audio1["mimeType"] == "audio/opus"
    assert audio1["totalSamplesReceived"] > audio0["totalSamplesReceived"]
    assert max(levels) > 0, "the element plays the reply (audioLevel reads 0 when muted)"
    assert states[0] == "listening"
    assert states[1:] == ["speaking", "listening"]
    assert session_id not in live_server.manager.sessions, "Stop deletes the session"


@pytest.mark.browser
@needs_chromium
async def test_av_offset_measured_in_the_browser(live_server: LiveServer, tmp_path: Path) -> None:
    """Mouth motion against the heard audio's envelope change: |offset| <= 45 ms.

    Both sides are on the page's performance.now() clock: video by expectedDisplayTime, audio by
    the WebAudio tap corrected to the <video> element's own output (tests/browser.py).

    The probe starts once the browser can keep the streams together: two RTCP sender reports per
    stream, the audio jitter buffer back near its target (after a stall while the call starts
    it holds 60-150 ms and drains ~10 ms/s), then 3 s for Chromium's lip-sync to act. Measured
    that way, 34 runs gave -12 to +32 ms (peak 0.58-0.89). Each later say waits for the buffer
    too: with one core kept busy by another process, a say that began while NetEq still held
    a stall's extra audio was heard up to +61 ms late (six runs: +19 to +48 ms); waiting,
    twelve runs gave +8 to +45 ms and one +91 ms, where NetEq's own target had grown with the
    load (buffer 38, then 59, then 91 ms over the three says), which this wait does not undo.
    The server's own pacing is not what stalls: under that load its reply audio left within
    3 ms of each frame's instant (p99). Measured from the first second
    instead, the first reply was +45 to +55 ms, and after a bad start up to +114 ms. What is
    left is mostly the browser's: audio waits in its jitter buffer (30-60 ms) and the sink
    (30 ms), video 25-70 ms from arrival to display, and Chromium corrects only what exceeds a
    30 ms dead band. The server's own share (``wire``) was -4 to -21 ms (audio ahead).
    """
    engine = live_server.manager.engine_factory
    assert engine is not None and engine.mouth_box is not None
    started = time.monotonic()
    async with chromium_page(tmp_path / "profile", bypass_csp=True) as page:
        await start_call(page, f"{live_server.url}/")
        await wait_for_sender_reports(page, 2)
        settled = await wait_for_audio_buffer_to_settle(page)
        await asyncio.sleep(SYNC_SETTLE_S)
        await install_sync_probe(page, engine.mouth_box)
        segments = []
        for i, text in enumerate(SYNC_TEXTS):
            if i:
                # Each say, like the first, starts with the audio buffer near its target: a
                # stall during the say before (a busy machine) leaves NetEq holding extra
                # audio that drains at ~10 ms/s, with Chromium's lip-sync seconds behind it.
                await wait_for_audio_buffer_to_settle(page)
            start = await page_now(page)
            await say_from_page(page, text)
            await wait_for_state(page, "speaking", timeout_s=10)
            await wait_for_state(page, "listening", timeout_s=20)
            segments.append((start, await page_now(page)))
        probe = await collect_sync_probe(page)
        stats = await call_stats(page)
    report = measure_sync(probe, stats, segments)
    elapsed = time.monotonic() - started
    buffer_note = (
        f"audio buffer settled after {settled['waitedMs'] / 1000:.1f} s"
        if settled["settled"]
        else f"audio buffer did not settle: {settled['history']}"
    )
    print(f"\nAV_SYNC {report.summary()}; {buffer_note}; {elapsed:.1f} s")

    assert report.path.tap_peak > 0.9, "the WebAudio tap could not be matched to the element"
    assert report.heard.estimate.peak >= MIN_PEAK, report.summary()
    assert abs(report.heard.estimate.offset_ms) <= MAX_OFFSET_MS, report.summary()


DENY_MICROPHONE_JS = """
navigator.mediaDevices.getUserMedia = async () => {
  throw new DOMException("Permission denied", "NotAllowedError");
};
"""


@pytest.mark.browser
@needs_chromium
async def test_call_without_microphone_and_interrupt(
    live_server: LiveServer, tmp_path: Path
) -> None:
    """Microphone denied: the call still connects, receive-only audio; Interrupt stops speech."""
    async with chromium_page(tmp_path / "profile") as page:
        await page.add_init_script(DENY_MICROPHONE_JS)
        status = page.get_by_role("status")

        # An HTTP error from /offer shows its JSON message and leaves Start usable.
        busy = {"error": {"code": "at_capacity", "message": "the server is at its limit"}}
        await page.route("**/offer", lambda route: route.fulfill(status=503, json=busy))
        await page.goto(f"{live_server.url}/")
        await page.get_by_role("button", name="Start").click()
        await expect(status).to_contain_text("the server is at its limit (at_capacity, HTTP 503)")
        # Without ?testHooks the page exposes no test hook (the call it started is not global).
        assert await page.evaluate("() => window.avatarCall === undefined")
        await expect(page.get_by_role("button", name="Start")).to_be_enabled()
        await page.unroute("**/offer")

        await start_call(page, f"{live_server.url}/")
        await expect(status).to_contain_text("text only: microphone permission denied")
        directions = await page.evaluate(
            "() => window.avatarCall.pc.getTransceivers()"
            ".map((t) => [t.receiver.track.kind, t.currentDirection])"
        )
        assert sorted(directions) == [["audio", "recvonly"], ["video", "recvonly"]]

        await say_from_page(page, " ".join([GREETING] * 4))
        await wait_for_state(page, "speaking", timeout_s=10)
        await page.get_by_role("button", name="Interrupt").click()
        await wait_for_state(page, "listening", timeout_s=2)
        await expect(status).to_contain_text("Listening")
        await page.wait_for_timeout(1000)
        assert await page.evaluate("() => window.avatarCall.state") == "listening"


def test_offset_estimate_recovers_a_known_lag() -> None:
    """The cross-correlation finds a lag put in on purpose (no browser needed)."""
    rng = np.random.default_rng(7)
    block_ms = 128 / 48
    audio_ms = np.arange(0, 12_000, block_ms)
    # Syllable-like bursts: 60-250 ms of sound, 30-200 ms of quiet.
    rms = np.zeros_like(audio_ms)
    t = 200.0
    while t < 11_500:
        length = rng.uniform(60, 250)
        rms[(audio_ms >= t) & (audio_ms < t + length)] = rng.uniform(0.05, 0.3)
        t += length + rng.uniform(30, 200)
    for lag in (-30.0, 0.0, 37.0):
        video_ms = np.arange(300, 11_000, 40.0)
        # Frame k shows the level of the audio heard during [t_k + lag, t_k + lag + 40).
        level = window_rms(audio_ms, rms, video_ms + lag, ENVELOPE_MS)
        motion = np.abs(np.diff(level, prepend=level[0])) + rng.normal(0, 0.003, len(level))
        estimate = estimate_offset(video_ms, motion, audio_ms, rms)
        assert abs(estimate.offset_ms - lag) <= 2, estimate
        assert estimate.peak > 0.8


@pytest.mark.browser
@needs_chromium
async def test_the_call_page_takes_its_token_from_the_fragment_only(
    engine_factory: EngineFactory, cache_dir: Path, tmp_path: Path
) -> None:
    key = "browser-test-api-key-0123456789abcdef"
    server, runner = await start_server(engine_factory, cache_dir, api_key=key)
    token = TokenSigner(key).mint(ttl_s=300)
    try:
        async with chromium_page(tmp_path / "profile") as page:
            offers: list[str] = []
            page.on("request", lambda r: offers.append(r.url) if "/offer" in r.url else None)
            # In the query, where every log on the way keeps it: the page says where it goes
            # and sends nothing.
            await page.goto(f"{server.url}/?testHooks=1&token={token}")
            await page.get_by_role("button", name="Start").click()
            await expect(page.get_by_role("status")).to_contain_text("#token=")
            assert offers == [] and not server.manager.sessions
            # In the fragment: the call starts with it, and the address bar no longer shows it.
            await page.goto(f"{server.url}/?testHooks=1#token={token}")
            session_id = await start_call(page, server.url, navigate=False)
            assert session_id in server.manager.sessions and len(offers) == 1
            assert token not in page.url and page.url.endswith("/?testHooks=1")
    finally:
        await runner.cleanup()
