"""Real calls over a bad network: packet loss, jitter and outages (issue 7, "bad networks").

Every call goes through :mod:`tests.netrelay`, a seeded UDP relay on 127.0.0.1 that is the only
path between the caller and the server (checked: both ICE agents nominated the relay's sockets,
and the caller received exactly the RTP packets the relay sent on). The server runs the
``sync-test`` engine, so the A/V offset is measured exactly (a flash and a beep on the same
instant once a second, as in ``bench sync``) while the network misbehaves.

What is measured, and where:

- **Video recovery after a loss**: from the moment the relay dropped a video packet to the
  moment the caller had it again (the server's retransmission, RTX, answering a NACK), or the
  first keyframe after it. After an outage: from its end to the first decoded frame the server
  sent after it (frames are placed on the sender's timeline by their RTP timestamps).
- **Audio**: audio is not retransmitted, so a lost packet is 20 ms missing; what is checked is
  that the server never stopped sending (every missing audio packet is one the relay dropped),
  that no run of missing audio is longer than 200 ms, and that no wait between audio packets
  reaching the caller is longer than 200 ms beyond the longest stall of the test's own event
  loop (server, relay and caller share it on a 2-core machine). aiortc's receiver then throws
  away the 4 packets its jitter buffer holds before each lost one (100 ms per loss, see
  :class:`AudioCheck`); a browser conceals the loss instead, so that is reported, not checked.
- **A/V offset**: each flash minus its beep, in the caller's arrival-anchored RTP timelines,
  skipping a flash or beep whose preceding frame was lost (its onset would read late).

The caller is aiortc's, with one change to make it behave like a browser: aiortc asks for a
missing video packet once (a NACK when the gap shows) and never again, so a lost NACK or a lost
retransmission would stall its video until the next, unrelated loss. Browsers (libwebrtc's
``NackRequester``) ask again about every round trip, up to 10 times; :class:`NetCaller` asks
again every 50 ms, so what is measured is the server's answer, not aiortc's receiver.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import av
import numpy as np
import pytest
from aiortc.mediastreams import MediaStreamTrack

from benchmarks.analysis import (
    beep_onsets,
    flash_onsets,
    frame_times,
    loud_frames,
    paired_offsets_ms,
)
from benchmarks.client import CallClient
from benchmarks.sync import OPUS_DECODER_DELAY_S, sync_test_factory
from tests.conftest import LiveServer, start_server
from tests.netrelay import Impairment, NetRelay
from tests.reliability import trials
from tests.waiting import holds_within, wait_for_video

SEED = 7
AV_BOUND_MS = 45.0
"""The call issue's A/V bound."""
RECOVERY_BOUND_MS = 1000.0
MIN_FPS = 20.0
"""Of the 25 sent; the bounds are the issues', not tighter, so a loaded machine still passes."""
MAX_AUDIO_GAP_MS = 200.0
NACK_RETRY_S = 0.050
NACK_TRIES = 10
VIDEO_CLOCK = 90_000
AUDIO_CLOCK = 48_000


@dataclass
class Delivered:
    at: float
    """time.monotonic() when aiortc's receiver handed the decoded frame over."""
    kind: str
    pts: int
    key: bool


@dataclass
class Packet:
    at: float
    kind: str
    payload_type: int
    seq: int
    """For a retransmission (RTX): the sequence number of the packet it repeats."""
    timestamp: int
    rtx: bool


@dataclass(frozen=True)
class AudioCheck:
    arrival_gap_ms: float
    """Longest time between two audio packets reaching the caller."""
    hole_ms: float
    """Longest run of audio packets that never arrived (the media missing, not the wait)."""
    unexplained: int
    """Audio packets missing that the relay did not drop: the server stopped sending."""
    decoded_hole_ms: float
    """Longest hole in the audio aiortc's receiver decoded: its jitter buffer throws away
    the 4 packets it holds before a lost one, so each loss costs 100 ms there. A browser
    conceals a loss instead (NetEq); this is the test caller's, not the server's."""
    loop_stall_ms: float
    """Longest stall of the test's event loop meanwhile (a busy machine): a gap in arrivals
    that long is the process's, not the network's."""

    def __str__(self) -> str:
        return (
            f"audio: arrival gap max {self.arrival_gap_ms:.0f} ms (loop stall "
            f"{self.loop_stall_ms:.0f} ms), longest hole {self.hole_ms:.0f} ms, "
            f"{self.unexplained} unexplained, decoded hole (aiortc) {self.decoded_hole_ms:.0f} ms"
        )

    def check(self) -> None:
        assert self.unexplained == 0, "the server stopped sending audio"
        assert self.hole_ms <= MAX_AUDIO_GAP_MS
        assert self.arrival_gap_ms <= MAX_AUDIO_GAP_MS + self.loop_stall_ms


