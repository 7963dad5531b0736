"""GET /embed and static/embed.js: the avatar framed by a page of another origin.

Plain HTTP checks of the page (CSP, 403, query settings), then Chromium: a host page on another
127.0.0.1 port embeds the avatar with embed.js and drives it over postMessage; a host origin the
server does not allow can neither frame the page nor call /offer.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

import aiohttp
import pytest
from aiohttp import web
from playwright.async_api import Frame, Page, Response, expect

from benchmarks.browser import chromium_missing, chromium_page
from benchmarks.client import make_offer
from rtc_server.engine_factory import EngineFactory
from signaling.access import AccessPolicy, origin_of
from tests.conftest import LiveServer, start_server

needs_chromium = pytest.mark.skipif(chromium_missing() is not None, reason=chromium_missing() or "")

KEY = "embed-test-api-key-0123-abcdefghijk"
PARTNER = "https://partner.example"


# ---------------------------------------------------------------------------------------------
# Plain HTTP


@pytest.fixture
async def embedding_server(
    engine_factory: EngineFactory, cache_dir: Path
) -> AsyncIterator[LiveServer]:
    server, runner = await start_server(
        engine_factory, cache_dir, allowed_origins=(PARTNER, "http://127.0.0.1:9")
    )
    try:
        yield server
    finally:
        await runner.cleanup()


async def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str, Any]:
    async with aiohttp.ClientSession() as http:
        async with http.get(url, headers=headers or {}) as resp:
            return resp.status, await resp.text(), resp.headers.copy()


def _directives(csp: str) -> dict[str, list[str]]:
    parts = (d.split() for d in csp.split(";") if d.strip())
    return {p[0]: p[1:] for p in parts}


def _page_settings(page: str) -> dict[str, str]:
    tag = re.search(r"<html\b[^>]*>", page)
    assert tag is not None
    return {k: html.unescape(v) for k, v in re.findall(r'(data-[a-z-]+)="([^"]*)"', tag.group())}


async def test_embed_page_frame_ancestors_are_self_and_the_allowed_origins(
    embedding_server: LiveServer, live_server: LiveServer
) -> None:
    status, page, headers = await _get(embedding_server.url + "/embed")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    csp = _directives(headers["Content-Security-Policy"])
    assert sorted(csp["frame-ancestors"]) == sorted(["'self'", PARTNER, "http://127.0.0.1:9"])
    assert csp["script-src"] == ["'self'"]
    assert '<script type="module" src="/static/embed-frame.js">' in page
    # The page is told whom it may talk to: its own origin and the allowed ones.
    allowed = json.loads(_page_settings(page)["data-allowed-origins"])
    assert allowed[0] == embedding_server.url
    assert set(allowed) == {embedding_server.url, PARTNER, "http://127.0.0.1:9"}

    # By default only the server's own pages may frame it.
    status, page, headers = await _get(live_server.url + "/embed")
    assert _directives(headers["Content-Security-Policy"])["frame-ancestors"] == ["'self'"]
    assert json.loads(_page_settings(page)["data-allowed-origins"]) == [live_server.url]

    # The call page opens the microphone too: the same origins may frame it, no others.
    status, _, headers = await _get(embedding_server.url + "/")
    assert status == 200
    csp = _directives(headers["Content-Security-Policy"])
    assert sorted(csp["frame-ancestors"]) == sorted(["'self'", PARTNER, "http://127.0.0.1:9"])
    _, _, headers = await _get(live_server.url + "/")
    assert _directives(headers["Content-Security-Policy"])["frame-ancestors"] == ["'self'"]


def test_frame_ancestors_never_carries_anything_but_origins() -> None:
    policy = AccessPolicy(
        frozenset({"https://ok.example:8443", "https://x.example; script-src *", "ftp://a"}), None
    )
    assert policy.frame_ancestors() == "frame-ancestors 'self' https://ok.example:8443"
    assert AccessPolicy(frozenset({"*"}), None).frame_ancestors() == "frame-ancestors 'self' *"
    assert origin_of("https://Partner.example:8443/page?q=1") == "https://partner.example:8443"
    assert origin_of("javascript:alert(1)") is None and origin_of("null") is None


def test_allowed_origins_must_be_plain_origins() -> None:
    from rtc_server.config import ServerConfig

    ServerConfig.of(allowed_origins=("https://a.example", "http://127.0.0.1:9", "http://[::1]:8"))
    for bad in ("https://a.example/", "a.example", "https://a.example; script-src *"):
        with pytest.raises(ValueError, match="allowed-origin"):
            ServerConfig.of(allowed_origins=(bad,))


async def test_embed_is_403_when_framed_by_a_page_of_another_origin(
    embedding_server: LiveServer,
) -> None:
    url = embedding_server.url + "/embed"
    frame = {"Sec-Fetch-Dest": "iframe", "Sec-Fetch-Site": "cross-site"}
    status, body, headers = await _get(url, {**frame, "Referer": "https://evil.example/post/1"})
    assert status == 403
    error = json.loads(body)["error"]
    assert error["code"] == "origin_not_allowed" and "https://evil.example" in error["message"]
    # The refusal carries the CSP too, so the browser does not show the error in the frame.
    assert "frame-ancestors" in headers["Content-Security-Policy"]
    status, _, _ = await _get(url, {**frame, "Origin": "null"})
    assert status == 403  # an opaque origin (sandboxed page) is no allowed origin

    for headers_ok in (
        {**frame, "Referer": PARTNER + "/shop/item"},
        {**frame, "Referer": embedding_server.url + "/"},  # the server's own page
        frame,  # no Referer (referrerpolicy="no-referrer"): CSP is the guard
        {"Referer": "https://evil.example/"},  # a link, not a frame: opening the page is fine
    ):
        status, _, _ = await _get(url, headers_ok)
        assert status == 200, headers_ok


async def test_embed_query_settings_are_in_the_page(embedding_server: LiveServer) -> None:
    status, page, _ = await _get(embedding_server.url + '/embed?autostart=1&theme=dark&avatar=a"<b')
    assert status == 200
    settings = _page_settings(page)
    assert settings["data-theme"] == "dark"
    assert settings["data-autostart"] == "true"
    assert settings["data-avatar"] == 'a"<b'  # escaped in the HTML, intact in the attribute
    assert '"<b' not in page

    _, page, _ = await _get(embedding_server.url + "/embed?theme=neon&autostart=0")
    settings = _page_settings(page)
    assert settings["data-theme"] == "auto" and settings["data-autostart"] == "false"
    assert settings["data-avatar"] == ""

    status, body, _ = await _get(embedding_server.url + "/embed?avatar=" + "x" * 500)
    assert status == 400 and json.loads(body)["error"]["code"] == "bad_avatar"


# ---------------------------------------------------------------------------------------------
# In Chromium: a host page of another origin

HOST_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>host</title><link rel="icon" href="data:,">
</head><body>
<div id="slot" style="width: 256px; height: 256px"></div>
<script src="{script}"></script>
<script>
  window.events = [];
  window.messages = [];
  window.addEventListener("message", (e) => window.messages.push(e.data));
  const options = {options};
  if (options) {{
    window.avatar = AvatarRTC.embed(document.getElementById("slot"), options);
    window.avatar.on("*", (e) => window.events.push(e));
  }}
</script>
</body></html>
"""


