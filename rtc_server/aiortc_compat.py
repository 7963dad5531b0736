"""Every place the project reaches into aiortc and aioice beyond their public API, in one module.

Each function says what it changes and why. The versions it was written against are checked
at import (:data:`TESTED`): another aiortc or aioice stops the server at start with a message,
not a call in the middle. ``tests/test_media_units.py`` pins that they still behave as assumed.

What is changed per peer connection, sender or receiver: the reply's encoder and its encoded
frames, when the video's encoded frames leave (:func:`send_at_media_time`), the microphone's
jitter buffer, the benchmarks' packet timing and undecoded video.
What is read: the candidate pair ICE nominated (:func:`selected_candidate_pair`). What is
rewritten: the sender reports' NTP times, from the call's clock (:func:`stamp_sender_reports`).
What is process-wide, because aioice has no per-connection hook: the host addresses ICE
gathers (:func:`restrict_host_addresses`), aiortc's audio-level function
(:func:`use_fast_audio_level`, the same result, faster), its NTP clock (:func:`use_fast_ntp_clock`,
likewise), and a look at every datagram ICE
receives for the connections a benchmark watches (:func:`observe_datagrams`).
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import math
import struct
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Sequence
from importlib.metadata import version
from typing import Any

import aioice.ice
import numpy as np
from aioice import Candidate
from aiortc import (
    RTCIceTransport,
    RTCRtpCodecParameters,
    RTCRtpReceiver,
    RTCRtpSender,
    RTCRtpTransceiver,
    rtp,
)
from aiortc import clock as aiortc_clock
from aiortc.codecs.base import Encoder
from aiortc.jitterbuffer import JitterBuffer
from aiortc.rtcrtpsender import RTCEncodedFrame
from av import AudioFrame

logger = logging.getLogger(__name__)

TESTED = {"aiortc": ("1.16",), "aioice": ("0.13",)}
"""Release series (major.minor) whose internals this module was written and tested against."""


def check_versions(installed: Callable[[str], str] = version) -> None:
    """Raise ImportError unless the installed aiortc and aioice are of a tested series."""
    for package, series in TESTED.items():
        found = installed(package)
        if ".".join(found.split(".")[:2]) not in series:
            wanted = " or ".join(f"{s}.*" for s in series)
            raise ImportError(
                f"avatar-rtc reaches into {package}'s internals (rtc_server/aiortc_compat.py) "
                f"and was tested with {package} {wanted}; {found} is installed: "
                f"pip install '{package}=={series[-1]}.*'"
            )


check_versions()

AIORTC_AUDIO_LEVEL = rtp.compute_audio_level_dbov
"""aiortc's own audio-level function, kept before :func:`use_fast_audio_level` replaces it."""

__all__ = [
    "audio_level_dbov",
    "check_versions",
    "decode_on_loop",
    "negotiated_codec",
    "restrict_host_addresses",
    "stop_decoding",
    "wrap_rtp_handler",
    "samples_level_dbov",
    "send_at_media_time",
    "send_encoded_audio",
    "set_receiver_jitter_buffer",
    "set_sender_encoder",
    "use_fast_audio_level",
    "use_fast_ntp_clock",
]


def set_sender_encoder(sender: RTCRtpSender, encoder: Encoder) -> None:
    """Make ``sender`` encode with ``encoder``; call after negotiation, before it starts.

    aiortc creates its encoder lazily on the first frame only if none is set, so a preset one
    is kept.
    """
    sender._RTCRtpSender__encoder = encoder  # type: ignore[attr-defined]


def set_receiver_jitter_buffer(transceiver: RTCRtpTransceiver, buffer: JitterBuffer) -> None:
    """Replace the jitter buffer of ``transceiver``'s receiver."""
    transceiver.receiver._RTCRtpReceiver__jitter_buffer = buffer  # type: ignore[attr-defined]


Decode = Callable[[RTCRtpCodecParameters, Any], list[Any]]
"""``decode(codec, encoded_frame)``: one received frame (aiortc's ``JitterFrame``: ``data``,
``timestamp``) as the items its track's ``recv()`` returns, in order; [] for none."""


