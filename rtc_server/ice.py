"""ICE set-up from configuration: which host addresses to gather, which STUN/TURN servers."""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from urllib.parse import unquote

import aioice.ice
from aiortc import RTCConfiguration, RTCIceServer

_original_get_host_addresses = aioice.ice.get_host_addresses


def restrict_host_addresses(addresses: Sequence[str]) -> None:
    """Gather host candidates only on ``addresses`` (empty: every interface, aioice's default).

    aioice reads this module function at gathering time and skips loopback on its own, so the
    process-wide replacement is what lets a server bound to 127.0.0.1 gather 127.0.0.1.
    """
    checked = [str(ipaddress.ip_address(a)) for a in addresses]
    if not checked:
        aioice.ice.get_host_addresses = _original_get_host_addresses
        return

    def get_host_addresses(use_ipv4: bool, use_ipv6: bool) -> list[str]:
        return [
            a
            for a in checked
            if (use_ipv4 and ipaddress.ip_address(a).version == 4)
            or (use_ipv6 and ipaddress.ip_address(a).version == 6)
        ]

    aioice.ice.get_host_addresses = get_host_addresses


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
