"""One call: a peer connection, its media clock, engine, scheduler, tracks, listening and speech."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import av
import numpy as np
from aiortc import RTCDataChannel, RTCPeerConnection
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from musetalk_core.types import LipSyncEngine
from rtc_server.media.clock import MonotonicClock
from rtc_server.media.fallback import ResilientEngine
from rtc_server.media.inbound import MicDownsampler
from rtc_server.media.scheduler import AVScheduler, Unit
from rtc_server.media.tracks import STILL_REPEAT_S, AvatarAudioTrack, AvatarVideoTrack
from rtc_server.metrics import Metrics
from rtc_server.providers.base import LLM, STT, TTS, ProviderError
from rtc_server.sentences import SentenceSplitter, bounded_pieces
from rtc_server.speech import SpeechOutput, Utterance
from rtc_server.turns import DEFAULT_SYSTEM_PROMPT, Conversation, TurnTimer
from rtc_server.vad import SAMPLE_RATE as VAD_RATE
from rtc_server.vad import (
    SileroModel,
    SpeechEnd,
    SpeechPause,
    SpeechResume,
    SpeechStart,
    VADEvent,
    VADParams,
    VADStream,
)
from signaling.errors import SignalingError
from signaling.messages import MAX_TEXT_CHARS, parse_client_event

logger = logging.getLogger(__name__)


class CallLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """A call's logger: every line starts with ``session <first 8 of its id>:``, whatever the
    log format, so one call's lines can be picked out of a busy server's log."""

    def process(self, msg: object, kwargs: Any) -> tuple[object, Any]:
        return f"session {self.extra['session']}: {msg}", kwargs  # type: ignore[index]


APOLOGY = "Sorry, I ran into a problem answering that."
EARLY_STT = "early-stt"
PAUSE_TAIL = VAD_RATE // 5
"""Silence (200 ms) added after the audio of a pause before it is transcribed."""
PEER_SILENCE_S = 15.0
"""A connected caller from whom nothing (RTP, RTCP, data channel, DTLS) arrived for this long
has vanished (killed, unplugged) and its call is closed. Every live client sends RTCP reports
for the media it receives, about once a second, even with no microphone. aioice's own consent
check alone takes 24-36 s (6 unanswered checks about 5 s apart)."""


@dataclass(frozen=True, slots=True)
class Providers:
    """What a call talks with; shared by all calls of a process."""

    tts: TTS
    llm: LLM | None = None
    stt: STT | None = None
    vad: SileroModel | None = None
    fallback_tts: TTS | None = None
    """The local voice, for a spoken apology when a cloud TTS fails."""


@dataclass(frozen=True, slots=True)
class ListenSettings:
    vad: VADParams = field(default_factory=VADParams)
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    history_chars: int = 6000
    barge_in: bool = True
    max_text_chars: int = MAX_TEXT_CHARS
    """Longest say or typed turn on the data channel; longer ones get an error event."""


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
    ) -> None:
        self.id = uuid.uuid4().hex
        self.pc = pc
        self.engine = engine
        self.providers = providers
        self.settings = settings or ListenSettings()
        self.metrics = metrics
        self.clock = MonotonicClock()
        self.scheduler = AVScheduler(
            engine,
            self.clock,
            on_unit=self._on_unit,
            on_video=self._on_video,
            on_behind=self._engine_behind,
        )
        self.audio_track = AvatarAudioTrack(self.clock, self.scheduler)
        self.video_track = AvatarVideoTrack(self.clock, self.scheduler, still_repeat_s)
        self.speech = SpeechOutput(self.scheduler, executor)
        if isinstance(engine, ResilientEngine):
            engine.on_failure = lambda exc: self._engine_failed(engine, exc)
        self.conversation = Conversation(self.settings.system_prompt, self.settings.history_chars)
        self.channel: RTCDataChannel | None = None
        self.notices: list[tuple[str, str]] = []
        """(code, message) errors told to the caller when the data channel opens."""
        self.state = "listening"
        self.last_turn: dict[str, float] | None = None
        self._executor = executor
        self._on_closed = on_closed
        self._connect_timeout_s = connect_timeout_s
        self._max_call_s = max_call_s
        self._idle_timeout_s = idle_timeout_s
        self._peer_silence_s = peer_silence_s
        self._peer_watched = False
        self._last_activity = time.monotonic()
        """When the caller spoke, typed or a say came in, or the avatar's state last changed."""
        self._tasks: set[asyncio.Task[Any]] = set()
        self._speaking: set[asyncio.Task[Any]] = set()
        """Tasks producing speech (says and replies): barge-in cancels them all."""
        self._turn: asyncio.Task[None] | None = None
        self._early_transcript: asyncio.Task[str] | None = None
        self._closed = False
        self._close_done = asyncio.Event()
        self._log = CallLog(logger, {"session": self.id[:8]})

        pc.on("datachannel", self._on_datachannel)
        pc.on("track", self._on_track)
        pc.on("connectionstatechange", self._on_connection_state)

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self.scheduler.start()
        self._spawn(self._connect_watchdog(), "connect-watchdog")
        if self._max_call_s is not None:
            self._spawn(self._call_limit(self._max_call_s), "call-limit")
        if self._idle_timeout_s:
            self._spawn(self._idle_limit(self._idle_timeout_s), "idle-limit")

    def _spawn(self, coro: Awaitable[Any], name: str) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = asyncio.ensure_future(coro)
        task.set_name(f"session-{self.id[:8]}-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        self._speaking.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        if task.get_name().endswith(EARLY_STT):
            return  # an early transcript fails into the turn that awaits it, which reports it
        self._log.error("task %s failed", task.get_name(), exc_info=task.exception())

    async def _connect_watchdog(self) -> None:
        await asyncio.sleep(self._connect_timeout_s)
        if self.pc.connectionState != "connected":
            self._log.warning("peer did not connect within %.0f s", self._connect_timeout_s)
            await self.aclose()

    async def _call_limit(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        self._log.info("call reached its %.0f s limit", seconds)
        self._error("call_limit", f"calls last at most {seconds:.0f} s on this server")
        await self.aclose()

    async def _idle_limit(self, seconds: float) -> None:
        """Close a call in which, for ``seconds``, nothing happened while the avatar listened."""
        while True:
            left = self._last_activity + seconds - time.monotonic()
            if left <= 0 and self.state == "listening":
                break
            # Thinking or speaking is not idle: the state's return to listening restarts the
            # count, so waking a full period later is never late.
            await asyncio.sleep(left if left > 0 else seconds)
        self._log.info("call idle for %.0f s", seconds)
        await self.end("idle_timeout", f"nothing was said or sent for {seconds:.0f} s")

    def _touch(self) -> None:
        self._last_activity = time.monotonic()

    async def end(self, code: str, message: str) -> None:
        """Tell the caller why with an ``error`` event, then close the call."""
        self._error(code, message)
        await self.aclose()

    async def _on_connection_state(self) -> None:
        state = self.pc.connectionState
        self._log.info("connection %s", state)
        if state in ("failed", "closed"):
            await self.aclose()
        elif state == "connected" and self._peer_silence_s and not self._peer_watched:
            self._peer_watched = True
            self._spawn(self._peer_watchdog(self._peer_silence_s), "peer-watchdog")

    async def _peer_watchdog(self, silence_s: float) -> None:
        """Close the call once nothing has come from the caller for ``silence_s``.

        Silence is counted in polls that saw no new packet, not in wall time: an event loop
        held up for a while (the datagrams wait in the socket meanwhile) costs one poll, so a
        busy server does not mistake itself for a silent caller.
        """
        interval = min(1.0, silence_s / 4)
        polls = max(1, round(silence_s / interval))
        last, quiet = -1, 0
        while quiet < polls:
            await asyncio.sleep(interval)
            report = await self.pc.getStats()
            # One DTLS transport (BUNDLE): every datagram after ICE, whatever it carries.
            count = sum(s.packetsReceived for s in report.values() if s.type == "transport")
            quiet = quiet + 1 if count == last else 0
            last = count
        self._log.warning("nothing from the caller for %.0f s: it is gone", silence_s)
        await self.end("peer_gone", f"nothing came from the caller for {silence_s:.0f} s")

    async def aclose(self) -> None:
        if self._closed:
            # Already closing (the connection failed as a DELETE came in, say): return once
            # that is done, so that "closed" means gone for every caller.
            await self._close_done.wait()
            return
        self._closed = True
        try:
            current = asyncio.current_task()
            tasks = [t for t in self._tasks if t is not current]
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
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

    # -- peer events -----------------------------------------------------------------------

    def _on_track(self, track: MediaStreamTrack) -> None:
        if track.kind == "audio":
            # The microphone: it must be read, or aiortc queues its frames without bound.
            self._spawn(self._listen(track), "microphone")

    def _on_datachannel(self, channel: RTCDataChannel) -> None:
        if channel.label != "events":
            return
        self.channel = channel
        channel.on("message", self._on_message)
        self.send_event({"type": "state", "state": self.state})
        for code, message in self.notices:
            self._error(code, message)

    def _on_message(self, message: str | bytes) -> None:
        # Called inside aiortc's DTLS receive loop: an exception escaping from here ends that
        # loop, and with it every later message and packet of the call, without a word.
        try:
            self._handle_message(message)
        except Exception:
            self._log.exception("data-channel message failed")
            self._error("internal", "the message could not be handled")

    def _handle_message(self, message: str | bytes) -> None:
        try:
            event = parse_client_event(message, max_chars=self.settings.max_text_chars)
        except SignalingError as exc:
            self.send_event({"type": "error", "code": exc.code, "message": exc.message})
            return
        self._touch()
        if event.type == "say":
            self.say(event.text)
        elif event.type == "interrupt":
            self.interrupt()
        elif self.providers.llm is None:
            self.send_event(
                {"type": "error", "code": "not_available", "message": "no LLM is configured"}
            )
        else:
            self.interrupt()
            self._start_turn(self._reply(event.text, TurnTimer(speech_end=time.monotonic())))

    def send_event(self, event: dict[str, Any]) -> None:
        channel = self.channel
        if channel is not None and channel.readyState == "open":
            channel.send(json.dumps(event))

    def _error(self, code: str, message: str) -> None:
        self.send_event({"type": "error", "code": code, "message": message})

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

    # -- listening -------------------------------------------------------------------------

    async def _listen(self, track: MediaStreamTrack) -> None:
        model = self.providers.vad
        vad = VADStream(model, self.settings.vad) if model is not None else None
        downsample = MicDownsampler(VAD_RATE)
        with contextlib.suppress(MediaStreamError):
            while True:
                frame = await track.recv()
                if vad is None or self.providers.stt is None:
                    continue
                assert isinstance(frame, av.AudioFrame)
                # On the loop: a 20 ms frame costs ~0.1 ms (resampling, Silero in onnxruntime),
                # less than a round trip through an executor thread would.
                for event in vad.feed(downsample(frame)):
                    self._on_vad(event)

    def _on_vad(self, event: VADEvent) -> None:
        self._touch()
        if isinstance(event, SpeechStart):
            if self.settings.barge_in and self.state in ("speaking", "thinking"):
                self._log.info("barge-in")
                self.interrupt()
        elif isinstance(event, SpeechPause):
            # Transcribe while the hang-over runs: if the caller stays quiet, the text is
            # (nearly) ready when the turn ends, instead of only starting then.
            self._drop_early_transcript()
            # The pause is declared on the first quiet chunk, so the audio stops right at the
            # last sound; Whisper needs the silence after a word to hear its ending ("France"
            # came out "friends" without it). The end-of-turn audio has it from the hang-over.
            audio = np.concatenate([event.audio, np.zeros(PAUSE_TAIL, np.int16)])
            self._early_transcript = self._spawn(self._transcribe(audio), EARLY_STT)
        elif isinstance(event, SpeechResume):
            self._drop_early_transcript()
        else:
            now = time.monotonic()
            timer = TurnTimer(speech_end=now - (event.detected_at - event.at))
            timer.vad_end_s = event.detected_at - event.at
            early, self._early_transcript = self._early_transcript, None
            self.interrupt()
            self._start_turn(self._hear(event, timer, early))

    def _drop_early_transcript(self) -> None:
        if self._early_transcript is not None:
            self._early_transcript.cancel()
            self._early_transcript = None

    async def _transcribe(self, audio: np.ndarray) -> str:
        stt = self.providers.stt
        assert stt is not None
        return await stt.transcribe(audio, VAD_RATE)

    def _start_turn(self, coro: Awaitable[None]) -> None:
        self._turn = self._spawn(coro, "turn")
        self._speaking.add(self._turn)

    async def _hear(
        self, event: SpeechEnd, timer: TurnTimer, early: asyncio.Task[str] | None
    ) -> None:
        self._set_state("thinking")
        # stt_ms counts from the end of the turn: the share of transcription the hang-over
        # did not already hide.
        timer.mark("stt_start")
        try:
            text = await (early if early is not None else self._transcribe(event.audio))
        except ProviderError as exc:
            self._log.warning("STT failed: %s", exc)
            self._error(exc.code, f"speech recognition failed: {exc.message}")
            await self._apologize()
            return
        timer.mark("stt_end")
        if not text:
            self._set_state("listening")
            return
        self.send_event({"type": "transcript", "text": text, "final": True})
        await self._reply(text, timer)

    async def _reply(self, text: str, timer: TurnTimer) -> None:
        llm = self.providers.llm
        assert llm is not None
        self._set_state("thinking")
        self.conversation.add("user", text)
        utterance = Utterance()
        try:
            await self.speech.speak(
                self.providers.tts,
                self._sentences(llm, timer),
                utterance,
                on_tts_audio=lambda: timer.mark("tts_first_audio"),
            )
            if utterance.first_push_at is not None:
                timer.mark("engine_first_push", utterance.first_push_at)
            await self.speech.wait_played(utterance)
        except ProviderError as exc:
            self._log.warning("reply failed: %s", exc)
            self._error(exc.code, exc.message)
            await self._apologize()
        except Exception:
            # Not the provider's failure but ours: without the apology's speech the call
            # would stay "thinking" (and never idle out).
            self._log.exception("reply failed")
            self._error("internal", "the reply failed")
            await self._apologize()
        finally:
            self.conversation.add("assistant", utterance.played_text())
            self.speech.forget(utterance)
            if utterance.first_push_at is not None:
                timer.mark("engine_first_push", utterance.first_push_at)
            if utterance.first_played_at is not None:
                timer.mark("first_frame", utterance.first_played_at)
            self._finish_turn(timer)

    async def _sentences(self, llm: LLM, timer: TurnTimer) -> AsyncGenerator[str, None]:
        splitter = SentenceSplitter()
        timer.mark("llm_start")
        async for delta in llm.stream(self.conversation.messages()):
            timer.mark("llm_first_token")
            for sentence in splitter.feed(delta):
                self.send_event({"type": "response", "text": sentence})
                timer.mark("tts_start")
                yield sentence
        for rest in splitter.flush():
            self.send_event({"type": "response", "text": rest})
            timer.mark("tts_start")
            yield rest

    def _finish_turn(self, timer: TurnTimer) -> None:
        metrics = timer.metrics()
        self.last_turn = metrics
        for name, value in metrics.items():
            self.metrics.turn_stage.labels(name.removesuffix("_ms")).observe(value / 1000)
        self.send_event({"type": "turn", "turn_id": uuid.uuid4().hex, "metrics": metrics})

    async def _apologize(self) -> None:
        voice = self.providers.fallback_tts or self.providers.tts
        utterance = Utterance()
        with contextlib.suppress(ProviderError):
            await self.speech.speak(voice, _one(APOLOGY), utterance)
            await self.speech.wait_played(utterance)
        self.speech.forget(utterance)

    # -- speech ----------------------------------------------------------------------------

    def say(self, text: str, *, interrupt: bool = False) -> str:
        """Queue ``text`` to be spoken verbatim; returns its utterance id."""
        self._touch()
        if interrupt:
            self.interrupt()
        utterance_id = uuid.uuid4().hex
        task = self._spawn(self._say(text), f"say-{utterance_id[:8]}")
        self._speaking.add(task)
        self.metrics.utterances.inc()
        return utterance_id

    async def _say(self, text: str) -> None:
        utterance = Utterance()
        try:
            await self.speech.speak(self.providers.tts, _pieces(text), utterance)
            await self.speech.wait_played(utterance)
        except ProviderError as exc:
            self._error(exc.code, f"speech synthesis failed: {exc.message}")
        except Exception:
            self._log.exception("say failed")
            self._error("internal", "speech synthesis failed")
        finally:
            self.speech.forget(utterance)

    def interrupt(self) -> None:
        """Stop speaking now: text queued, synthesis in flight and frames rendered are dropped."""
        for task in list(self._speaking):
            task.cancel()
        self._speaking.clear()
        self.scheduler.clear()
        self._set_state("listening")

    def _on_unit(self, index: int, unit: Unit) -> None:
        """Called as each unit is presented: drives the state events."""
        if unit.speaking and self.speech.is_live(unit.segment_id):
            self.speech.on_unit(unit)
            self._set_state("speaking")
        elif self.state == "speaking" and not self._speaking:
            self._set_state("listening")

    def _on_video(self, dropped: int, held: bool) -> None:
        if held:
            self.metrics.video_frames_late.labels("held").inc()
            return
        self.metrics.video_frames.inc()
        if dropped:
            self.metrics.video_frames_late.labels("dropped").inc(dropped)

    def _set_state(self, state: str) -> None:
        if state != self.state:
            self.state = state
            self._touch()
            self.send_event({"type": "state", "state": state})


async def _pieces(text: str) -> AsyncGenerator[str, None]:
    """A say's text in pieces short enough that barge-in and hang-up can cut in between."""
    for piece in bounded_pieces(text):
        yield piece


async def _one(text: str) -> AsyncGenerator[str, None]:
    yield text
