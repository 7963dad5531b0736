"""The call page in Chromium rides out a lost link: its peer connection goes through the network
stand-in (tests/netrelay.py), which then drops everything; the page sees ICE give up, makes a
new peer connection and resumes the call, whose conversation carries on. A page that cannot
come back within the grace period finds the call freed and says so."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
from playwright.async_api import Page, Route, expect

from benchmarks.browser import chromium_missing, chromium_page, start_call
from benchmarks.vendor_standin import CHAT, VendorServer
from tests.conftest import RESUME_GRACE_S, LiveServer
from tests.netrelay import NetRelay
from tests.waiting import wait_until

needs_chromium = pytest.mark.skipif(chromium_missing() is not None, reason=chromium_missing() or "")


RECORD_EVENTS_JS = """() => {
  window.callEvents = [];
  for (const type of ["reconnecting", "reconnected", "closed"]) {
    window.avatarCall.addEventListener(type, (e) => window.callEvents.push({type, ...e.detail}));
  }
}"""


def through(relay: NetRelay) -> Any:
    """A Playwright route handler: the call's offer and answer rewritten to go through
    ``relay`` (what the network between the page and the server becomes)."""

    async def handle(route: Route) -> None:
        body = json.loads(route.request.post_data or "{}")
        body["sdp"] = relay.rewrite_offer(body["sdp"])
        response = await route.fetch(post_data=json.dumps(body))
        answer = await response.json()
        if response.status == 200:
            answer["sdp"] = relay.rewrite_answer(answer["sdp"])
        await route.fulfill(response=response, json=answer)

    return handle


async def ask(page: Page, text: str) -> None:
    """A typed turn, answered: the page's Ask, then the turn's end."""
    turns = await page.evaluate("() => window.avatarCall.events.filter(e => e.type === 'turn')")
    await page.get_by_label("Text for the avatar to say").fill(text)
    await page.get_by_role("button", name="Ask").click()
    await page.wait_for_function(
        f"() => window.avatarCall.events.filter(e => e.type === 'turn').length > {len(turns)}",
        timeout=30_000,
    )


async def call_events(page: Page) -> list[dict[str, Any]]:
    return list(await page.evaluate("() => window.callEvents"))


@pytest.mark.browser
@needs_chromium
async def test_the_page_resumes_a_lost_call_and_the_conversation_goes_on(
    resumable_server: LiveServer, chat_vendor: VendorServer, tmp_path: Path
) -> None:
    relay = NetRelay()
    try:
        async with chromium_page(tmp_path / "profile") as page:
            await page.route("**/offer", through(relay))
            session_id = await start_call(page, f"{resumable_server.url}/")
            await page.evaluate(RECORD_EVENTS_JS)
            await ask(page, "My name is Ada.")

            # The network goes; the page's way back (its resume offer) does not cross it.
            relay.outage(3600)
            cut = time.monotonic()
            status = page.get_by_role("status")
            await expect(status).to_contain_text("reconnecting", timeout=30_000)
            await page.wait_for_function(
                "() => window.callEvents.some(e => e.type === 'reconnected')", timeout=30_000
            )
            back_after = time.monotonic() - cut
            events = await call_events(page)
            print(f"reconnected {back_after:.1f} s after the cut: {events}")
            assert events[0]["type"] == "reconnecting" and events[-1]["type"] == "reconnected"
            assert not any(e["type"] == "closed" for e in events)
            assert await page.evaluate("() => window.avatarCall.sessionId") == session_id
            assert list(resumable_server.manager.sessions) == [session_id]
            await page.wait_for_function(
                "() => window.avatarCall.channel.readyState === 'open'", timeout=10_000
            )

            # The conversation goes on: the model hears the earlier turn with the next.
            await ask(page, "What is my name?")
            said = [(m["role"], m["content"]) for m in chat_vendor.seen(CHAT)[-1].json["messages"]]
            assert ("user", "My name is Ada.") in said
            assert said[-1] == ("user", "What is my name?")
            # And the page plays the new connection's media.
            await page.wait_for_function(
                """async () => {
                    let frames = 0;
                    (await window.avatarCall.pc.getStats()).forEach((s) => {
                        const video = s.type === "inbound-rtp" && s.kind === "video";
                        if (video) frames = s.framesDecoded;
                    });
                    return frames > 3;
                }""",
                timeout=15_000,
            )
            await page.get_by_role("button", name="Stop").click()
        await wait_until(lambda: not resumable_server.manager.sessions, 10, "the call hung up")
    finally:
        relay.close()


@pytest.mark.browser
@needs_chromium
async def test_a_page_that_cannot_come_back_in_time_finds_the_call_freed(
    resumable_server: LiveServer, tmp_path: Path
) -> None:
    relay = NetRelay()
    try:
        async with chromium_page(tmp_path / "profile") as page:
            await page.route("**/offer", through(relay))
            # The server is out of reach for the page's resume tries too, for now.
            await page.route("**/resume", lambda route: route.abort("internetdisconnected"))
            session_id = await start_call(page, f"{resumable_server.url}/")
            await page.evaluate(RECORD_EVENTS_JS)
            relay.outage(3600)
            cut = time.monotonic()
            gone = lambda: session_id not in resumable_server.manager.sessions  # noqa: E731
            await wait_until(gone, RESUME_GRACE_S + 10, "freed")
            freed_after = time.monotonic() - cut
            assert freed_after >= RESUME_GRACE_S - 1, freed_after
            tries = [e for e in await call_events(page) if e["type"] == "reconnecting"]
            assert len(tries) >= 3, tries  # it kept trying, backing off
            delays = [e["delayMs"] for e in tries]
            assert delays[1] > delays[0] / 2 and max(delays) <= 8000, delays

            # Reachable again: the next try hears the call is gone, and the page says so.
            await page.unroute("**/resume")
            await page.wait_for_function(
                "() => window.callEvents.some(e => e.type === 'closed')", timeout=20_000
            )
            closed = [e for e in await call_events(page) if e["type"] == "closed"][0]
            assert "unknown_session" in closed["reason"], closed
            await expect(page.get_by_role("status")).to_contain_text("Call ended")
            await expect(page.get_by_role("button", name="Start")).to_be_enabled()
            await asyncio.sleep(0.5)
            assert not resumable_server.manager.sessions
    finally:
        relay.close()
