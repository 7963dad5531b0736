"""Calls through a real TURN relay: Debian's coturn on 127.0.0.1, the caller relay-only.

The server mints the TURN credentials (coturn's shared-secret scheme) and hands them out on
``/ice-servers``; an aiortc caller takes them from there and gathers relay candidates alone
(``iceTransportPolicy: "relay"``), reaching coturn over UDP, over TCP or over TLS (``turns:``,
coturn holding a certificate made for the test, which the caller trusts), so every packet of its
call goes through the relay. Each relayed call must do what a direct call in the same run
does: the reply spoken in full, video at a steady pace, the mouth in sync with the audio.
Chromium makes the same calls from the call page with ``?relay``, over UDP, TCP and TLS.

coturn runs with a config of this test's own: the shipped ``deploy/turnserver.conf`` denies
loopback peers on purpose (``tests/test_turn_relay.py``), and here the avatar server is one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from benchmarks.analysis import (
    first_loud_after,
    frame_intervals_ms,
    lip_sync,
    pcm_by_rtp_time,
    voiced_span,
)
from benchmarks.client import CallClient, fetch_ice_servers
from rtc_server.engine_factory import EngineFactory
from tests.certs import self_signed, spki_sha256
from tests.conftest import LiveServer, start_server
from tests.coturn import Allocation, Coturn, running_coturn
from tests.waiting import wait_for_video

FRAME_TICKS = 90_000 // 25
SECRET = "relayed-call-secret-0123456789abcdefgh"
SENTENCES = (
    "The quick brown fox jumps over the lazy dog. "
    "Welcome to the avatar server. It is a sunny morning today."
)

# Loopback peers allowed (the avatar server is on 127.0.0.1), and nothing else to it: no
# deny list, no DTLS listener, no admin CLI. tests/coturn.py adds the ports (TLS on one of its
# own), the certificate, the log and the 127.0.0.1-only listening and relay addresses on the
# command line as well.
CONFIG = """\
listening-ip=127.0.0.1
relay-ip=127.0.0.1
use-auth-secret
static-auth-secret={secret}
realm=avatar-rtc-test
fingerprint
allow-loopback-peers
no-multicast-peers
no-cli
no-dtls
log-file={log}
simple-log
"""


@pytest.fixture
def coturn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Coturn]:
    config = tmp_path / "turnserver.conf"
    config.write_text(CONFIG.format(secret=SECRET, log=tmp_path / "turnserver.log"))
    cert, key = self_signed(tmp_path)
    # The callers of this process trust that certificate alone (Python's default context
    # reads SSL_CERT_FILE when it is made: aioice makes one per TLS connection to the relay).
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    with running_coturn(config, tmp_path, SECRET, tls=(cert, key)) as server:
        yield server


@pytest.fixture
async def relay_server(
    engine_factory: EngineFactory, cache_dir: Path, coturn: Coturn
) -> AsyncIterator[LiveServer]:
    """The server, with coturn's URLs (UDP first, then TCP, then TLS) and secret; only the
    test's own callers reach it (``private_network``: credentials without an API key)."""
    urls = (
        *(f"turn:127.0.0.1:{coturn.port}?transport={t}" for t in ("udp", "tcp")),
        f"turns:127.0.0.1:{coturn.tls_port}?transport=tcp",
    )
    server, runner = await start_server(
        engine_factory, cache_dir, turn_secret=SECRET, turn_urls=urls, private_network=True
    )
    try:
        yield server
    finally:
        await runner.cleanup()


@dataclass
class CallFigures:
    name: str
    local: str
    """Type of the caller's candidate in the pair ICE selected (host, relay)."""
    remote: str
    reply_audio_ms: float
    """From the say's answer to the first loud audio packet."""
    sounding_s: float
    """From the reply's first sound to its last, as received (RTP time)."""
    offset_ms: float
    correlation: float
    interval_p50_ms: float
    interval_p99_ms: float
    steady_frames: int
    """Video frames that arrived in 5 s of the reply, from 0.5 s into it."""
    delivered: float
    """Video frames received, of those the reply's RTP timestamps span (one per 40 ms)."""
    lost: int
    """RTP packets lost on the way, audio and video (the receiver's count)."""

    def line(self) -> str:
        return (
            f"{self.name:<11} pair {self.local}->{self.remote:<5} reply audio "
            f"{self.reply_audio_ms:5.0f} ms  speech {self.sounding_s:.2f} s  lip-sync "
            f"{self.offset_ms:+4.0f} ms r={self.correlation:.2f}  frame interval p50 "
            f"{self.interval_p50_ms:.0f} ms p99 {self.interval_p99_ms:.0f} ms  "
            f"{self.steady_frames} frames/5 s, {self.delivered:.0%} delivered, "
            f"{self.lost} packets lost"
        )


