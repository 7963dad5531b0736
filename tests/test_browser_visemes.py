"""The viseme stream's example page in Debian's Chromium: the mouth it draws follows the frames
of the audio being played, found by the RTP time the browser reports for that audio."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from benchmarks.browser import chromium_missing, chromium_page
from musetalk_core.visemes import BLEND_SHAPES, VISEMES
from rtc_server.pages import STATIC_DIR
from tests.conftest import LiveServer

needs_chromium = pytest.mark.skipif(chromium_missing() is not None, reason=chromium_missing() or "")


def test_example_page_knows_the_frame_layout() -> None:
    script = (STATIC_DIR / "visemes.js").read_text()
    shapes = re.search(r"BLEND_SHAPES = \[(.*?)\]", script, re.S)
    visemes = re.search(r"VISEMES = \[(.*?)\]", script, re.S)
    assert shapes and visemes
    assert re.findall(r'"(\w+)"', shapes.group(1)) == list(BLEND_SHAPES)
    assert re.findall(r'"(\w+)"', visemes.group(1)) == list(VISEMES)


@pytest.mark.browser
@needs_chromium
async def test_example_page_draws_the_mouth_from_the_viseme_stream(
    live_server: LiveServer, tmp_path: Path
) -> None:
    async with chromium_page(tmp_path / "profile") as page:
        refused: list[str] = []
        page.on("console", lambda m: refused.append(m.text) if "Security Policy" in m.text else 0)
        await page.goto(f"{live_server.url}/static/visemes.html?testHooks")
        await page.get_by_role("button", name="Start").click()
        await page.wait_for_function(
            "() => window.visemeDemo?.call.channel?.readyState === 'open'", timeout=20_000
        )
        await page.evaluate("() => window.visemeDemo.call.playing")
        await page.wait_for_function("() => window.visemeDemo.call.state === 'listening'")
        await page.get_by_role("button", name="Say").click()
        await page.wait_for_function(
            "() => window.visemeDemo.call.states.includes('speaking')", timeout=10_000
        )
        await page.wait_for_function(
            "() => window.visemeDemo.call.state === 'listening'", timeout=30_000
        )
        seen = await page.evaluate(
            """() => ({
              received: window.visemeDemo.track.received,
              drawn: window.visemeDemo.drawn.frames,
              visemes: window.visemeDemo.drawn.visemes,
              behind: window.visemeDemo.drawn.behindMs,
              ticks: window.visemeDemo.drawn.speakingTicks,
              misses: window.visemeDemo.drawn.speakingMisses,
            })"""
        )
    behind_ms = np.percentile(seen["behind"], [50, 95]) if seen["behind"] else []
    print(
        f"frames received {seen['received']}, drawn {seen['drawn']}; speaking animation frames "
        f"{seen['ticks']}, without a frame {seen['misses']}; behind p50/p95 {behind_ms} ms"
    )
    assert not refused, refused
    assert seen["received"] >= 100, seen
    # The page drew the mouths of the sentence it said ("My mother bought a big blue map for
    # five pounds."): lips closed, lip to teeth, open.
    assert {"PP", "FF", "aa"} <= set(seen["visemes"]), seen["visemes"]
    # The frame shown for the audio playing was that audio's own 20 ms frame: every frame was
    # there before its sound played.
    # While the avatar spoke, nearly every animation frame found the frame of the audio it
    # played (the misses: the first and last few tens of ms, still in the jitter buffer).
    assert seen["ticks"] >= 60 and seen["misses"] <= 0.1 * seen["ticks"], seen
    behind = np.asarray(seen["behind"])
    assert len(behind) >= 100
    assert np.mean(behind < 20.0 + 1e-6) >= 0.95, np.percentile(behind, [50, 95, 99])
