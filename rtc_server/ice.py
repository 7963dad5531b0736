"""ICE set-up from configuration: host addresses, STUN/TURN servers, TURN credentials, NAT 1:1."""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import re
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from aiortc import RTCConfiguration, RTCIceServer


def parse_ice_server(url: str) -> RTCIceServer:
    """``stun:host:port`` or ``turn:user:password@host:port[?transport=udp]``."""
    scheme, sep, rest = url.partition(":")
    if not sep or scheme not in ("stun", "stuns", "turn", "turns") or not rest:
        raise ValueError(f"ICE server must be stun:host:port or turn:user:pw@host, not {url!r}")
    if "@" not in rest:
        return RTCIceServer(urls=url)
    credentials, _, host = rest.rpartition("@")
    username, _, password = credentials.partition(":")
    return RTCIceServer(
        urls=f"{scheme}:{host}", username=unquote(username), credential=unquote(password)
    )


def rtc_configuration(ice_servers: Sequence[str]) -> RTCConfiguration:
    # An explicit empty list: aiortc would otherwise ask Google's public STUN server.
    return RTCConfiguration(iceServers=[parse_ice_server(u) for u in ice_servers])


def turn_rest_credentials(
    secret: str, user: str, ttl_s: int, *, now: float | None = None
) -> tuple[str, str]:
    """Time-limited TURN credentials in coturn's shared-secret scheme (``use-auth-secret``).

    The username is ``<unix expiry>:<user>``, the password base64(HMAC-SHA1(secret, username)):
    coturn recomputes the password from its ``static-auth-secret`` and refuses it once expired.
    """
    username = f"{int(time.time() if now is None else now) + ttl_s}:{user}"
    digest = hmac.new(secret.encode(), username.encode(), hashlib.sha1).digest()
    return username, base64.b64encode(digest).decode()


@dataclass(frozen=True)
class IceServers:
    """The STUN/TURN servers of a deployment, for browsers (JSON) and for our own peers."""

    static: tuple[RTCIceServer, ...] = ()
    """``--ice-server`` entries, credentials (if any) as given."""
    turn_urls: tuple[str, ...] = ()
    turn_secret: str | None = field(default=None, repr=False)
    ttl_s: int = 3600

    @classmethod
    def from_config(
        cls,
        ice_servers: Sequence[str],
        *,
        turn_urls: Sequence[str] = (),
        turn_secret: str | None = None,
        turn_ttl_s: int = 3600,
    ) -> IceServers:
        return cls(
            tuple(parse_ice_server(u) for u in ice_servers),
            tuple(turn_urls),
            turn_secret,
            turn_ttl_s,
        )

    def servers(self, user: str | None = None, *, now: float | None = None) -> list[RTCIceServer]:
        """Every server, with freshly minted TURN credentials for ``user`` (default: random)."""
        servers = list(self.static)
        if self.turn_secret and self.turn_urls:
            username, credential = turn_rest_credentials(
                self.turn_secret, user or secrets.token_hex(8), self.ttl_s, now=now
            )
            servers.append(
                RTCIceServer(urls=list(self.turn_urls), username=username, credential=credential)
            )
        return servers

    def for_browser(self, user: str | None = None) -> list[dict[str, Any]]:
        """The ``iceServers`` of an ``RTCConfiguration``, as JSON for ``GET /ice-servers``."""
        out: list[dict[str, Any]] = []
        for server in self.servers(user):
            urls = [server.urls] if isinstance(server.urls, str) else list(server.urls)
            entry: dict[str, Any] = {"urls": urls}
            if server.username is not None:
                entry["username"] = server.username
            if server.credential is not None:
                entry["credential"] = server.credential
            out.append(entry)
        return out

    def rtc_configuration(self) -> RTCConfiguration:
        """For the server's own peer connection (aiortc uses the first TURN server only)."""
        return RTCConfiguration(iceServers=self.servers("avatar-rtc-server"))


_HOST_CANDIDATE = re.compile(
    r"^(a=candidate:\S+ \d+ \S+ \d+ )(\S+)( \d+ typ host(?: .*)?)$", re.IGNORECASE
)
_CONNECTION = re.compile(r"^c=IN (IP4|IP6) (\S+)$")


def announce_address(sdp: str, public: str | None) -> str:
    """NAT 1:1: host candidates (and c= lines) name ``public`` instead of the gathered address.

    Ports stay: the NAT maps public:port to private:port (mediasoup's ``announcedIp``). Only
    candidates of the public address's family change; srflx and relay ones are left as they are.
    """
    if public is None:
        return sdp
    address = ipaddress.ip_address(public)
    family = "IP4" if address.version == 4 else "IP6"
    replaced: set[str] = set()
    lines = sdp.split("\r\n")
    for i, line in enumerate(lines):
        match = _HOST_CANDIDATE.match(line)
        if match is None:
            continue
        try:
            gathered = ipaddress.ip_address(match.group(2))
        except ValueError:
            continue  # an mDNS name: not ours to rewrite
        if gathered.version == address.version:
            replaced.add(match.group(2))
            lines[i] = f"{match.group(1)}{address}{match.group(3)}"
    for i, line in enumerate(lines):
        match = _CONNECTION.match(line)
        if match is not None and match.group(2) in replaced:
            lines[i] = f"c=IN {family} {address}"
    return "\r\n".join(lines)