class _DecodeOnLoop:
    """Stands in for an ``RTCRtpReceiver``'s decoder queue (see :func:`decode_on_loop`)."""

    def __init__(self, receiver: RTCRtpReceiver, decode: Decode) -> None:
        self._receiver = receiver
        """Its track (and so the queue the frames go to) exists once the offer is applied."""
        self._stopped = threading.Event()
        self._decode = decode

    def put(self, item: Any) -> None:
        """aiortc's receiver hands over ``(codec, encoded_frame)``, on the event loop; None
        when it stops."""
        if item is None:
            self._stopped.set()  # aiortc's idle decoder thread ends, and with it the track
            return
        codec, encoded_frame = item
        track = self._receiver._track
        assert track is not None, "a receiver receives only once its track exists"
        for frame in self._decode(codec, encoded_frame):
            track._queue.put_nowait(frame)

    def get(self) -> None:
        """aiortc's decoder thread waits here, idle, until the receiver stops."""
        self._stopped.wait()


def decode_on_loop(transceiver: RTCRtpTransceiver, decode: Decode) -> None:
    """Decode ``transceiver``'s incoming audio on the event loop with ``decode``, as its
    packets arrive.

    aiortc hands every received frame to a decoder thread, which passes each decoded frame back
    to the loop with ``run_coroutine_threadsafe`` (a task per 20 ms frame, two thread wake-ups);
    decoding a 20 ms Opus frame costs less than that hand-off. Call it before the receiver
    starts (before the answer is set): aiortc's decoder thread then only waits, idle, until
    the receiver stops, when it ends the track as before.
    """
    if transceiver.kind != "audio":
        raise ValueError("decode_on_loop is for audio receivers (video decodes off the loop)")
    receiver = transceiver.receiver
    stand_in = _DecodeOnLoop(receiver, decode)
    receiver._RTCRtpReceiver__decoder_queue = stand_in  # type: ignore[attr-defined]


def negotiated_codec(transceiver: RTCRtpTransceiver) -> str | None:
    """The MIME type negotiated for ``transceiver`` (after the local description is set)."""
    codecs = transceiver._codecs
    return str(codecs[0].mimeType) if codecs else None


def audio_level_dbov(frame: AudioFrame) -> int:
    """RFC 6465's audio level of an s16 frame, as ``aiortc.rtp.compute_audio_level_dbov``.

    aiortc computes it in a Python loop over every sample of every outgoing audio frame (960
    a frame, 50 frames a second per call): about 6 % of the server's active CPU on idle calls.
    The same arithmetic in numpy gives the same integer.
    """
    return samples_level_dbov(np.frombuffer(memoryview(frame.planes[0]), np.int16)[: frame.samples])


def samples_level_dbov(samples: np.ndarray) -> int:
    """RFC 6465's audio level of int16 samples (mono, or interleaved): -127 for silence."""
    if not samples.size:
        return -127
    x = samples.astype(np.float64)
    rms = math.sqrt(float(np.dot(x, x)) / (samples.size * 32767 * 32767))
    if rms <= 0:
        return -127
    return round(min(0.0, max(-127.0, 20 * math.log10(rms))))


EncodedSource = Callable[[], Awaitable[tuple[bytes, int, int]]]
"""Gives the next encoded audio frame: (payload, RTP time, RFC 6465 level)."""


def send_encoded_audio(
    sender: RTCRtpSender,
    source: EncodedSource,
    on_rtp_origin: Callable[[int], None] | None = None,
) -> None:
    """Have ``sender`` send the frames ``source`` gives, already encoded, with their levels.

    aiortc's sender reads its track, then encodes each frame on an executor thread and waits
    for it (a thread hand-off both ways every 20 ms); it sends packets a track hands it as
    they are, but without their audio level. This sender's next frame comes from ``source``
    instead, level included; its track is no longer read. Only this sender changes.

    aiortc adds a random origin to the frames' RTP times and keeps it to itself; once the first
    packet is out, ``on_rtp_origin`` is told it (the RTP timestamp of media time 0), read back
    from the packet the sender last sent: what a client sees is then known here.
    """
    last: list[int] = []

    async def next_encoded_frame(codec: RTCRtpCodecParameters) -> RTCEncodedFrame | None:
        nonlocal on_rtp_origin
        if on_rtp_origin is not None and (origin := _rtp_origin(sender, last)) is not None:
            on_rtp_origin(origin)
            on_rtp_origin = None
        payload, timestamp, level = await source()
        if not sender._enabled:  # as aiortc: a disabled sender drops what it is given
            return None
        last[:] = [timestamp]
        return RTCEncodedFrame([payload], timestamp, level)

    sender._next_encoded_frame = next_encoded_frame  # type: ignore[method-assign]


