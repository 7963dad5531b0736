"""Bad input on the HTTP API: a 4xx with the JSON error shape, and the server stays healthy."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from benchmarks.client import make_offer
from tests.conftest import LiveServer
from tests.waiting import holds_within


async def _post(server: LiveServer, path: str, data: bytes | str, **kw: object) -> tuple[int, dict]:
    """``data`` as the body, sent as JSON whatever it holds (the route reads it as JSON)."""
    kw.setdefault("headers", {"Content-Type": "application/json"})
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url + path, data=data, **kw) as resp:  # type: ignore[arg-type]
            body = await resp.json(content_type=None)
            return resp.status, body


def _assert_error(status: int, body: dict, expected_status: int, code: str | None = None) -> None:
    assert status == expected_status, body
    assert set(body) == {"error"}
    assert set(body["error"]) == {"code", "message"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code


async def _healthy(server: LiveServer) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(server.url + "/healthz") as resp:
            assert resp.status == 200
        async with http.get(server.url + "/readyz") as resp:
            assert resp.status == 200


@pytest.mark.parametrize(
    ("payload", "status", "code"),
    [
        (b"not json at all", 400, "bad_json"),
        (b"\xff\xfe\x00garbage", 400, "bad_json"),
        (b"[1, 2, 3]", 400, "bad_json"),
        (json.dumps({"type": "offer"}), 400, "bad_offer"),
        (json.dumps({"sdp": 42, "type": "offer"}), 400, "bad_offer"),
        (json.dumps({"sdp": "v=0", "type": "answer"}), 400, "bad_offer"),
        (json.dumps({"sdp": "v=0\r\n", "type": "offer", "avatar": 7}), 400, "bad_offer"),
        (json.dumps({"sdp": "this is not sdp\r\nm=garbage\r\n", "type": "offer"}), 400, None),
        (
            json.dumps(
                {"sdp": "v=0\r\no=- 1 1 IN IP4 0.0.0.0\r\ns=-\r\nt=0 0\r\n", "type": "offer"}
            ),
            400,
            "no_audio",
        ),
    ],
)
async def test_offer_rejects_bad_input(
    live_server: LiveServer, payload: bytes | str, status: int, code: str | None
) -> None:
    got, body = await _post(live_server, "/offer", payload)
    _assert_error(got, body, status, code)
    await _healthy(live_server)


async def test_offer_without_audio_mline_is_rejected(live_server: LiveServer) -> None:
    sdp = await make_offer(audio=False)
    got, body = await _post(live_server, "/offer", json.dumps({"sdp": sdp, "type": "offer"}))
    _assert_error(got, body, 400, "no_audio")
    assert not live_server.manager.sessions


async def test_offer_over_64_kib_is_413(live_server: LiveServer) -> None:
    payload = json.dumps({"sdp": "v=0\r\n" + "a=x\r\n" * 20000, "type": "offer"})
    assert len(payload) > 64 * 1024
    got, body = await _post(live_server, "/offer", payload)
    _assert_error(got, body, 413, "body_too_large")
    await _healthy(live_server)


@pytest.mark.parametrize(
    ("payload", "status", "code"),
    [
        (b"{", 400, "bad_json"),
        (json.dumps({"text": 5}), 400, "bad_text"),
        (json.dumps({"text": "   "}), 400, "bad_text"),
        (json.dumps({"text": "hi", "interrupt": "yes"}), 400, "bad_interrupt"),
        (json.dumps({"text": "x" * 5000}), 413, "text_too_long"),
        (json.dumps({"text": "hello"}), 404, "unknown_session"),
    ],
)
async def test_say_rejects_bad_input(
    live_server: LiveServer, payload: bytes | str, status: int, code: str
) -> None:
    got, body = await _post(live_server, "/sessions/nope/say", payload)
    _assert_error(got, body, status, code)
    await _healthy(live_server)


async def test_say_body_over_64_kib_is_413(live_server: LiveServer) -> None:
    got, body = await _post(live_server, "/sessions/nope/say", json.dumps({"text": "a" * 70000}))
    _assert_error(got, body, 413, "body_too_large")


async def test_delete_unknown_session_is_404(live_server: LiveServer) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.delete(live_server.url + "/sessions/nope") as resp:
            _assert_error(resp.status, await resp.json(), 404, "unknown_session")


async def test_unknown_route_and_method_use_the_error_shape(live_server: LiveServer) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(live_server.url + "/no/such/route") as resp:
            _assert_error(resp.status, await resp.json(), 404, "not_found")
        async with http.get(live_server.url + "/offer") as resp:
            _assert_error(resp.status, await resp.json(), 405, "method_not_allowed")


async def test_metrics_are_prometheus_text(live_server: LiveServer) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(live_server.url + "/metrics") as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/plain")
            text = await resp.text()
    for name in (
        "avatar_rtc_sessions",
        "avatar_rtc_video_frames_sent_total",
        "avatar_rtc_video_frames_late_total",
        "avatar_rtc_video_encode_cpu_seconds_bucket",
        "avatar_rtc_calls_answered_total",
    ):
        assert name in text
    # Prometheus style: a counter's name does not end in a suffix the client library adds.
    assert "_created_created" not in text and "_total_total" not in text


async def test_at_capacity_is_503_with_retry_after(engine_factory, cache_dir) -> None:  # type: ignore[no-untyped-def]
    from benchmarks.client import CallClient
    from tests.conftest import start_server

    server, runner = await start_server(engine_factory, cache_dir, max_sessions=1)
    first = CallClient(server.url)
    try:
        await first.connect()
        sdp = await make_offer()
        await holds_within(lambda: first.received.video, 5.0)
        before = len(first.received.video)
        async with aiohttp.ClientSession() as http:
            async with http.post(server.url + "/offer", json={"sdp": sdp, "type": "offer"}) as r:
                _assert_error(r.status, await r.json(), 503, "at_capacity")
                assert int(r.headers["Retry-After"]) > 0
        assert len(server.manager.sessions) == 1
        # The call already running is untouched: its video keeps coming (an idle avatar's
        # still picture goes out every 0.25 s).
        await asyncio.sleep(1.0)
        assert len(first.received.video) >= before + 3
    finally:
        await first.close()
        await runner.cleanup()