FORGE_JS = r"""async (server) => {
  // The page itself, posing as the avatar.
  window.postMessage({ avatarRtc: 1, type: "response", text: "forged" }, "*");
  // A second avatar of the same server on the page, not started: its say gets it an error.
  const slot = document.createElement("div");
  document.body.append(slot);
  window.secondEvents = [];
  window.second = AvatarRTC.embed(slot, { server }).on("*", (e) => window.secondEvents.push(e));
  window.second.say("forged");
  // A frame of the page's own origin, not the avatar frame's parent, sending it a command.
  const sibling = document.createElement("iframe");
  sibling.srcdoc = `<script>
    parent.document.querySelector("#slot iframe").contentWindow.postMessage(
      { avatarRtc: 1, type: "text", text: "forged" }, ${JSON.stringify(server)});
  <\/script>`;
  await new Promise((loaded) => { sibling.onload = loaded; document.body.append(sibling); });
}"""


async def start_host_page() -> tuple[str, web.AppRunner]:
    """A page server on its own 127.0.0.1 port: a host origin. ``/?server=&options=`` is a page
    that loads embed.js from ``server`` and calls AvatarRTC.embed with ``options`` (JSON)."""

    async def page(request: web.Request) -> web.Response:
        server = request.query["server"]
        options = request.query.get("options", "null")
        json.loads(options)
        text = HOST_PAGE.format(
            script=html.escape(f"{server}/static/embed.js"), options=options.replace("<", "")
        )
        return web.Response(text=text, content_type="text/html")

    app = web.Application()
    app.router.add_get("/", page)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return f"http://127.0.0.1:{runner.addresses[0][1]}", runner