class _Tap:
    """A track that notes when each decoded frame was handed over."""

    def __init__(self, track: MediaStreamTrack, log: list[Delivered]) -> None:
        self.kind = track.kind
        self._track = track
        self._log = log

    async def recv(self) -> Any:
        frame = await self._track.recv()
        key = isinstance(frame, av.VideoFrame) and bool(frame.key_frame)
        self._log.append(Delivered(time.monotonic(), self.kind, int(frame.pts or 0), key))
        return frame


def _payload_types(sdp: str) -> dict[str, set[int]]:
    """``{"audio": {...}, "video": {...}, "rtx": {...}}`` from an SDP's rtpmap lines."""
    out: dict[str, set[int]] = {"audio": set(), "video": set(), "rtx": set()}
    kind = ""
    for line in sdp.split("\r\n"):
        if line.startswith("m="):
            kind = line[2:].split(" ")[0]
        match = re.match(r"a=rtpmap:(\d+) ([^/]+)/", line)
        if match and kind in ("audio", "video"):
            out["rtx" if match.group(2).lower() == "rtx" else kind].add(int(match.group(1)))
    return out


class Window(NamedTuple):
    """An impaired stretch of a call, measured."""

    start: float
    end: float
    fps: float
    undecoded: int
    audio: AudioCheck
    offsets: np.ndarray


