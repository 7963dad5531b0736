"""A public endpoint: no one client or token takes every call, floods are refused, proxies
are believed only where trusted, and a host name the server does not answer for is refused.

Callers are real aiortc peers on 127.0.0.1. Different clients are told apart the way a server
behind a proxy tells them apart: the test stands in for the proxy (127.0.0.1, trusted) and
names each client in ``X-Forwarded-For``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from benchmarks.client import CallClient, make_offer
from rtc_server.config import ConfigError, ServerConfig
from rtc_server.engine_factory import EngineFactory
from rtc_server.turn_controller import MAX_QUEUED_SAYS
from signaling.addresses import parse_networks
from signaling.errors import SignalingError
from signaling.forwarded import ClientView
from signaling.messages import max_message_chars, parse_client_event
from signaling.quota import CallQuota, client_key
from tests.conftest import LiveServer, start_server
from tests.waiting import holds_within

PROXY = ("127.0.0.1",)
ALICE = {"X-Forwarded-For": "198.51.100.7"}
BOB = {"X-Forwarded-For": "198.51.100.8"}


@pytest.fixture
async def server(
    request: pytest.FixtureRequest, engine_factory: EngineFactory, cache_dir: Path
) -> AsyncIterator[LiveServer]:
    """A server behind the test's stand-in proxy; ``@pytest.mark.config(...)`` adds settings."""
    marker = request.node.get_closest_marker("config")
    config: dict[str, Any] = {"trusted_proxies": PROXY, "max_calls_per_client": 2}
    config.update(marker.kwargs if marker else {})
    live, runner = await start_server(engine_factory, cache_dir, **config)
    try:
        yield live
    finally:
        await runner.cleanup()


async def post_offer(
    server: LiveServer, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any], dict[str, str]]:
    body = {"sdp": await make_offer(), "type": "offer"}
    async with aiohttp.ClientSession(headers=headers or {}) as http:
        async with http.post(server.url + "/offer", json=body) as resp:
            return resp.status, await resp.json(), dict(resp.headers)


async def connected(server: LiveServer, headers: dict[str, str]) -> CallClient:
    caller = CallClient(server.url, record_video=False, headers=headers)
    await caller.connect()
    await caller.wait_channel_open()
    await caller.wait_state("listening", 10)
    return caller


# -- the pieces ------------------------------------------------------------------------------


def test_clients_are_keyed_by_address_and_ipv6_by_64() -> None:
    assert client_key("203.0.113.9") == "203.0.113.9"
    assert client_key("2001:db8:1:2:aaaa::1") == client_key("2001:db8:1:2:bbbb::9")
    assert client_key("2001:db8:1:2::1") == "2001:db8:1:2::/64"
    assert client_key("2001:db8:1:3::1") != client_key("2001:db8:1:2::1")
    assert client_key("::ffff:203.0.113.9") == "203.0.113.9"
    assert client_key(None) == client_key("") == "?"


def test_the_quota_counts_reservations_and_forgets_ended_calls() -> None:
    quota = CallQuota(per_client=2, per_token=1)
    first = quota.admit("a", None)
    quota.admit("a", None)  # still only reserved: simultaneous offers count at once
    with pytest.raises(SignalingError) as refused:
        quota.admit("a", None)
    assert refused.value.status == 429 and refused.value.code == "too_many_calls"
    assert refused.value.headers["Retry-After"]
    quota.admit("b", "t1").bind("s-b")
    with pytest.raises(SignalingError):
        quota.admit("c", "t1")  # another client, the same token
    first.release()
    quota.admit("a", "t2").bind("s-a")
    quota.keep_only(lambda s: s != "s-b")  # s-b ended by itself
    quota.admit("c", "t1")
    quota.end("s-a")
    assert quota.calls_of("a") == 1  # the unbound reservation is still held


def test_forwarded_headers_are_believed_from_trusted_proxies_only() -> None:
    view = ClientView(parse_networks(["10.0.0.0/8", "127.0.0.1"]))
    # Each proxy appends what it saw: the client is the rightmost hop that is not a proxy.
    assert view.client_of("10.1.2.3", "203.0.113.5, 10.9.9.9") == "203.0.113.5"
    assert view.client_of("10.1.2.3", "198.51.100.1, 203.0.113.5") == "203.0.113.5"
    assert view.client_of("192.0.2.1", "203.0.113.5") == "192.0.2.1"  # not a proxy: ignored
    assert view.client_of("10.1.2.3", "junk") == "10.1.2.3"
    assert view.client_of("10.1.2.3", "[2001:db8::1]:443") == "2001:db8::1"
    with pytest.raises(ValueError, match="--trusted-proxy"):
        parse_networks(["not-a-network"])