async def _wait_event(page: Page, kind: str, timeout_s: float = 15.0, **match: Any) -> Any:
    """The first event of ``kind`` (with the given fields) the host page got from the avatar."""
    handle = await page.wait_for_function(
        """([kind, match]) => window.events.find((e) => e.type === kind
             && Object.entries(match).every(([k, v]) => e[k] === v))""",
        arg=[kind, match],
        timeout=timeout_s * 1000,
    )
    return await handle.json_value()


def _embed_frame(page: Page) -> Frame:
    frames = [f for f in page.frames if urlsplit(f.url).path == "/embed"]
    assert len(frames) == 1, [f.url for f in page.frames]
    return frames[0]


async def _mint(server: LiveServer) -> str:
    async with aiohttp.ClientSession() as http:
        async with http.post(
            server.url + "/token", json={}, headers={"Authorization": f"Bearer {KEY}"}
        ) as resp:
            assert resp.status == 200
            return str((await resp.json())["token"])


@pytest.fixture
async def host() -> AsyncIterator[Callable[[], Awaitable[str]]]:
    runners: list[web.AppRunner] = []

    async def start() -> str:
        origin, runner = await start_host_page()
        runners.append(runner)
        return origin

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.mark.browser
@needs_chromium
async def test_a_host_page_embeds_the_avatar_and_drives_it(
    engine_factory: EngineFactory,
    cache_dir: Path,
    host: Callable[[], Awaitable[str]],
    tmp_path: Path,
) -> None:
    """embed.js on an allowed origin: the call connects (token auth on), say/text go in over
    postMessage, state/response/turn come out, the video plays in the frame, stop hangs up."""
    host_origin = await host()
    server, runner = await start_server(
        engine_factory, cache_dir, api_key=KEY, allowed_origins=(host_origin,)
    )
    try:
        token = await _mint(server)
        options = {"server": server.url, "token": token, "autostart": True, "theme": "dark"}
        query = {"server": server.url, "options": json.dumps(options), "testHooks": "1"}
        url = host_origin + "/?" + urlencode(query)
        async with chromium_page(tmp_path / "profile") as page:
            await page.goto(url)
            await _wait_event(page, "ready")
            connected = await _wait_event(page, "connected", 20)
            assert connected["sessionId"] in server.manager.sessions
            await _wait_event(page, "state", state="listening")
            frame = _embed_frame(page)
            assert await frame.evaluate("() => document.documentElement.dataset.theme") == "dark"
            # The video plays inside the frame.
            await frame.evaluate("() => window.avatarCall.playing")
            assert await frame.evaluate(
                """() => { const v = document.getElementById("remote");
                           return !v.paused && v.videoWidth > 0 && !v.muted; }"""
            )
            # No chrome but the microphone toggle while in the call.
            await expect(frame.get_by_role("button", name="Start")).to_be_hidden()
            await frame.get_by_role("button", name="Mute microphone").click()
            assert (await _wait_event(page, "microphone"))["enabled"] is False
            await expect(frame.get_by_role("button", name="Unmute microphone")).to_have_attribute(
                "aria-pressed", "true"
            )
            assert not await frame.evaluate(
                "() => window.avatarCall.microphone.getAudioTracks()[0].enabled"
            )

            # Forged messages are ignored on both sides: the library takes only its own
            # frame's, the frame only its parent's.
            await frame.evaluate(
                """() => window.postMessage({ avatarRtc: 1, type: "text", text: "forged" }, "*")"""
            )
            await page.evaluate(FORGE_JS, server.url)
            # The second avatar's own events (its "ready" may come first) include the refusal.
            second = await page.wait_for_function(
                "() => window.secondEvents.find((e) => e.type === 'error')"
            )
            assert (await second.json_value())["code"] == "not_connected"

            await page.evaluate("() => window.avatar.say('Hello from the host page.')")
            await _wait_event(page, "state", 10, state="speaking")
            await page.evaluate("() => window.avatar.text('What is an avatar?')")
            await _wait_event(page, "turn", 20)
            reply = await page.evaluate(
                "() => window.events.filter((e) => e.type === 'response').map((e) => e.text)"
            )
            assert "avatar" in " ".join(reply).lower(), reply

            await page.evaluate("() => window.avatar.stop()")
            closed = await _wait_event(page, "closed")
            assert closed["reason"] == "stopped"
            events = await page.evaluate("() => window.events")
            messages = await page.evaluate("() => window.messages")
        types = [e["type"] for e in events]
        assert types[0] == "ready"
        # No forged message got through and nothing failed. engine_behind is no failure: a
        # busy machine's notice that the picture skips ahead (the call goes on).
        assert not [
            e
            for e in events
            if "forged" in json.dumps(e) or e.get("code") not in (None, "engine_behind")
        ]
        assert all("avatarRtc" not in e for e in events)  # the library strips its marker
        # What the page's window saw came only from the frame, with the protocol's marker.
        assert all(m.get("avatarRtc") == 1 for m in messages if "forged" not in json.dumps(m))
        # Stop deleted the session with the token (the session route needs it).
        assert connected["sessionId"] not in server.manager.sessions
    finally:
        await runner.cleanup()