def send_at_media_time(
    sender: RTCRtpSender,
    clock_rate: int,
    sleep_until: Callable[[float], Awaitable[None]],
    after_s: float = 0.0,
) -> None:
    """Have ``sender`` send each encoded frame at its media instant, not as soon as encoded.

    aiortc's sender takes a frame from its track, encodes it on an executor thread and sends
    the packets the moment the encode returns, so every frame leaves the encode's time (and two
    thread hand-offs) after it was taken: 5-15 ms, unevenly, on a busy server. A track that
    hands its frames over ahead of their instants (``AvatarVideoTrack``, by the scheduler's
    ``video_lead_s``) has them encoded meanwhile, and here each waits for its instant on the
    call's clock (``sleep_until(media seconds)``; a frame's RTP time without aiortc's random
    origin is its media time). A frame encoded after its instant goes at once, as before.
    ``after_s``: each frame waits that much past its instant instead (its RTP time unchanged).
    """
    next_frame = sender._next_encoded_frame

    async def next_encoded_frame(codec: RTCRtpCodecParameters) -> RTCEncodedFrame | None:
        frame = await next_frame(codec)
        if frame is not None:
            await sleep_until(frame.timestamp / clock_rate + after_s)
        return frame

    sender._next_encoded_frame = next_encoded_frame  # type: ignore[method-assign]


NTP_EPOCH_OFFSET_S = 2_208_988_800
"""Seconds from 1900 (NTP's epoch) to 1970 (Unix's)."""


def ntp_timestamp(unix_s: float) -> int:
    """A 64-bit NTP timestamp (32.32 fixed point) of a Unix time."""
    return round((unix_s + NTP_EPOCH_OFFSET_S) * (1 << 32)) & 0xFFFFFFFFFFFFFFFF


def stamp_sender_reports(
    sender: RTCRtpSender,
    clock_rate: int,
    wall_time_of: Callable[[float], float],
    on_frame_out: Callable[[float], None] | None = None,
) -> None:
    """Have ``sender``'s RTCP sender reports map RTP time to the media instant it belongs to.

    aiortc stamps a sender report with the wall-clock time its last packet left, so a frame that
    went out late (an encode that took long, a busy loop at the start of a call) makes the
    receiver believe that media instant was captured later; a browser that syncs audio to video
    by those reports then plays them apart, and its lip-sync moves only slowly back. Here the
    report's NTP time is ``wall_time_of(media seconds)`` for the RTP time it carries: give both
    tracks of a call the same mapping (their session clock's), and they are in step on the
    receiver whatever the lateness of either. The RTP time of media time 0 is read back from the
    first packet sent (aiortc adds a random origin it keeps to itself), and a first report goes
    out then, not 0.5-1.5 s later as aiortc's loop would: a receiver can line the streams up from
    the first second. None goes out before it (aiortc's loop would report NTP 0 for a track
    that has sent nothing yet). Each report's LSR is remembered as sent, so round-trip times from
    the receiver's reports still count.

    ``on_frame_out(media seconds)`` is told each frame's media instant as the sender takes it
    to send (its packets leave before the sender asks for the next).
    """
    origin: list[int] = []
    given: list[int] = []
    next_frame = sender._next_encoded_frame
    send_rtcp = sender._send_rtcp

    async def next_encoded_frame(codec: RTCRtpCodecParameters) -> RTCEncodedFrame | None:
        if not origin and (found := _rtp_origin(sender, given)) is not None:
            origin.append(found)
            # A first report now, not 0.5-1.5 s on: a receiver lines the streams up from it.
            sent = sender._RTCRtpSender__rtp_timestamp  # type: ignore[attr-defined]
            await send_reports([_first_report(sender, sent)])
        frame = await next_frame(codec)
        if frame is not None:
            if not origin:
                given[:] = [frame.timestamp]
            if on_frame_out is not None:  # a frame's own time is its media time (no origin)
                on_frame_out(frame.timestamp / clock_rate)
        return frame

    async def send_reports(packets: list[Any]) -> None:
        if not origin:
            if any(isinstance(p, rtp.RtcpSrPacket) for p in packets):
                # Nothing sent yet (an audio track that starts later): aiortc's loop would send
                # a report of NTP 0 and RTP 0, which a receiver takes as the stream's mapping.
                return
        else:
            for packet in packets:
                if isinstance(packet, rtp.RtcpSrPacket):
                    info = packet.sender_info
                    media_s = ((info.rtp_timestamp - origin[0]) & 0xFFFFFFFF) / clock_rate
                    info.ntp_timestamp = ntp_timestamp(wall_time_of(media_s))
                    sender._RTCRtpSender__lsr = (info.ntp_timestamp >> 16) & 0xFFFFFFFF  # type: ignore[attr-defined]
                    sender._RTCRtpSender__lsr_time = time.time()  # type: ignore[attr-defined]
        await send_rtcp(packets)

    sender._next_encoded_frame = next_encoded_frame  # type: ignore[method-assign]
    sender._send_rtcp = send_reports  # type: ignore[method-assign]


