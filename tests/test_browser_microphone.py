"""The call page's microphone in Debian's Chromium: the constraints it asks for, the device
picker, mute and the level meter. Chromium's fake capture offers three microphones, each
playing its beep."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from playwright.async_api import Page, expect

from benchmarks.browser import chromium_missing, chromium_page, start_call
from tests.conftest import LiveServer

needs_chromium = pytest.mark.skipif(chromium_missing() is not None, reason=chromium_missing() or "")

SENT_TRACK = "window.avatarCall.pc.getSenders().find((s) => s.track?.kind === 'audio').track"


async def _sent(page: Page) -> dict[str, Any]:
    """The microphone track the call sends: its constraints, settings, state."""
    return dict(
        await page.evaluate(
            f"""() => {{
                const track = {SENT_TRACK};
                return {{constraints: track.getConstraints(), settings: track.getSettings(),
                         enabled: track.enabled, state: track.readyState, label: track.label}};
            }}"""
        )
    )


async def _packets_sent(page: Page) -> int:
    return int(
        await page.evaluate(
            """async () => {
                let sent = 0;
                (await window.avatarCall.pc.getStats()).forEach((s) => {
                    if (s.type === "outbound-rtp" && s.kind === "audio") sent = s.packetsSent;
                });
                return sent;
            }"""
        )
    )


async def _more_packets_sent(page: Page, timeout_s: float = 10.0) -> None:
    """The call's audio sender is sending: its packet count grows."""
    before = await _packets_sent(page)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        if await _packets_sent(page) > before + 10:
            return
    raise AssertionError("the microphone's packets stopped")


@pytest.mark.browser
@needs_chromium
async def test_microphone_constraints_picker_mute_and_meter(
    live_server: LiveServer, tmp_path: Path
) -> None:
    async with chromium_page(tmp_path / "profile") as page:
        session_id = await start_call(page, f"{live_server.url}/")
        # Asked for explicitly (Chromium's defaults would say the same in getSettings, so the
        # constraints are read too), and granted.
        sent = await _sent(page)
        wanted = {
            "echoCancellation": True,
            "noiseSuppression": True,
            "autoGainControl": True,
            "channelCount": 1,
        }
        assert {k: sent["constraints"].get(k) for k in wanted} == wanted
        assert {k: sent["settings"].get(k) for k in wanted} == wanted

        # The picker lists the browser's microphones, the one in use chosen.
        picker = page.get_by_label("Microphone", exact=True)
        await expect(picker).to_be_visible()
        options = await picker.locator("option").all_text_contents()
        assert len(options) == 3 and "Fake Audio Input 1" in options, options
        assert await picker.input_value() == sent["settings"]["deviceId"]

        # The meter moves with the fake microphone's beeps.
        meter = page.get_by_label("Microphone level")
        peak = 0.0
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and peak <= 0.05:
            peak = max(peak, float(await meter.evaluate("(m) => m.value")))
            await asyncio.sleep(0.1)
        assert peak > 0.05, "the level meter never moved"

        # Switching devices replaces the sent track in the same call: no new session, the
        # connection stays up and the new microphone's packets flow.
        await picker.select_option(label="Fake Audio Input 1")
        await page.wait_for_function(f"() => {SENT_TRACK}.label === 'Fake Audio Input 1'")
        switched = await _sent(page)
        assert switched["state"] == "live" and switched["enabled"]
        assert {k: switched["constraints"].get(k) for k in wanted} == wanted
        assert await picker.input_value() == switched["settings"]["deviceId"]
        assert await page.evaluate("() => window.avatarCall.sessionId") == session_id
        assert await page.evaluate("() => window.avatarCall.pc.connectionState") == "connected"
        assert list(live_server.manager.sessions) == [session_id]
        await _more_packets_sent(page)

        # Mute: the sent track is disabled (it sends silence), and a switch keeps it muted.
        mute = page.get_by_role("button", name="Mute")
        await mute.click()
        await expect(mute).to_have_attribute("aria-pressed", "true")
        assert (await _sent(page))["enabled"] is False
        await picker.select_option(label="Fake Audio Input 2")
        await page.wait_for_function(f"() => {SENT_TRACK}.label === 'Fake Audio Input 2'")
        assert (await _sent(page))["enabled"] is False
        await mute.click()
        await expect(mute).to_have_attribute("aria-pressed", "false")
        assert (await _sent(page))["enabled"] is True
        await _more_packets_sent(page)

        # The call still answers after all that.
        await page.get_by_label("Text for the avatar to say").fill("Still here.")
        await page.get_by_role("button", name="Send").click()
        await page.wait_for_function(
            "() => window.avatarCall.states.includes('speaking')", timeout=20_000
        )
        await page.get_by_role("button", name="Stop").click()
        await expect(picker).to_be_hidden()


@pytest.mark.browser
@needs_chromium
async def test_a_microphone_that_goes_mid_call_falls_back_to_the_default(
    live_server: LiveServer, tmp_path: Path
) -> None:
    """Chromium's fake microphones cannot be unplugged, so the page is told so as the browser
    would tell it: the device list without the one in use and a ``devicechange`` event; then
    the other way a microphone goes, its track ending. Each time the call carries on with the
    default microphone, in the same session."""
    async with chromium_page(tmp_path / "profile") as page:
        session_id = await start_call(page, f"{live_server.url}/")
        picker = page.get_by_label("Microphone", exact=True)
        await picker.select_option(label="Fake Audio Input 2")
        await page.wait_for_function(f"() => {SENT_TRACK}.label === 'Fake Audio Input 2'")
        gone = await page.evaluate(
            f"""() => {{
                const devices = navigator.mediaDevices;
                const list = devices.enumerateDevices.bind(devices);
                const gone = {SENT_TRACK}.getSettings().deviceId;
                devices.enumerateDevices = async () =>
                    (await list()).filter((d) => d.deviceId !== gone);
                devices.dispatchEvent(new Event("devicechange"));
                return gone;
            }}"""
        )
        await page.wait_for_function(f"() => {SENT_TRACK}.label !== 'Fake Audio Input 2'")
        fallen_back = await _sent(page)
        assert fallen_back["state"] == "live" and fallen_back["settings"]["deviceId"] != gone
        options = await picker.locator("option").all_text_contents()
        assert len(options) == 2 and "Fake Audio Input 2" not in options, options
        await _more_packets_sent(page)

        # The track in use ends (the device went away under it): the default again.
        ended = await page.evaluate(
            f"""() => {{
                const track = {SENT_TRACK};
                track.stop();
                navigator.mediaDevices.dispatchEvent(new Event("devicechange"));
                return track.id;
            }}"""
        )
        await page.wait_for_function(
            f"() => {SENT_TRACK}.id !== {ended!r} && {SENT_TRACK}.readyState === 'live'"
        )
        await _more_packets_sent(page)
        assert await page.evaluate("() => window.avatarCall.sessionId") == session_id
        assert await page.evaluate("() => window.avatarCall.pc.connectionState") == "connected"
        assert list(live_server.manager.sessions) == [session_id]
        await page.get_by_role("button", name="Stop").click()
