"""An in-process aiortc caller for tests and benchmarks: connects to a server, records media.

Frames are timed by the arrival of their first RTP packet, not by when aiortc's receiver hands
them over (its jitter buffers hold audio and video for different times). With
``decode_video=False`` (load runs) video frames are only counted, by the arrival of the first
packet of each new RTP timestamp, and never decoded. With ``kernel_arrivals=True`` (load runs
too) a packet's arrival is when the kernel received it, not when this process's event loop got
to it: many callers in one process read their packets late whenever that loop is busy, which
says nothing about the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import fractions
import functools
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import aiohttp
import av
import numpy as np
from aioice import Candidate
from aiortc import (
    RTCIceServer,
    RTCIceTransportPolicy,
    RTCPeerConnection,
    RTCRtpCodecParameters,
    RTCRtpSender,
    RTCSessionDescription,
)
from aiortc.mediastreams import AudioStreamTrack, MediaStreamError, MediaStreamTrack
from aiortc.rtcconfiguration import RTCConfiguration

from rtc_server.aiortc_compat import (
    decode_on_loop,
    negotiated_codec,
    observe_datagrams,
    restrict_host_addresses,
    selected_candidate_pair,
    send_encoded_audio,
    stop_decoding,
    use_fast_audio_level,
    wrap_rtcp_handler,
    wrap_rtp_handler,
)
from rtc_server.media.inbound import MicDecoder
from rtc_server.media.opus import ReplyOpusEncoder

_NO_IMAGE = np.zeros((0, 0, 3), np.uint8)
_KERNEL_TIMES_KEPT = 4096


class DecodedAudio(NamedTuple):
    """One received 20 ms frame of the server's audio, as the receiver's track hands it."""

    pts: int
    """RTP time from the stream's first packet (aiortc's mapping, as a decoded frame's pts)."""
    samples: np.ndarray
    """Mono int16 at 48 kHz."""


class ReplyAudioDecoder:
    """The server's audio decoded on the event loop as it arrives (``decode_on_loop``), by the
    server's own microphone decoder at 48 kHz (``inbound.MicDecoder``): Opus, what the server
    sends, by libopus straight to mono (the same samples as aiortc's stereo decode's first
    channel: the stream is mono), without aiortc's decoder thread and its two hand-offs and a
    PyAV frame per 20 ms; other codecs through aiortc's decoder, brought to mono 48 kHz. Many
    callers share one process in ``bench load``: what each costs is CPU the server on the
    same machine does not get.
    """

    def __init__(self) -> None:
        self._decode = MicDecoder(48_000)

    def __call__(self, codec: RTCRtpCodecParameters, encoded_frame: Any) -> list[DecodedAudio]:
        pieces = [audio.samples for audio in self._decode(codec, encoded_frame)]
        if not pieces:
            return []  # undecodable: logged and skipped, as the server does
        samples = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        return [DecodedAudio(int(encoded_frame.timestamp), samples)]


async def make_offer(*, audio: bool = True, video: bool = True) -> str:
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    try:
        if audio:
            pc.addTransceiver("audio", direction="recvonly")
        if video:
            pc.addTransceiver("video", direction="recvonly")
        pc.createDataChannel("events")
        await pc.setLocalDescription(await pc.createOffer())
        return str(pc.localDescription.sdp)
    finally:
        await pc.close()


async def fetch_ice_servers(url: str, headers: dict[str, str] | None = None) -> list[RTCIceServer]:
    """The ICE servers the server at ``url`` hands its callers (``GET /ice-servers``), TURN
    credentials included, as aiortc takes them."""
    async with aiohttp.ClientSession(headers=headers) as http:
        async with http.get(url + "/ice-servers") as resp:
            body = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"/ice-servers refused ({resp.status}): {body}")
    return [
        RTCIceServer(
            urls=entry["urls"], username=entry.get("username"), credential=entry.get("credential")
        )
        for entry in body["iceServers"]
    ]


@dataclass
class Received:
    video: list[tuple[float, int, np.ndarray]] = field(default_factory=list)
    """(arrival s, RTP timestamp, RGB image) per decoded frame; the image is empty (0x0) when
    video is not converted (``record_video=False``) or not decoded (``decode_video=False``)."""
    audio: list[tuple[float, int, np.ndarray]] = field(default_factory=list)
    """(arrival s, RTP timestamp, mono int16 at 48 kHz) per decoded 20 ms frame."""
    video_read: list[float] = field(default_factory=list)
    """Without decoding: when this process read each counted frame's first packet (with
    kernel arrivals, ``video`` holds when it arrived)."""


