"""A bad network on 127.0.0.1: a seeded UDP relay between a caller and the server.

The kernel here has no netem, so calls that must cross a lossy, jittery or broken network go
through this relay instead. It stands in for each side towards the other: for every host
candidate the caller offers, a server-facing socket (B) the server is told to use instead; for
every candidate the server answers with, a caller-facing socket (A). ``rewrite_offer`` and
``rewrite_answer`` put those addresses into the SDPs (and keep only 127.0.0.1 host candidates),
so ICE can only pair caller→A and server→B: the caller's packets go caller→A, then out of B
to the server; the server's go server→B, then out of A to the caller. Neither side ever learns
the other's real address.

Each direction applies its own :class:`Impairment`. A packet's fate is drawn from a random
generator seeded with (seed, direction, stream, index in that stream), where an RTP stream is
its payload type and the other kinds (STUN, DTLS, RTCP) are one stream each: with the same
seed, the n-th video packet of every run meets the same fate, however the streams interleave.

- ``loss``: each packet dropped with that probability;
- ``delay_ms`` + uniform ``[0, jitter_ms]``: each packet held that long; a jitter larger than
  the packet spacing reorders them, as a real path does;
- ``outages``: ``(start_s, length_s)`` after :meth:`NetRelay.impair`, every packet dropped;
  :meth:`NetRelay.outage` cuts the path from now, on demand.

SRTP leaves the RTP/RTCP headers in the clear, so the relay counts what it carries by kind
(STUN, DTLS, RTP, RTCP) and logs each RTP packet it drops (SSRC, sequence number, timestamp).
"""

from __future__ import annotations

import asyncio
import random
import re
import socket
import struct
import time
from collections import Counter
from dataclasses import dataclass, field

HOST = "127.0.0.1"

_CANDIDATE = re.compile(r"^a=candidate:(\S+) (\d+) (\S+) (\d+) (\S+) (\d+) typ (\S+)(.*)$")
_MEDIA = re.compile(r"^m=(\S+) (\d+) (.*)$")


@dataclass(frozen=True, slots=True)
class Impairment:
    loss: float = 0.0
    """Probability that a packet is dropped."""
    delay_ms: float = 0.0
    """Fixed extra delay of every packet."""
    jitter_ms: float = 0.0
    """Extra delay, uniform in [0, jitter_ms] per packet (reorders packets closer than that)."""
    outages: tuple[tuple[float, float], ...] = ()
    """(start s, length s) after the impairment was set: every packet dropped."""


CLEAN = Impairment()


def packet_kind(data: bytes) -> str:
    """RFC 7983 demultiplexing: ``stun``, ``dtls``, ``rtp``, ``rtcp`` or ``other``."""
    if not data:
        return "other"
    first = data[0]
    if first <= 3:
        return "stun"
    if 20 <= first <= 63:
        return "dtls"
    if 128 <= first <= 191 and len(data) >= 2:
        return "rtcp" if 192 <= data[1] <= 223 else "rtp"
    return "other"


@dataclass(frozen=True, slots=True)
class RtpHeader:
    payload_type: int
    sequence_number: int
    timestamp: int
    ssrc: int


def rtp_header(data: bytes) -> RtpHeader | None:
    """The clear-text header of an (S)RTP packet."""
    if len(data) < 12 or packet_kind(data) != "rtp":
        return None
    seq, ts, ssrc = struct.unpack("!HII", data[2:12])
    return RtpHeader(data[1] & 0x7F, seq, ts, ssrc)


def rtcp_type(data: bytes) -> tuple[int, int] | None:
    """(packet type, format) of the first packet of an (S)RTCP packet.

    SRTCP encrypts what follows the first header and sender SSRC, so a compound packet's
    other parts cannot be read; aiortc sends its NACKs and PLIs alone.
    """
    if packet_kind(data) != "rtcp":
        return None
    return data[1], data[0] & 0x1F


@dataclass(frozen=True, slots=True)
class Drop:
    at: float
    """time.monotonic() of the drop."""
    reason: str
    """``loss``, ``outage`` or ``unmapped``."""
    kind: str
    rtp: RtpHeader | None


