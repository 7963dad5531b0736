"""ICE for deployments: TURN REST credentials, GET /ice-servers, NAT 1:1 (--public-address).

Every address here is a loopback one; nothing leaves the host.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import re
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from benchmarks.client import CallClient
from benchmarks.latency import spawn_server
from rtc_server.cli import build_parser, main
from rtc_server.config import ServerConfig
from rtc_server.engine_factory import EngineFactory
from rtc_server.ice import IceServers, announce_address, turn_rest_credentials
from rtc_server.options import config_from
from signaling.access import TokenSigner
from tests.conftest import LiveServer, start_server
from tests.waiting import wait_for_video

SECRET = "north-wind-secret-7f3a9c2e5b1d4068"
TURN_URLS = ("turn:127.0.0.1:3478?transport=udp", "turn:127.0.0.1:3478?transport=tcp")
KEY = "ice-test-api-key-0123456789abcdefgh"


def _expected_credential(secret: str, username: str) -> str:
    """coturn's check, written out from the TURN REST API draft with the stdlib."""
    mac = hmac.new(secret.encode("utf-8"), username.encode("utf-8"), hashlib.sha1)
    return base64.b64encode(mac.digest()).decode("ascii")


def test_turn_credentials_worked_example() -> None:
    username, credential = turn_rest_credentials(SECRET, "alice", 3600, now=1_700_000_000)
    assert username == "1700003600:alice"
    assert credential == _expected_credential(SECRET, "1700003600:alice")
    # The same value from `openssl dgst -sha1 -hmac north-wind-secret-7f3a9c2e5b1d4068 -binary
    # | base64`.
    assert credential == "rW0RxJie/68CfpkUtsvhntNaIPg="
    assert turn_rest_credentials("another", "alice", 3600, now=1_700_000_000)[1] != credential


def test_ice_servers_for_browsers_and_for_our_own_peer() -> None:
    ice = IceServers.from_config(
        ["stun:127.0.0.1:3478", "turn:bob:pa%3Ass@127.0.0.1:3479"],
        turn_urls=TURN_URLS,
        turn_secret=SECRET,
        turn_ttl_s=600,
    )
    before = int(time.time())
    stun, static_turn, minted = ice.for_browser()
    assert stun == {"urls": ["stun:127.0.0.1:3478"]}
    assert static_turn == {
        "urls": ["turn:127.0.0.1:3479"],
        "username": "bob",
        "credential": "pa:ss",
    }
    assert minted["urls"] == list(TURN_URLS)
    expiry, _, user = minted["username"].partition(":")
    assert before + 600 <= int(expiry) <= int(time.time()) + 600 and user
    assert minted["credential"] == _expected_credential(SECRET, minted["username"])
    # Every browser gets its own user id.
    assert ice.for_browser()[2]["username"] != minted["username"]
    # The server's peer connection uses the same servers, with credentials of its own.
    servers = ice.rtc_configuration().iceServers
    assert servers is not None and len(servers) == 3
    assert servers[2].urls == list(TURN_URLS)
    assert servers[2].credential == _expected_credential(SECRET, str(servers[2].username))
    assert IceServers.from_config([]).for_browser() == []


async def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict, dict]:  # type: ignore[type-arg]
    async with aiohttp.ClientSession() as http:
        async with http.get(url, headers=headers or {}) as resp:
            return resp.status, await resp.json(content_type=None), dict(resp.headers)


async def test_ice_servers_route_without_servers(live_server: LiveServer) -> None:
    status, body, headers = await _get(live_server.url + "/ice-servers")
    assert status == 200
    assert body == {"iceServers": [], "ttl_s": 3600}
    assert headers["Cache-Control"] == "no-store"


@pytest.fixture
async def turn_server(engine_factory: EngineFactory, cache_dir: Path) -> AsyncIterator[LiveServer]:
    server, runner = await start_server(
        engine_factory,
        cache_dir,
        ice_servers=("stun:127.0.0.1:3478",),
        turn_secret=SECRET,
        turn_urls=TURN_URLS,
        turn_ttl_s=900,
        api_key=KEY,
        allowed_origins=("http://host.example:9000",),
    )
    try:
        yield server
    finally:
        await runner.cleanup()


