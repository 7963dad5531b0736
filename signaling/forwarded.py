"""Who the client is and which host it asked for, behind proxies the operator trusts.

A request from an address in ``--trusted-proxy`` takes its client address from
``X-Forwarded-For`` (the rightmost address that is not itself a trusted proxy, as each proxy
appends the address it saw), and its scheme and host from ``X-Forwarded-Proto`` and
``X-Forwarded-Host`` (the values of the nearest proxy: the last listed). From anyone else
those headers change nothing: a client cannot forge its way past a limit or an origin check.

The Host a request names must be one this server answers for: with ``--public-origin``, that
origin's host (or an IP literal: health checks by address); without it, on a server bound to
loopback and not reached through a trusted proxy, ``localhost`` or an IP literal. A name other
than those is how DNS rebinding reaches a local server (a page of evil.example whose name now
resolves to 127.0.0.1 is, to the browser, same-origin with it): it gets 421.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from urllib.parse import urlsplit

from aiohttp import web

from signaling.addresses import IP, Network, in_any, parse_ip
from signaling.errors import SignalingError

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
LOOPBACK_NAMES = frozenset({"localhost"})


def _ip(text: str) -> IP | None:
    """An address as proxies write it: plain, ``v4:port`` or ``[v6]:port``."""
    text = text.strip()
    if text.startswith("[") and "]" in text:  # [v6]:port
        text = text[1 : text.index("]")]
    elif text.count(":") == 1:  # v4:port
        text = text.split(":", 1)[0]
    return parse_ip(text)


def host_name(host: str) -> str:
    """The name or address part of a Host value (no port, no brackets), lower case."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.index("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class ClientView:
    """The client address, scheme and host of each request, and whether the host is known."""

    def __init__(
        self,
        trusted_proxies: Sequence[Network] = (),
        *,
        public_origin: str | None = None,
        loopback_only: bool = False,
    ) -> None:
        """``loopback_only``: the server listens on loopback only (names other than
        ``localhost`` are refused there without a public origin)."""
        self.trusted = tuple(trusted_proxies)
        self.public_origin = public_origin
        self._public_host = host_name(urlsplit(public_origin).netloc) if public_origin else None
        self._loopback_only = loopback_only

    def is_trusted(self, address: str | None) -> bool:
        ip = _ip(address) if address else None
        return ip is not None and in_any(ip, self.trusted)

    def client_of(self, remote: str | None, forwarded_for: str | None) -> str | None:
        """The client address: ``remote``, or behind trusted proxies the one they name."""
        if not forwarded_for or not self.is_trusted(remote):
            return remote
        hops = [h.strip() for h in forwarded_for.split(",") if h.strip()]
        for hop in reversed(hops):
            ip = _ip(hop)
            if ip is None:
                return remote  # a hop no proxy would write: the header is not to be believed
            if not in_any(ip, self.trusted):
                return str(ip)
        return str(_ip(hops[0])) if hops else remote

    def host_known(self, host: str, *, via_proxy: bool = False) -> bool:
        """Whether this server answers for ``host``; ``via_proxy``: a trusted proxy named it
        (the browser did not reach this server itself, so no rebinding can be at work)."""
        name = host_name(host)
        if parse_ip(name) is not None:  # an IP literal: nothing to rebind
            return True
        if self._public_host is not None:
            return name == self._public_host
        return via_proxy or not self._loopback_only or name in LOOPBACK_NAMES

    def middleware(self) -> Callable[..., Awaitable[web.StreamResponse]]:
        @web.middleware
        async def client_view(request: web.Request, handler: Handler) -> web.StreamResponse:
            via_proxy = bool(self.trusted) and self.is_trusted(request.remote)
            if via_proxy:
                client = self.client_of(request.remote, request.headers.get("X-Forwarded-For"))
                proto = _last(request.headers.get("X-Forwarded-Proto"))
                forwarded_host = _last(request.headers.get("X-Forwarded-Host"))
                # One clone: a clone starts again from the request as received.
                request = request.clone(
                    remote=client or request.remote or "",
                    scheme=proto if proto in ("http", "https") else request.scheme,
                    host=forwarded_host or request.host,
                )
            if not self.host_known(request.host, via_proxy=via_proxy):
                raise SignalingError(
                    421,
                    "unknown_host",
                    f"this server does not answer for the host name {host_name(request.host)!r}"
                    " (its operator can set --public-origin, or --trusted-proxy for the proxy "
                    "in front of it)",
                )
            return await handler(request)

        return client_view


def _last(value: str | None) -> str | None:
    if not value:
        return None
    last = value.split(",")[-1].strip()
    return last.lower() if last else None
