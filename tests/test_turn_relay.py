"""The shipped coturn config is no open relay: it denies every peer that is not on a public
address and relays only UDP, as read from the file and as a real coturn (Debian's
``turnserver``, on 127.0.0.1) enforces it.

The live test asks coturn for permissions only (TURN CreatePermission): no packet goes to any
peer address, allowed or denied.
"""

from __future__ import annotations

import ipaddress
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from aioice import stun
from aioice.turn import TCP_TRANSPORT, UDP_TRANSPORT, make_integrity_key

from rtc_server.ice import turn_rest_credentials

CONF = Path(__file__).resolve().parents[1] / "deploy" / "turnserver.conf"
TURNSERVER = shutil.which("turnserver") or "/usr/bin/turnserver"
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


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class TurnClient:
    """The few TURN requests the test needs (RFC 8656), over UDP to 127.0.0.1."""

    def __init__(self, port: int, username: str, password: str) -> None:
        self.server = ("127.0.0.1", port)
        self.username, self.password = username, password
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.settimeout(2.0)
        self.key: bytes | None = None
        self.realm, self.nonce = "", b""

    def close(self) -> None:
        self.sock.close()

    def request(self, method: stun.Method, attributes: dict[str, object]) -> stun.Message:
        """One request, authenticated once the server named its realm; the response."""
        for _ in range(2):
            message = stun.Message(method, stun.Class.REQUEST, attributes=dict(attributes))
            if self.key is not None:
                message.attributes.update(
                    {"USERNAME": self.username, "REALM": self.realm, "NONCE": self.nonce}
                )
                message.add_message_integrity(self.key)
            self.sock.sendto(bytes(message), self.server)
            response = stun.parse_message(self.sock.recv(4096))
            assert response.transaction_id == message.transaction_id
            if response.error_code in (401, 438) and "NONCE" in response.attributes:
                self.nonce = response.attributes["NONCE"]  # bytes, as aioice packs it
                self.realm = response.attributes.get("REALM", self.realm)
                self.key = make_integrity_key(self.username, self.realm, self.password)
                continue
            return response
        return response

    def allocate(self, transport: int = UDP_TRANSPORT) -> stun.Message:
        return self.request(
            stun.Method.ALLOCATE, {"REQUESTED-TRANSPORT": transport, "LIFETIME": 60}
        )

    def permit(self, peer: str) -> int | None:
        """CreatePermission for ``peer``: None when granted, else the error code. Nothing is
        sent to the peer either way."""
        response = self.request(stun.Method.CREATE_PERMISSION, {"XOR-PEER-ADDRESS": (peer, 9)})
        return response.error_code if response.message_class == stun.Class.ERROR else None


@pytest.fixture
def coturn(tmp_path: Path) -> Iterator[int]:
    """The shipped config, on 127.0.0.1. Loopback is one range of its deny list; so that one
    loopback address can show what an allowed peer gets, the test allows loopback peers in
    general and 127.0.0.2 alone past the deny list."""
    if not Path(TURNSERVER).is_file():
        pytest.skip(f"{TURNSERVER} is missing (Debian package 'coturn'; `make test` installs it)")
    port = _free_udp_port()
    process = subprocess.Popen(
        [
            TURNSERVER,
            "-c",
            str(CONF),
            "--listening-ip=127.0.0.1",
            "--relay-ip=127.0.0.1",
            f"--listening-port={port}",
            f"--static-auth-secret={SECRET}",
            "--allow-loopback-peers",
            "--allowed-peer-ip=127.0.0.2",
            "--no-tls",
            "--no-dtls",
            "--log-file=stdout",
            "--simple-log",
            f"--pidfile={tmp_path / 'turnserver.pid'}",
            f"--userdb={tmp_path / 'turndb'}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        username, password = turn_rest_credentials(SECRET, "probe", 600)
        deadline = time.monotonic() + 20
        while True:  # up once it answers an allocation
            client = TurnClient(port, username, password)
            try:
                client.allocate()
                break
            except (TimeoutError, ConnectionRefusedError):
                if process.poll() is not None or time.monotonic() > deadline:
                    process.kill()
                    output = process.communicate()[0]
                    pytest.fail(f"coturn did not come up:\n{output[-3000:]}")
                time.sleep(0.2)
            finally:
                client.close()
        yield port
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


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