async def test_ice_servers_route_with_turn_auth_and_origins(turn_server: LiveServer) -> None:
    url = turn_server.url + "/ice-servers"
    status, body, _ = await _get(url)
    assert status == 401 and body["error"]["code"] == "unauthorized"
    status, body, _ = await _get(url, {"Authorization": "Bearer forged"})
    assert status == 401 and body["error"]["code"] == "bad_token"

    token = TokenSigner(KEY).mint(ttl_s=60)
    auth = {"Authorization": f"Bearer {token}"}
    status, body, _ = await _get(url, {**auth, "Origin": "http://evil.example"})
    assert status == 403 and body["error"]["code"] == "origin_not_allowed"

    before = int(time.time())
    status, body, headers = await _get(url, {**auth, "Origin": "http://host.example:9000"})
    assert status == 200, body
    assert headers["Access-Control-Allow-Origin"] == "http://host.example:9000"
    assert headers["Cache-Control"] == "no-store"
    assert body["ttl_s"] == 900
    stun, turn = body["iceServers"]
    assert stun == {"urls": ["stun:127.0.0.1:3478"]}
    assert turn["urls"] == list(TURN_URLS)
    assert int(turn["username"].split(":")[0]) in range(before + 900, int(time.time()) + 901)
    assert turn["credential"] == _expected_credential(SECRET, turn["username"])

    # A browser's preflight for the GET with its Authorization header.
    async with aiohttp.ClientSession() as http:
        async with http.options(
            url,
            headers={
                "Origin": "http://host.example:9000",
                "Access-Control-Request-Method": "GET",
                "Access-Control-Request-Headers": "authorization",
            },
        ) as resp:
            assert resp.status == 204
            assert "GET" in resp.headers["Access-Control-Allow-Methods"]
            assert "Authorization" in resp.headers["Access-Control-Allow-Headers"]


SDP = "\r\n".join(
    [
        "v=0",
        "o=- 1 1 IN IP4 0.0.0.0",
        "s=-",
        "t=0 0",
        "m=audio 40000 UDP/TLS/RTP/SAVPF 96",
        "c=IN IP4 127.0.0.2",
        "a=rtcp:9 IN IP4 0.0.0.0",
        "a=candidate:aa 1 udp 2130706431 127.0.0.2 40000 typ host",
        "a=candidate:bb 1 udp 2130706431 ::1 40001 typ host",
        "a=candidate:cc 1 udp 1694498815 127.0.0.3 50000 typ srflx raddr 127.0.0.2 rport 40000",
        "a=candidate:dd 1 udp 2130706431 0b1e.local 40002 typ host",
        "a=end-of-candidates",
        "m=application 40000 UDP/DTLS/SCTP webrtc-datachannel",
        "c=IN IP4 127.0.0.2",
        "a=candidate:aa 1 udp 2130706431 127.0.0.2 40000 typ host generation 0",
        "",
    ]
)


def test_announce_address_rewrites_host_candidates_and_keeps_ports() -> None:
    out = announce_address(SDP, "127.0.0.1")
    assert out.split("\r\n") == [
        "v=0",
        "o=- 1 1 IN IP4 0.0.0.0",
        "s=-",
        "t=0 0",
        "m=audio 40000 UDP/TLS/RTP/SAVPF 96",
        "c=IN IP4 127.0.0.1",
        "a=rtcp:9 IN IP4 0.0.0.0",
        "a=candidate:aa 1 udp 2130706431 127.0.0.1 40000 typ host",
        # Another family, a server-reflexive candidate, an mDNS name: not ours to change.
        "a=candidate:bb 1 udp 2130706431 ::1 40001 typ host",
        "a=candidate:cc 1 udp 1694498815 127.0.0.3 50000 typ srflx raddr 127.0.0.2 rport 40000",
        "a=candidate:dd 1 udp 2130706431 0b1e.local 40002 typ host",
        "a=end-of-candidates",
        "m=application 40000 UDP/DTLS/SCTP webrtc-datachannel",
        "c=IN IP4 127.0.0.1",
        "a=candidate:aa 1 udp 2130706431 127.0.0.1 40000 typ host generation 0",
        "",
    ]
    assert announce_address(SDP, None) == SDP
    v6 = announce_address(SDP, "::1")
    assert "127.0.0.2 40000 typ host" in v6 and "c=IN IP4 127.0.0.2" in v6


