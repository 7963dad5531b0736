"""The only place the benchmarks reach into aiortc's private attributes (checked: aiortc 1.16).

aiortc has no public hook for packet arrival times, for the negotiated codec of a transceiver,
or for receiving a track without decoding it: its ``RTCRtpReceiver`` hands every complete
encoded frame to a decoder thread as soon as ``receive()`` starts, whether or not anyone calls
``track.recv()`` (the decoded frames then pile up in the track's queue). If aiortc changes,
only this module needs to follow.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiortc import RTCRtpReceiver, RTCRtpTransceiver

RtpHandler = Callable[[Any, int], Awaitable[None]]
"""``async handler(packet, arrival_time_ms)``: how aiortc hands a receiver an RTP packet."""


def wrap_rtp_handler(receiver: RTCRtpReceiver, wrap: Callable[[RtpHandler], RtpHandler]) -> None:
    """Put ``wrap(aiortc's handler)`` in front of every RTP packet ``receiver`` gets.

    The packet is an ``aiortc.rtp.RtpPacket`` (``timestamp``, ``marker``, ``payload_type``,
    ``ssrc``), as it comes off the transport: RTX retransmissions included, in arrival order.
    The wrapper should await the handler it was given, or aiortc never sees the packet.
    """
    receiver._handle_rtp_packet = wrap(receiver._handle_rtp_packet)  # type: ignore[method-assign,assignment]


def stop_decoding(receiver: RTCRtpReceiver) -> None:
    """Stop ``receiver``'s decoder thread; packets keep flowing through everything else.

    SRTP, RTCP receiver reports, NACKs, REMB bandwidth estimates and the jitter buffer go on
    as before, so the sender sees an ordinary receiver; only the decoding (and so the track's
    frames) stops, and the track ends. ``_handle_disconnect`` is what aiortc itself calls when
    the transport goes away: it stops the decoder and nothing else. Call it once ``receive()``
    has run, e.g. from a ``wrap_rtp_handler`` wrapper on the first packet.
    """
    receiver._handle_disconnect()


def negotiated_codec(transceiver: RTCRtpTransceiver) -> str | None:
    """The mimeType of the first codec negotiated on ``transceiver``, or None before that."""
    codecs = transceiver._codecs
    return str(codecs[0].mimeType) if codecs else None
