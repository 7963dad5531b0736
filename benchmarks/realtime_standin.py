"""A local stand-in for the OpenAI Realtime API: its WebSocket, its event names and shapes.

Speaks the GA protocol (``/v1/realtime?model=...``, bearer key): ``session.update``, the input
audio buffer (append, commit, clear), conversation items (create, truncate), responses
(create, cancel) and the server events they cause, with 24 kHz PCM16 audio both ways. It
hears nothing for real: a committed turn is "transcribed" as :attr:`heard`, and every response
speaks :attr:`reply_pcm` with :attr:`reply_text` as its transcript, after a fixed simulated
service delay, in deltas faster than real time (as the service sends them).

When the session asks for ``server_vad`` turn detection it detects the caller's speech itself,
by energy: a 10 ms window of the appended audio is speech when its RMS is above
:data:`SPEECH_RMS` (-40 dBFS; the session's ``threshold`` is not modelled). At the onset comes
``input_audio_buffer.speech_started`` (``audio_start_ms`` from the start of the session's
audio, ``prefix_padding_ms`` before the onset, default 300, and the ``item_id`` the turn will
have); after ``silence_duration_ms`` of no speech (default 500)
``input_audio_buffer.speech_stopped``, the commit of that audio (``committed``, the item, its
transcription) and, with ``create_response`` (default true), a response. With
``interrupt_response`` (default true) speech that starts during a response cancels it
(``response.done``, ``cancelled``, reason ``turn_detected``).

What a test can script: refused handshakes (:attr:`refuse`, an HTTP status each), and per
response a failure (:meth:`fail_next`): ``"close"`` hangs up mid-response, ``"error"`` sends an
``error`` event in its place, ``"rate_limit"`` ends it ``failed`` with ``rate_limit_exceeded``,
``"bad_audio"`` sends one audio delta mid-response that is not base64 (and goes on).
Everything a client sent is kept per connection, and a malformed event is a violation (an
``error`` event back, and listed in :attr:`violations`, which tests assert empty). The tests
use it, and so does ``bench realtime``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import itertools
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from aiohttp import WSMsgType, web

KEY = "sk-realtime-test"
RATE = 24_000
DELTA_SAMPLES = 2_400
"""Audio per ``response.output_audio.delta`` (100 ms)."""
SPEECH_RMS = 328.0
"""Server VAD: a window of the caller's audio is speech above this RMS (-40 dBFS)."""
VAD_WINDOW = RATE // 100
"""Server VAD: the caller's audio is judged in windows of 10 ms."""


@dataclass
class Truncate:
    item_id: str
    audio_end_ms: int
    at: float
    """Loop time it came."""


@dataclass
class Speech:
    """A turn the server VAD heard (ms from the start of the session's audio)."""

    item_id: str
    audio_start_ms: int
    """Where the turn's audio starts: the onset, less the prefix padding."""
    onset_ms: int
    audio_end_ms: int | None = None
    """Where it was stopped: the last speech plus the silence duration; None: still going."""


