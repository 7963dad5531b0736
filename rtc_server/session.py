"""One call: its peer connection, media clock, engine, scheduler, tracks and data channel.

The conversation itself (turns, barge-in, says) is the call's :class:`TurnController`; the
session connects it to the peer: microphone frames through the VAD into it, its events out on
the data channel, the presented media units back into it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor

from aiortc import RTCDataChannel, RTCPeerConnection
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from musetalk_core.types import LipSyncEngine
from rtc_server.call_tasks import CallTasks
from rtc_server.event_channel import EventChannel
from rtc_server.logs import CallLog
from rtc_server.media.clock import MonotonicClock
from rtc_server.media.inbound import MicAudio, ToRate
from rtc_server.media.resilient_engine import ResilientEngine
from rtc_server.media.scheduler import AVScheduler, Unit
from rtc_server.media.tracks import STILL_REPEAT_S, AvatarAudioTrack, AvatarVideoTrack
from rtc_server.metrics import Metrics
from rtc_server.providers.openai_realtime import SAMPLE_RATE as REALTIME_RATE
from rtc_server.speech import SpeechOutput
from rtc_server.turn_controller import CallState, ListenSettings, Providers, TurnController
from rtc_server.vad import SAMPLE_RATE as VAD_RATE
from rtc_server.vad import VADStream
from rtc_server.viseme_stream import VisemeStream
from rtc_server.watchdogs import PEER_SILENCE_S, connected_within, idle_for, peer_silent_for
from signaling.errors import SignalingError
from signaling.messages import ClientEvent
from signaling.ratelimit import RateLimiter

__all__ = ["PEER_SILENCE_S", "AvatarSession", "ListenSettings", "Providers"]

logger = logging.getLogger(__name__)


class AvatarSession:
    """Owns every task and resource of one call; ``aclose()`` releases all of them once."""

    def __init__(
        self,
        pc: RTCPeerConnection,
        engine: LipSyncEngine,
        providers: Providers,
        *,
        metrics: Metrics,
        settings: ListenSettings | None = None,
        executor: Executor | None = None,
        on_closed: Callable[[AvatarSession], Awaitable[None]] | None = None,
        connect_timeout_s: float = 30.0,
        max_call_s: float | None = None,
        idle_timeout_s: float | None = None,
        peer_silence_s: float | None = PEER_SILENCE_S,
        still_repeat_s: float = STILL_REPEAT_S,
        audio_start_s: float = 0.0,
        video_lead_s: float = 0.0,
        messages: RateLimiter | None = None,
        visemes: bool = False,
        resume_grace_s: float = 0.0,
    ) -> None:
        """``messages`` limits the caller's says and data-channel messages (None: no limit);
        ``visemes`` sends the caller ``viseme`` events on its events channel;
        ``resume_grace_s``: how long a call whose link was lost waits for :meth:`attach`;
        ``audio_start_s``: the audio of each peer connection starts that long after its first
        request (``MediaSettings.audio_start_s``); ``video_lead_s``: how long before its instant
        a video frame is taken and encoded (``MediaSettings.video_lead_s``)."""
        self.id = uuid.uuid4().hex
        self.pc = pc
        self.engine = engine
        self.providers = providers
        self.metrics = metrics
        self.clock = MonotonicClock()
        self._wall_minus_monotonic = time.time() - time.monotonic()
        self.scheduler = AVScheduler(
            engine,
            self.clock,
            on_unit=self._on_unit,
            on_video=self._on_video,
            on_behind=self._engine_behind,
            video_lead_s=video_lead_s,
        )
        self.visemes = VisemeStream(self.scheduler)
        self.scheduler.on_clear = self.visemes.on_clear
        self.scheduler.on_queued = self.visemes.on_queued
        self.audio_track = AvatarAudioTrack(self.clock, self.scheduler, start_after_s=audio_start_s)
        self.video_track = AvatarVideoTrack(self.clock, self.scheduler, still_repeat_s)
        self._still_repeat_s = still_repeat_s
        self._audio_start_s = audio_start_s
        self._log = CallLog(logger, {"session": self.id[:8]})
        self._tasks = CallTasks(self.id, self._log)
        settings = settings or ListenSettings()
        self._messages = messages
        self.events = EventChannel(
            self._on_client_event, self._log, max_chars=settings.max_text_chars
        )
        if visemes:
            self.visemes.json = self.events.send
        self.turns = TurnController(
            providers,
            SpeechOutput(self.scheduler, executor),
            sink=self.events.send,
            tasks=self._tasks,
            metrics=metrics,
            log=self._log,
            settings=settings,
        )
        if isinstance(engine, ResilientEngine):
            engine.on_failure = lambda exc: self._engine_failed(engine, exc)
        self.notices: list[tuple[str, str]] = []
        """(code, message) errors told to the caller when the data channel opens."""
        self._on_closed = on_closed
        self._connect_timeout_s = connect_timeout_s
        self._max_call_s = max_call_s
        self._idle_timeout_s = idle_timeout_s
        self._peer_silence_s = peer_silence_s
        self._peer_watched = False
        self._closed = False
        self._close_done = asyncio.Event()
        self._resume_grace_s = resume_grace_s
        self.resume_credential = secrets.token_urlsafe(24) if resume_grace_s > 0 else ""
        """What the caller shows to resume this call on a new peer connection ("": never)."""
        self._grace: asyncio.Task[None] | None = None
        """While the link is lost: the wait for a resume, which ends the call."""
        self._peer_watchdog_task: asyncio.Task[None] | None = None
        self.resuming = asyncio.Lock()
        """Held while a resume replaces the peer connection (SessionManager.resume_session)."""
        self._connected_once = False
        self._peer_left = False
        """The current peer was let go of (leave_peer) and the next is being wired."""
        self._watch(pc)

    def _watch(self, pc: RTCPeerConnection) -> None:
        pc.on("datachannel", self._on_datachannel)
        pc.on("track", self._on_track)
        pc.on("connectionstatechange", lambda: self._on_connection_state(pc))

    def wall_time_of(self, media_s: float) -> float:
        """The Unix time of the call's media instant ``media_s`` (for its sender reports)."""
        return self._wall_minus_monotonic + self.clock.to_monotonic(media_s)

    @property
    def state(self) -> CallState:
        return self.turns.state

    # -- lifecycle and watchdogs -----------------------------------------------------------

    def start(self) -> None:
        self.scheduler.start()
        self.turns.start()
        self._tasks.spawn(self._connect_watchdog(self.pc), "connect-watchdog")
        if self._max_call_s is not None:
            self._tasks.spawn(self._call_limit(self._max_call_s), "call-limit")
        if self._idle_timeout_s:
            self._tasks.spawn(self._idle_limit(self._idle_timeout_s), "idle-limit")

    async def _connect_watchdog(self, pc: RTCPeerConnection) -> None:
        connected = await connected_within(pc, self._connect_timeout_s)
        if not connected and pc is self.pc and not self._peer_left:
            self._log.warning("peer did not connect within %.0f s", self._connect_timeout_s)
            await self.aclose()

    async def _call_limit(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        self._log.info("call reached its %.0f s limit", seconds)
        await self.end("call_limit", f"calls last at most {seconds:.0f} s on this server")

    async def _idle_limit(self, seconds: float) -> None:
        turns = self.turns
        listening = lambda: turns.state is CallState.LISTENING  # noqa: E731
        await idle_for(seconds, lambda: turns.last_activity, listening, turns.clock)
        self._log.info("call idle for %.0f s", seconds)
        await self.end("idle_timeout", f"nothing was said or sent for {seconds:.0f} s")

    async def _peer_watchdog(self, pc: RTCPeerConnection, silence_s: float) -> None:
        await peer_silent_for(pc, silence_s)
        if pc is not self.pc or self._peer_left:
            return
        self._log.warning("nothing from the caller for %.0f s", silence_s)
        self._link_lost(f"nothing came from the caller for {silence_s:.0f} s", silence_s)

    async def end(self, code: str, message: str) -> None:
        """Tell the caller why with an ``error`` event, then close the call."""
        self._error(code, message)
        await self.aclose()

    async def _on_connection_state(self, pc: RTCPeerConnection) -> None:
        if pc is not self.pc or self._peer_left:
            return  # a peer connection this call has left behind (resumed on another)
        state = pc.connectionState
        self._log.info("connection %s", state)
        if state == "failed" and not self._connected_once:
            await self.aclose()  # never connected: there is no conversation to resume
        elif state == "failed":
            self._link_lost("the connection failed", 0.0)
        elif state == "closed":
            await self.aclose()
        if state == "connected":
            self._connected_once = True
        if state == "connected" and self._peer_silence_s and not self._peer_watched:
            self._peer_watched = True
            self._peer_watchdog_task = self._tasks.spawn(
                self._peer_watchdog(pc, self._peer_silence_s), "peer-watchdog"
            )

    # -- a lost link, and its resumption ------------------------------------------------------

    def _link_lost(self, why: str, silent_s: float) -> None:
        """The caller is unreachable: stop speaking to it (the avatar rests) and wait for a
        resume until the grace period, counted from when it was last heard, runs out."""
        if self._closed or self._grace is not None:
            return
        wait_s = self._resume_grace_s - silent_s
        if wait_s <= 0:
            self._tasks.spawn(self.end("peer_gone", why), "end")
            return
        self._log.info("link lost (%s): resumable for %.0f s", why, wait_s)
        self.turns.interrupt()
        self._wait_for_resume(why, wait_s)

    def _wait_for_resume(self, why: str, wait_s: float | None = None) -> None:
        """Close the call in ``wait_s`` (default: the whole grace) unless :meth:`attach` comes."""

        async def grace() -> None:
            await asyncio.sleep(self._resume_grace_s if wait_s is None else wait_s)
            self._log.warning("not resumed within %.0f s: closing", self._resume_grace_s)
            self._grace = None
            await self.end("peer_gone", f"{why}, and the call was not resumed")

        self._grace = self._tasks.spawn(grace(), "resume-grace")

    def may_resume(self, credential: str) -> bool:
        return bool(self.resume_credential) and secrets.compare_digest(
            credential.encode(), self.resume_credential.encode()
        )

    async def leave_peer(self) -> None:
        """Let go of the current peer connection, before :meth:`attach` wires a new one: what
        was playing stops (the caller did not hear it), the old peer is closed, and the grace
        period runs (whole) until a new peer is attached."""
        self._peer_left = True
        self.turns.interrupt()
        if self._peer_watchdog_task is not None:
            self._peer_watchdog_task.cancel()
            self._peer_watchdog_task = None
        self._peer_watched = False
        if self._grace is None and not self._closed:
            self._wait_for_resume("the caller left to resume on a new connection")
        try:
            await self.pc.close()
        except Exception:
            self._log.exception("the lost peer connection failed to close")
        # aiortc ends a sender's track with the sender: the next peer gets new ones, on the
        # same clock and scheduler, from the instant it takes over.
        self.audio_track.stop()
        self.video_track.stop()
        self.audio_track = AvatarAudioTrack(
            self.clock, self.scheduler, from_now=True, start_after_s=self._audio_start_s
        )
        self.video_track = AvatarVideoTrack(self.clock, self.scheduler, self._still_repeat_s)

    def attach(self, pc: RTCPeerConnection) -> None:
        """Carry on the call over ``pc`` (answered with this call's tracks): the conversation,
        its history and the media clock go on as they were."""
        if self._grace is not None:
            self._grace.cancel()
            self._grace = None
        self.pc = pc
        self._peer_left = False
        self._watch(pc)
        self._log.info("resumed on a new peer connection")
        self._tasks.spawn(self._connect_watchdog(pc), "connect-watchdog")

    async def aclose(self) -> None:
        if self._closed:
            # Already closing (the connection failed as a DELETE came in, say): return once
            # that is done, so that "closed" means gone for every caller.
            await self._close_done.wait()
            return
        self._closed = True
        try:
            await self._tasks.cancel_all()
            await self.scheduler.aclose()
            try:
                await self.engine.aclose()
            except Exception:
                self._log.exception("the lip-sync engine failed to close")
            self.audio_track.stop()
            self.video_track.stop()
            try:
                await self.pc.close()
            except Exception:
                # aiortc cannot close a peer whose answer it failed to create (a malformed
                # offer leaves its SCTP transport without a DTLS one): the rest still goes.
                self._log.exception("the peer connection failed to close")
            self._log.info("closed")
            if self._on_closed is not None:
                await self._on_closed(self)
        finally:
            self._close_done.set()

    @property
    def closed(self) -> bool:
        return self._closed

    # -- the peer: microphone and data channel ---------------------------------------------

    def _on_track(self, track: MediaStreamTrack) -> None:
        if track.kind == "audio":
            # The microphone: it must be read, or aiortc queues its frames without bound.
            self._tasks.spawn(self._listen(track), "microphone")

    @property
    def mic_rate(self) -> int:
        """The rate the caller's microphone is decoded at: the speech-to-speech model's when
        the call has one (it hears more of the voice), else the VAD's."""
        return REALTIME_RATE if self.turns.realtime is not None else VAD_RATE

    async def _listen(self, track: MediaStreamTrack) -> None:
        model = self.providers.vad
        vad = VADStream(model, self.turns.settings.vad) if model is not None else None
        if vad is not None:
            self.turns.hear_through(vad)
        realtime = self.turns.realtime
        to_vad, to_model = ToRate(VAD_RATE), ToRate(REALTIME_RATE)
        with contextlib.suppress(MediaStreamError):
            while True:
                audio = await track.recv()
                if vad is None or not self.turns.listens:
                    continue
                assert isinstance(audio, MicAudio)  # low_latency_audio decodes to these
                if realtime is not None:
                    realtime.on_audio(to_model(audio))
                # On the loop: a 20 ms frame costs ~0.1 ms (Silero in onnxruntime), less than
                # a round trip through an executor thread would.
                for event in vad.feed(to_vad(audio)):
                    self.turns.on_vad(event)

    def admit_message(self) -> None:
        """Count one say or data-channel message of the caller; 429 rate_limited when over."""
        if self._messages is None:
            return
        wait = self._messages.take("call")
        if wait > 0:
            raise SignalingError(
                429,
                "rate_limited",
                f"too many says and messages in this call; try again in {wait:.1f} s",
                headers={"Retry-After": RateLimiter.retry_after(wait)},
            )

    def say(self, text: str, *, interrupt: bool = False) -> str:
        """A say over HTTP: counted, then queued (429 when over the rate or the queue)."""
        self.admit_message()
        return self.turns.say(text, interrupt=interrupt)

    def _on_client_event(self, event: ClientEvent) -> None:
        self.admit_message()
        self.turns.handle(event)

    def _on_datachannel(self, channel: RTCDataChannel) -> None:
        if self.visemes.attach(channel):
            return
        state = {"type": "state", "state": self.state.value}
        notices = [{"type": "error", "code": c, "message": m} for c, m in self.notices]
        self.events.attach(channel, [state, *notices])

    def _error(self, code: str, message: str) -> None:
        self.events.error(code, message)

    # -- the media path's events -----------------------------------------------------------

    def _on_unit(self, index: int, unit: Unit) -> None:
        self.turns.on_unit(index, unit)
        self.visemes.on_unit(index, unit)

    def _on_video(self, dropped: int, held: bool) -> None:
        if held:
            self.metrics.video_frames_late.labels("held").inc()
            return
        self.metrics.video_frames.inc()
        if dropped:
            self.metrics.video_frames_late.labels("dropped").inc(dropped)

    def _engine_behind(self) -> None:
        if isinstance(self.engine, ResilientEngine) and self.engine.failed is not None:
            return  # its still image is being realigned to the clock; the failure was told
        self._log.warning("lip-sync engine fell behind real time; its picture skips ahead")
        self._error("engine_behind", "the avatar's animation fell behind; the voice goes on")

    def _engine_failed(self, engine: ResilientEngine, exc: BaseException) -> None:
        if engine.replaced:
            self._error("engine_fallback", "the lip-sync engine failed; the CPU renderer took over")
        else:
            self._error("engine_failed", "the avatar's animation stopped; the voice goes on")