def _rtp_origin(sender: RTCRtpSender, given: list[int]) -> int | None:
    """The RTP timestamp of media time 0 on ``sender``, once a packet is out: aiortc adds a
    random origin to the frames' times and keeps it to itself, so it is read back from the
    packet the sender sent last, which holds ``given[0]``, the frame handed to its loop last
    (the loop sends the frame it has before it asks for the next). None until then."""
    if not given or sender._RTCRtpSender__packet_count == 0:  # type: ignore[attr-defined]
        return None
    sent: int = sender._RTCRtpSender__rtp_timestamp  # type: ignore[attr-defined]
    return (sent - given[0]) & 0xFFFFFFFF


def _first_report(sender: RTCRtpSender, rtp_timestamp: int) -> Any:
    """A sender report as aiortc's RTCP loop makes one, for the packets sent so far."""
    return rtp.RtcpSrPacket(
        ssrc=sender._ssrc,
        sender_info=rtp.RtcpSenderInfo(
            ntp_timestamp=0,  # stamped from the call's clock on the way out
            rtp_timestamp=rtp_timestamp,
            packet_count=sender._RTCRtpSender__packet_count & 0xFFFFFFFF,  # type: ignore[attr-defined]
            octet_count=sender._RTCRtpSender__octet_count & 0xFFFFFFFF,  # type: ignore[attr-defined]
        ),
    )


