"""A real TURN server for the tests: Debian's coturn (``turnserver``), on 127.0.0.1 only.

:func:`running_coturn` starts one with a given config file on a free port, listening on UDP and
TCP on 127.0.0.1 alone and relaying from 127.0.0.1 alone (whatever the file says), without TLS,
DTLS or its admin CLI, its log in the test's own directory; it returns once the server answers
a TURN allocation. :class:`TurnClient` makes the few TURN requests a test needs by hand.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from aioice import stun
from aioice.turn import UDP_TRANSPORT, make_integrity_key

from rtc_server.ice import turn_rest_credentials

TURNSERVER = shutil.which("turnserver") or "/usr/bin/turnserver"


def require_coturn() -> None:
    """Skip the test when coturn is not installed."""
    if not Path(TURNSERVER).is_file():
        pytest.skip(f"{TURNSERVER} is missing (Debian package 'coturn'; `make coturn` installs it)")


def free_port() -> int:
    """A port of 127.0.0.1 free for both UDP and TCP just now."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.bind(("127.0.0.1", 0))
            port = int(udp.getsockname()[1])
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
                try:
                    tcp.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    raise RuntimeError("no port of 127.0.0.1 free for both UDP and TCP")


class TurnClient:
    """The few TURN requests the tests need (RFC 8656), over UDP to 127.0.0.1."""

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


_SESSION = re.compile(r"session (\d+): (.*)$")
_USER = re.compile(r"username=<([^>]*)>|user <([^>]*)>")
_USAGE = re.compile(r"^usage: .*rb=(\d+), sp=\d+, sb=(\d+)")


@dataclass
class Allocation:
    """One TURN allocation (a coturn session), as coturn logs it (``--verbose``)."""

    session: str
    username: str = ""
    closed: bool = False
    received: int = 0
    """Bytes coturn received from the client on it (logged when the session ends)."""
    sent: int = 0
    """Bytes coturn sent the client on it (logged when the session ends)."""
    transport: str = "UDP"
    """How the client reached coturn: UDP, or TCP (coturn logs the TCP connection)."""


@dataclass
class Coturn:
    port: int
    log: Path
    tls_port: int | None = None
    """Where it takes TURN over TLS (``turns:``), when it was given a certificate."""
    cert: Path | None = None
    """That certificate (PEM)."""

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def allocations(self, username: str) -> list[Allocation]:
        """The allocations of ``username`` so far; their bytes are counted once they ended."""
        found: dict[str, Allocation] = {}
        for line in self.log_text().splitlines():
            if (match := _SESSION.search(line)) is None:
                continue
            session, what = match.groups()
            allocation = found.setdefault(session, Allocation(session))
            if (user := _USER.search(what)) is not None and any(user.groups()):
                allocation.username = next(g for g in user.groups() if g)
            if (usage := _USAGE.search(what)) is not None:
                allocation.received += int(usage.group(1))
                allocation.sent += int(usage.group(2))
            elif what.startswith("closed"):
                allocation.closed = True
            elif what.startswith("TCP socket"):
                allocation.transport = "TCP"
            elif what.startswith("TLS/TCP socket"):
                allocation.transport = "TLS"
        return [a for a in found.values() if a.username == username]


@contextlib.contextmanager
def running_coturn(
    config: Path,
    directory: Path,
    secret: str,
    options: Sequence[str] = (),
    tls: tuple[Path, Path] | None = None,
) -> Iterator[Coturn]:
    """coturn with ``config`` (and ``options``, ``--name=value``) on a free port of
    127.0.0.1, its log, pid file and user database in ``directory``; skips when coturn is
    not installed. ``secret`` is its static-auth-secret (``use-auth-secret``). ``tls``
    (certificate, key): TURN over TLS too, on a second free port."""
    require_coturn()
    port = free_port()
    tls_port = None
    while tls is not None and tls_port in (None, port):
        tls_port = free_port()
    tls_options = (
        ["--no-tls"]
        if tls is None
        else [f"--cert={tls[0]}", f"--pkey={tls[1]}", f"--tls-listening-port={tls_port}"]
    )
    log = directory / "turnserver.log"
    with (directory / "turnserver.out").open("w") as out:
        process = subprocess.Popen(
            [
                TURNSERVER,
                "-c",
                str(config),
                *options,
                "--listening-ip=127.0.0.1",
                "--relay-ip=127.0.0.1",
                f"--listening-port={port}",
                f"--static-auth-secret={secret}",
                *tls_options,
                "--no-dtls",
                "--no-cli",
                "--no-rfc5780",  # no second (alternate) listening port
                f"--log-file={log}",
                "--simple-log",
                "--verbose",  # sessions, allocations and their byte counts in the log
                f"--pidfile={directory / 'turnserver.pid'}",
                f"--userdb={directory / 'turndb'}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        username, password = turn_rest_credentials(secret, "probe", 600)
        deadline = time.monotonic() + 20
        while True:  # up once it answers an allocation
            client = TurnClient(port, username, password)
            try:
                client.allocate()
                break
            except (TimeoutError, ConnectionRefusedError):
                if process.poll() is not None or time.monotonic() > deadline:
                    process.kill()
                    process.wait()
                    output = (directory / "turnserver.out").read_text(errors="replace")
                    log_text = log.read_text(errors="replace") if log.exists() else ""
                    pytest.fail(f"coturn did not come up:\n{output[-1500:]}\n{log_text[-3000:]}")
                time.sleep(0.2)
            finally:
                client.close()
        yield Coturn(port, log, tls_port, tls[0] if tls is not None else None)
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