class NetCaller(CallClient):
    """CallClient that connects through a relay and notes packets, decoded frames and NACKs."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.delivered: list[Delivered] = []
        self.packets: list[Packet] = []
        self.payload_types: dict[str, set[int]] = {}
        self.video_ssrc: int | None = None
        self.nacks_repeated = 0
        self._renacker: asyncio.Task[None] | None = None

    async def _consume(self, track: MediaStreamTrack) -> None:
        await super()._consume(_Tap(track, self.delivered))  # type: ignore[arg-type]

    def _timed(self, kind: str, handler: Any) -> Any:
        inner = super()._timed(kind, handler)

        async def handle(packet: Any, arrival_time_ms: int) -> None:
            rtx = packet.payload_type in self.payload_types.get("rtx", ())
            seq = int.from_bytes(packet.payload[:2], "big") if rtx else packet.sequence_number
            if kind == "video" and not rtx:
                self.video_ssrc = packet.ssrc
            self.packets.append(
                Packet(time.monotonic(), kind, packet.payload_type, seq, packet.timestamp, rtx)
            )
            await inner(packet, arrival_time_ms)

        return handle

    async def connect_through(self, relay: NetRelay) -> None:
        async def keep(answer: str) -> None:
            self.payload_types = _payload_types(answer)

        await self.connect(
            rewrite_offer=relay.rewrite_offer,
            rewrite_answer=relay.rewrite_answer,
            before_answer=keep,
        )
        self._renacker = asyncio.ensure_future(self._renack())

    async def _renack(self) -> None:
        """Ask again for video packets still missing, as browsers do (aiortc asks once)."""
        receiver = next(t.receiver for t in self.pc.getTransceivers() if t.kind == "video")
        missing: set[int] = receiver._RTCRtpReceiver__nack_generator.missing  # type: ignore[attr-defined]
        asked: dict[int, tuple[float, int]] = {}
        while True:
            await asyncio.sleep(NACK_RETRY_S)
            now = time.monotonic()
            for seq in [s for s in asked if s not in missing]:
                del asked[seq]
            again = []
            for seq in sorted(missing):
                last, tries = asked.setdefault(seq, (now, 1))  # aiortc asked when it saw the gap
                if now - last >= NACK_RETRY_S and tries < NACK_TRIES:
                    asked[seq] = (now, tries + 1)
                    again.append(seq)
            if again and self.video_ssrc is not None:
                self.nacks_repeated += 1
                await receiver._send_rtcp_nack(self.video_ssrc, again)

    async def request_keyframe(self) -> None:
        """A PLI, as a browser sends when it cannot repair its picture."""
        receiver = next(t.receiver for t in self.pc.getTransceivers() if t.kind == "video")
        assert self.video_ssrc is not None
        await receiver._send_rtcp_pli(self.video_ssrc)

    async def close(self) -> None:
        if self._renacker is not None:
            self._renacker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renacker
        await super().close()


def _nominated_remotes(pc: Any) -> set[int]:
    ports = set()
    for transceiver in pc.getTransceivers():
        connection = transceiver.receiver.transport.transport._connection
        ports |= {pair.remote_addr[1] for pair in connection._nominated.values()}
    return ports


@dataclass
class NetCall:
    server: LiveServer
    relay: NetRelay
    client: NetCaller
    marks: dict[str, float] = field(default_factory=dict)
    loop_lags: list[tuple[float, float]] = field(default_factory=list)

    @property
    def session(self) -> Any:
        return self.server.manager.sessions.get(self.client.session_id)

    def alive(self) -> bool:
        for task in self.client._tasks:  # the caller's track readers
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise AssertionError("the caller stopped reading a track") from task.exception()
        session = self.session
        return (
            session is not None
            and not session.closed
            and session.pc.connectionState == "connected"
            and self.client.pc.connectionState == "connected"
        )

    def assert_only_path(self) -> None:
        """Both agents talk to the relay's sockets, and nothing reached the caller around it."""
        assert _nominated_remotes(self.client.pc) <= self.relay.caller_facing_ports
        assert _nominated_remotes(self.session.pc) <= self.relay.server_facing_ports
        sent_on = self.relay.down.stats.forwarded["rtp"]
        assert len(self.client.packets) == sent_on, (len(self.client.packets), sent_on)

    async def cut_and_count(self) -> None:
        """Cut the link, let the packets in flight land, then check the path."""
        self.relay.outage(60.0)
        await holds_within(lambda: not self.relay.in_flight, 2.0)
        await asyncio.sleep(0.2)
        self.assert_only_path()

    async def impaired(
        self,
        both_ways: Impairment,
        seconds: float = 8.0,
        during: Callable[[], Awaitable[None]] | None = None,
    ) -> Window:
        """Impair the link both ways for ``seconds`` (running ``during`` meanwhile), lift it,
        check the call survived and the path, and measure the impaired window."""
        start = time.monotonic()
        self.relay.impair(up=both_ways, down=both_ways)
        if during is not None:
            await during()
        await asyncio.sleep(max(0.0, start + seconds - time.monotonic()))
        end = time.monotonic()
        self.relay.impair()
        await asyncio.sleep(1.0)
        assert self.alive()
        await self.cut_and_count()
        return Window(
            start,
            end,
            self.fps(start + 0.5, end),
            self.undecoded_video_frames(start, end),
            self.audio_check(start, end),
            self.av_offsets_ms(start, end),
        )

    # -- measurements ----------------------------------------------------------------------

    def anchor(self, kind: str, before: float) -> float:
        """Arrival minus RTP time (s) of the frames that arrived before ``before`` (clean)."""
        frames = self.client.received.video if kind == "video" else self.client.received.audio
        clock = VIDEO_CLOCK if kind == "video" else AUDIO_CLOCK
        return float(np.median([a - pts / clock for a, pts, _ in frames if a < before]))

    def fps(self, start: float, end: float) -> float:
        n = sum(1 for d in self.delivered("video") if start <= d.at < end)
        return n / (end - start)

    def delivered(self, kind: str) -> list[Delivered]:
        return [d for d in self.client.delivered if d.kind == kind]

    def _sent_video(self, start: float, end: float) -> list[int]:
        """RTP times (from the first frame, in 1/90000 s) of the video frames the server sent
        in [start, end): a packet of theirs reached the caller, or the relay dropped one."""
        origin = self.client._origins["video"]
        anchor = self.anchor("video", self.marks["clean_end"])
        stamps = {p.timestamp for p in self.client.packets if p.kind == "video"}
        stamps |= {
            d.rtp.timestamp
            for d in self.relay.down.stats.drops
            if d.rtp is not None and d.rtp.payload_type in self.client.payload_types["video"]
        }
        pts = sorted((ts - origin) & 0xFFFFFFFF for ts in stamps)
        return [t for t in pts if start <= t / VIDEO_CLOCK + anchor < end]

    def undecoded_video_frames(self, start: float, end: float) -> int:
        """Video frames sent in [start, end) that the caller never decoded."""
        decoded = {d.pts & 0xFFFFFFFF for d in self.delivered("video")}
        return len(set(self._sent_video(start, end)) - decoded)

    def skipped_by_server(self, start: float, end: float) -> int:
        """Frame instants in [start, end) the server sent no video for (late frames dropped
        on a busy machine, DECISIONS "one clock"): not the network's doing."""
        sent = self._sent_video(start, end)
        return sum(max(0, int(step) // 3600 - 1) for step in np.diff(sent))

    def resumed_after(self, kind: str, end: float) -> float:
        """Seconds from ``end`` until the first decoded frame the server sent after it."""
        clock = VIDEO_CLOCK if kind == "video" else AUDIO_CLOCK
        anchor = self.anchor(kind, self.marks["clean_end"])
        for d in self.delivered(kind):
            if d.pts / clock + anchor >= end:
                return d.at - end
        return float("inf")

    def video_loss_recoveries_ms(self, start: float, end: float) -> list[float]:
        """Per video packet the relay dropped in [start, end): ms until the caller had it again
        (retransmitted) or a keyframe came after it."""
        video = self.client.payload_types["video"]
        regained: dict[int, float] = {}
        for p in self.client.packets:
            if p.kind == "video":
                regained.setdefault(p.seq, p.at)
        keyframes = [d.at for d in self.delivered("video") if d.key]
        out = []
        for drop in self.relay.down.stats.drops:
            if drop.rtp is None or drop.rtp.payload_type not in video or drop.reason != "loss":
                continue
            if not start <= drop.at < end:
                continue
            again = regained.get(drop.rtp.sequence_number)
            after = [k for k in keyframes if k > drop.at]
            candidates = [t for t in (again, after[0] if after else None) if t is not None]
            out.append((min(candidates) - drop.at) * 1000 if candidates else float("inf"))
        return out

    def audio_check(self, start: float, end: float) -> AudioCheck:
        audio = [p for p in self.client.packets if p.kind == "audio"]
        times = np.asarray([p.at for p in audio if start <= p.at < end])
        first = audio[0].seq
        got = {(p.seq - first) % 65536 for p in audio}
        dropped = {
            (d.rtp.sequence_number - first) % 65536
            for d in self.relay.down.stats.drops
            if d.rtp is not None and d.rtp.payload_type in self.client.payload_types["audio"]
        }
        missing = sorted(set(range(max(got) + 1)) - got)
        run = longest = 0
        for i, seq in enumerate(missing):
            run = run + 1 if i and seq == missing[i - 1] + 1 else 1
            longest = max(longest, run)
        decoded = sorted(d.pts for d in self.delivered("audio") if start <= d.at < end)
        return AudioCheck(
            arrival_gap_ms=float(np.diff(times).max() * 1000),
            hole_ms=longest * 20.0,
            unexplained=len(set(missing) - dropped),
            decoded_hole_ms=float((np.diff(decoded).max() / 960 - 1) * 20),
            loop_stall_ms=self.loop_stall_ms(start, end),
        )

    def loop_stall_ms(self, start: float, end: float) -> float:
        """The longest the event loop (server, relay and caller alike) was held up."""
        return max((lag for at, lag in self.loop_lags if start <= at < end), default=0.0) * 1000

    async def watch_loop(self) -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(0.010)
            now = time.monotonic()
            self.loop_lags.append((now, now - before - 0.010))

    def av_offsets_ms(self, start: float, end: float) -> np.ndarray:
        """Flash minus beep for the flashes and beeps that arrived in [start, end)."""
        video = [f for f in self.client.received.video if start <= f[0] < end]
        audio = [f for f in self.client.received.audio if start <= f[0] < end]
        assert video and audio, f"{len(video)} video and {len(audio)} audio frames arrived"
        video.sort(key=lambda f: f[1])
        audio.sort(key=lambda f: f[1])
        vt = frame_times(video, VIDEO_CLOCK, self.server.video_sent_late_s)
        at = frame_times(audio, AUDIO_CLOCK)
        vpts = np.asarray([t for _, t, _ in video])
        apts = np.asarray([t for _, t, _ in audio])
        flashes = flash_onsets(vt, [img for _, _, img in video])
        beeps = beep_onsets(at, np.concatenate([p for _, _, p in audio]))
        # A lost frame just before an onset makes the onset read late: keep whole ones only.
        fi = np.searchsorted(vt, flashes)
        flashes = flashes[(fi > 0) & (vpts[fi] - vpts[np.maximum(fi - 1, 0)] == 3600)]
        bi = np.searchsorted(at, beeps, side="right") - 1
        whole = (bi > 0) & (apts[bi] - apts[np.maximum(bi - 1, 0)] == 960)
        return paired_offsets_ms(flashes, beeps[whole] - OPUS_DECODER_DELAY_S)


OFFER = (
    "v=0\r\nm=audio 40001 UDP/TLS/RTP/SAVPF 96\r\nc=IN IP4 127.0.0.1\r\n"
    "a=candidate:a 1 udp 2130706431 127.0.0.1 40001 typ host\r\n"
    "a=candidate:b 1 udp 2130706431 192.0.2.2 40003 typ host\r\n"
    "a=candidate:c 1 udp 1694498815 198.51.100.7 40004 typ srflx raddr 127.0.0.1 rport 40001\r\n"
    "m=video 40002 UDP/TLS/RTP/SAVPF 99\r\n"
    "a=candidate:a 1 udp 2130706431 127.0.0.1 40002 typ host\r\n"
)


async def test_relay_rewrites_candidates_and_replays_its_schedule() -> None:
    relay = NetRelay(seed=3)
    try:
        sdp = relay.rewrite_offer(OFFER)
        ports = [int(m) for m in re.findall(r"127\.0\.0\.1 (\d+) typ host", sdp)]
        assert sorted(ports) == sorted(relay.server_facing_ports) and len(ports) == 2
        assert "192.0.2.2" not in sdp and "srflx" not in sdp  # the relay is the only way
        assert "40001" not in sdp and "40002" not in sdp  # m= lines follow their candidates
    finally:
        relay.close()

    def fates(seed: int, streams: list[str]) -> list[tuple[str | None, float]]:
        relay = NetRelay(seed=seed)
        try:
            relay.impair(down=Impairment(loss=0.3, jitter_ms=50))
            return [relay.down.decide(time.monotonic(), stream) for stream in streams]
        finally:
            relay.close()

    video = fates(3, ["rtp99"] * 50)
    # The n-th packet of a stream meets the same fate whatever is interleaved with it.
    mixed = fates(3, [s for _ in range(50) for s in ("rtp99", "rtp111", "rtcp")])[::3]
    assert video == mixed
    assert video != fates(4, ["rtp99"] * 50)
    assert 5 <= sum(reason == "loss" for reason, _ in video) <= 25
    assert all(0 <= delay <= 0.050 for reason, delay in video if reason is None)

    relay = NetRelay(seed=3)
    try:
        relay.impair(up=Impairment(outages=((0.0, 0.2),)))
        assert relay.up.decide(time.monotonic(), "rtp99")[0] == "outage"
        assert relay.down.decide(time.monotonic(), "rtp99")[0] is None
        await asyncio.sleep(0.25)
        assert relay.up.decide(time.monotonic(), "rtp99")[0] is None
    finally:
        relay.close()


@pytest.fixture
async def net_call(cache_dir: Path) -> AsyncIterator[NetCall]:
    # Every instant sent, still or not: these calls measure a full-rate stream through loss.
    server, runner = await start_server(sync_test_factory(), cache_dir, still_repeat_s=0.0)
    relay = NetRelay(seed=SEED)
    client = NetCaller(server.url)
    watcher: asyncio.Future[None] | None = None
    try:
        await client.connect_through(relay)
        await client.wait_channel_open()
        call = NetCall(server, relay, client)
        await wait_for_video(client, 10, 15.0)  # through the relay
        watcher = asyncio.ensure_future(call.watch_loop())
        await asyncio.sleep(1.5)  # a clean stretch: the timelines' anchors
        call.marks["clean_end"] = time.monotonic()
        yield call
    finally:
        if watcher is not None:
            watcher.cancel()
        await client.close()
        relay.close()
        await runner.cleanup()


async def _error_event_roundtrip(client: NetCaller, timeout: float) -> None:
    client.channel.send('{"type": "dance"}')
    event = await client.wait_event(lambda e: e.get("type") == "error", timeout=timeout)
    assert event["code"] == "unknown_type"


async def test_five_percent_loss_both_ways(net_call: NetCall) -> None:
    with trials(
        "5 % packet loss both ways (8 s)",
        area="network",
        note=(
            "tried = video packets lost: each came back by NACK and retransmission (RTX), no "
            "keyframe needed, every frame decoded; a lost audio packet is 20 ms missing "
            "(Opus is not retransmitted), the server never stopped sending"
        ),
    ) as t:
        call, relay = net_call, net_call.relay
        # The events channel works through the loss (SCTP retransmits).
        w = await call.impaired(
            Impairment(loss=0.05), during=lambda: _error_event_roundtrip(call.client, timeout=5)
        )
        start, end, fps, undecoded, audio, offsets = w
        recoveries = call.video_loss_recoveries_ms(start, end)
        print(
            f"loss: fps {fps:.1f}; {len(recoveries)} video packets lost, back after "
            f"{sorted(round(r) for r in recoveries)} ms; {undecoded} frames never decoded, "
            f"{call.skipped_by_server(start, end)} skipped by the server; "
            f"PLIs {relay.up.stats.rtcp[(206, 1)]}, NACKs {relay.up.stats.rtcp[(205, 1)]} "
            f"({call.client.nacks_repeated} repeats); {audio}; "
            f"A/V {np.round(offsets).tolist()} ms; "
            f"dropped down {dict(relay.down.stats.dropped)}, up {dict(relay.up.stats.dropped)}"
        )
        assert fps >= MIN_FPS
        assert recoveries, "the seeded schedule dropped no video packet"
        for r in recoveries:  # each lost video packet is a trial
            t.judge([] if r <= RECOVERY_BOUND_MS else [f"a lost video packet took {r:.0f} ms"])
        assert max(recoveries) <= RECOVERY_BOUND_MS
        assert undecoded == 0
        audio.check()
        assert len(offsets) >= 5
        assert np.abs(offsets).max() <= AV_BOUND_MS
        t.figures = {
            "video_recovery_ms_p50": round(float(np.median(recoveries))),
            "video_recovery_ms_max": round(max(recoveries)),
            "fps": round(fps, 1),
            "av_offset_ms_max_abs": round(float(np.abs(offsets).max())),
            "audio_hole_ms_max": round(audio.hole_ms),
            "audio_arrival_gap_ms_max": round(audio.arrival_gap_ms),
        }


async def test_jitter_of_100_ms_both_ways(net_call: NetCall) -> None:
    with (
        trials(
            "jitter: 0-100 ms extra delay per packet both ways (8 s, reorders)",
            area="network",
            note="every frame decoded; video packets overtaken by later ones were NACKed, "
            "harmlessly",
        ) as t,
        t.trial(),
    ):
        call, relay = net_call, net_call.relay
        start, end, fps, undecoded, audio, offsets = await call.impaired(Impairment(jitter_ms=100))
        print(
            f"jitter: fps {fps:.1f}; {undecoded} frames never decoded, "
            f"{call.skipped_by_server(start, end)} skipped by the server; {audio}; "
            f"A/V {np.round(offsets).tolist()} ms; NACKs {relay.up.stats.rtcp[(205, 1)]}"
        )
        assert fps >= MIN_FPS
        assert undecoded == 0
        audio.check()
        assert len(offsets) >= 5
        assert np.abs(offsets).max() <= AV_BOUND_MS
        t.figures = {
            "fps": round(fps, 1),
            "av_offset_ms_median": round(float(np.median(offsets))),
            "av_offset_ms_max_abs": round(float(np.abs(offsets).max())),
            "audio_arrival_gap_ms_max": round(audio.arrival_gap_ms),
        }


async def test_outages_of_2_s(net_call: NetCall) -> None:
    with trials(
        "link cut entirely for 2 s mid-call (both ways)",
        area="network",
        note=(
            "recovery: end of the outage to the first decoded frame sent after it; the "
            "session stayed connected (ICE consent and the 15 s peer watchdog outlast it); "
            "a say afterwards was heard"
        ),
    ) as t:
        call, relay = net_call, net_call.relay
        video_ms, audio_ms, offsets = [], [], []
        for _ in range(2):
            _, end = relay.outage(2.0)
            await asyncio.sleep(end - time.monotonic() + 2.5)
            assert call.alive(), "the call died in an outage"
            video_ms.append(call.resumed_after("video", end) * 1000)
            audio_ms.append(call.resumed_after("audio", end) * 1000)
            # Sync afterwards, from the frames sent after the outage (not the ones repeated late).
            offsets.extend(call.av_offsets_ms(end + 0.3, time.monotonic()).tolist())
            slow = [
                f"{kind} back after {ms:.0f} ms"
                for kind, ms in (("video", video_ms[-1]), ("audio", audio_ms[-1]))
                if ms > RECOVERY_BOUND_MS
            ]
            t.judge(slow, f"outage {len(video_ms)}")  # each outage is a trial
        print(
            f"outages: video resumed after {np.round(video_ms).tolist()} ms, audio after "
            f"{np.round(audio_ms).tolist()} ms; A/V after {np.round(offsets).tolist()} ms; "
            f"PLIs {relay.up.stats.rtcp[(206, 1)]}"
        )
        assert max(video_ms) <= RECOVERY_BOUND_MS
        assert max(audio_ms) <= RECOVERY_BOUND_MS
        assert offsets and max(abs(o) for o in offsets) <= AV_BOUND_MS

        # Nothing here needed a keyframe (the retransmissions covered the outages); a browser that
        # cannot repair its picture asks for one with a PLI: the server answers within the bound.
        asked = time.monotonic()
        await call.client.request_keyframe()

        def keyframes() -> list[float]:
            return [d.at for d in call.delivered("video") if d.key and d.at > asked]

        await holds_within(keyframes, 2.0)
        keyframes_seen = keyframes()
        keyframe_ms = (keyframes_seen[0] - asked) * 1000 if keyframes_seen else float("inf")
        print(f"outages: keyframe {keyframe_ms:.0f} ms after a PLI")
        assert keyframe_ms <= RECOVERY_BOUND_MS

        # A say after the outages is spoken.
        heard_from = len(call.client.received.audio)
        await call.client.say("The network is back, and so am I.")
        await call.client.wait_state("speaking", timeout=10)
        await call.client.wait_state("listening", timeout=20)
        speech = call.client.received.audio[heard_from:]
        loud = int(loud_frames([pcm for _, _, pcm in speech]).sum())
        print(f"outages: {loud} loud 20 ms frames in the reply")
        assert loud >= 25, "the say after the outages was not heard"
        assert call.alive()
        await call.cut_and_count()
        t.figures = {
            "video_recovery_ms_p50": round(float(np.median(video_ms))),
            "video_recovery_ms_max": round(max(video_ms)),
            "audio_recovery_ms_max": round(max(audio_ms)),
            "av_offset_ms_max_abs": round(max(abs(o) for o in offsets)),
            "keyframe_after_pli_ms": round(keyframe_ms),
        }