def test_host_names_a_server_answers_for() -> None:
    local = ClientView(loopback_only=True)
    assert local.host_known("127.0.0.1:8080") and local.host_known("localhost:8080")
    assert local.host_known("[::1]:8080")
    assert not local.host_known("rebind.example:8080")  # DNS rebinding onto loopback
    assert local.host_known("avatar.example", via_proxy=True)  # named by a trusted proxy
    assert ClientView(loopback_only=False).host_known("avatar.lan:8080")
    public = ClientView(public_origin="https://avatar.example.com")
    assert public.host_known("avatar.example.com") and public.host_known("avatar.example.com:443")
    assert public.host_known("10.0.0.7:8080")  # probes by address
    assert not public.host_known("other.example.com")


def test_oversized_channel_messages_are_refused_before_parsing() -> None:
    limit = max_message_chars(40)
    huge = '{"type": "say", "text": "' + "[" * limit + '"}'
    with pytest.raises(SignalingError) as refused:
        parse_client_event(huge, max_chars=40)
    assert refused.value.code == "message_too_large"
    # Forty characters spelled as escape pairs still fit.
    escaped = json.dumps({"type": "say", "text": "\U0001f600" * 20})
    assert parse_client_event(escaped, max_chars=40).text == "\U0001f600" * 20


def test_limit_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="max_calls_per_client"):
        ServerConfig.of(max_calls_per_client=-1)
    with pytest.raises(ConfigError, match="--public-origin"):
        ServerConfig.of(public_origin="https://avatar.example.com/path")
    with pytest.raises(ConfigError, match="--trusted-proxy"):
        ServerConfig.of(trusted_proxies=("10.0.0.0/33",))


# -- on a live server ------------------------------------------------------------------------


async def test_one_client_cannot_hold_more_than_its_calls(server: LiveServer) -> None:
    calls = [await connected(server, ALICE), await connected(server, ALICE)]
    try:
        status, body, headers = await post_offer(server, ALICE)
        assert status == 429 and body["error"]["code"] == "too_many_calls", body
        assert int(headers["Retry-After"]) > 0
        # Another client still gets through, and its call works.
        bob = await connected(server, BOB)
        calls.append(bob)
        await bob.say("Hello.")
        await bob.wait_state("speaking", 10)
        # A call Alice ends frees her slot.
        await calls[0].close()
        assert await holds_within(lambda: calls[0].session_id not in server.manager.sessions, 10)
        calls[0] = await connected(server, ALICE)
    finally:
        for call in calls:
            await call.close()


KEY = "hardening-test-key-0123456789abcdef"


@pytest.mark.config(api_key=KEY, max_calls_per_client=0)
async def test_one_token_opens_one_call(server: LiveServer) -> None:
    async def mint() -> str:
        async with aiohttp.ClientSession() as http:
            auth = {"Authorization": "Bearer " + KEY}
            async with http.post(server.url + "/token", json={}, headers=auth) as resp:
                return str((await resp.json())["token"])

    token, other = await mint(), await mint()
    call = await connected(server, {**ALICE, "Authorization": f"Bearer {token}"})
    try:
        status, body, _ = await post_offer(server, {**BOB, "Authorization": f"Bearer {token}"})
        assert status == 429 and body["error"]["code"] == "too_many_calls", body
        status, body, _ = await post_offer(server, {**ALICE, "Authorization": f"Bearer {other}"})
        assert status == 200, body
    finally:
        await call.close()


@pytest.mark.config(connect_timeout_s=1.5, max_calls_per_client=1)
async def test_a_call_that_never_connects_frees_its_slot(server: LiveServer) -> None:
    offered_at = time.monotonic()
    status, body, _ = await post_offer(server, ALICE)  # the answer is never applied
    assert status == 200, body
    session_id = body["session_id"]
    assert session_id in server.manager.sessions
    assert (await post_offer(server, ALICE))[0] == 429
    assert await holds_within(lambda: session_id not in server.manager.sessions, 15)
    assert time.monotonic() - offered_at >= 1.4, "closed before its connect deadline"
    call = await connected(server, ALICE)
    await call.close()


