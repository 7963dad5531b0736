"""IP addresses and networks as the access rules compare them.

One reading of an address for every rule (client keys, trusted proxies, offered candidates):
an IPv6 zone (``%eth0``) is dropped and an IPv4-mapped IPv6 address (``::ffff:10.0.0.1``) is
its IPv4 address, so that no rule can be passed by spelling an address another way.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

IP = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_ip(text: str) -> IP | None:
    """The address ``text`` spells, IPv4-mapped ones as IPv4; None when it is none."""
    try:
        ip = ipaddress.ip_address(text.strip().split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def parse_networks(cidrs: Sequence[str], option: str = "--trusted-proxy") -> tuple[Network, ...]:
    """Addresses or CIDRs (the values of ``option``) as networks; ValueError names a bad one."""
    networks = []
    for cidr in cidrs:
        try:
            networks.append(ipaddress.ip_network(cidr.strip(), strict=False))
        except ValueError:
            raise ValueError(f"{option} must be an address or CIDR, not {cidr!r}") from None
    return tuple(networks)


def in_any(ip: IP, networks: Sequence[Network]) -> bool:
    return any(ip.version == n.version and ip in n for n in networks)
