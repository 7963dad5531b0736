"""Chromium asks a question through its (fake) microphone and gets the answer back."""

from __future__ import annotations

import asyncio
import re
import time
import wave
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from playwright.async_api import Page, expect

from benchmarks.browser import call_stats, chromium_missing, chromium_page, start_call
from benchmarks.clip import speech_pcm
from tests.conftest import LiveServer
from tests.test_listening import QUESTION

needs_chromium = pytest.mark.skipif(chromium_missing() is not None, reason=chromium_missing() or "")


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z]+", text.lower()))


async def _question_wav(path: Path) -> Path:
    speech = await speech_pcm(QUESTION, 48_000)
    silence = np.zeros(48_000 * 2, np.int16)
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(48_000)
        out.writeframes(np.concatenate([silence, speech, silence, silence]).tobytes())
    return path


async def _microphone(page: Page) -> dict[str, Any]:
    """What Chromium says it captured and sent of the fake microphone: frames its capture
    pipeline dropped (the track's stats), seconds of audio and packets sent. A failure's
    message carries it, to tell audio the browser lost from words the server misheard."""
    report: dict[str, Any] = await page.evaluate(
        """async () => {
          const pc = window.avatarCall.pc;
          const sender = pc.getSenders().find((s) => s.track?.kind === "audio");
          const out = {};
          const t = sender?.track?.stats;
          if (t) {
            out.track = { total: t.totalFrames, delivered: t.deliveredFrames,
                          total_s: t.totalFramesDuration / 1000 };
          }
          (await pc.getStats()).forEach((s) => {
            if (s.type === "media-source" && s.kind === "audio") {
              out.source_s = s.totalSamplesDuration;
            } else if (s.type === "outbound-rtp" && s.kind === "audio") {
              out.packets_sent = s.packetsSent;
            }
          });
          return out;
        }"""
    )
    return report


async def _event(page: Page, kind: str, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        events = await page.evaluate("() => window.avatarCall?.events ?? []")
        for event in events:
            if event.get("type") == kind:
                return dict(event)
        await asyncio.sleep(0.1)
    raise TimeoutError(f"no {kind} event in the page")


@pytest.mark.browser
@needs_chromium
async def test_browser_asks_by_voice_and_hears_the_answer(
    live_server: LiveServer, tmp_path: Path
) -> None:
    wav = await _question_wav(tmp_path / "question.wav")
    # %noloop: the fake microphone says the question once, then stays silent.
    args = [f"--use-file-for-fake-audio-capture={wav}%noloop"]
    async with chromium_page(tmp_path / "profile", args) as page:
        await start_call(page, f"{live_server.url}/")
        transcript = await _event(page, "transcript", 20)
        heard = transcript["text"]
        assert {"capital", "italy"} <= _words(heard), (heard, await _microphone(page))
        response = await _event(page, "response", 10)
        assert response["text"].startswith("You said")
        # The answer is heard: the remote audio carries sound while the avatar speaks.
        await expect(page.get_by_role("status")).to_have_text("Speaking", timeout=10_000)
        energy0 = (await call_stats(page))["audio"].get("totalAudioEnergy", 0.0)
        await asyncio.sleep(1.0)
        energy1 = (await call_stats(page))["audio"].get("totalAudioEnergy", 0.0)
        assert energy1 - energy0 > 1e-3
        await _event(page, "turn", 20)
        # The conversation log shows both sides.
        log = page.get_by_role("list", name="Conversation")
        await expect(log.locator("li")).to_have_count(2)
        await expect(log.locator("li").first).to_contain_text("capital")
        await expect(log.locator("li").last).to_contain_text("You said")