@dataclass
class Connection:
    """One client connection: what it sent and what the stand-in made of it."""

    model: str
    events: list[dict[str, Any]] = field(default_factory=list)
    session: dict[str, Any] | None = None
    buffer: list[np.ndarray] = field(default_factory=list)
    buffer_from: int = 0
    """Sample of the session's audio that the buffer starts at."""
    vad_pending: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int16))
    """Audio short of a whole VAD window, waiting for more."""
    vad_heard: int = 0
    """Samples of the session's audio the server VAD has judged."""
    last_speech: int = 0
    """One past the last sample of speech the server VAD heard."""
    speech: list[Speech] = field(default_factory=list)
    """The turns the server VAD heard, in order."""
    vad_cancels: int = 0
    """Responses the server VAD cancelled (speech during them)."""
    committed: list[np.ndarray] = field(default_factory=list)
    """The caller's audio of each committed turn."""
    items: list[dict[str, Any]] = field(default_factory=list)
    """Conversation items, in order: the client's and the stand-in's."""
    truncates: list[Truncate] = field(default_factory=list)
    cancels: int = 0
    responses: int = 0
    response: asyncio.Task[None] | None = None
    response_id: str | None = None

    def sent(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("type") == kind]

    @property
    def server_vad(self) -> dict[str, Any] | None:
        """The session's ``server_vad`` turn detection; None: the client ends the turns."""
        audio = (self.session or {}).get("audio", {})
        detection = audio.get("input", {}).get("turn_detection")
        return (
            detection
            if isinstance(detection, dict) and detection.get("type") == "server_vad"
            else None
        )

    @property
    def responding(self) -> bool:
        return self.response is not None and not self.response.done()

    def take_buffer(self, end: int | None = None) -> np.ndarray:
        """The buffer's audio up to sample ``end`` of the session (all of it: None), taken out."""
        audio = np.concatenate(self.buffer) if self.buffer else np.zeros(0, np.int16)
        cut = len(audio) if end is None else max(0, end - self.buffer_from)
        self.buffer = [audio[cut:]] if cut < len(audio) else []
        self.buffer_from += cut
        return audio[:cut]


