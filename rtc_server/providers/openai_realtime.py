"""The OpenAI Realtime API: one model that hears the caller and speaks back (speech-to-speech).

A call holds one :class:`RealtimeLink`: a WebSocket (the ``openai`` SDK's realtime client) that
it opens when it starts, renews when it broke or nears the service's session limit (60 minutes;
we renew after :data:`MAX_SESSION_S`, between turns), and seeds on every new connection with the
conversation so far (the texts both sides said), so the model's memory survives the renewal.

What goes over it, all 24 kHz mono PCM16 (``audio/pcm``):

* the caller's speech, appended as it is heard (``input_audio_buffer.append``);
* at the end of the caller's turn, ``input_audio_buffer.commit`` and ``response.create``; a
  typed turn is a ``conversation.item.create`` of ``input_text`` and a ``response.create``;
* a barge-in: ``response.cancel`` while the service still writes, and always
  ``conversation.item.truncate`` of the reply's item at the audio the caller heard, so that
  what the model remembers it said is what was heard.

Back come the reply's audio (``response.output_audio.delta``) and its transcript
(``response.output_audio_transcript.delta``), gathered per response in a
:class:`RealtimeReply`, and the caller's words (``conversation.item.input_audio_transcription
.completed``). Failures are :class:`ProviderError`: a refused connection or handshake, a
connection closed mid-response, an ``error`` event, a response that ended ``failed``, audio that
is not base64 PCM16 (``bad_response``: the response is cancelled), a service silent for the read
timeout.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from musetalk_core.types import AudioChunk
from rtc_server.call_tasks import CallTasks
from rtc_server.providers.base import ChatMessage, ProviderError
from rtc_server.providers.http import bad_response, status_error

if TYPE_CHECKING:
    from openai import AsyncOpenAI
    from openai.resources.realtime.realtime import AsyncRealtimeConnection
    from openai.types.realtime import RealtimeClientEventParam

logger = logging.getLogger(__name__)

PROVIDER = "openai-realtime"
VENDOR = "OpenAI Realtime"
SAMPLE_RATE = 24_000
"""The API's PCM rate, both ways."""
DEFAULT_MODEL = "gpt-realtime"
DEFAULT_VOICE = "marin"
DEFAULT_TRANSCRIPTION_MODEL = "gpt-4o-mini-transcribe"
MAX_SESSION_S = 50 * 60.0
"""Age after which a connection is renewed at the next turn (the service ends it at 60 min)."""
MAX_OUTBOX = 4000
"""Events waiting for a connection (a minute of speech in 100 ms pieces): more are dropped."""