def ntp_time_now() -> int:
    """``aiortc.clock.current_ntp_time`` without datetime arithmetic: the same 64-bit NTP
    time of the wall clock, to the nanosecond before the fraction is truncated."""
    seconds, ns = divmod(time.time_ns(), 1_000_000_000)
    return ((seconds + NTP_EPOCH_OFFSET_S) << 32 | (ns << 32) // 1_000_000_000) & 0xFFFFFFFFFFFFFFFF


def use_fast_ntp_clock() -> None:
    """Have aiortc read the NTP time with :func:`ntp_time_now`: every sender asks for it for
    each packet's abs-send-time and each frame's next report, which through ``datetime`` was
    3 % of the event loop's time with eight calls speaking."""
    aiortc_clock.current_ntp_time = ntp_time_now


def use_fast_audio_level() -> None:
    """Have every aiortc sender of this process compute audio levels with numpy."""
    rtp.compute_audio_level_dbov = audio_level_dbov


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


RtpHandler = Callable[[Any, int], Awaitable[None]]
"""``async handler(packet, arrival_time_ms)``: how aiortc hands a receiver an RTP packet."""
RtcpHandler = Callable[[Any], Awaitable[None]]
"""``async handler(packet)``: how aiortc hands a receiver an RTCP packet."""


def wrap_rtp_handler(receiver: RTCRtpReceiver, wrap: Callable[[RtpHandler], RtpHandler]) -> None:
    """Put ``wrap(aiortc's handler)`` in front of every RTP packet ``receiver`` gets (the
    benchmarks time packets by arrival; aiortc has no public hook for it).

    The packet is an ``aiortc.rtp.RtpPacket`` (``timestamp``, ``marker``, ``payload_type``,
    ``ssrc``), as it comes off the transport: RTX retransmissions included, in arrival order.
    The wrapper should await the handler it was given, or aiortc never sees the packet.
    """
    receiver._handle_rtp_packet = wrap(receiver._handle_rtp_packet)  # type: ignore[method-assign,assignment]


def wrap_rtcp_handler(receiver: RTCRtpReceiver, wrap: Callable[[RtcpHandler], RtcpHandler]) -> None:
    """Put ``wrap(aiortc's handler)`` in front of every RTCP packet ``receiver`` gets (the
    benchmarks read the sender reports; aiortc has no public hook for them). The wrapper should
    await the handler it was given."""
    receiver._handle_rtcp_packet = wrap(receiver._handle_rtcp_packet)  # type: ignore[method-assign,assignment]


def stop_decoding(receiver: RTCRtpReceiver) -> None:
    """Stop ``receiver``'s decoder thread; packets keep flowing through everything else.

    aiortc hands every complete encoded frame to a decoder thread as soon as ``receive()``
    starts, whether or not anyone reads the track. The benchmarks' light callers count video
    frames without decoding them. SRTP, RTCP receiver reports, NACKs, REMB and the jitter
    buffer go on as before, so the sender sees an ordinary receiver; only the decoding (and so
    the track's frames) stops, and the track ends. ``_handle_disconnect`` is what aiortc itself
    calls when the transport goes away: it stops the decoder and nothing else. Call it once
    ``receive()`` has run, e.g. from a ``wrap_rtp_handler`` wrapper on the first packet.
    """
    receiver._handle_disconnect()


def selected_candidate_pair(transport: RTCIceTransport) -> tuple[Candidate, Candidate] | None:
    """The (local, remote) candidates of the pair ICE nominated on ``transport`` for its RTP
    component (None before one is): what a browser's stats call the selected pair. aiortc's
    ``getStats()`` has no candidate-pair entries; aioice keeps the nominated pairs privately.
    """
    pair = transport._connection._nominated.get(1)
    return None if pair is None else (pair.local_candidate, pair.remote_candidate)


DatagramObserver = Callable[[bytes, float], None]
"""``observer(datagram, arrival)``: a datagram as it came off the socket (SRTP, SRTCP, DTLS or
STUN), and when the kernel received it, on :func:`time.monotonic`'s scale."""
_SIOCGSTAMPNS = 0x8907
"""Linux: when the last datagram read from a socket was received (a ``timespec``)."""
_observers: weakref.WeakKeyDictionary[Any, DatagramObserver] = weakref.WeakKeyDictionary()
_original_datagram_received = aioice.ice.StunProtocol.datagram_received


def observe_datagrams(transceiver: RTCRtpTransceiver, observer: DatagramObserver) -> None:
    """Show ``observer`` every datagram the transceiver's ICE connection receives, with the
    time the kernel received it, before aiortc reads it.

    A process holding many callers (``bench load``) reads packets late when its own event
    loop is busy; the kernel's receive time is when the server's packet arrived, whatever the
    caller was doing. On loopback that is the moment the server sent it. aioice reads its
    sockets in ``StunProtocol.datagram_received`` (one datagram a call), so that method is
    replaced once for the process; connections nobody observes pass straight through. Where
    the kernel keeps no receive time (not Linux, or before timestamps were on for the
    socket) the arrival is the moment of reading.
    """
    connection = transceiver.receiver.transport.transport._connection
    _observers[connection] = observer
    if aioice.ice.StunProtocol.datagram_received is _original_datagram_received:
        aioice.ice.StunProtocol.datagram_received = _observed_datagram_received  # type: ignore[method-assign]


def _observed_datagram_received(
    self: aioice.ice.StunProtocol, data: bytes | str, addr: tuple[Any, ...]
) -> None:
    observer = _observers.get(self.receiver)
    if observer is not None and isinstance(data, bytes):
        observer(data, kernel_arrival(self.transport.get_extra_info("socket")))
    _original_datagram_received(self, data, addr)


def kernel_arrival(sock: Any) -> float:
    """When the kernel received the datagram last read from ``sock`` (a socket, or asyncio's
    wrapper of one), on :func:`time.monotonic`'s scale (now, where it cannot say)."""
    if sock is None:
        return time.monotonic()
    try:
        raw = fcntl.ioctl(sock.fileno(), _SIOCGSTAMPNS, bytes(16))
    except OSError:  # no stamp yet: the first call turns them on for the socket
        return time.monotonic()
    seconds, nanoseconds = struct.unpack("qq", raw)
    # The stamp is on the wall clock: matched to the monotonic one by a reading of both that
    # was not interrupted (a thread preempted between them would shift every arrival).
    for _ in range(3):
        before, wall, after = time.monotonic(), time.time(), time.monotonic()
        if after - before < 0.001:
            break
    received: float = seconds + nanoseconds / 1e9 - wall + (before + after) / 2
    return min(received, after)