@pytest.mark.browser
@needs_chromium
async def test_a_host_origin_not_allowed_can_neither_frame_nor_call(
    engine_factory: EngineFactory,
    cache_dir: Path,
    host: Callable[[], Awaitable[str]],
    tmp_path: Path,
) -> None:
    allowed, stranger = await host(), await host()
    server, runner = await start_server(engine_factory, cache_dir, allowed_origins=(allowed,))
    try:
        async with chromium_page(tmp_path / "profile") as page:
            responses: list[Response] = []
            page.on("response", lambda r: responses.append(r))
            options = {"server": server.url, "autostart": True}
            await page.goto(
                stranger + "/?" + urlencode({"server": server.url, "options": json.dumps(options)})
            )
            # embed.js: the server refuses the frame (403, it knows the page from Referer) and
            # the browser shows nothing of it; the library reports it.
            error = await _wait_event(page, "error", 10)
            assert error["code"] == "embed_blocked"
            embeds = [r for r in responses if urlsplit(r.url).path == "/embed"]
            assert [r.status for r in embeds] == [403]
            assert not await page.evaluate("() => window.events.some((e) => e.type === 'ready')")

            # A frame whose page hides its origin (no Referer) is served, and CSP
            # frame-ancestors stops the browser from showing it.
            await page.evaluate(
                """(src) => new Promise((loaded) => {
                     const f = document.createElement("iframe");
                     f.referrerPolicy = "no-referrer";
                     f.src = src;
                     f.addEventListener("load", loaded);
                     document.body.append(f);
                   })""",
                f"{server.url}/embed?autostart=1",
            )
            await page.wait_for_timeout(500)  # a "ready" would have been posted before load
            raw = [r for r in responses if urlsplit(r.url).path == "/embed"][1:]
            assert [r.status for r in raw] == [200]
            assert all(urlsplit(f.url).path != "/embed" for f in page.frames), [
                f.url for f in page.frames
            ]
            assert await page.evaluate("() => window.messages") == []

            # Its calls to the API are refused: a JSON POST fails its preflight, and a simple
            # (no-cors) POST, which needs none, gets 403 from the server.
            offer = {"sdp": await make_offer(), "type": "offer"}
            outcomes = await page.evaluate(
                """async ([url, offer]) => {
                     const tries = [
                       { headers: { "Content-Type": "application/json" } },
                       { mode: "no-cors", headers: { "Content-Type": "text/plain" } },
                     ];
                     const out = [];
                     for (const extra of tries) {
                       try {
                         const r = await fetch(url,
                           { method: "POST", body: JSON.stringify(offer), ...extra });
                         out.push(r.type);
                       } catch (err) { out.push(err.name); }
                     }
                     return out;
                   }""",
                [server.url + "/offer", offer],
            )
            assert outcomes == ["TypeError", "opaque"]
            offers = [r for r in responses if r.url == server.url + "/offer"]
            assert [r.status for r in offers] == [403]
        assert not server.manager.sessions
    finally:
        await runner.cleanup()