_HARMLESS = frozenset({"response_cancel_not_active"})
"""Error codes that only say a cancel came after the response had ended."""
_CODES = {
    "rate_limit_exceeded": ("rate_limited", True),
    "insufficient_quota": ("quota_exceeded", False),
    "invalid_api_key": ("unauthorized", False),
    "server_error": ("server_error", True),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class RealtimeSettings:
    model: str = DEFAULT_MODEL
    voice: str = DEFAULT_VOICE
    instructions: str = ""
    transcription_model: str | None = DEFAULT_TRANSCRIPTION_MODEL
    """The model transcribing the caller (None: no ``transcript`` events, no history)."""
    service_turns: bool = False
    """The service's VAD ends turns (and starts responses); else ours commits at turn end."""
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 15.0
    """Longest silence of the service while a response is due."""
    max_session_s: float = MAX_SESSION_S

    def session(self) -> dict[str, Any]:
        """The ``session.update`` body."""
        audio_in: dict[str, Any] = {
            "format": {"type": "audio/pcm", "rate": SAMPLE_RATE},
            "turn_detection": {"type": "server_vad"} if self.service_turns else None,
        }
        if self.transcription_model:
            audio_in["transcription"] = {"model": self.transcription_model}
        session: dict[str, Any] = {
            "type": "realtime",
            "model": self.model,
            "output_modalities": ["audio"],
            "audio": {
                "input": audio_in,
                "output": {
                    "format": {"type": "audio/pcm", "rate": SAMPLE_RATE},
                    "voice": self.voice,
                },
            },
        }
        if self.instructions:
            session["instructions"] = self.instructions
        return session


class OpenAIRealtime:
    """The process's Realtime service: the app's SDK client and the session settings."""

    name = PROVIDER

    def __init__(self, client: AsyncOpenAI, settings: RealtimeSettings | None = None) -> None:
        self.client = client
        self.settings = settings or RealtimeSettings()

    def link(
        self,
        tasks: CallTasks,
        *,
        history: Callable[[], Sequence[ChatMessage]],
        on_transcript: Callable[[str], None],
        on_reply: Callable[[RealtimeReply], None] | None = None,
        on_speech_started: Callable[[], None] | None = None,
        log: logging.Logger | logging.LoggerAdapter[Any] = logger,
    ) -> RealtimeLink:
        return RealtimeLink(
            self,
            tasks,
            history=history,
            on_transcript=on_transcript,
            on_reply=on_reply,
            on_speech_started=on_speech_started,
            log=log,
        )


class RealtimeReply:
    """One response of the model: its audio as it arrives, its transcript, how it ended."""

    def __init__(self, read_timeout_s: float) -> None:
        self.read_timeout_s = read_timeout_s
        self.response_id: str | None = None
        self.item_id: str | None = None
        """The assistant message item its audio belongs to (what a truncate names)."""
        self.transcript = ""
        self.samples = 0
        """Audio samples received (24 kHz)."""
        self.status: str | None = None
        """How the service ended it (completed, cancelled, incomplete, failed); None: going."""
        self._on_text: Callable[[str], None] | None = None
        self._queue: asyncio.Queue[np.ndarray | ProviderError | None] = asyncio.Queue()

    @property
    def done(self) -> bool:
        return self.status is not None

    def audio(self, pcm: np.ndarray) -> None:
        self.samples += len(pcm)
        self._queue.put_nowait(pcm)

    def follow(self, on_text: Callable[[str], None]) -> None:
        """Give each piece of the transcript to ``on_text`` as it comes, starting with what came
        already (a response the service started can speak before its turn is taken up)."""
        self._on_text = on_text
        if self.transcript:
            on_text(self.transcript)

    def text(self, delta: str) -> None:
        self.transcript += delta
        if self._on_text is not None:
            self._on_text(delta)

    def finish(self, status: str) -> None:
        if self.status is None:
            self.status = status
            self._queue.put_nowait(None)

    def fail(self, error: ProviderError) -> None:
        if self.status is None:
            self.status = "failed"
            self._queue.put_nowait(error)

    async def chunks(self) -> AsyncGenerator[AudioChunk, None]:
        """Its audio, as it arrives; raises the ProviderError it failed with."""
        while True:
            try:
                async with asyncio.timeout(self.read_timeout_s):
                    item = await self._queue.get()
            except TimeoutError:
                self.status = self.status or "failed"
                raise ProviderError(
                    PROVIDER,
                    f"{VENDOR} said nothing for {self.read_timeout_s:.0f} s",
                    retryable=True,
                    code="timeout",
                ) from None
            if item is None:
                return
            if isinstance(item, ProviderError):
                raise item
            yield AudioChunk(item, SAMPLE_RATE)


class RealtimeLink:
    """One call's connection to the Realtime API (see the module docstring)."""

    def __init__(
        self,
        service: OpenAIRealtime,
        tasks: CallTasks,
        *,
        history: Callable[[], Sequence[ChatMessage]],
        on_transcript: Callable[[str], None],
        on_reply: Callable[[RealtimeReply], None] | None,
        on_speech_started: Callable[[], None] | None,
        log: logging.Logger | logging.LoggerAdapter[Any],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.service = service
        self.settings = service.settings
        self._tasks = tasks
        self._history = history
        self._on_transcript = on_transcript
        self._on_reply = on_reply
        self._on_speech_started = on_speech_started
        self._log = log
        self._clock = clock
        self._outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        """Connects, then reads and writes; owns the connection and closes it."""
        self._opened_at: float | None = None
        self._waiting: list[RealtimeReply] = []
        """Replies asked for whose ``response.created`` has not come yet."""
        self._replies: dict[str, RealtimeReply] = {}
        self.connections = 0
        """Connections opened so far."""

    # -- the connection --------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._opened_at is not None and self._task is not None and not self._task.done()

    def ensure(self) -> None:
        """Open the connection unless one is open or opening; renew one past its age, when no
        response is under way. Events sent meanwhile wait for it."""
        running = self._task is not None and not self._task.done()
        if running and self._opened_at is not None and self._busy():
            return
        if running and (self._opened_at is None or not self._expired()):
            return
        if running:
            self._log.info("renewing the Realtime session after %.0f s", self._age())
            assert self._task is not None
            self._task.cancel()
        self._opened_at = None
        # The history as it is now: what is said from here on goes after it, as events.
        self._task = self._tasks.spawn(self._run(self._seed()), "realtime", quiet=True)

    def _busy(self) -> bool:
        return bool(self._waiting) or any(not r.done for r in self._replies.values())

    def _age(self) -> float:
        return 0.0 if self._opened_at is None else self._clock() - self._opened_at

    def _expired(self) -> bool:
        return self._age() >= self.settings.max_session_s

    async def _run(self, seed: list[dict[str, Any]]) -> None:
        conn: AsyncRealtimeConnection | None = None
        try:
            try:
                async with asyncio.timeout(self.settings.connect_timeout_s):
                    conn = await self.service.client.realtime.connect(
                        model=self.settings.model
                    ).enter()
                    await _send(
                        conn, {"type": "session.update", "session": self.settings.session()}
                    )
                    for event in seed:
                        await _send(conn, event)
            except Exception as exc:
                raise _connect_error(exc) from exc
            self.connections += 1
            self._opened_at = self._clock()
            async with asyncio.TaskGroup() as group:
                group.create_task(self._write(conn))
                await self._read(conn)
                raise ProviderError(
                    PROVIDER, f"{VENDOR} closed the connection", retryable=True, code="connection"
                )
        except* ProviderError as group:
            error = group.exceptions[0]
            assert isinstance(error, ProviderError)
            self._broke(error)
        except* Exception as group:
            self._broke(_connect_error(group.exceptions[0]))
        finally:
            self._opened_at = None
            if conn is not None:
                with contextlib.suppress(Exception):
                    await conn.close()

    def _broke(self, error: ProviderError) -> None:
        self._log.warning("Realtime connection: %s", error)
        for reply in [*self._waiting, *self._replies.values()]:
            reply.fail(error)
        self._waiting.clear()
        self._replies.clear()
        while not self._outbox.empty():  # what it would have said belongs to the lost session
            self._outbox.get_nowait()

    def _seed(self) -> list[dict[str, Any]]:
        """The conversation so far, as items of a new session (the instructions are its own)."""
        events = []
        for message in self._history():
            if message.role == "system":
                continue
            kind = "input_text" if message.role == "user" else "output_text"
            events.append(
                {
                    "type": "conversation.item.create",
                    "item": {
                        "type": "message",
                        "role": message.role,
                        "content": [{"type": kind, "text": message.content}],
                    },
                }
            )
        return events

    async def _write(self, conn: AsyncRealtimeConnection) -> None:
        while True:
            event = await self._outbox.get()
            await _send(conn, event)

    async def _read(self, conn: AsyncRealtimeConnection) -> None:
        async for event in conn:
            self._on_event(event.type, event)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    # -- what goes out ---------------------------------------------------------------------

    def send(self, event: dict[str, Any]) -> None:
        if self._outbox.qsize() >= MAX_OUTBOX:
            self._log.warning("Realtime connection is not taking events: %s dropped", event["type"])
            return
        self._outbox.put_nowait(event)

    def append(self, pcm: np.ndarray) -> None:
        """The caller's audio (int16, 24 kHz) into the service's input buffer."""
        audio = base64.b64encode(pcm.astype("<i2", copy=False).tobytes()).decode("ascii")
        self.send({"type": "input_audio_buffer.append", "audio": audio})

    def clear_input(self) -> None:
        self.send({"type": "input_audio_buffer.clear"})

    def respond(self, *, commit: bool) -> RealtimeReply:
        """Ask for a response (after committing the caller's audio, with ``commit``)."""
        self.ensure()
        if commit:
            self.send({"type": "input_audio_buffer.commit"})
        self.send({"type": "response.create"})
        reply = RealtimeReply(self.settings.read_timeout_s)
        self._waiting.append(reply)
        return reply

    def ask(self, text: str) -> RealtimeReply:
        """A typed turn: the caller's text as a message, and a response to it."""
        self.ensure()
        self.send(
            {
                "type": "conversation.item.create",
                "item": {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": text}],
                },
            }
        )
        return self.respond(commit=False)

    def cut(self, reply: RealtimeReply, audio_end_ms: int) -> None:
        """The caller barged in having heard ``audio_end_ms`` of ``reply``: stop the service
        writing and make its item end where the caller stopped hearing it."""
        if not reply.done:
            self.send({"type": "response.cancel"})
            reply.finish("cancelled")
        if reply in self._waiting:
            self._waiting.remove(reply)
        if reply.item_id is not None:
            self.send(
                {
                    "type": "conversation.item.truncate",
                    "item_id": reply.item_id,
                    "content_index": 0,
                    "audio_end_ms": max(0, audio_end_ms),
                }
            )

    # -- what comes back -------------------------------------------------------------------

    def _on_event(self, kind: str, event: Any) -> None:
        if kind == "response.output_audio.delta":
            reply = self._replies.get(event.response_id)
            if reply is not None and not reply.done:
                try:
                    reply.audio(_pcm(event.delta))
                except ProviderError as error:
                    self._log.warning("Realtime audio: %s", error)
                    self.send({"type": "response.cancel"})  # the rest of it is of no use
                    reply.fail(error)
        elif kind == "response.output_audio_transcript.delta":
            reply = self._replies.get(event.response_id)
            if reply is not None and not reply.done:
                reply.text(event.delta)
        elif kind == "response.created":
            self._created(event.response.id)
        elif kind == "response.output_item.added":
            reply = self._replies.get(event.response_id)
            if reply is not None and reply.item_id is None and event.item.type == "message":
                reply.item_id = event.item.id
        elif kind == "response.done":
            self._done(event.response)
        elif kind == "conversation.item.input_audio_transcription.completed":
            self._on_transcript(event.transcript)
        elif kind == "input_audio_buffer.speech_started":
            if self._on_speech_started is not None:
                self._on_speech_started()
        elif kind == "error":
            self._error(event.error)

    def _created(self, response_id: str) -> None:
        if self._waiting:
            reply = self._waiting.pop(0)
        else:  # the service's own turn detection started it
            reply = RealtimeReply(self.settings.read_timeout_s)
            if self._on_reply is not None:
                self._on_reply(reply)
        reply.response_id = response_id
        self._replies[response_id] = reply

    def _done(self, response: Any) -> None:
        reply = self._replies.pop(response.id, None)
        if reply is None:
            return
        status = response.status or "completed"
        if status == "failed":
            details = getattr(response, "status_details", None)
            error = getattr(details, "error", None)
            reply.fail(_event_error(getattr(error, "code", None), getattr(error, "message", None)))
        else:
            reply.finish(status)

    def _error(self, error: Any) -> None:
        code = getattr(error, "code", None)
        if code in _HARMLESS:
            return
        failure = _event_error(code, getattr(error, "message", None))
        self._log.warning("Realtime error event: %s", failure)
        # An error answers the oldest request under way: the response asked for, or going.
        going = [r for r in self._replies.values() if not r.done]
        target = self._waiting.pop(0) if self._waiting else (going[0] if going else None)
        if target is not None:
            target.fail(failure)


async def _send(conn: AsyncRealtimeConnection, event: dict[str, Any]) -> None:
    """One client event, as JSON (the SDK's typed forms checked by the tests' stand-in)."""
    await conn.send(cast("RealtimeClientEventParam", event))


def _pcm(delta: str) -> np.ndarray:
    """A reply's audio delta as int16 samples; raises ``bad_response`` unless it is base64 of
    whole PCM16 samples."""
    try:
        data = base64.b64decode(delta, validate=True)
    except (binascii.Error, ValueError, TypeError):
        raise bad_response(PROVIDER, VENDOR, "an audio delta that is not base64") from None
    if len(data) % 2:
        raise bad_response(PROVIDER, VENDOR, f"an audio delta of {len(data)} bytes (odd)")
    return np.frombuffer(data, dtype="<i2").astype(np.int16)


def _event_error(code: str | None, message: str | None) -> ProviderError:
    mapped, retryable = _CODES.get(code or "", ("vendor_error", False))
    return ProviderError(
        PROVIDER,
        f"{VENDOR} reported {code or 'an error'}: {(message or '')[:300]}",
        retryable=retryable,
        code=mapped,
    )


def _connect_error(exc: BaseException) -> ProviderError:
    """A failed connection or handshake, in our terms."""
    from websockets.exceptions import InvalidStatus

    if isinstance(exc, ProviderError):
        return exc
    if isinstance(exc, InvalidStatus):
        response = exc.response
        return status_error(
            PROVIDER, VENDOR, response.status_code, bytes(response.body or b""), response.headers
        )
    if isinstance(exc, TimeoutError):
        return ProviderError(
            PROVIDER, f"{VENDOR} did not answer in time", retryable=True, code="timeout"
        )
    return ProviderError(
        PROVIDER, f"cannot reach {VENDOR}: {exc}", retryable=True, code="connection"
    )