class RealtimeStandIn:
    def __init__(
        self,
        reply_pcm: np.ndarray,
        reply_text: str,
        *,
        heard: str = "What is the capital of France?",
        delay_s: float = 0.2,
        pace: float = 4.0,
    ) -> None:
        self.reply_pcm = reply_pcm.astype(np.int16)
        self.reply_text = reply_text
        self.heard = heard
        self.delay_s = delay_s
        """Simulated service time from response.create to its first event."""
        self.pace = pace
        """Audio sent this many times faster than real time."""
        self.refuse: list[int] = []
        """HTTP statuses for the next handshakes, one each."""
        self._failures: list[str] = []
        self.connections: list[Connection] = []
        self.violations: list[str] = []
        self.errors: list[str] = []
        """The codes of the ``error`` events sent, in order."""
        self.first_delta_at: list[float] = []
        """Loop time of each response's first audio delta."""
        self._ids = itertools.count(1)
        self._runner: web.AppRunner | None = None
        self.port = 0

    # -- set-up ----------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def fail_next(self, mode: str) -> None:
        assert mode in ("close", "error", "rate_limit", "bad_audio")
        self._failures.append(mode)

    async def __aenter__(self) -> RealtimeStandIn:
        app = web.Application()
        app.router.add_get("/v1/realtime", self._connect)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def _id(self, prefix: str) -> str:
        return f"{prefix}_{next(self._ids):04d}"

    # -- the protocol ----------------------------------------------------------------------

    async def _connect(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {KEY}":
            return web.json_response(
                {"error": {"message": "Incorrect API key", "code": "invalid_api_key"}}, status=401
            )
        model = request.query.get("model")
        if not model:
            return web.json_response({"error": {"message": "model is required"}}, status=400)
        if self.refuse:
            status = self.refuse.pop(0)
            return web.json_response({"error": {"message": "unavailable"}}, status=status)
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        conn = Connection(model)
        self.connections.append(conn)
        await self._send(ws, "session.created", session={"type": "realtime", "model": model})
        try:
            async for msg in ws:
                if msg.type is not WSMsgType.TEXT:
                    await self._violation(ws, f"a {msg.type.name} message")
                    continue
                try:
                    event = json.loads(msg.data)
                except ValueError:
                    await self._violation(ws, "a message that is not JSON")
                    continue
                conn.events.append(event)
                await self._handle(ws, conn, event)
        finally:
            if conn.response is not None:
                conn.response.cancel()
        return ws

    async def _send(self, ws: web.WebSocketResponse, kind: str, **fields: Any) -> None:
        if kind == "error":
            self.errors.append(fields["error"]["code"])
        if not ws.closed:
            await ws.send_str(json.dumps({"type": kind, "event_id": self._id("event"), **fields}))

    async def _violation(self, ws: web.WebSocketResponse, what: str) -> None:
        self.violations.append(what)
        await self._send(
            ws,
            "error",
            error={"type": "invalid_request_error", "code": "invalid_event", "message": what},
        )

    async def _handle(self, ws: web.WebSocketResponse, conn: Connection, event: Any) -> None:
        kind = event.get("type") if isinstance(event, dict) else None
        if kind == "session.update":
            session = event.get("session")
            audio = session.get("audio", {}) if isinstance(session, dict) else {}
            pcm = {"type": "audio/pcm", "rate": RATE}
            if not (
                isinstance(session, dict)
                and session.get("type") == "realtime"
                and audio.get("input", {}).get("format") == pcm
                and audio.get("output", {}).get("format") == pcm
            ):
                await self._violation(ws, f"session.update without 24 kHz PCM: {session}")
                return
            conn.session = session
            await self._send(ws, "session.updated", session=session)
        elif kind == "input_audio_buffer.append":
            try:
                data = base64.b64decode(event["audio"], validate=True)
            except (KeyError, TypeError, binascii.Error, ValueError):
                await self._violation(ws, "input_audio_buffer.append without base64 audio")
                return
            if len(data) % 2:
                await self._violation(ws, "audio of an odd number of bytes")
                return
            samples = np.frombuffer(data, "<i2").astype(np.int16)
            conn.buffer.append(samples)
            if conn.server_vad is not None:
                await self._detect(ws, conn, conn.server_vad, samples)
        elif kind == "input_audio_buffer.commit":
            await self._commit(ws, conn, conn.take_buffer(), self._id("item"))
        elif kind == "input_audio_buffer.clear":
            conn.take_buffer()
            await self._send(ws, "input_audio_buffer.cleared")
        elif kind == "conversation.item.create":
            await self._create_item(ws, conn, event.get("item"))
        elif kind == "response.create":
            if conn.response is not None and not conn.response.done():
                await self._send(
                    ws,
                    "error",
                    error={
                        "type": "invalid_request_error",
                        "code": "conversation_already_has_active_response",
                        "message": "a response is in progress",
                    },
                )
                return
            self._start_response(ws, conn)
        elif kind == "response.cancel":
            await self._cancel(ws, conn)
        elif kind == "conversation.item.truncate":
            await self._truncate(ws, conn, event)
        else:
            await self._violation(ws, f"an event of unknown type {kind!r}")

    def _start_response(self, ws: web.WebSocketResponse, conn: Connection) -> None:
        conn.responses += 1
        conn.response_id = None  # until the simulated service time has passed
        conn.response = asyncio.create_task(self._respond(ws, conn))

    async def _detect(
        self, ws: web.WebSocketResponse, conn: Connection, vad: dict[str, Any], pcm: np.ndarray
    ) -> None:
        """The server VAD, on the audio just appended (see the module docstring)."""
        audio = np.concatenate([conn.vad_pending, pcm])
        whole = len(audio) // VAD_WINDOW * VAD_WINDOW
        conn.vad_pending = audio[whole:]
        windows = audio[:whole].reshape(-1, VAD_WINDOW).astype(np.float64)
        silence = int(vad.get("silence_duration_ms", 500)) * RATE // 1000
        padding = int(vad.get("prefix_padding_ms", 300)) * RATE // 1000
        for loud in np.sqrt((windows**2).mean(axis=1)) > SPEECH_RMS:
            start = conn.vad_heard
            conn.vad_heard += VAD_WINDOW
            going = (
                conn.speech[-1] if conn.speech and conn.speech[-1].audio_end_ms is None else None
            )
            if loud:
                conn.last_speech = conn.vad_heard
                if going is None:
                    await self._speech_started(ws, conn, vad, start, padding)
            elif going is not None and conn.vad_heard - conn.last_speech >= silence:
                await self._speech_stopped(ws, conn, vad, going)

    async def _speech_started(
        self,
        ws: web.WebSocketResponse,
        conn: Connection,
        vad: dict[str, Any],
        onset: int,
        padding: int,
    ) -> None:
        start = max(conn.buffer_from, onset - padding)
        speech = Speech(self._id("item"), start * 1000 // RATE, onset * 1000 // RATE)
        conn.speech.append(speech)
        await self._send(
            ws,
            "input_audio_buffer.speech_started",
            audio_start_ms=speech.audio_start_ms,
            item_id=speech.item_id,
        )
        if vad.get("interrupt_response", True) and conn.responding:
            conn.vad_cancels += 1
            await self._stop_response(ws, conn, "turn_detected")

    async def _speech_stopped(
        self, ws: web.WebSocketResponse, conn: Connection, vad: dict[str, Any], speech: Speech
    ) -> None:
        speech.audio_end_ms = conn.vad_heard * 1000 // RATE
        await self._send(
            ws,
            "input_audio_buffer.speech_stopped",
            audio_end_ms=speech.audio_end_ms,
            item_id=speech.item_id,
        )
        conn.take_buffer(speech.audio_start_ms * RATE // 1000)  # before the turn: not in it
        await self._commit(ws, conn, conn.take_buffer(conn.vad_heard), speech.item_id)
        if vad.get("create_response", True) and not conn.responding:
            self._start_response(ws, conn)

    async def _commit(
        self, ws: web.WebSocketResponse, conn: Connection, audio: np.ndarray, item_id: str
    ) -> None:
        if len(audio) < RATE // 10:
            await self._send(
                ws,
                "error",
                error={
                    "type": "invalid_request_error",
                    "code": "input_audio_buffer_commit_empty",
                    "message": "buffer too small: at least 100 ms of audio is needed",
                },
            )
            return
        conn.committed.append(audio)
        previous = conn.items[-1]["id"] if conn.items else None
        item = {
            "id": item_id,
            "type": "message",
            "role": "user",
            "content": [{"type": "input_audio", "transcript": None}],
        }
        conn.items.append(item)
        await self._send(
            ws, "input_audio_buffer.committed", item_id=item_id, previous_item_id=previous
        )
        await self._send(ws, "conversation.item.added", item=item, previous_item_id=previous)
        if conn.session and conn.session["audio"]["input"].get("transcription"):
            await self._send(
                ws,
                "conversation.item.input_audio_transcription.completed",
                item_id=item_id,
                content_index=0,
                transcript=self.heard,
            )

    async def _create_item(self, ws: web.WebSocketResponse, conn: Connection, item: Any) -> None:
        kinds = {"user": "input_text", "assistant": "output_text", "system": "input_text"}
        if not (
            isinstance(item, dict)
            and item.get("type") == "message"
            and item.get("role") in kinds
            and isinstance(item.get("content"), list)
            and item["content"]
            and all(
                isinstance(c, dict)
                and c.get("type") == kinds[item["role"]]
                and isinstance(c.get("text"), str)
                for c in item["content"]
            )
        ):
            await self._violation(ws, f"a malformed conversation item: {item}")
            return
        item = {"id": self._id("item"), **item}
        previous = conn.items[-1]["id"] if conn.items else None
        conn.items.append(item)
        await self._send(ws, "conversation.item.added", item=item, previous_item_id=previous)

    async def _respond(self, ws: web.WebSocketResponse, conn: Connection) -> None:
        await asyncio.sleep(self.delay_s)
        failure = self._failures.pop(0) if self._failures else None
        response_id, item_id = self._id("resp"), self._id("item")
        conn.response_id = response_id
        base = {"response_id": response_id, "item_id": item_id, "output_index": 0}
        await self._send(
            ws,
            "response.created",
            response={"id": response_id, "object": "realtime.response", "status": "in_progress"},
        )
        if failure == "error":
            await self._send(
                ws,
                "error",
                error={"type": "server_error", "code": "server_error", "message": "boom"},
            )
            return
        if failure == "rate_limit":
            await self._send(
                ws,
                "response.done",
                response={
                    "id": response_id,
                    "object": "realtime.response",
                    "status": "failed",
                    "status_details": {
                        "type": "failed",
                        "error": {
                            "type": "rate_limit_exceeded",
                            "code": "rate_limit_exceeded",
                            "message": "Rate limit reached for requests",
                        },
                    },
                },
            )
            return
        item = {"id": item_id, "type": "message", "role": "assistant", "status": "in_progress"}
        conn.items.append({**item, "audio_samples": len(self.reply_pcm)})
        await self._send(
            ws, "response.output_item.added", response_id=response_id, output_index=0, item=item
        )
        await self._send(
            ws,
            "response.content_part.added",
            **base,
            content_index=0,
            part={"type": "audio", "transcript": ""},
        )
        pieces = range(0, len(self.reply_pcm), DELTA_SAMPLES)
        words = self.reply_text.split(" ")
        per_piece = max(1, -(-len(words) // len(pieces)))
        loop = asyncio.get_running_loop()
        for n, start in enumerate(pieces):
            text = " ".join(words[n * per_piece : (n + 1) * per_piece])
            if text:
                await self._send(
                    ws,
                    "response.output_audio_transcript.delta",
                    **base,
                    content_index=0,
                    delta=text if n == 0 else " " + text,
                )
            pcm = self.reply_pcm[start : start + DELTA_SAMPLES]
            if n == 0:
                self.first_delta_at.append(loop.time())
            audio = base64.b64encode(pcm.astype("<i2").tobytes()).decode()
            if failure == "bad_audio" and n == 2:
                audio = "not base64 audio!"
            await self._send(
                ws, "response.output_audio.delta", **base, content_index=0, delta=audio
            )
            if failure == "close" and n == 2:
                await ws.close()
                return
            await asyncio.sleep(len(pcm) / RATE / self.pace)
        await self._send(ws, "response.output_audio.done", **base, content_index=0)
        await self._send(
            ws,
            "response.output_audio_transcript.done",
            **base,
            content_index=0,
            transcript=self.reply_text,
        )
        await self._send(
            ws,
            "response.output_item.done",
            response_id=response_id,
            output_index=0,
            item={**item, "status": "completed"},
        )
        await self._send(
            ws,
            "response.done",
            response={"id": response_id, "object": "realtime.response", "status": "completed"},
        )

    async def _cancel(self, ws: web.WebSocketResponse, conn: Connection) -> None:
        conn.cancels += 1
        if not conn.responding:
            await self._send(
                ws,
                "error",
                error={
                    "type": "invalid_request_error",
                    "code": "response_cancel_not_active",
                    "message": "Cancellation failed: no active response found",
                },
            )
            return
        await self._stop_response(ws, conn, "client_cancelled")

    async def _stop_response(
        self, ws: web.WebSocketResponse, conn: Connection, reason: str
    ) -> None:
        assert conn.response is not None
        conn.response.cancel()
        conn.response = None
        if conn.response_id is None:  # cancelled before it began: it begins, and ends
            conn.response_id = self._id("resp")
            await self._send(
                ws,
                "response.created",
                response={
                    "id": conn.response_id,
                    "object": "realtime.response",
                    "status": "in_progress",
                },
            )
        await self._send(
            ws,
            "response.done",
            response={
                "id": conn.response_id,
                "object": "realtime.response",
                "status": "cancelled",
                "status_details": {"type": "cancelled", "reason": reason},
            },
        )

    async def _truncate(self, ws: web.WebSocketResponse, conn: Connection, event: Any) -> None:
        item = next((i for i in conn.items if i["id"] == event.get("item_id")), None)
        end = event.get("audio_end_ms")
        if item is None or item.get("role") != "assistant" or event.get("content_index") != 0:
            await self._violation(ws, f"truncate of no assistant audio item: {event}")
            return
        if not isinstance(end, int) or not 0 <= end <= item["audio_samples"] * 1000 // RATE:
            await self._violation(ws, f"audio_end_ms out of the item's audio: {event}")
            return
        conn.truncates.append(Truncate(item["id"], end, asyncio.get_running_loop().time()))
        await self._send(
            ws,
            "conversation.item.truncated",
            item_id=item["id"],
            content_index=0,
            audio_end_ms=end,
        )
