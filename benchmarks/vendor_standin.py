"""Local HTTP servers that speak the cloud vendors' wire protocols, with scriptable failures.

One :class:`VendorServer` on 127.0.0.1 serves OpenAI's chat completions (SSE), audio
transcriptions (multipart in, JSON out) and audio speech (raw 24 kHz PCM, chunked), and
ElevenLabs' streaming text-to-speech (raw PCM at the requested rate). Unless a test scripted
something else, each route answers like the vendor does on success, and a wrong key gets the
vendor's 401. Every request is recorded, with the TCP peer it came on, so tests can assert
paths, headers, bodies and connection reuse. The tests use it, and ``bench realtime`` runs
the STT -> LLM -> TTS path against it with a fixed simulated service time per request.

``python -m benchmarks.vendor_standin`` runs one in a process of its own (``bench load
--providers cloud`` does, through :func:`standin_process`, so the server it loads is measured
without the stand-in's CPU): it prints its URL, serves until SIGTERM, then prints what it
served as one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import math
import signal
import sys
import tempfile
import time
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import web

OPENAI_KEY = "sk-test-openai-0123456789"
ELEVENLABS_KEY = "xi-test-elevenlabs-0123456789"

CHAT = "chat"
TRANSCRIPTIONS = "transcriptions"
SPEECH = "speech"
ELEVENLABS = "elevenlabs"


@dataclass
class Recorded:
    """One request as the server saw it."""

    route: str
    method: str
    path: str
    raw_path: str
    """As sent, percent-escapes kept."""
    query: dict[str, str]
    headers: dict[str, str]
    peer: tuple[str, int]
    json: Any = None
    form: dict[str, Any] = field(default_factory=dict)
    """Multipart fields; the file as ``{"filename", "content_type", "data"}``."""


@dataclass
class Reply:
    """One scripted answer. Fields left alone give the route's normal success."""

    status: int = 200
    headers: Mapping[str, str] = field(default_factory=dict)
    body: bytes | None = None
    """The whole body, sent with a Content-Length; replaces the route's normal body."""
    content_type: str | None = None
    pieces: Sequence[bytes] | None = None
    """The body as chunked-encoding pieces, each written (and flushed) on its own."""
    delay_s: float = 0.0
    """Before the status line."""
    gate: asyncio.Event | None = None
    """After the first piece, wait for this before sending the rest."""
    stall_s: float = 0.0
    """After the first piece, go quiet this long."""
    pace_s: float | None = None
    """Between pieces; None paces the route's normal body like a vendor generating it."""
    disconnect: bool = False
    """Drop the connection after the pieces instead of ending the body properly."""
    endless: bool = False
    """After the pieces, keep streaming filler until the client hangs up."""


def openai_error(
    status: int,
    message: str,
    *,
    type_: str = "server_error",
    code: str | None = None,
    **headers: str,
) -> Reply:
    """An error the way api.openai.com sends it."""
    body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return Reply(status=status, body=json.dumps(body).encode(), headers=_headers(headers))


def elevenlabs_error(status: int, message: str, *, code: str = "error", **headers: str) -> Reply:
    """An error the way api.elevenlabs.io sends it."""
    body = {"detail": {"status": code, "message": message}}
    return Reply(status=status, body=json.dumps(body).encode(), headers=_headers(headers))


def _headers(kwargs: Mapping[str, str]) -> dict[str, str]:
    return {name.replace("_", "-"): value for name, value in kwargs.items()}


