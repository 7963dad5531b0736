"""The shipped coturn config is no open relay: it denies every peer that is not on a public
address and relays only UDP, as read from the file and as a real coturn (Debian's
``turnserver``, on 127.0.0.1) enforces it.

The live test asks coturn for permissions only (TURN CreatePermission): no packet goes to any
peer address, allowed or denied.
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from aioice import stun
from aioice.turn import TCP_TRANSPORT

from rtc_server.ice import turn_rest_credentials
from tests.coturn import TurnClient, running_coturn

CONF = Path(__file__).resolve().parents[1] / "deploy" / "turnserver.conf"
SECRET = "relay-test-secret-0123456789abcdef"

PRIVATE = [
    "0.1.2.3",
    "10.0.0.1",
    "10.255.255.254",
    "100.64.0.1",
    "127.0.0.1",
    "169.254.169.254",  # the cloud metadata service
    "172.16.0.1",
    "172.17.0.1",  # Docker's bridge
    "172.31.255.254",
    "192.0.0.8",
    "192.0.2.1",
    "192.168.1.1",
    "198.18.0.1",
    "198.51.100.1",
    "203.0.113.1",
    "224.0.0.251",
    "240.0.0.1",
    "255.255.255.255",
    "::1",
    "::",
    "::ffff:10.0.0.1",
    "::ffff:127.0.0.1",
    "64:ff9b::a00:1",  # NAT64 of 10.0.0.1
    "2002:a00:1::1",  # 6to4 of 10.0.0.1
    "2001:db8::1",
    "fc00::1",
    "fd12:3456::1",
    "fe80::1",
    "ff02::1",
]
PUBLIC = ["8.8.8.8", "1.1.1.1", "93.184.216.34", "2606:4700:4700::1111", "2a00:1450:4001::1"]


def conf_lines() -> list[tuple[str, str]]:
    lines = []
    for raw in CONF.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            lines.append((key.strip(), value.strip()))
    return lines


def denied_ranges() -> list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, ...]]:
    ranges = []
    for key, value in conf_lines():
        if key == "denied-peer-ip":
            low, _, high = value.partition("-")
            ranges.append((ipaddress.ip_address(low), ipaddress.ip_address(high or low)))
    return ranges


def denied(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return any(low.version == ip.version and low <= ip <= high for low, high in denied_ranges())


@pytest.mark.parametrize("address", PRIVATE)
def test_the_config_denies_every_peer_that_is_not_public(address: str) -> None:
    assert denied(address), address


@pytest.mark.parametrize("address", PUBLIC)
def test_the_config_allows_public_peers(address: str) -> None:
    assert not denied(address), address


def test_the_config_relays_udp_only_with_quotas() -> None:
    keys = dict(conf_lines())
    assert "no-tcp-relay" in keys and "no-multicast-peers" in keys
    assert "allow-loopback-peers" not in keys and "allowed-peer-ip" not in keys
    assert 1 <= int(keys["user-quota"]) <= 10
    assert int(keys["total-quota"]) >= int(keys["user-quota"])
    assert int(keys["max-bps"]) > 0
    assert "use-auth-secret" in keys  # credentials from avatar-rtc only, time-limited


# -- a real coturn --------------------------------------------------------------------------


@pytest.fixture
def coturn(tmp_path: Path) -> Iterator[int]:
    """The shipped config, on 127.0.0.1. Loopback is one range of its deny list; so that one
    loopback address can show what an allowed peer gets, the test allows loopback peers in
    general and 127.0.0.2 alone past the deny list."""
    options = ["--allow-loopback-peers", "--allowed-peer-ip=127.0.0.2"]
    with running_coturn(CONF, tmp_path, SECRET, options) as server:
        yield server.port


def test_a_real_coturn_relays_to_no_private_peer_and_over_no_tcp(coturn: int) -> None:
    username, password = turn_rest_credentials(SECRET, "caller", 600)
    client = TurnClient(coturn, username, password)
    try:
        allocated = client.allocate()
        assert allocated.message_class == stun.Class.RESPONSE, allocated.attributes
        refused = {
            peer: client.permit(peer)
            for peer in (
                "127.0.0.1",
                "10.0.0.1",
                "172.17.0.1",
                "192.168.1.1",
                "169.254.169.254",
                "100.64.0.1",
            )
        }
        assert refused == dict.fromkeys(refused, 403), refused
        assert client.permit("127.0.0.2") is None  # the one the test allowed: granted
    finally:
        client.close()
    # A TCP relay (RFC 6062) is refused: 442, unsupported transport protocol.
    tcp = TurnClient(coturn, *turn_rest_credentials(SECRET, "tcp", 600))
    try:
        response = tcp.allocate(TCP_TRANSPORT)
        assert response.error_code == 442, response.attributes
    finally:
        tcp.close()
    # Credentials not minted from the secret get nothing.
    forged = TurnClient(coturn, f"{int(time.time()) + 600}:mallory", "not-the-password")
    try:
        assert forged.allocate().error_code == 401
    finally:
        forged.close()