@pytest.mark.config(idle_timeout_s=2.0)
async def test_interrupts_do_not_keep_a_call_open(server: LiveServer) -> None:
    call = await connected(server, ALICE)
    started = time.monotonic()
    try:
        while time.monotonic() - started < 20 and call.session_id in server.manager.sessions:
            call.channel.send(json.dumps({"type": "interrupt"}))
            await asyncio.sleep(0.25)
        codes = [e.get("code") for e in call.events if e.get("type") == "error"]
        assert "idle_timeout" in codes, call.events
        assert call.session_id not in server.manager.sessions
    finally:
        await call.close()


async def say_many(url: str, text: str, count: int) -> list[tuple[int, str | None, str | None]]:
    """POST ``count`` says one after another: (status, error code, Retry-After) of each."""
    replies = []
    async with aiohttp.ClientSession() as http:
        for _ in range(count):
            async with http.post(url, json={"text": text}) as resp:
                code = (await resp.json()).get("error", {}).get("code")
                replies.append((resp.status, code, resp.headers.get("Retry-After")))
    return replies


@pytest.mark.config(call_messages_per_min=6)
async def test_floods_of_says_and_messages_are_refused(server: LiveServer) -> None:
    call = await connected(server, ALICE)
    url = f"{server.url}/sessions/{call.session_id}/say"
    try:
        started = time.monotonic()
        replies = await say_many(url, "Hi.", 15)
        statuses = [status for status, _, _ in replies]
        for status, code, retry_after in replies:
            if status == 429:
                assert code == "rate_limited" and int(retry_after or 0) >= 1
        # A burst of a third of the minute's rate (2) goes through, then one every 10 s.
        refilled = int((time.monotonic() - started) / 10)
        assert statuses[:2] == [202, 202], statuses
        assert statuses.count(202) <= 2 + refilled and statuses.count(429) >= 1, statuses
        call.skip_events()
        for _ in range(5):
            call.channel.send(json.dumps({"type": "text", "text": "Hello?"}))
        error = await call.wait_event(lambda e: e.get("type") == "error", 5)
        assert error["code"] == "rate_limited"
        assert call.session_id in server.manager.sessions  # refused, not dropped
    finally:
        await call.close()


@pytest.mark.config(call_messages_per_min=6000)
async def test_queued_says_are_bounded(server: LiveServer) -> None:
    call = await connected(server, ALICE)
    url = f"{server.url}/sessions/{call.session_id}/say"
    session = server.manager.sessions[call.session_id]
    try:
        replies = await say_many(url, "One more sentence to say.", MAX_QUEUED_SAYS + 8)
        codes = [code for _, code, _ in replies]
        assert codes.count("say_queue_full") >= 8, codes
        assert session.turns.queued_says <= MAX_QUEUED_SAYS
    finally:
        await call.close()


# -- behind a proxy --------------------------------------------------------------------------

PUBLIC = {
    "Origin": "https://avatar.example",
    "X-Forwarded-Proto": "https",
    "X-Forwarded-Host": "avatar.example",
}


@pytest.mark.config(max_calls_per_client=1)
async def test_behind_a_trusted_proxy_the_client_and_origin_are_the_callers(
    server: LiveServer,
) -> None:
    # The page at https://avatar.example calls its own origin through the proxy.
    status, body, _ = await post_offer(server, {**PUBLIC, **ALICE})
    assert status == 200, body
    assert (await post_offer(server, {**PUBLIC, **ALICE}))[0] == 429
    assert (await post_offer(server, {**PUBLIC, **BOB}))[0] == 200


@pytest.mark.config(trusted_proxies=(), max_calls_per_client=1)
async def test_forged_forwarded_headers_change_nothing(server: LiveServer) -> None:
    status, body, _ = await post_offer(server, {**PUBLIC, **ALICE})
    assert status == 403 and body["error"]["code"] == "origin_not_allowed", body
    # Without the origin: the two "clients" are one address, 127.0.0.1.
    assert (await post_offer(server, ALICE))[0] == 200
    status, body, _ = await post_offer(server, BOB)
    assert status == 429 and body["error"]["code"] == "too_many_calls", body


@pytest.mark.config(trusted_proxies=())
async def test_an_unknown_host_name_is_refused(server: LiveServer) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(server.url + "/", headers={"Host": "rebind.example"}) as resp:
            assert resp.status == 421
            assert (await resp.json())["error"]["code"] == "unknown_host"
        async with http.get(server.url + "/healthz", headers={"Host": "localhost"}) as resp:
            assert resp.status == 200
