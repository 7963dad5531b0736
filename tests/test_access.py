"""Allowed origins (403 and CORS) and signed call tokens (401 unless valid)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from benchmarks.client import make_offer
from rtc_server.engine_factory import EngineFactory
from signaling.access import TokenSigner
from signaling.errors import SignalingError
from tests.conftest import LiveServer, start_server
from tests.waiting import wait_until

KEY = "test-api-key-0123456789-abcdefghijk"


@pytest.fixture
async def guarded(engine_factory: EngineFactory, cache_dir: Path) -> AsyncIterator[LiveServer]:
    server, runner = await start_server(
        engine_factory, cache_dir, api_key=KEY, allowed_origins=("http://host.example:9000",)
    )
    try:
        yield server
    finally:
        await runner.cleanup()


async def _post(url: str, body: object, headers: dict[str, str]) -> tuple[int, dict, dict]:  # type: ignore[type-arg]
    async with aiohttp.ClientSession() as http:
        async with http.post(url, json=body, headers=headers) as resp:
            return resp.status, await resp.json(content_type=None), dict(resp.headers)


async def _mint(server: LiveServer, **body: object) -> str:
    status, answer, _ = await _post(server.url + "/token", body, {"Authorization": f"Bearer {KEY}"})
    assert status == 200, answer
    return str(answer["token"])


def test_tokens_sign_verify_expire_and_resist_tampering() -> None:
    signer = TokenSigner(KEY)
    token = signer.mint(ttl_s=60, avatar="alice")
    grant = signer.verify(token)
    assert grant.avatar == "alice" and grant.expires_at > time.time()
    body, sig = token.split(".")
    for bad in (f"{body}.{sig[:-2]}xx", f"{body[:-2]}xx.{sig}", "nonsense", ""):
        with pytest.raises(SignalingError) as err:
            signer.verify(bad)
        assert err.value.status == 401
    with pytest.raises(SignalingError) as err:
        signer.verify(signer.mint(ttl_s=1, now=time.time() - 10))
    assert err.value.code == "token_expired"
    with pytest.raises(SignalingError):
        TokenSigner("another-key").verify(token)


async def test_token_route(guarded: LiveServer) -> None:
    status, body, _ = await _post(guarded.url + "/token", {}, {"Authorization": "Bearer nope"})
    assert status == 401 and body["error"]["code"] == "unauthorized"
    status, body, _ = await _post(
        guarded.url + "/token", {"ttl_s": 99999}, {"Authorization": f"Bearer {KEY}"}
    )
    assert status == 400 and body["error"]["code"] == "bad_ttl"
    token = await _mint(guarded, ttl_s=120)
    assert TokenSigner(KEY).verify(token).expires_at - time.time() == pytest.approx(120, abs=3)
    # One avatar per server: a token scoped to one could open no call, so none is minted.
    status, body, _ = await _post(
        guarded.url + "/token", {"avatar": "alice"}, {"Authorization": f"Bearer {KEY}"}
    )
    assert status == 400 and body["error"]["code"] == "bad_avatar"


async def test_token_route_is_404_when_auth_is_off(live_server: LiveServer) -> None:
    status, body, _ = await _post(live_server.url + "/token", {}, {})
    assert status == 404 and body["error"]["code"] == "auth_off"


async def test_offer_needs_a_valid_token_and_the_session_routes_the_same(
    guarded: LiveServer,
) -> None:
    sdp = await make_offer()
    offer = {"sdp": sdp, "type": "offer"}
    signer = TokenSigner(KEY)
    for headers, code in [
        ({}, "unauthorized"),
        ({"Authorization": "Bearer garbage"}, "bad_token"),
        ({"Authorization": f"Bearer {signer.mint(ttl_s=1, now=time.time() - 5)}"}, "token_expired"),
        ({"Authorization": f"Bearer {signer.mint(ttl_s=60, avatar='alice')}"}, "wrong_scope"),
        ({"Authorization": f"Bearer {TokenSigner('other').mint(ttl_s=60)}"}, "bad_token"),
    ]:
        status, body, _ = await _post(guarded.url + "/offer", offer, headers)
        assert status == 401 and body["error"]["code"] == code, body
    assert not guarded.manager.sessions

    token = await _mint(guarded)
    client_headers = {"Authorization": f"Bearer {token}"}
    # The offer is answered, never connected: enough for the session routes.
    status, answer, _ = await _post(guarded.url + "/offer", offer, client_headers)
    assert status == 200
    session = answer["session_id"]
    say = guarded.url + f"/sessions/{session}/say"
    other = await _mint(guarded)
    status, body, _ = await _post(say, {"text": "hi"}, {"Authorization": f"Bearer {other}"})
    assert status == 401  # a valid token, but not this session's
    status, body, _ = await _post(say, {"text": "hi"}, {})
    assert status == 401
    status, body, _ = await _post(say, {"text": "hi"}, client_headers)
    assert status == 202
    async with aiohttp.ClientSession() as http:
        async with http.delete(guarded.url + f"/sessions/{session}") as resp:
            assert resp.status == 401
        async with http.delete(
            guarded.url + f"/sessions/{session}", headers=client_headers
        ) as resp:
            assert resp.status == 204


async def test_origins(guarded: LiveServer) -> None:
    sdp = await make_offer()
    offer = {"sdp": sdp, "type": "offer"}
    status, body, _ = await _post(guarded.url + "/offer", offer, {"Origin": "http://evil.example"})
    assert status == 403 and body["error"]["code"] == "origin_not_allowed"
    # An allowed origin gets CORS headers, on errors too, and its preflight is answered.
    status, body, headers = await _post(
        guarded.url + "/offer", offer, {"Origin": "http://host.example:9000"}
    )
    assert status == 401  # allowed origin, but no token yet
    assert headers["Access-Control-Allow-Origin"] == "http://host.example:9000"
    async with aiohttp.ClientSession() as http:
        async with http.options(
            guarded.url + "/offer",
            headers={"Origin": "http://host.example:9000", "Access-Control-Request-Method": "POST"},
        ) as resp:
            assert resp.status == 204
            assert "Authorization" in resp.headers["Access-Control-Allow-Headers"]
    # The server's own page is always allowed; the page route itself is not an API route.
    own = guarded.url
    status, body, _ = await _post(guarded.url + "/offer", offer, {"Origin": own})
    assert status == 401


def test_rate_limiter_buckets() -> None:
    from signaling.ratelimit import RateLimiter

    now = [0.0]
    limiter = RateLimiter(rate=1.0, burst=2, max_clients=2, clock=lambda: now[0])
    assert [limiter.take("a") for _ in range(2)] == [0.0, 0.0]
    assert limiter.take("a") == pytest.approx(1.0)
    assert limiter.take("b") == 0.0  # clients are separate
    now[0] += 1.0
    assert limiter.take("a") == 0.0  # refilled one
    limiter.take("c")  # evicts the least recently used bucket ("b")
    assert len(limiter._buckets) == 2


async def test_offer_rate_limit_is_429_and_spares_running_calls(
    engine_factory: EngineFactory, cache_dir: Path
) -> None:
    from benchmarks.client import CallClient

    server, runner = await start_server(engine_factory, cache_dir, rate_limit_per_min=6)
    caller = CallClient(server.url)
    try:
        await caller.connect()  # uses one of the burst of 2
        await caller.wait_channel_open()
        sdp = await make_offer()
        statuses = []
        for _ in range(3):
            status, body, headers = await _post(server.url + "/offer", {"sdp": sdp}, {})
            statuses.append(status)
        assert statuses[-1] == 429 and body["error"]["code"] == "rate_limited"
        assert int(headers["Retry-After"]) >= 1
        # The call already running goes on.
        await caller.say("Still talking.")
        await caller.wait_state("speaking", 10)
    finally:
        await caller.close()
        await runner.cleanup()


async def test_a_call_ends_at_its_time_limit(
    engine_factory: EngineFactory, cache_dir: Path
) -> None:

    from benchmarks.client import CallClient

    server, runner = await start_server(engine_factory, cache_dir, max_call_s=2.0)
    caller = CallClient(server.url)
    try:
        session_id = await caller.connect()
        await caller.wait_channel_open()
        error = await caller.wait_event(lambda e: e.get("type") == "error", 5)
        assert error["code"] == "call_limit"
        await wait_until(lambda: session_id not in server.manager.sessions, 10.0, "call closed")
    finally:
        await caller.close()
        await runner.cleanup()