async def _call(server: LiveServer, name: str, client: CallClient) -> CallFigures:
    """A say over ``client``'s call, measured."""
    try:
        await client.connect()
        await client.wait_channel_open(timeout=20)
        await wait_for_video(client, 5, timeout=20)
        await client.wait_state("listening", timeout=10)
        pair = client.selected_pair()
        assert pair is not None, f"{name}: no candidate pair nominated"
        video_start, audio_start = len(client.received.video), len(client.received.audio)
        await client.say(SENTENCES)
        said_at = time.monotonic()
        await client.wait_state("speaking", timeout=20)
        await client.wait_state("listening", timeout=40)
        await asyncio.sleep(0.3)
        video = client.received.video[video_start:]
        audio = client.received.audio[audio_start:]
        lost = sum(
            s.packetsLost for s in (await client.pc.getStats()).values() if s.type == "inbound-rtp"
        )
    finally:
        await client.close()
    box = server.manager.engine_factory.mouth_box  # type: ignore[union-attr]
    assert box is not None
    sync = lip_sync(video, audio, box, video_sent_late_s=server.video_sent_late_s)
    first_sound = first_loud_after(audio, said_at)
    assert first_sound is not None, f"{name}: no reply audio arrived"
    pcm = pcm_by_rtp_time(audio)
    start, end = voiced_span(pcm, 48_000)
    arrivals = np.asarray([a for a, _, _ in video])
    intervals = frame_intervals_ms(arrivals)
    steady = (arrivals >= arrivals[0] + 0.5) & (arrivals < arrivals[0] + 5.5)
    return CallFigures(
        name=name,
        local=pair[0].type,
        remote=pair[1].type,
        reply_audio_ms=(first_sound - said_at) * 1000,
        sounding_s=(end - start) / 48_000,
        offset_ms=sync.offset_ms,
        correlation=sync.correlation,
        interval_p50_ms=float(np.percentile(intervals, 50)),
        interval_p99_ms=float(np.percentile(intervals, 99)),
        steady_frames=int(steady.sum()),
        delivered=len(video) / ((video[-1][1] - video[0][1]) / FRAME_TICKS + 1),
        lost=lost,
    )


@pytest.mark.timeout(400)
async def test_calls_through_a_real_turn_relay_speak_and_lip_sync_as_a_direct_call(
    relay_server: LiveServer, coturn: Coturn
) -> None:
    servers = await fetch_ice_servers(relay_server.url)
    assert len(servers) == 1 and servers[0].username and servers[0].credential, servers
    urls = servers[0].urls
    assert isinstance(urls, list) and len(urls) == 3, urls

    figures = [await _call(relay_server, "direct", CallClient(relay_server.url))]
    for transport in ("udp", "tcp", "tls"):
        # aiortc takes the first TURN URL of a server: one URL, one transport to coturn.
        (url,) = [u for u in urls if _reaches_coturn_over(u, transport)]
        # Credentials of their own for each call, as a page gets them.
        (server,) = await fetch_ice_servers(relay_server.url)
        server.urls = url
        relayed = CallClient(relay_server.url, ice_servers=[server], relay_only=True)
        figures.append(await _call(relay_server, f"relayed/{transport}", relayed))
        # coturn carried the call on one of the caller's allocations (aiortc allocates one per
        # media section of its offer and releases the others once BUNDLE is agreed), over the
        # transport asked for, and counted its media there.
        allocations = await _ended_allocations(coturn, str(server.username))
        carried = max(allocations, key=lambda a: a.sent)
        log = coturn.log_text()[-3000:]
        # To the caller: the reply's video and audio; from it: its microphone (Opus silence).
        assert carried.sent > 200_000 and carried.received > 5_000, (carried, log)
        assert {a.transport for a in allocations} == {transport.upper()}, (allocations, log)

    print()
    for f in figures:
        print(f.line())
    direct = figures[0]
    assert (direct.local, direct.remote) == ("host", "host"), direct
    assert direct.sounding_s > 5, direct  # the whole reply, as a yardstick
    for f in figures:
        assert f.correlation >= 0.5 and abs(f.offset_ms) <= 40, f
        # The frames arrived at a steady 25 fps, with room for a busy machine (whose server
        # skips a frame now and then, as on a direct call): no stalls, few gaps.
        assert f.delivered >= 0.85, f
        assert 20 <= f.interval_p50_ms <= 60 and f.interval_p99_ms <= 500, f
        assert f.reply_audio_ms < 10_000, f
    for f in figures[1:]:
        assert f.local == "relay", f
        # The deterministic voice says the same thing as on the direct call, none of it lost
        # or stretched on the way through the relay.
        assert abs(f.sounding_s - direct.sounding_s) <= 0.04, (f, direct)


