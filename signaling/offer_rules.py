"""What an offer may hold before a call is built from it.

Its sections: one audio, one video and at most one data channel (46 audio sections would be 46
microphone tasks). Its security: a DTLS fingerprint and ICE credentials on every section, or
no secure call can be set up. Its candidates: the server sends connectivity checks to every
address an offer lists, so the candidates are capped, and those to addresses a public server
has no business reaching (loopback, private, link-local, shared and metadata ranges, names
the server would have to resolve) are dropped unless the operator allows their networks.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

from aiortc.sdp import SessionDescription

from signaling.addresses import Network, in_any, parse_ip
from signaling.errors import SignalingError

logger = logging.getLogger(__name__)

MAX_CANDIDATES_PER_SECTION = 16
"""A browser lists a few per network interface; more is a list of targets, not of routes."""

SECTION_LIMITS = {"audio": (1, 1), "video": (1, 1), "application": (0, 1)}
"""Sections of each kind an offer must have: (at least, at most). No other kind is taken."""


@dataclass(frozen=True, slots=True)
class PeerRule:
    """Which candidate addresses of an offer the server may send checks to."""

    networks: tuple[Network, ...] = ()
    """Networks allowed besides public addresses (``--peer-network``)."""
    local: bool = False
    """The server is local (it listens on loopback only): its callers are on this machine or
    its own networks, and every unicast address is theirs."""

    def allows(self, address: str) -> bool:
        if address.lower().endswith(".local"):
            # A browser's mDNS name for a host address. It resolves only on the server's own
            # link: wanted where the callers are local, or on a network the operator named.
            return self.local or bool(self.networks)
        ip = parse_ip(address)
        if ip is None:
            return False  # a name: the server would resolve whatever the caller chose
        if ip.is_multicast or ip.is_unspecified:
            return False
        if in_any(ip, self.networks):
            return True
        return ip.is_global or self.local


def check_sections(parsed: SessionDescription) -> None:
    """400 for an offer of the wrong shape, or one no secure call can be built from."""
    kinds = Counter(m.kind for m in parsed.media)
    if kinds["audio"] == 0:
        raise SignalingError(400, "no_audio", "the offer has no audio m-line")
    if kinds["video"] == 0:
        raise SignalingError(400, "no_video", "the offer has no video m-line to receive the avatar")
    for kind, count in kinds.items():
        low, high = SECTION_LIMITS.get(kind, (0, 0))
        if not low <= count <= high:
            raise SignalingError(
                400,
                "bad_sections",
                "an offer has one audio, one video and at most one data (application) section; "
                f"this one has {count} {kind!r}",
            )
    for media in parsed.media:
        if media.dtls is None or not media.dtls.fingerprints:
            raise SignalingError(
                400, "no_fingerprint", f"the offer's {media.kind} section has no DTLS fingerprint"
            )
        ice = media.ice
        if ice is None or not ice.usernameFragment or not ice.password:
            raise SignalingError(
                400,
                "no_ice_credentials",
                f"the offer's {media.kind} section has no ICE username fragment and password",
            )


def filter_candidates(sdp: str, rule: PeerRule) -> tuple[str, int]:
    """``sdp`` without the candidates ``rule`` refuses, non-UDP ones, and those past
    MAX_CANDIDATES_PER_SECTION, every other line exactly as it was; and how many it keeps."""
    kept: list[str] = []
    candidates = 0
    in_section = 0
    dropped = 0
    # Lines as aiortc's parser splits them, so that a dropped line is one it would have read.
    for line in sdp.splitlines(keepends=True):
        text = line.rstrip("\r\n")
        if text.startswith("m="):
            in_section = 0
        elif text.startswith("a=candidate:"):
            bits = text[len("a=candidate:") :].split()
            usable = len(bits) >= 8 and bits[2].lower() == "udp" and rule.allows(bits[4])
            if not usable or in_section >= MAX_CANDIDATES_PER_SECTION:
                dropped += 1
                continue
            in_section += 1
            candidates += 1
        kept.append(line)
    if dropped:
        logger.info("offer: %d candidates dropped (not UDP, not reachable, or too many)", dropped)
    return "".join(kept), candidates


def reachable_sdp(sdp: str, rule: PeerRule) -> str:
    """``sdp`` filtered as filter_candidates does; 400 when no candidate is left, for ICE has
    then nothing to check and the call could never connect."""
    filtered, candidates = filter_candidates(sdp, rule)
    if candidates == 0:
        raise SignalingError(
            400,
            "no_candidates",
            "the offer lists no candidate this server may reach: a UDP candidate on a public "
            "address (browsers find theirs with the STUN or TURN servers of /ice-servers), or "
            "on a network the server allows (--peer-network)",
        )
    return filtered