def _host_candidates(sdp: str) -> list[tuple[str, int]]:
    return [
        (address, int(port))
        for address, port in re.findall(r"a=candidate:\S+ \d+ udp \d+ (\S+) (\d+) typ host", sdp)
    ]


async def test_a_call_connects_with_a_public_address(
    engine_factory: EngineFactory, cache_dir: Path
) -> None:
    server, runner = await start_server(engine_factory, cache_dir, public_address="127.0.0.1")
    caller = CallClient(server.url, record_video=False)
    answers: list[str] = []

    async def keep(sdp: str) -> None:
        answers.append(sdp)

    try:
        await caller.connect(before_answer=keep)
        candidates = _host_candidates(answers[0])
        assert candidates and all(address == "127.0.0.1" for address, _ in candidates)
        await wait_for_video(caller, 10)
    finally:
        await caller.close()
        await runner.cleanup()


async def test_a_call_connects_when_the_servers_own_turn_allocation_fails(
    engine_factory: EngineFactory, cache_dir: Path
) -> None:
    # The server's peer asks a TURN server for a relay of its own: here a loopback port where
    # nothing answers. The allocation fails within aioice's gathering timeout; host candidates
    # carry the call.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    server, runner = await start_server(
        engine_factory,
        cache_dir,
        turn_secret=SECRET,
        turn_urls=(f"turn:127.0.0.1:{closed_port}?transport=udp",),
        private_network=True,  # no --api-key: told it is on a private network
    )
    caller = CallClient(server.url, record_video=False)
    try:
        started = time.monotonic()
        await caller.connect()
        assert time.monotonic() - started < 8.0
        await wait_for_video(caller, 10)
    finally:
        await caller.close()
        await runner.cleanup()


class LoopbackNat:
    """A port-keeping 1:1 NAT for inbound UDP, on loopback: public:port -> private:port.

    Each outside peer gets its own inside socket, so the private side's replies find their way
    back out through public:port, as through a real NAT.
    """

    def __init__(self, public: str, private: str, port: int) -> None:
        self._loop = asyncio.get_running_loop()
        self._public = public
        self._private = (private, port)
        self._outside = self._socket((public, port))
        self._inside: dict[tuple[str, int], socket.socket] = {}
        self.inbound = 0
        self.outbound = 0
        self._loop.add_reader(self._outside, self._from_outside)

    @staticmethod
    def _socket(address: tuple[str, int]) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(address)
        sock.setblocking(False)
        return sock

    def _from_outside(self) -> None:
        with contextlib.suppress(BlockingIOError):
            data, peer = self._outside.recvfrom(65536)
            inside = self._inside.get(peer)
            if inside is None:
                inside = self._inside[peer] = self._socket((self._public, 0))
                self._loop.add_reader(inside, self._from_inside, inside, peer)
            inside.sendto(data, self._private)
            self.inbound += 1

    def _from_inside(self, inside: socket.socket, peer: tuple[str, int]) -> None:
        with contextlib.suppress(BlockingIOError):
            data, _ = inside.recvfrom(65536)
            self._outside.sendto(data, peer)
            self.outbound += 1

    def close(self) -> None:
        for sock in [self._outside, *self._inside.values()]:
            self._loop.remove_reader(sock)
            sock.close()


