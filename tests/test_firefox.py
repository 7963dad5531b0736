"""The call page and the embed in Debian's Firefox ESR, through Marionette.

Firefox offline has no OpenH264 (Mozilla downloads it as a plugin on first use), so its offer
carries VP8 only and the server answers VP8 (docs: README, "Browsers").
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest

from benchmarks.browser import with_test_hooks
from rtc_server.engine_factory import EngineFactory
from tests.conftest import LiveServer, start_server
from tests.firefox import (
    click_button,
    firefox,
    firefox_missing,
    inbound,
    run,
    video_frames,
    wait_for,
)
from tests.test_embed import start_host_page

needs_firefox = pytest.mark.skipif(firefox_missing() is not None, reason=firefox_missing() or "")

SAY = (
    "The quick brown fox jumps over the lazy dog. "
    "Welcome to the avatar server. It is a sunny morning today."
)
"""About six seconds of speech: long enough to time the picture in the middle of it."""

MIN_FPS = 24.0
WINDOW_S = 4.0
"""Frames are counted over this long, from 0.5 s after the avatar began to speak (the picture
of a still, idle avatar is sent at 4 fps on purpose; speech goes out at 25)."""


def _level(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The RMS level (0-1) of the audio Firefox decoded between two samples of its stats."""
    return math.sqrt(max(0.0, b["energy"] - a["energy"]) / (b["duration"] - a["duration"]))


def _speaking_span(client: Any, say: Callable[[], None]) -> dict[str, Any]:
    """Call ``say`` (it starts a say), then measure while the avatar speaks: the frames
    decoded over WINDOW_S, and the level of the decoded audio before and during the speech."""
    wait_for(
        client,
        """return window.avatarCall.pc.getStats().then((report) => {
             let playing = false;
             report.forEach((s) => {
               if (s.type === "inbound-rtp" && s.kind === "audio") {
                 playing = s.totalSamplesDuration > 0;
               }
             });
             return playing;
           });""",
        10,
        "audio",
    )
    quiet = video_frames(client)
    time.sleep(1.0)
    quiet_end = video_frames(client)
    say()
    wait_for(client, "return window.avatarCall.state === 'speaking'", 20, "speaking state")
    time.sleep(0.5)
    first = video_frames(client)
    time.sleep(WINDOW_S)
    last = video_frames(client)
    still_speaking = run(client, "return window.avatarCall.state === 'speaking'")
    wait_for(client, "return window.avatarCall.state === 'listening'", 30, "the say's end")
    fps = (last["decoded"] - first["decoded"]) / ((last["at"] - first["at"]) / 1000.0)
    return {
        "fps": fps,
        "still_speaking": still_speaking,
        "quiet_level": _level(quiet, quiet_end),
        "speech_level": _level(first, last),
        "width": last["width"],
    }


def _call_page(url: str, log: Path) -> dict[str, Any]:
    with firefox(log) as client:
        client.navigate(with_test_hooks(f"{url}/"))
        click_button(client, "Start")
        wait_for(
            client,
            """const v = document.getElementById("remote");
               return window.avatarCall?.channel?.readyState === "open" && !v.paused
                 && v.videoWidth > 0;""",
            60,
            "call playing",
        )

        def say() -> None:
            run(
                client,
                """document.getElementById("say-text").value = arguments[0];
                   document.getElementById("send").click();""",
                SAY,
            )

        span = _speaking_span(client, say)
        stats = inbound(client)
        states = run(client, "return window.avatarCall.states")
        session = run(client, "return window.avatarCall.sessionId")
        click_button(client, "Stop")
        return {"stats": stats, "states": states, "session": session, **span}


def _check(r: dict[str, Any]) -> None:
    print(
        f"\nFIREFOX video {r['stats']['video']['mimeType']} {r['width']} px, "
        f"{r['fps']:.1f} fps decoded while speaking; audio RMS {r['quiet_level']:.4f} quiet, "
        f"{r['speech_level']:.3f} speaking"
    )
    assert r["stats"]["video"]["mimeType"] == "video/VP8", r["stats"]
    assert r["stats"]["audio"]["mimeType"] == "audio/opus", r["stats"]
    assert r["still_speaking"], "the say ended inside the window: too short to time"
    assert r["fps"] >= MIN_FPS, r
    # The say is heard: the decoded audio is loud while the avatar speaks, silent before.
    assert r["speech_level"] > 0.02 and r["speech_level"] > 20 * r["quiet_level"], r


@pytest.mark.browser
@needs_firefox
async def test_the_call_page_in_firefox_speaks_a_say_and_plays_the_avatar(
    live_server: LiveServer, tmp_path: Path
) -> None:
    r = await asyncio.to_thread(_call_page, live_server.url, tmp_path / "gecko.log")
    _check(r)
    assert r["states"][:3] == ["listening", "speaking", "listening"], r["states"]
    assert r["session"] not in live_server.manager.sessions, "Stop deletes the session"


def _embed(host_url: str, log: Path) -> dict[str, Any]:
    with firefox(log) as client:
        client.navigate(host_url)
        wait_for(
            client,
            "return window.events.some((e) => e.type === 'state' && e.state === 'listening')",
            60,
            "the embedded call listening",
        )
        frame = client.find_element("css selector", "iframe")
        client.switch_to_frame(frame)
        wait_for(
            client,
            """const v = document.getElementById("remote");
               return !v.paused && v.videoWidth > 0;""",
            30,
            "the frame's video playing",
        )

        def say() -> None:
            # The host page says it (postMessage into the frame); the frame is measured.
            client.switch_to_parent_frame()
            run(client, "window.avatar.say(arguments[0])", SAY)
            client.switch_to_frame(frame)

        span = _speaking_span(client, say)
        stats = inbound(client)
        client.switch_to_parent_frame()
        events = run(client, "return window.events")
        run(client, "window.avatar.stop()")
        wait_for(client, "return window.events.some((e) => e.type === 'closed')", 15, "closed")
        return {"stats": stats, "events": events, **span}


@pytest.mark.browser
@needs_firefox
async def test_the_embed_in_firefox_speaks_a_say_and_plays_the_avatar(
    engine_factory: EngineFactory, cache_dir: Path, tmp_path: Path
) -> None:
    origin, host_runner = await start_host_page()
    server, runner = await start_server(engine_factory, cache_dir, allowed_origins=(origin,))
    try:
        options = {"server": server.url, "autostart": True}
        query = {"server": server.url, "options": json.dumps(options), "testHooks": "1"}
        r = await asyncio.to_thread(_embed, f"{origin}/?{urlencode(query)}", tmp_path / "gecko.log")
        _check(r)
        states = [e["state"] for e in r["events"] if e["type"] == "state"]
        assert states[:3] == ["listening", "speaking", "listening"], r["events"]
        assert not [e for e in r["events"] if e["type"] == "error" and e["code"] != "engine_behind"]
        assert not server.manager.sessions, "stop hung up"
    finally:
        await runner.cleanup()
        await host_runner.cleanup()
