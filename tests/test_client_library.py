"""The browser client as a library (static/package.json): its package is whole, and in Chromium a
page of another origin that ships the modules itself (as a bundle from npm would) calls the
server with ``Call`` and its ``baseUrl``, and frames the avatar with the embed module."""

from __future__ import annotations

import json
import tomllib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from playwright.async_api import Page

from benchmarks.browser import chromium_missing, chromium_page
from rtc_server.engine_factory import EngineFactory
from tests.conftest import LiveServer, start_server
from tests.waiting import wait_until

needs_chromium = pytest.mark.skipif(chromium_missing() is not None, reason=chromium_missing() or "")

ROOT = Path(__file__).resolve().parents[1]
STATIC = ROOT / "static"
PACKAGE = json.loads((STATIC / "package.json").read_text())

CALL_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>host</title><link rel="icon" href="data:,">
</head><body>
<video id="avatar" autoplay playsinline></video>
<script type="module">
  import { Call } from "/lib/call.js";
  const call = new Call(document.getElementById("avatar"), { baseUrl: SERVER });
  window.call = call;
  window.started = call.start().then(() => "started", (err) => `failed: ${err.message}`);
</script>
</body></html>
"""

EMBED_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>host</title><link rel="icon" href="data:,">
</head><body>
<div id="slot" style="width: 256px; height: 256px"></div>
<script type="module">
  import { embed, AvatarEmbed } from "/lib/embed-host.js";
  window.events = [];
  window.avatar = embed(document.getElementById("slot"), { server: SERVER });
  window.isEmbed = window.avatar instanceof AvatarEmbed;
  window.avatar.on("*", (e) => window.events.push(e));
</script>
</body></html>
"""


def test_the_package_holds_what_it_names_at_the_projects_version() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert PACKAGE["version"] == project["version"]
    assert PACKAGE["license"] == project["license"]
    assert PACKAGE["type"] == "module"
    for name in PACKAGE["files"]:
        assert (STATIC / name).is_file(), name
    for entry in PACKAGE["exports"].values():
        for target in entry.values():
            assert target.removeprefix("./") in PACKAGE["files"], target


@pytest.fixture
async def host_origin() -> AsyncIterator[str]:
    """A page server on its own port (another origin) shipping the package's files in /lib/."""
    pages: dict[str, str] = {}

    async def page(request: web.Request) -> web.Response:
        text = pages[request.match_info["name"]].replace("SERVER", json.dumps(request.query["s"]))
        return web.Response(text=text, content_type="text/html")

    async def lib(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in PACKAGE["files"]:
            raise web.HTTPNotFound()
        return web.Response(text=(STATIC / name).read_text(), content_type="text/javascript")

    pages.update({"call": CALL_PAGE, "embed": EMBED_PAGE})
    app = web.Application()
    app.router.add_get("/page/{name}", page)
    app.router.add_get("/lib/{name}", lib)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@pytest.fixture
async def server(
    engine_factory: EngineFactory, cache_dir: Path, host_origin: str
) -> AsyncIterator[LiveServer]:
    live, runner = await start_server(engine_factory, cache_dir, allowed_origins=(host_origin,))
    try:
        yield live
    finally:
        await runner.cleanup()


async def _open(page: Page, host_origin: str, name: str, server: LiveServer) -> None:
    await page.goto(f"{host_origin}/page/{name}?s={server.url}")


@pytest.mark.browser
@needs_chromium
async def test_a_page_of_another_origin_calls_the_server_with_the_library(
    server: LiveServer, host_origin: str, tmp_path: Path
) -> None:
    async with chromium_page(tmp_path / "profile") as page:
        await _open(page, host_origin, "call", server)
        assert await page.evaluate("() => window.started") == "started"
        session_id = await page.evaluate("() => window.call.sessionId")
        assert session_id in server.manager.sessions
        await page.wait_for_function("() => window.call.channel?.readyState === 'open'")
        await page.evaluate("() => window.call.playing")
        assert await page.evaluate("() => window.call.send({type: 'say', text: 'Hello there.'})")
        await page.wait_for_function(
            "() => window.call.states.includes('speaking')", timeout=20_000
        )
        assert await page.evaluate("() => document.getElementById('avatar').videoWidth") > 0
        await page.evaluate("() => window.call.stop()")
    await wait_until(lambda: not server.manager.sessions, 10, "the library hung up")


@pytest.mark.browser
@needs_chromium
async def test_a_page_frames_the_avatar_with_the_embed_module(
    server: LiveServer, host_origin: str, tmp_path: Path
) -> None:
    async with chromium_page(tmp_path / "profile") as page:
        await _open(page, host_origin, "embed", server)
        await page.wait_for_function(
            "() => window.events?.some((e) => e.type === 'ready')", timeout=15_000
        )
        assert await page.evaluate("() => window.isEmbed && typeof AvatarRTC.embed")
        await page.evaluate("() => window.avatar.start()")
        await page.wait_for_function(
            "() => window.events.some((e) => e.type === 'connected')", timeout=20_000
        )
        assert len(server.manager.sessions) == 1
        await page.evaluate("() => window.avatar.stop()")
        await page.wait_for_function("() => window.events.some((e) => e.type === 'closed')")
    await wait_until(lambda: not server.manager.sessions, 10, "the embed hung up")