@dataclass
class DirectionStats:
    received: int = 0
    forwarded: Counter[str] = field(default_factory=Counter)
    """Packets sent on, by kind."""
    dropped: Counter[str] = field(default_factory=Counter)
    """Packets dropped, by reason (``loss``, ``outage``, ``unmapped``)."""
    rtp_by_ssrc: Counter[int] = field(default_factory=Counter)
    """RTP packets sent on, per SSRC."""
    rtcp: Counter[tuple[int, int]] = field(default_factory=Counter)
    """RTCP packets sent on, by (type, format) of their first part: (205, 1) NACK, (206, 1) PLI."""
    drops: list[Drop] = field(default_factory=list)


class Direction:
    """One way through the relay: its impairment, its random stream, its counters."""

    def __init__(self, name: str, seed: int) -> None:
        self.name = name
        self.seed = seed
        self._index: Counter[str] = Counter()
        self.impairment = CLEAN
        self.windows: list[tuple[float, float]] = []
        """Outages as absolute (start, end) times.monotonic()."""
        self.stats = DirectionStats()

    def set(self, impairment: Impairment, now: float) -> None:
        self.impairment = impairment
        self.windows.extend(
            (now + start, now + start + length) for start, length in impairment.outages
        )

    def decide(self, now: float, stream: str) -> tuple[str | None, float]:
        """(drop reason or None, delay s) for the next packet of ``stream``."""
        index = self._index[stream]
        self._index[stream] += 1
        rng = random.Random(f"{self.seed}:{self.name}:{stream}:{index}")
        lost = rng.random() < self.impairment.loss
        jitter = rng.random() * self.impairment.jitter_ms
        if any(start <= now < end for start, end in self.windows):
            return "outage", 0.0
        if lost:
            return "loss", 0.0
        return None, (self.impairment.delay_ms + jitter) / 1000


class _Proxy:
    """A relay socket standing in for one real endpoint (``port``) towards the other side."""

    def __init__(self, stands_for: int) -> None:
        self.stands_for = stands_for
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        self.sock.bind((HOST, 0))
        self.sock.setblocking(False)
        self.port: int = self.sock.getsockname()[1]