def _reaches_coturn_over(url: str, transport: str) -> bool:
    """Whether a TURN URL reaches the relay over ``transport`` (udp, tcp, or tls)."""
    if transport == "tls":
        return url.startswith("turns:")
    return url.startswith("turn:") and url.endswith(f"?transport={transport}")


async def _ended_allocations(
    coturn: Coturn, username: str, timeout: float = 30
) -> list[Allocation]:
    """``username``'s allocations, once coturn has deleted every one (the caller released
    them as it hung up); their usage is logged then."""
    deadline = time.monotonic() + timeout
    while True:
        allocations = coturn.allocations(username)
        if allocations and all(a.closed for a in allocations):
            return allocations
        if time.monotonic() > deadline:
            raise AssertionError(f"coturn still holds {allocations}:\n{coturn.log_text()[-3000:]}")
        await asyncio.sleep(0.5)


@pytest.mark.browser
@pytest.mark.timeout(200)
@pytest.mark.parametrize("transport", ["udp", "tcp", "tls"])
async def test_chromium_calls_through_the_relay_only(
    relay_server: LiveServer, coturn: Coturn, tmp_path: Path, transport: str
) -> None:
    """The call page with ``?relay``: Chromium gathers relay candidates only, the pair it
    selects is a relay over the transport asked for, coturn carries the call, and the reply
    plays. The page's TURN URLs are cut to one transport on their way (a network that lets
    only that one through). Over TLS Chromium checks the relay's certificate (a call with it
    unknown does not connect): it is given the test certificate's key to trust."""
    from playwright.async_api import Route

    from benchmarks.browser import chromium_missing, chromium_page, say_from_page, start_call

    if chromium_missing():
        pytest.skip(chromium_missing() or "")

    async def one_transport(route: Route) -> None:
        response = await route.fetch()
        body = await response.json()
        for server in body["iceServers"]:
            server["urls"] = [u for u in server["urls"] if _reaches_coturn_over(u, transport)]
        await route.fulfill(response=response, json=body)

    # Chromium trusts the relay's certificate as it would a CA's: the test's key, pinned.
    assert coturn.cert is not None
    trusted = [f"--ignore-certificate-errors-spki-list={spki_sha256(coturn.cert)}"]
    async with chromium_page(tmp_path / "profile", trusted) as page:
        await page.route("**/ice-servers", one_transport)
        session_id = await start_call(page, f"{relay_server.url}/?relay")
        assert session_id in relay_server.manager.sessions
        username = await page.evaluate("() => window.avatarCall.iceServers[0].username")
        pair = await page.evaluate(
            """async () => {
                const report = await window.avatarCall.pc.getStats();
                let selected = null;
                report.forEach((s) => {
                    if (s.type === "transport" && s.selectedCandidatePairId) {
                        selected = report.get(s.selectedCandidatePairId);
                    }
                });
                const local = selected && report.get(selected.localCandidateId);
                return local ? { type: local.candidateType, protocol: local.relayProtocol } : null;
            }"""
        )
        assert pair is not None and pair["type"] == "relay", pair
        assert pair["protocol"] == transport, pair
        await say_from_page(page, SENTENCES[:60])
        await page.wait_for_function(
            "() => window.avatarCall.states.includes('speaking')", timeout=20_000
        )
        await page.wait_for_function(
            "() => window.avatarCall.states.at(-1) === 'listening'", timeout=30_000
        )
        played = await page.evaluate(
            """async () => {
                const out = {};
                (await window.avatarCall.pc.getStats()).forEach((s) => {
                    if (s.type === "inbound-rtp") out[s.kind] = s.kind === "video"
                        ? s.framesDecoded : s.totalSamplesReceived;
                });
                return out;
            }"""
        )
        assert played["video"] > 25 and played["audio"] > 48_000, played
        await page.get_by_role("button", name="Stop").click()
    allocations = await _ended_allocations(coturn, str(username))
    carried = max(allocations, key=lambda a: a.sent)
    print(f"Chromium relayed over {pair['protocol']}: {carried}")
    assert carried.sent > 200_000 and carried.received > 5_000, carried
    assert {a.transport for a in allocations} == {transport.upper()}, allocations
