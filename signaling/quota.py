"""Live calls per client and per token, so that no one client takes every call slot.

A call is counted from the moment its offer is admitted (a reservation, before the SDP work)
until it ends, so that simultaneous offers cannot slip past the limit together. Clients are
keyed by address; an IPv6 address by its /64, the block one subscriber gets, so that the
addresses of one network do not each count as a client. Tokens are keyed by their id.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from dataclasses import dataclass

from signaling.addresses import parse_ip
from signaling.errors import SignalingError

DEFAULT_CALLS_PER_CLIENT = 2
"""Live calls one client address may hold: two tabs of a public page, not every slot."""
DEFAULT_CALLS_PER_TOKEN = 1
"""Live calls one token may open: a token is minted for one visitor's call."""
RETRY_AFTER_S = 5


def client_key(address: str | None) -> str:
    """The quota key of a client address: IPv4 as it is, IPv6 as its /64 network."""
    if not address:
        return "?"
    ip = parse_ip(address)
    if ip is None:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


@dataclass(eq=False, slots=True)
class Reservation:
    """An admitted offer: :meth:`bind` it to its session, or :meth:`release` it. As a context
    manager, it is released on leaving unless it was bound (the offer failed, or was refused
    further on)."""

    quota: CallQuota
    client: str
    token_id: str | None
    session_id: str | None = None
    released: bool = False

    def bind(self, session_id: str) -> None:
        self.quota._bind(self, session_id)

    def release(self) -> None:
        self.quota._release(self)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.session_id is None:
            self.release()


class CallQuota:
    """``per_client`` live calls per client key and ``per_token`` per token id (0: no limit)."""

    def __init__(
        self, per_client: int = DEFAULT_CALLS_PER_CLIENT, per_token: int = DEFAULT_CALLS_PER_TOKEN
    ) -> None:
        if per_client < 0 or per_token < 0:
            raise ValueError("call limits must be >= 0")
        self.per_client = per_client
        self.per_token = per_token
        self._held: set[Reservation] = set()
        self._by_session: dict[str, Reservation] = {}

    def calls_of(self, client: str) -> int:
        return sum(1 for r in self._held if r.client == client)

    def calls_of_token(self, token_id: str) -> int:
        return sum(1 for r in self._held if r.token_id == token_id)

    def over(self, client: str, token_id: str | None) -> SignalingError | None:
        """The refusal a new call of this client and token would get now, or None."""
        if self.per_client and self.calls_of(client) >= self.per_client:
            return SignalingError(
                429,
                "too_many_calls",
                f"this client already has {self.per_client} live call(s); end one first",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        if (
            token_id is not None
            and self.per_token
            and self.calls_of_token(token_id) >= self.per_token
        ):
            return SignalingError(
                429,
                "too_many_calls",
                f"this token already opened {self.per_token} live call(s); end one first",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        return None

    def admit(self, client: str, token_id: str | None) -> Reservation:
        """Count a new call of ``client`` (a :func:`client_key`) and ``token_id``; 429 if over."""
        refusal = self.over(client, token_id)
        if refusal is not None:
            raise refusal
        reservation = Reservation(self, client, token_id)
        self._held.add(reservation)
        return reservation

    def end(self, session_id: str) -> None:
        """The call ``session_id`` ended: it no longer counts."""
        reservation = self._by_session.pop(session_id, None)
        if reservation is not None:
            self._held.discard(reservation)

    def keep_only(self, alive: Callable[[str], bool]) -> None:
        """Forget the bound calls for which ``alive(session_id)`` is false (they ended)."""
        for session_id in [s for s in self._by_session if not alive(s)]:
            self.end(session_id)

    def _bind(self, reservation: Reservation, session_id: str) -> None:
        if reservation.released:
            return
        reservation.session_id = session_id
        self._by_session[session_id] = reservation

    def _release(self, reservation: Reservation) -> None:
        reservation.released = True
        self._held.discard(reservation)
        if reservation.session_id is not None:
            self._by_session.pop(reservation.session_id, None)