class OfferRefused(RuntimeError):
    """The server answered the offer with an error (``503 at_capacity``, ``429``...)."""

    def __init__(self, status: int, answer: Any) -> None:
        super().__init__(f"offer refused ({status}): {answer}")
        self.status = status
        error = answer.get("error", {}) if isinstance(answer, dict) else {}
        self.code = str(error.get("code", ""))
        self.message = str(error.get("message", ""))


class CallClient:
    """A caller: offers audio (sendrecv) + video (recvonly) + the ``events`` data channel."""

    def __init__(
        self,
        url: str,
        *,
        microphone: MediaStreamTrack | None = None,
        record_video: bool = True,
        decode_video: bool = True,
        ice_address: str | None = "127.0.0.1",
        headers: dict[str, str] | None = None,
        visemes: bool = False,
        ice_servers: Sequence[RTCIceServer] | None = None,
        relay_only: bool = False,
        kernel_arrivals: bool = False,
    ) -> None:
        """``headers`` go with every HTTP request of the call (a token, a proxy's headers);
        ``visemes`` asks for the viseme stream in both forms (JSON events, binary channel).
        ``ice_servers``: STUN/TURN servers (none by default; aiortc uses the first TURN URL
        only); ``relay_only`` gathers relay candidates alone (``iceTransportPolicy: "relay"``),
        so every packet of the call goes through that TURN server. ``kernel_arrivals``: RTP
        packets are timed by the kernel's receive time (see the module's text)."""
        # Benchmarks and tests keep every packet on loopback; aioice skips it unless told.
        if ice_address is not None:
            restrict_host_addresses([ice_address])
        # aiortc's audio level is a Python loop over every sample sent (the server's too).
        use_fast_audio_level()
        self.url = url
        self.headers = dict(headers or {})
        policy = RTCIceTransportPolicy.RELAY if relay_only else RTCIceTransportPolicy.ALL
        self.pc = RTCPeerConnection(
            RTCConfiguration(iceServers=list(ice_servers or []), iceTransportPolicy=policy)
        )
        self.microphone = microphone or AudioStreamTrack()
        self.session_id = ""
        self.resume_credential = ""
        """From the answer: what resumes this call on a new peer connection ("": it cannot)."""
        self.events: list[dict[str, Any]] = []
        self.received = Received()
        self.record = True
        self.record_video = record_video
        """False: video is received and decoded but not converted or kept."""
        self.decode_video = decode_video
        """False: video frames are counted by RTP arrival and never decoded (``bench load``)."""
        self.sender_reports: list[tuple[str, float, int, int]] = []
        """(kind, arrival, NTP timestamp, RTP timestamp) of each RTCP sender report received."""
        self._last_video_ts: int | None = None
        self._arrivals: dict[tuple[str, int], float] = {}
        self.kernel_arrivals = kernel_arrivals
        self._kernel_times: dict[tuple[int, int], float] = {}
        """(SSRC, sequence number) -> the kernel's receive time, for packets not yet handled."""
        self._origins: dict[str, int] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._event_signal = asyncio.Event()
        self._cursor = 0
        self.channel = self.pc.createDataChannel("events")
        self.channel.on("message", self._on_message)
        self.visemes = visemes
        self.viseme_events: list[tuple[float, dict[str, Any]]] = []
        """(arrival, event) of each ``viseme`` event, as they came."""
        self.viseme_binary: list[tuple[float, bytes]] = []
        """(arrival, message) of each message on the ``visemes`` channel."""
        if visemes:
            binary = self.pc.createDataChannel("visemes")
            binary.on("message", self._on_viseme_message)
        self.pc.on("track", self._on_track)

    def _on_message(self, message: str | bytes) -> None:
        event = json.loads(message)
        if event.get("type") == "viseme":
            self.viseme_events.append((time.monotonic(), event))
            return  # fifty a second: kept apart from the conversation's events
        self.events.append(event)
        self._event_signal.set()

    def _on_viseme_message(self, message: str | bytes) -> None:
        if isinstance(message, bytes):
            self.viseme_binary.append((time.monotonic(), message))

    def audio_arrival(self, rtp: int) -> float | None:
        """When the audio packet of RTP timestamp ``rtp`` arrived (None: it did not)."""
        return self._arrivals.get(("audio", rtp))

    def reported_time(self, kind: str, rtp: int, clock_rate: int) -> float | None:
        """When the sender says RTP time ``rtp`` of ``kind`` was (its last sender report's
        mapping, in NTP seconds); None before a report came."""
        last = [(ntp, ts) for k, _, ntp, ts in self.sender_reports if k == kind]
        if not last:
            return None
        ntp, ts = last[-1]
        ahead = ((rtp - ts + 2**31) % 2**32) - 2**31
        return ntp / 2**32 + ahead / clock_rate

    def audio_rtp(self, pts: int) -> int:
        """The RTP timestamp of a received audio frame's ``pts``."""
        return self.rtp_of("audio", pts)

    def first_arrival(self, kind: str) -> float | None:
        """When the first packet of ``kind`` arrived (None: none did)."""
        origin = self._origins.get(kind)
        return None if origin is None else self._arrivals.get((kind, origin))

    def rtp_of(self, kind: str, pts: int) -> int:
        """The RTP timestamp of a received ``kind`` frame's ``pts``."""
        return (self._origins.get(kind, 0) + pts) & 0xFFFFFFFF

    def _on_track(self, track: MediaStreamTrack) -> None:
        if track.kind == "video" and not self.decode_video:
            return  # its decoder is stopped at the first packet: the track only ends
        self._tasks.append(asyncio.ensure_future(self._consume(track)))

    async def _consume(self, track: MediaStreamTrack) -> None:
        with contextlib.suppress(MediaStreamError):
            while True:
                frame = await track.recv()
                assert isinstance(frame, (av.VideoFrame, DecodedAudio)) and frame.pts is not None
                # aiortc rebases decoded pts to the first RTP timestamp it saw (TimestampMapper).
                origin = self._origins.get(track.kind, 0)
                rtp = (origin + frame.pts) & 0xFFFFFFFF
                arrival = self._arrivals.get((track.kind, rtp))
                if arrival is None:
                    raise RuntimeError(f"{track.kind} frame with no packet: pts {frame.pts}")
                if not self.record:
                    continue
                if isinstance(frame, av.VideoFrame):
                    # Without images (load runs) the arrival times are still kept.
                    image = frame.to_ndarray(format="rgb24") if self.record_video else _NO_IMAGE
                    self.received.video.append((arrival, frame.pts, image))
                else:
                    self.received.audio.append((arrival, frame.pts, frame.samples))

    def _watch_arrivals(self) -> None:
        for transceiver in self.pc.getTransceivers():
            receiver, kind = transceiver.receiver, transceiver.kind
            if kind == "video" and not self.decode_video:
                wrap_rtp_handler(receiver, functools.partial(self._counted, receiver))
            else:
                wrap_rtp_handler(receiver, functools.partial(self._timed, kind))
            wrap_rtcp_handler(receiver, functools.partial(self._reports, kind))

    def _timed(self, kind: str, handler: Any) -> Any:
        async def handle(packet: Any, arrival_time_ms: int) -> None:
            arrival = self._arrival_of(packet)
            self._origins.setdefault(kind, packet.timestamp)
            self._arrivals.setdefault((kind, packet.timestamp), arrival)
            await handler(packet, arrival_time_ms)

        return handle

    def _reports(self, kind: str, handler: Any) -> Any:
        async def handle(packet: Any) -> None:
            info = getattr(packet, "sender_info", None)
            if info is not None:
                report = (kind, time.monotonic(), info.ntp_timestamp, info.rtp_timestamp)
                self.sender_reports.append(report)
            await handler(packet)

        return handle

    def _counted(self, receiver: Any, handler: Any) -> Any:
        """Video without decoding: one frame per new RTP timestamp, timed by its first packet.

        Retransmissions and late packets of earlier frames carry older timestamps and are not
        counted again (timestamps compared modulo 2**32). The packets still go through aiortc
        (receiver reports, NACKs, REMB), all but the decoder, which the first packet stops.
        """

        async def handle(packet: Any, arrival_time_ms: int) -> None:
            arrival = self._arrival_of(packet)
            ts = packet.timestamp
            if self._last_video_ts is None:
                stop_decoding(receiver)
                self._origins["video"] = ts
                self._last_video_ts = ts - 1
            if 0 < (ts - self._last_video_ts) & 0xFFFFFFFF < 2**31:
                self._last_video_ts = ts
                if self.record:
                    rtp = (ts - self._origins["video"]) & 0xFFFFFFFF
                    self.received.video.append((arrival, rtp, _NO_IMAGE))
                    self.received.video_read.append(time.monotonic())
            await handler(packet, arrival_time_ms)

        return handle

    def _on_datagram(self, data: bytes, arrival: float) -> None:
        """Keep the kernel's receive time of each RTP packet until its handler asks for it."""
        if len(data) < 12 or data[0] >> 6 != 2 or 64 <= data[1] & 0x7F < 96:
            return  # not RTP: STUN, DTLS, or RTCP (payload types 64-95 with its marker bit)
        key = (int.from_bytes(data[8:12], "big"), int.from_bytes(data[2:4], "big"))
        self._kernel_times[key] = arrival
        if len(self._kernel_times) > _KERNEL_TIMES_KEPT:  # packets aiortc dropped: the oldest
            del self._kernel_times[next(iter(self._kernel_times))]

    def _arrival_of(self, packet: Any) -> float:
        if self.kernel_arrivals:
            arrival = self._kernel_times.pop((packet.ssrc, packet.sequence_number), None)
            if arrival is not None:
                return arrival
        return time.monotonic()

    async def connect(
        self,
        *,
        video_codecs: Sequence[str] | None = None,
        before_answer: Callable[[str], Awaitable[None]] | None = None,
        rewrite_offer: Callable[[str], str] | None = None,
        rewrite_answer: Callable[[str], str] | None = None,
        resume: tuple[str, str] | None = None,
    ) -> str:
        """Offer and connect; ``video_codecs`` (mimeTypes) restricts what the offer accepts.

        ``before_answer`` sees the answer's SDP before it is applied (and ICE checks begin).
        ``rewrite_offer`` and ``rewrite_answer`` may change the SDPs (e.g. their candidates):
        the offer before it is sent, the answer before ``before_answer`` sees it.
        ``resume``: (session id, resume credential) of a call whose link was lost, to carry it
        on over this client's new peer connection (``POST /sessions/{id}/resume``).
        """
        audio = self.pc.addTransceiver(self.microphone, direction="sendrecv")
        decode_on_loop(audio, ReplyAudioDecoder())
        video = self.pc.addTransceiver("video", direction="recvonly")
        if video_codecs is not None:
            caps = RTCRtpSender.getCapabilities("video").codecs
            video.setCodecPreferences([c for c in caps if c.mimeType in video_codecs])
        self._watch_arrivals()
        await self.pc.setLocalDescription(await self.pc.createOffer())
        sdp = self.pc.localDescription.sdp
        body: dict[str, Any] = {"sdp": rewrite_offer(sdp) if rewrite_offer else sdp}
        body["type"] = "offer"
        if self.visemes:
            body["visemes"] = True
        route = "/offer"
        if resume is not None:
            route = f"/sessions/{resume[0]}/resume"
            body["resume"] = resume[1]
        async with aiohttp.ClientSession(headers=self.headers) as http:
            async with http.post(self.url + route, json=body) as resp:
                answer = await resp.json()
                if resp.status != 200:
                    raise OfferRefused(resp.status, answer)
        self.resume_credential = str(answer.get("resume", ""))
        if rewrite_answer is not None:
            answer["sdp"] = rewrite_answer(answer["sdp"])
        if before_answer is not None:
            await before_answer(answer["sdp"])
        await self.pc.setRemoteDescription(RTCSessionDescription(answer["sdp"], "answer"))
        if isinstance(self.microphone, Microphone) and negotiated_codec(audio) == "audio/opus":
            # Encoded as the track gives it, on the loop (see Microphone.next_encoded).
            send_encoded_audio(audio.sender, self.microphone.next_encoded)
        if self.kernel_arrivals:
            # After the answer: BUNDLE has put every transceiver on one ICE connection.
            for transceiver in self.pc.getTransceivers():
                observe_datagrams(transceiver, self._on_datagram)
        self.session_id = answer["session_id"]
        return self.session_id

    def selected_pair(self) -> tuple[Candidate, Candidate] | None:
        """(local, remote) candidates of the pair ICE nominated (None before one is); every
        stream and the data channel share it (BUNDLE)."""
        return selected_candidate_pair(self.channel.transport.transport.transport)

    def video_codec(self) -> str | None:
        for t in self.pc.getTransceivers():
            if t.kind == "video" and (codec := negotiated_codec(t)) is not None:
                return codec
        return None

    async def say(self, text: str, *, interrupt: bool = False) -> str:
        async with aiohttp.ClientSession(headers=self.headers) as http:
            url = f"{self.url}/sessions/{self.session_id}/say"
            async with http.post(url, json={"text": text, "interrupt": interrupt}) as resp:
                body = await resp.json()
                if resp.status != 202:
                    raise RuntimeError(f"say refused ({resp.status}): {body}")
                return str(body["utterance_id"])

    async def wait_event(
        self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 10.0
    ) -> dict[str, Any]:
        """The next event after the last one matched that satisfies ``predicate``."""
        deadline = time.monotonic() + timeout
        while True:
            for index in range(self._cursor, len(self.events)):
                if predicate(self.events[index]):
                    self._cursor = index + 1
                    return self.events[index]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no matching event; got {self.events}")
            self._event_signal.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._event_signal.wait(), remaining)

    def skip_events(self) -> None:
        """Let ``wait_event`` look only at events that come after now."""
        self._cursor = len(self.events)

    async def wait_state(self, state: str, timeout: float = 10.0) -> None:
        await self.wait_event(lambda e: e == {"type": "state", "state": state}, timeout)

    async def wait_channel_open(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while self.channel.readyState != "open":
            if time.monotonic() > deadline:
                raise TimeoutError("events channel did not open")
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        await self.pc.close()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


_SILENT_FRAME = np.zeros(960, np.int16)
_SILENT_FRAME.flags.writeable = False


class Microphone(MediaStreamTrack):
    """A caller's microphone that says what it is given, in real time, and silence otherwise.

    ``play`` queues 48 kHz mono int16 audio; ``sent_at(sample)`` tells when the 20 ms frame
    holding that sample (counted from the start of the ``play``) went to the network.
    """

    kind = "audio"

    def __init__(self) -> None:
        super().__init__()
        self._queue: list[np.ndarray] = []
        self._start: float | None = None
        self._index = 0
        self._plays: list[tuple[int, int]] = []
        """(first frame index, samples) of each play."""
        self._frame_times: dict[int, float] = {}
        self._encoder: ReplyOpusEncoder | None = None

    def play(self, pcm: np.ndarray) -> int:
        """Queue ``pcm``; returns a handle for ``sent_at``."""
        frames = [pcm[i : i + 960] for i in range(0, len(pcm), 960)]
        frames[-1] = np.pad(frames[-1], (0, 960 - len(frames[-1])))
        first = self._index + sum(1 for _ in self._queue)
        self._queue.extend(frames)
        self._plays.append((first, len(pcm)))
        return len(self._plays) - 1

    def _frame_of(self, handle: int, sample: int) -> int:
        """The frame holding ``sample`` of play ``handle``."""
        first, _ = self._plays[handle]
        return first + sample // 960

    def _due(self, index: int) -> float:
        assert self._start is not None
        return self._start + index * 0.020

    def sent_at(self, handle: int, sample: int) -> float | None:
        return self._frame_times.get(self._frame_of(handle, sample))

    def lag_at(self, handle: int, sample: int) -> float | None:
        """How late (s) the frame holding ``sample`` of play ``handle`` was sent after its due
        time (the pace is absolute: after a stall the frames due meanwhile go out at once)."""
        index = self._frame_of(handle, sample)
        sent = self._frame_times.get(index)
        return None if sent is None else sent - self._due(index)

    @property
    def busy(self) -> bool:
        return bool(self._queue)

    async def _next(self) -> tuple[np.ndarray, int]:
        """The next 20 ms frame, at its time: (48 kHz mono int16 samples, pts in samples)."""
        if self.readyState != "live":
            raise MediaStreamError
        if self._start is None:
            self._start = time.monotonic()
        delay = self._due(self._index) - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        pcm = self._queue.pop(0) if self._queue else _SILENT_FRAME
        self._frame_times[self._index] = time.monotonic()
        pts = self._index * 960
        self._index += 1
        return pcm, pts

    async def recv(self) -> av.AudioFrame:
        pcm, pts = await self._next()
        frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = 48_000
        frame.pts = pts
        frame.time_base = fractions.Fraction(1, 48_000)
        return frame

    async def next_encoded(self) -> tuple[bytes, int, int]:
        """The next frame as Opus (payload, RTP time, audio level), for a sender that sends
        what it is given (``aiortc_compat.send_encoded_audio``; the caller does so when Opus is
        negotiated): mono at 64 kb/s by libopus on the loop, as a browser sends a microphone,
        silence replayed once it has lasted (the server's reply encoder, ``ReplyOpusEncoder``),
        instead of aiortc's stereo encode on an executor thread for every frame."""
        pcm, pts = await self._next()
        if self._encoder is None:
            self._encoder = ReplyOpusEncoder()
        return self._encoder.encode_samples(pcm, pts)
