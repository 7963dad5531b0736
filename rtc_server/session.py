"""One call: a peer connection, its media clock, engine, scheduler, tracks and speech."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Any

from aiortc import RTCDataChannel, RTCPeerConnection
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from musetalk_core.types import AudioChunk, AvatarFrame, LipSyncEngine
from rtc_server.media.clock import AUDIO_RATE, MonotonicClock
from rtc_server.media.resample import resample_int16
from rtc_server.media.scheduler import AVScheduler
from rtc_server.media.tracks import AvatarAudioTrack, AvatarVideoTrack
from rtc_server.metrics import Metrics
from rtc_server.providers.base import TTS
from signaling.errors import SignalingError
from signaling.messages import parse_client_event

logger = logging.getLogger(__name__)


class AvatarSession:
    """Owns every task and resource of one call; ``aclose()`` releases all of them once."""

    def __init__(
        self,
        pc: RTCPeerConnection,
        engine: LipSyncEngine,
        tts: TTS,
        *,
        metrics: Metrics,
        executor: Executor | None = None,
        on_closed: Callable[[AvatarSession], Awaitable[None]] | None = None,
        connect_timeout_s: float = 30.0,
    ) -> None:
        self.id = uuid.uuid4().hex
        self.pc = pc
        self.engine = engine
        self.tts = tts
        self.metrics = metrics
        self.clock = MonotonicClock()
        self.scheduler = AVScheduler(engine, on_unit=self._on_unit, on_video=self._on_video)
        self.audio_track = AvatarAudioTrack(self.clock, self.scheduler)
        self.video_track = AvatarVideoTrack(self.clock, self.scheduler)
        self.channel: RTCDataChannel | None = None
        self.state = "listening"
        self._executor = executor
        self._on_closed = on_closed
        self._connect_timeout_s = connect_timeout_s
        self._speech: asyncio.Queue[tuple[str, int, str]] = asyncio.Queue()
        self._speaking_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._next_segment = 0
        self._first_live_segment = 0
        """Segments below this were interrupted; frames of theirs still in flight are stale."""
        self._closed = False
        self._log = logging.LoggerAdapter(logger, {"session": self.id[:8]})

        pc.on("datachannel", self._on_datachannel)
        pc.on("track", self._on_track)
        pc.on("connectionstatechange", self._on_connection_state)

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self.scheduler.start()
        self._spawn(self._speaker(), "speaker")
        self._spawn(self._connect_watchdog(), "connect-watchdog")

    def _spawn(self, coro: Awaitable[Any], name: str) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = asyncio.ensure_future(coro)
        task.set_name(f"session-{self.id[:8]}-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._log.error("task %s failed", task.get_name(), exc_info=task.exception())

    async def _connect_watchdog(self) -> None:
        await asyncio.sleep(self._connect_timeout_s)
        if self.pc.connectionState != "connected":
            self._log.warning("peer did not connect within %.0f s", self._connect_timeout_s)
            await self.aclose()

    async def _on_connection_state(self) -> None:
        state = self.pc.connectionState
        self._log.info("connection %s", state)
        if state in ("failed", "closed"):
            await self.aclose()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        current = asyncio.current_task()
        tasks = [t for t in self._tasks if t is not current]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.scheduler.aclose()
        await self.engine.aclose()
        self.audio_track.stop()
        self.video_track.stop()
        await self.pc.close()
        self._log.info("closed")
        if self._on_closed is not None:
            await self._on_closed(self)

    @property
    def closed(self) -> bool:
        return self._closed

    # -- peer events -----------------------------------------------------------------------

    def _on_track(self, track: MediaStreamTrack) -> None:
        if track.kind == "audio":
            # The microphone: it must be read, or aiortc queues its frames without bound.
            self._spawn(self._consume_microphone(track), "microphone")

    async def _consume_microphone(self, track: MediaStreamTrack) -> None:
        with contextlib.suppress(MediaStreamError):
            while True:
                await track.recv()

    def _on_datachannel(self, channel: RTCDataChannel) -> None:
        if channel.label != "events":
            return
        self.channel = channel
        channel.on("message", self._on_message)
        self.send_event({"type": "state", "state": self.state})

    def _on_message(self, message: str | bytes) -> None:
        try:
            event = parse_client_event(message)
        except SignalingError as exc:
            self.send_event({"type": "error", "code": exc.code, "message": exc.message})
            return
        if event.type == "say":
            self.say(event.text)
        elif event.type == "interrupt":
            self.interrupt()
        else:
            self.send_event(
                {
                    "type": "error",
                    "code": "not_implemented",
                    "message": "typed turns need the listening pipeline, which is not built yet",
                }
            )

    def send_event(self, event: dict[str, Any]) -> None:
        channel = self.channel
        if channel is not None and channel.readyState == "open":
            channel.send(json.dumps(event))

    # -- speech ----------------------------------------------------------------------------

    def say(self, text: str, *, interrupt: bool = False) -> str:
        """Queue ``text`` to be spoken; returns its utterance id."""
        if interrupt:
            self.interrupt()
        utterance_id = uuid.uuid4().hex
        segment_id = self._next_segment
        self._next_segment += 1
        self._speech.put_nowait((utterance_id, segment_id, text))
        self.metrics.utterances.inc()
        return utterance_id

    def interrupt(self) -> None:
        """Stop speaking now: queued text, synthesis in flight and rendered frames are dropped."""
        while not self._speech.empty():
            self._speech.get_nowait()
        if self._speaking_task is not None:
            self._speaking_task.cancel()
        self._first_live_segment = self._next_segment
        self.scheduler.clear()
        self._set_state("listening")

    async def _speaker(self) -> None:
        while True:
            utterance_id, segment_id, text = await self._speech.get()
            self._speaking_task = asyncio.ensure_future(self._speak(segment_id, text))
            try:
                await self._speaking_task
            except asyncio.CancelledError:
                if self._closed or not self._speaking_task.cancelled():
                    raise
            except Exception:
                self._log.exception("could not speak utterance %s", utterance_id)
                self.send_event(
                    {"type": "error", "code": "tts_failed", "message": "speech synthesis failed"}
                )
            finally:
                self._speaking_task = None

    async def _speak(self, segment_id: int, text: str) -> None:
        loop = asyncio.get_running_loop()
        async for chunk in self.tts.synthesize(text):
            pcm = await loop.run_in_executor(
                self._executor, resample_int16, chunk.pcm, chunk.sample_rate, AUDIO_RATE
            )
            await self.engine.push_audio(AudioChunk(pcm, AUDIO_RATE), segment_id)
        await self.engine.end_segment(segment_id)

    def _on_unit(self, index: int, unit: AvatarFrame, filler: bool) -> None:
        """Called as each pair is presented: drives the state events and the counters."""
        if filler:
            self.metrics.video_frames_late.labels("filler").inc()
        if unit.speaking and unit.segment_id >= self._first_live_segment:
            self._set_state("speaking")
        elif self.state == "speaking" and self._speech.empty() and self._speaking_task is None:
            self._set_state("listening")

    def _on_video(self, dropped: int) -> None:
        self.metrics.video_frames.inc()
        if dropped:
            self.metrics.video_frames_late.labels("dropped").inc(dropped)

    def _set_state(self, state: str) -> None:
        if state != self.state:
            self.state = state
            self.send_event({"type": "state", "state": state})