class NetRelay:
    """Create inside a running event loop; ``close()`` when done."""

    def __init__(self, seed: int = 0) -> None:
        self._loop = asyncio.get_running_loop()
        self.up = Direction("up", seed)
        """Caller to server."""
        self.down = Direction("down", seed)
        """Server to caller."""
        self._for_caller: dict[int, _Proxy] = {}
        """Caller-facing sockets (A), by the server port each stands for."""
        self._for_server: dict[int, _Proxy] = {}
        """Server-facing sockets (B), by the caller port each stands for."""
        self._timers: set[asyncio.TimerHandle] = set()
        self._closed = False

    # -- addresses -------------------------------------------------------------------------

    @property
    def caller_facing_ports(self) -> set[int]:
        return {p.port for p in self._for_caller.values()}

    @property
    def server_facing_ports(self) -> set[int]:
        return {p.port for p in self._for_server.values()}

    def _proxy(self, table: dict[int, _Proxy], port: int, caller_facing: bool) -> _Proxy:
        proxy = table.get(port)
        if proxy is None:
            proxy = table[port] = _Proxy(port)
            self._loop.add_reader(proxy.sock.fileno(), self._readable, proxy, caller_facing)
        return proxy

    def rewrite_offer(self, sdp: str) -> str:
        """The caller's offer as the server must see it: its candidates are B sockets."""
        return self._rewrite(sdp, self._for_server, caller_facing=False)

    def rewrite_answer(self, sdp: str) -> str:
        """The server's answer as the caller must see it: its candidates are A sockets."""
        return self._rewrite(sdp, self._for_caller, caller_facing=True)

    def _rewrite(self, sdp: str, table: dict[int, _Proxy], *, caller_facing: bool) -> str:
        lines = sdp.split("\r\n")
        ports: dict[int, int] = {}
        out: list[str] = []
        for line in lines:
            match = _CANDIDATE.match(line)
            if match is None:
                out.append(line)
                continue
            foundation, component, transport, priority, address, port, typ, rest = match.groups()
            if typ != "host" or address != HOST or transport.lower() != "udp":
                continue  # only the relay is a way through
            stand_in = self._proxy(table, int(port), caller_facing).port
            ports[int(port)] = stand_in
            out.append(
                f"a=candidate:{foundation} {component} {transport} {priority} "
                f"{HOST} {stand_in} typ host{rest}"
            )
        for i, line in enumerate(out):
            media = _MEDIA.match(line)
            if media is not None and int(media.group(2)) in ports:
                out[i] = f"m={media.group(1)} {ports[int(media.group(2))]} {media.group(3)}"
        return "\r\n".join(out)

    # -- faults ----------------------------------------------------------------------------

    def impair(self, up: Impairment | None = None, down: Impairment | None = None) -> None:
        """Apply impairments from now (``None``: clean); outages are timed from now."""
        now = time.monotonic()
        self.up.set(up or CLEAN, now)
        self.down.set(down or CLEAN, now)

    def outage(self, seconds: float, *, up: bool = True, down: bool = True) -> tuple[float, float]:
        """Drop everything from now for ``seconds``; returns (start, end) in time.monotonic()."""
        start = time.monotonic()
        window = (start, start + seconds)
        for direction, on in ((self.up, up), (self.down, down)):
            if on:
                direction.windows.append(window)
        return window

    # -- forwarding ------------------------------------------------------------------------

    def _readable(self, proxy: _Proxy, caller_facing: bool) -> None:
        for _ in range(64):
            try:
                data, (address, port) = proxy.sock.recvfrom(65536)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # e.g. ICMP port unreachable reported on the socket
            if caller_facing:
                # From the caller (port) to the server port this socket stands for.
                direction, out = self.up, self._for_server.get(port)
            else:
                # The server checks the offer's candidates before its answer reaches the caller
                # (and the relay): its socket's stand-in is made on its first packet, then.
                direction, out = self.down, self._proxy(self._for_caller, port, True)
            self._forward(direction, data, address, out, proxy.stands_for)

    def _forward(
        self, direction: Direction, data: bytes, address: str, out: _Proxy | None, to_port: int
    ) -> None:
        stats = direction.stats
        stats.received += 1
        now = time.monotonic()
        kind = packet_kind(data)
        header = rtp_header(data)
        if out is None or address != HOST:
            # From an address the SDPs never named: nowhere to send it.
            stats.dropped["unmapped"] += 1
            stats.drops.append(Drop(now, "unmapped", kind, header))
            return
        reason, delay = direction.decide(
            now, kind if header is None else f"rtp{header.payload_type}"
        )
        if reason is not None:
            stats.dropped[reason] += 1
            stats.drops.append(Drop(now, reason, kind, header))
            return
        if delay <= 0:
            self._send(direction, out, data, to_port)
            return
        handle: asyncio.TimerHandle | None = None

        def later() -> None:
            assert handle is not None
            self._timers.discard(handle)
            self._send(direction, out, data, to_port)

        handle = self._loop.call_later(delay, later)
        self._timers.add(handle)

    def _send(self, direction: Direction, out: _Proxy, data: bytes, to_port: int) -> None:
        if self._closed:
            return
        kind = packet_kind(data)
        try:
            out.sock.sendto(data, (HOST, to_port))
        except OSError:
            direction.stats.dropped["send_error"] += 1
            return
        stats = direction.stats
        stats.forwarded[kind] += 1
        header = rtp_header(data)
        if header is not None:
            stats.rtp_by_ssrc[header.ssrc] += 1
        rtcp = rtcp_type(data)
        if rtcp is not None:
            stats.rtcp[rtcp] += 1

    @property
    def in_flight(self) -> int:
        """Packets held for their delay, not yet sent on."""
        return len(self._timers)

    def close(self) -> None:
        self._closed = True
        for handle in self._timers:
            handle.cancel()
        self._timers.clear()
        for proxy in [*self._for_caller.values(), *self._for_server.values()]:
            self._loop.remove_reader(proxy.sock.fileno())
            proxy.sock.close()
