"""Strict input on a public endpoint: offers limited in shape and in the peers they list, JSON
bodies only, no control characters in text, and the security headers on every response.

Offers are real aiortc offers, edited the way an attacker would; the live tests use a real
aiortc caller on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from benchmarks.client import CallClient, make_offer
from rtc_server.engine_factory import EngineFactory
from signaling.errors import SignalingError
from signaling.messages import parse_offer
from signaling.offer_rules import MAX_CANDIDATES_PER_SECTION, PeerRule, filter_candidates
from tests.conftest import LiveServer, start_server

LOCAL = PeerRule(local=True)


def sections(sdp: str) -> tuple[list[str], list[list[str]]]:
    lines = sdp.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("m=")]
    bounds = [*starts, len(lines)]
    return lines[: starts[0]], [lines[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def joined(head: list[str], media: list[list[str]]) -> str:
    return "\r\n".join([*head, *(line for section in media for line in section)]) + "\r\n"


def refusal(sdp: str, peers: PeerRule = LOCAL) -> str:
    with pytest.raises(SignalingError) as caught:
        parse_offer({"sdp": sdp, "type": "offer"}, peers=peers)
    assert caught.value.status == 400
    return caught.value.code


@pytest.fixture(scope="module")
def offer() -> str:
    return asyncio.run(make_offer())


# -- offers: their shape ----------------------------------------------------------------------


def test_a_real_offer_passes(offer: str) -> None:
    parsed = parse_offer({"sdp": offer, "type": "offer"}, peers=LOCAL)
    assert parsed.sdp == offer  # its candidates are all on 127.0.0.1: a local server keeps them


def test_more_sections_than_a_call_has_are_400(offer: str) -> None:
    head, media = sections(offer)
    kinds = [s[0].split()[0] for s in media]
    audio = media[kinds.index("m=audio")]
    data = media[kinds.index("m=application")]
    extra_audio = [re.sub(r"^a=mid:.*$", "a=mid:9", line) for line in audio]
    assert refusal(joined(head, [*media, *[extra_audio] * 45])) == "bad_sections"
    assert refusal(joined(head, [*media, data])) == "bad_sections"
    text = ["m=text 9 UDP/TLS/RTP/SAVPF 0", *audio[1:]]
    assert refusal(joined(head, [*media, text])) == "bad_sections"
    no_data = [s for s in media if not s[0].startswith("m=application")]
    assert parse_offer({"sdp": joined(head, no_data), "type": "offer"}, peers=LOCAL)


def test_an_offer_without_dtls_or_ice_credentials_is_400(offer: str) -> None:
    no_fingerprint = "".join(
        line for line in offer.splitlines(keepends=True) if not line.startswith("a=fingerprint:")
    )
    assert refusal(no_fingerprint) == "no_fingerprint"
    for attribute in ("a=ice-ufrag:", "a=ice-pwd:"):
        stripped = "".join(
            line for line in offer.splitlines(keepends=True) if not line.startswith(attribute)
        )
        assert refusal(stripped) == "no_ice_credentials"


# -- offers: the peers they list ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "public", "local"),
    [
        ("8.8.8.8", True, True),
        ("2001:4860:4860::8888", True, True),
        ("10.1.2.3", False, True),
        ("172.17.0.1", False, True),
        ("192.168.1.20", False, True),
        ("127.0.0.1", False, True),
        ("::1", False, True),
        ("169.254.169.254", False, True),
        ("100.64.0.1", False, True),
        ("fd00::1", False, True),
        ("fe80::1", False, True),
        ("::ffff:10.0.0.1", False, True),
        ("0.0.0.0", False, False),
        ("224.0.0.251", False, False),
        ("ff02::1", False, False),
        ("0a1b2c3d-1111-2222-3333-444455556666.local", False, True),
        ("metadata.google.internal", False, False),
        ("example.com", False, False),
    ],
)
def test_which_candidate_addresses_a_server_checks(address: str, public: bool, local: bool) -> None:
    assert PeerRule().allows(address) is public
    assert PeerRule(local=True).allows(address) is local


def test_operator_networks_are_allowed_as_given() -> None:
    rule = PeerRule((ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("fd00::/8")))
    assert rule.allows("10.9.8.7") and rule.allows("fd00::5")
    assert not rule.allows("192.168.0.1") and not rule.allows("169.254.169.254")
    # A browser's mDNS name resolves on the server's own link only: callers of the LAN the
    # operator named.
    assert rule.allows("0a1b2c3d-1111-2222-3333-444455556666.local")
    assert not rule.allows("metadata.google.internal")


def test_candidates_are_filtered_and_capped_and_nothing_else_changes(offer: str) -> None:
    head, media = sections(offer)
    first = media[0]
    listed = [f"a=candidate:{n} 1 udp 100 93.184.216.{n} 9 typ host" for n in range(1, 41)]
    refused = [
        "a=candidate:90 1 udp 100 10.0.0.1 9 typ host",
        "a=candidate:91 1 udp 100 169.254.169.254 80 typ host",
        "a=candidate:92 1 udp 100 internal.example 9 typ host",
        "a=candidate:93 1 tcp 100 93.184.216.99 9 typ host tcptype passive",
        "a=candidate:94 1 udp 100 127.0.0.1 22 typ srflx raddr 0.0.0.0 rport 0",
    ]
    edited = [first[0], *refused, *listed, *first[1:]]
    sdp = joined(head, [edited, *media[1:]])
    kept, count = filter_candidates(sdp, PeerRule())
    assert count == MAX_CANDIDATES_PER_SECTION
    kept_candidates = [line for line in kept.splitlines() if line.startswith("a=candidate:")]
    first_section = sections(kept)[1][0]
    assert [c for c in first_section if c.startswith("a=candidate:")] == (
        listed[:MAX_CANDIDATES_PER_SECTION]
    )
    assert len(kept_candidates) == MAX_CANDIDATES_PER_SECTION  # the others listed 127.0.0.1
    others = [line for line in sdp.splitlines() if not line.startswith("a=candidate:")]
    assert [line for line in kept.splitlines() if not line.startswith("a=candidate:")] == others


# -- live: a public server, bodies, text, headers -------------------------------------------------


@pytest.fixture
async def public_server(
    request: pytest.FixtureRequest, engine_factory: EngineFactory, cache_dir: Path
) -> AsyncIterator[LiveServer]:
    """A server configured as a public one (listening on every address) but bound, as every
    test server, to 127.0.0.1; ``@pytest.mark.config(...)`` adds settings."""
    marker = request.node.get_closest_marker("config")
    live, runner = await start_server(
        engine_factory, cache_dir, host="0.0.0.0", **(marker.kwargs if marker else {})
    )
    try:
        yield live
    finally:
        await runner.cleanup()


async def test_a_public_server_refuses_an_offer_of_loopback_candidates_only(
    public_server: LiveServer,
) -> None:
    offer = json.dumps({"sdp": await make_offer(), "type": "offer"}).encode()
    got = await post(public_server, "/offer", offer, "application/json")
    assert got == (400, "no_candidates")
    assert not public_server.manager.sessions


@pytest.mark.config(peer_networks=("127.0.0.0/8",))
async def test_a_public_server_checks_the_networks_it_is_told_to(
    public_server: LiveServer,
) -> None:
    caller = CallClient(public_server.url, record_video=False)
    try:
        await caller.connect()
        await caller.wait_channel_open()
        await caller.wait_state("listening", 10)
        (session,) = public_server.manager.sessions.values()
        remote = session.pc.remoteDescription.sdp.splitlines()
        candidates = [line for line in remote if line.startswith("a=candidate:")]
        assert candidates and all(" 127.0.0.1 " in line for line in candidates), candidates
    finally:
        await caller.close()


async def post(
    server: LiveServer, path: str, body: bytes, content_type: str | None
) -> tuple[int, str | None]:
    headers = {"Content-Type": content_type} if content_type is not None else {}
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url + path, data=body, headers=headers) as resp:
            reply = await resp.json()
            if resp.status == 200:  # an answer: its call is not wanted
                await server.manager.close_session(reply["session_id"])
                return 200, None
            return resp.status, reply["error"]["code"]


async def test_bodies_that_are_not_json_are_415(live_server: LiveServer) -> None:
    offer = json.dumps({"sdp": await make_offer(), "type": "offer"}).encode()
    say = json.dumps({"text": "hello"}).encode()
    for path, body, as_json in (
        ("/offer", offer, (200, None)),
        ("/sessions/nope/say", say, (404, "unknown_session")),
    ):
        for content_type in ("text/plain", "application/x-www-form-urlencoded", None, "text/json"):
            got = await post(live_server, path, body, content_type)
            assert got == (415, "unsupported_media_type"), (path, content_type)
        assert not live_server.manager.sessions
        # The same body as JSON reaches the route.
        assert await post(live_server, path, body, "Application/JSON; charset=utf-8") == as_json


@pytest.mark.parametrize("text", ["bell\x07", "esc \x1b[31m", "del\x7f", "c1 \x85", "nul\x00"])
async def test_text_with_control_characters_is_400(live_server: LiveServer, text: str) -> None:
    body = json.dumps({"text": text}).encode()
    got = await post(live_server, "/sessions/nope/say", body, "application/json")
    assert got == (400, "bad_text")
    # Tabs and line breaks are text: the route goes on (to find no such session).
    body = json.dumps({"text": "two\tlines\r\nof text"}).encode()
    got = await post(live_server, "/sessions/nope/say", body, "application/json")
    assert got == (404, "unknown_session")


@pytest.mark.parametrize(
    "path",
    ["/", "/static/index.html", "/embed", "/static/client.js", "/healthz", "/nope", "/offer"],
)
async def test_every_response_carries_the_security_headers(
    live_server: LiveServer, path: str
) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(live_server.url + path) as resp:
            headers = resp.headers
    csp = {
        part.split()[0]: part.split()[1:]
        for part in headers["Content-Security-Policy"].split(";")
        if part.strip()
    }
    assert csp["frame-ancestors"] == ["'self'"], headers
    assert csp["script-src"] == ["'self'"]
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert headers["Referrer-Policy"] == "no-referrer"