def chat_chunk(
    content: str | None = None, *, finish: str | None = None, role: bool = False
) -> dict[str, Any]:
    """A ``chat.completion.chunk`` as OpenAI streams it."""
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = "assistant"
    if content is not None:
        delta["content"] = content
    return {
        "id": "chatcmpl-test",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": "gpt-4o-mini",
        "system_fingerprint": "fp_test",
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n".encode()


def chat_stream(deltas: Sequence[str]) -> list[bytes]:
    """OpenAI's event stream for a reply: a role chunk, one per delta, a finish chunk, [DONE]."""
    return [
        sse(chat_chunk("", role=True)),
        *(sse(chat_chunk(d)) for d in deltas),
        sse(chat_chunk(finish="stop")),
        sse("[DONE]"),
    ]


def tone(seconds: float, sample_rate: int) -> bytes:
    """A 220 Hz s16le tone: recognisable samples, so tests can compare what came through."""
    t = np.arange(round(seconds * sample_rate)) / sample_rate
    return (np.sin(2 * math.pi * 220 * t) * 8000).astype("<i2").tobytes()


def elevenlabs_line(
    pcm: bytes,
    chars: Sequence[str] = (),
    starts: Sequence[float] = (),
    ends: Sequence[float] = (),
    *,
    normalized: bool = True,
) -> bytes:
    """One line of ElevenLabs' stream with timestamps: audio, and when its characters sound."""
    alignment: dict[str, Any] | None = None
    if chars:
        alignment = {
            "characters": list(chars),
            "character_start_times_seconds": [round(t, 3) for t in starts],
            "character_end_times_seconds": [round(t, 3) for t in ends],
        }
    message = {
        "audio_base64": base64.b64encode(pcm).decode(),
        "alignment": alignment,
        "normalized_alignment": alignment if normalized else None,
    }
    return json.dumps(message).encode() + b"\n"


def elevenlabs_lines(pcm: bytes, rate: int, text: str, samples: int = 2400) -> list[bytes]:
    """``pcm`` as ElevenLabs streams it with timestamps: pieces of ``samples``, each with the
    characters of ``text`` that sound in it (spread evenly over the audio)."""
    seconds = len(pcm) / 2 / rate
    step = seconds / max(1, len(text))
    lines = []
    for at in range(0, len(pcm) // 2, samples):
        a, b = at / rate, min(at + samples, len(pcm) // 2) / rate
        mine = [i for i in range(len(text)) if a <= i * step < b]
        lines.append(
            elevenlabs_line(
                pcm[2 * at : 2 * (at + samples)],
                [text[i] for i in mine],
                [i * step for i in mine],
                [(i + 1) * step for i in mine],
            )
        )
    return lines


def split(data: bytes, sizes: Sequence[int]) -> list[bytes]:
    """``data`` cut into pieces of the given sizes, cycling; odd sizes split samples."""
    pieces, i, k = [], 0, 0
    while i < len(data):
        pieces.append(data[i : i + sizes[k % len(sizes)]])
        i += sizes[k % len(sizes)]
        k += 1
    return pieces


class VendorServer:
    """OpenAI and ElevenLabs on one local port; see the module docstring."""

    def __init__(
        self,
        *,
        reply_deltas: Sequence[str] = ("Hello", " there", "! How", " can I", " help?"),
        transcript: str = "what's the weather like",
        speech_seconds: float = 0.5,
        speech: bytes | None = None,
        delay_s: float = 0.0,
    ) -> None:
        self.reply_deltas = list(reply_deltas)
        self.speech = speech
        """What the OpenAI speech route says (24 kHz s16le); None: a tone of ``speech_seconds``."""
        self.delay_s = delay_s
        """Simulated service time before every answer a test did not script."""
        self.transcript = transcript
        self.speech_seconds = speech_seconds
        self.requests: list[Recorded] = []
        self.hangups = 0
        self.violations: list[str] = []
        self.hung_up = asyncio.Event()
        self._scripts: defaultdict[str, deque[Reply]] = defaultdict(deque)
        self._runner: web.AppRunner | None = None
        self.url = ""

    @property
    def openai_base(self) -> str:
        return f"{self.url}/v1"

    @property
    def elevenlabs_base(self) -> str:
        return self.url

    def script(self, route: str, *replies: Reply) -> None:
        """Answer the next requests on ``route`` with ``replies``, in order, then normally."""
        self._scripts[route].extend(replies)

    def unscript(self, route: str) -> None:
        """Drop the replies still scripted for ``route``: it answers normally again."""
        self._scripts[route].clear()

    def seen(self, route: str) -> list[Recorded]:
        return [r for r in self.requests if r.route == route]

    @property
    def connections(self) -> int:
        """Distinct TCP connections that carried requests."""
        return len({r.peer for r in self.requests})

    async def start(self) -> VendorServer:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/audio/transcriptions", self._transcriptions)
        app.router.add_post("/v1/audio/speech", self._speech)
        app.router.add_post(
            "/v1/text-to-speech/{voice_id}/stream/with-timestamps", self._elevenlabs
        )
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def __aenter__(self) -> VendorServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- routes -------------------------------------------------------------------------------

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self._record(CHAT, request, json_body=body)
        if request.headers.get("Authorization") != f"Bearer {OPENAI_KEY}":
            return await self._send(request, _openai_401(), [], "")
        if body.get("stream") is not True or not isinstance(body.get("messages"), list):
            return self._violation(f"chat body must stream messages: {body}")
        return await self._send(
            request, self._next(CHAT), chat_stream(self.reply_deltas), "text/event-stream"
        )

    async def _transcriptions(self, request: web.Request) -> web.StreamResponse:
        form: dict[str, Any] = {}
        for name, value in (await request.post()).items():
            if isinstance(value, web.FileField):
                with value.file:
                    data = value.file.read()
                form[name] = {
                    "filename": value.filename,
                    "content_type": value.content_type,
                    "data": data,
                }
            else:
                form[name] = value
        self._record(TRANSCRIPTIONS, request, form=form)
        if request.headers.get("Authorization") != f"Bearer {OPENAI_KEY}":
            return await self._send(request, _openai_401(), [], "")
        if "model" not in form or form.get("file", {}).get("data", b"")[:4] != b"RIFF":
            return self._violation(f"transcription form needs a model and a WAV file: {form}")
        body = json.dumps({"text": self.transcript}).encode()
        return await self._send(request, self._next(TRANSCRIPTIONS), [body], "application/json")

    async def _speech(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self._record(SPEECH, request, json_body=body)
        if request.headers.get("Authorization") != f"Bearer {OPENAI_KEY}":
            return await self._send(request, _openai_401(), [], "")
        if body.get("response_format") != "pcm" or not body.get("input"):
            return self._violation(f"speech body must ask for pcm: {body}")
        audio = self.speech if self.speech is not None else tone(self.speech_seconds, 24_000)
        pcm = split(audio, [1001, 999, 4096, 3])
        return await self._send(request, self._next(SPEECH), pcm, "application/octet-stream")

    async def _elevenlabs(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self._record(ELEVENLABS, request, json_body=body)
        if request.headers.get("xi-api-key") != ELEVENLABS_KEY:
            reply = elevenlabs_error(401, "Invalid API key", code="invalid_api_key")
            return await self._send(request, reply, [], "")
        output_format = request.query.get("output_format", "mp3_44100_128")
        if not output_format.startswith("pcm_") or not body.get("text"):
            return self._violation(f"expected text and a pcm_ output_format: {request.query}")
        lines = elevenlabs_lines(
            tone(self.speech_seconds, int(output_format[4:])), int(output_format[4:]), body["text"]
        )
        return await self._send(request, self._next(ELEVENLABS), lines, "application/json")

    # --- machinery ----------------------------------------------------------------------------

    def _next(self, route: str) -> Reply:
        script = self._scripts[route]
        return script.popleft() if script else Reply(delay_s=self.delay_s)

    def _record(
        self,
        route: str,
        request: web.Request,
        *,
        json_body: Any = None,
        form: dict[str, Any] | None = None,
    ) -> None:
        assert request.transport is not None
        self.requests.append(
            Recorded(
                route=route,
                method=request.method,
                path=request.path,
                raw_path=request.rel_url.raw_path,
                query=dict(request.query),
                headers=dict(request.headers),
                peer=request.transport.get_extra_info("peername"),
                json=json_body,
                form=form or {},
            )
        )

    async def _send(
        self, request: web.Request, reply: Reply, pieces: list[bytes], content_type: str
    ) -> web.StreamResponse:
        if reply.delay_s:
            await asyncio.sleep(reply.delay_s)
        if reply.body is not None:
            whole = web.Response(status=reply.status, body=reply.body, headers=reply.headers)
            whole.content_type = reply.content_type or "application/json"
            return whole
        response = web.StreamResponse(status=reply.status, headers=reply.headers)
        response.content_type = reply.content_type or content_type
        await response.prepare(request)
        pace_s = reply.pace_s if reply.pace_s is not None else 0.0 if reply.pieces else 0.001
        pieces = list(reply.pieces if reply.pieces is not None else pieces)
        try:
            for i, piece in enumerate(pieces):
                await response.write(piece)
                if i == 0 and reply.gate is not None:
                    await reply.gate.wait()
                if i == 0 and reply.stall_s:
                    await asyncio.sleep(reply.stall_s)
                elif pace_s:
                    await asyncio.sleep(pace_s)
            while reply.endless:
                await asyncio.sleep(0.005)
                sse_stream = response.content_type == "text/event-stream"
                await response.write(b": keep-alive\n\n" if sse_stream else b"\0" * 480)
        except ConnectionError:
            self._hang_up()
            return response
        except asyncio.CancelledError:
            # handler_cancellation: the client closed the connection while we waited.
            self._hang_up()
            raise
        if reply.disconnect:
            assert request.transport is not None
            request.transport.close()
            return response
        await response.write_eof()
        return response

    def _violation(self, message: str) -> web.Response:
        """A request the real vendor would reject: a 422 here, and a failure at teardown."""
        self.violations.append(message)
        return web.json_response({"detail": message}, status=422)

    def _hang_up(self) -> None:
        self.hangups += 1
        self.hung_up.set()


def _openai_401() -> Reply:
    return openai_error(
        401,
        "Incorrect API key provided: sk-wrong. You can find your API key at "
        "https://platform.openai.com/account/api-keys.",
        type_="invalid_request_error",
        code="invalid_api_key",
    )


@dataclass
class StandInProcess:
    """A :class:`VendorServer` in a child process; ``served`` is filled when it has stopped."""

    url: str
    pid: int
    served: dict[str, Any] = field(default_factory=dict)
    """Requests per route, the violations, the hang-ups (its last line)."""

    @property
    def openai_base(self) -> str:
        return f"{self.url}/v1"


@contextlib.asynccontextmanager
async def standin_process(
    *, transcript: str, reply: str, speech: np.ndarray, delay_s: float
) -> AsyncIterator[StandInProcess]:
    """Start ``python -m benchmarks.vendor_standin`` answering every request after ``delay_s``:
    transcriptions with ``transcript``, chat with ``reply`` word by word, speech with
    ``speech`` (mono int16 at 24 kHz)."""
    with tempfile.TemporaryDirectory() as tmp:
        audio = Path(tmp, "speech.s16le")
        await asyncio.to_thread(audio.write_bytes, speech.astype("<i2").tobytes())
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "benchmarks.vendor_standin",
            "--transcript",
            transcript,
            "--reply",
            reply,
            "--speech",
            str(audio),
            "--delay-ms",
            str(delay_s * 1000),
            stdout=asyncio.subprocess.PIPE,
        )
        assert process.stdout is not None
        line = await asyncio.wait_for(process.stdout.readline(), 30)
        if not line.startswith(b"http://"):
            process.kill()
            await process.wait()
            raise RuntimeError(f"the vendor stand-in did not start: {line!r}")
        standin = StandInProcess(line.decode().strip(), process.pid)
        try:
            yield standin
        finally:
            if process.returncode is None:
                process.terminate()
            last = (await process.stdout.read()).decode().strip().splitlines()
            await process.wait()
            standin.served = _summary(last[-1] if last else "", process.returncode)


def _summary(line: str, returncode: int | None) -> dict[str, Any]:
    """The stand-in's last line, or a violation saying it ended without one (it crashed)."""
    try:
        served: dict[str, Any] = json.loads(line)
    except ValueError:
        why = f"the stand-in ended (exit {returncode}) without its summary: {line[:200]!r}"
        return {"requests": {}, "violations": [why], "hangups": 0}
    return served


async def _serve_alone(args: argparse.Namespace) -> None:
    words = args.reply.split(" ")
    server = VendorServer(
        reply_deltas=[w if i == 0 else " " + w for i, w in enumerate(words)],
        transcript=args.transcript,
        speech=args.speech.read_bytes() if args.speech else None,
        delay_s=args.delay_ms / 1000,
    )
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with server:
        print(server.url, flush=True)
        await stop.wait()
    routes: defaultdict[str, int] = defaultdict(int)
    for r in server.requests:
        routes[r.route] += 1
    served = {"requests": dict(routes), "violations": server.violations, "hangups": server.hangups}
    print(json.dumps(served), flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vendor_standin")
    parser.add_argument("--transcript", default="what's the weather like")
    parser.add_argument("--reply", default="Hello there! How can I help?")
    parser.add_argument("--speech", type=Path, default=None, help="24 kHz s16le for speech")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="before every answer")
    asyncio.run(_serve_alone(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