async def test_nat_one_to_one_the_caller_reaches_the_announced_address(tmp_path: Path) -> None:
    # The server gathers on 127.0.0.2 only and announces 127.0.0.1; a NAT maps
    # 127.0.0.1:port -> 127.0.0.2:port. The caller is told only of 127.0.0.1.
    log = (tmp_path / "server.log").open("wb")
    url, process = await spawn_server(
        "--public-address", "127.0.0.1", ice_address="127.0.0.2", log=log
    )
    caller = CallClient(url, record_video=False)
    nats: list[LoopbackNat] = []

    async def open_nat(sdp: str) -> None:
        assert "127.0.0.2" not in sdp
        candidates = _host_candidates(sdp)
        assert candidates and {address for address, _ in candidates} == {"127.0.0.1"}
        assert "c=IN IP4 127.0.0.1" in sdp
        (port,) = {port for _, port in candidates}
        nats.append(LoopbackNat("127.0.0.1", "127.0.0.2", port))

    try:
        await caller.connect(before_answer=open_nat)
        await caller.wait_channel_open(15)
        await wait_for_video(caller, 10)
        (nat,) = nats
        # ICE checks to the announced address went in, and the server's answers came out.
        assert nat.inbound > 0 and nat.outbound > 0, (nat.inbound, nat.outbound)
    finally:
        await caller.close()
        for nat in nats:
            nat.close()
        process.terminate()
        await process.wait()
        log.close()


def test_turn_and_public_address_flags() -> None:
    env = {
        "AVATAR_RTC_TURN_SECRET": SECRET,
        "AVATAR_RTC_TURN_URL": ",".join(TURN_URLS),
        "AVATAR_RTC_PUBLIC_ADDRESS": "127.0.0.1",
        "AVATAR_RTC_API_KEY": KEY,
    }
    args = build_parser(env).parse_args(["serve", "--turn-ttl-s", "120"])
    media = config_from(args, env).media
    assert (media.turn_secret, media.turn_ttl_s, media.public_address) == (SECRET, 120, "127.0.0.1")
    assert build_parser({}).parse_args(["serve"]).turn_ttl_s == 3600


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"turn_secret": SECRET}, "and --turn-url go together"),
        ({"turn_urls": TURN_URLS}, "and --turn-url go together"),
        ({"turn_secret": SECRET, "turn_urls": ("stun:127.0.0.1:3478",)}, "--turn-url"),
        ({"turn_secret": SECRET, "turn_urls": ("turn:u:p@127.0.0.1",)}, "--turn-url"),
        ({"turn_secret": SECRET, "turn_urls": TURN_URLS, "turn_ttl_s": 5}, "turn_ttl_s"),
        ({"public_address": "my.host.example"}, "--public-address"),
        ({"public_address": "0.0.0.0"}, "--public-address"),
        # Relay credentials for anyone who asks /ice-servers: an open relay.
        ({"turn_secret": SECRET, "turn_urls": TURN_URLS}, "TURN credentials without an API key"),
        ({"ice_servers": ("turn:bob:pw@127.0.0.1:3478",)}, "TURN credentials without an API"),
    ],
)
def test_bad_ice_settings_are_refused(config: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServerConfig.of(**config)


def test_turn_credentials_go_out_only_to_token_holders_or_on_a_private_network(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    turn = {"turn_secret": SECRET, "turn_urls": TURN_URLS}
    assert ServerConfig.of(**turn, api_key=KEY).media.turn_secret == SECRET
    assert ServerConfig.of(**turn, private_network=True).access.private_network
    argv = ["serve", "--turn-url", TURN_URLS[0], "--cache-dir", str(tmp_path)]
    assert main(argv, {"AVATAR_RTC_TURN_SECRET": SECRET}) == 2
    error = capsys.readouterr().err
    assert "--api-key-file" in error and "--private-network" in error


def test_bad_ice_server_stops_start_up(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["serve", "--ice-server", "http://127.0.0.1", "--cache-dir", str(tmp_path)]
    assert main(argv, {}) == 2
    assert "ICE server" in capsys.readouterr().err
