"""TTS: OpenAI's speech endpoint, streamed as raw PCM (no MP3 to decode)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import TYPE_CHECKING

import numpy as np
from openai import omit

from musetalk_core.types import AudioChunk
from rtc_server.providers.base import ProviderError
from rtc_server.providers.http import DEFAULT_POLICY, HTTPPolicy, bad_response, vendor_detail
from rtc_server.providers.openai_sdk import VENDOR, media_type, request_headers, retrier, streamed

if TYPE_CHECKING:
    from openai import AsyncOpenAI

OPENAI_PCM_RATE = 24_000  # Hz; response_format "pcm" is always 24 kHz s16le mono, no header


class OpenAITTS:
    """Synthesizes with ``POST {base_url}/audio/speech`` and ``response_format: "pcm"``.

    The body is chunked as it is generated; chunks of at least ``min_chunk_ms`` are yielded as
    they arrive. Reads may split a sample between two network packets, so an odd trailing byte
    waits for the next read; an odd byte count at the end means the body was not PCM, and so
    does a JSON or text answer (servers that ignore the requested format): ``bad_response``.

    Args:
        client: the app's SDK client (``openai_sdk.openai_client``), pointed at a base URL up to
            and including ``/v1``; never closed here.
        model: ``gpt-4o-mini-tts`` (steerable with ``instructions``), ``tts-1`` or ``tts-1-hd``.
        voice: a built-in voice such as ``alloy``, ``coral`` or ``verse``.
        instructions: how to speak (tone, pace); ignored by the ``tts-1`` models, so not sent.
        speed: 0.25 to 4.0; None sends none (1.0).
        policy: retries and the limit on one attempt; the client has the other timeouts.
    """

    def __init__(
        self,
        client: AsyncOpenAI,
        *,
        model: str = "gpt-4o-mini-tts",
        voice: str = "alloy",
        instructions: str | None = None,
        speed: float | None = None,
        min_chunk_ms: int = 20,
        policy: HTTPPolicy = DEFAULT_POLICY,
    ) -> None:
        if speed is not None and not 0.25 <= speed <= 4.0:
            raise ValueError("speed must be within 0.25..4.0")
        self.model = model
        self.voice = voice
        self.instructions = instructions
        self.speed = speed
        self.min_chunk_ms = min_chunk_ms
        self._client = client
        self._headers = request_headers(client)
        self._policy = policy
        self._provider = "openai-tts"
        self._retrier = retrier(client, provider=self._provider, policy=policy)

    @property
    def name(self) -> str:
        return "openai"

    @property
    def sample_rate(self) -> int:
        return OPENAI_PCM_RATE

    async def synthesize(
        self, text: str, *, previous_text: str = ""
    ) -> AsyncGenerator[AudioChunk, None]:
        """``previous_text`` is ignored: the speech endpoint takes no context."""
        if not text.strip():
            return
        # aclosing: when our caller stops early, the request must be closed now, not at GC.
        async with aclosing(self._retrier.stream(lambda: self._attempt(text))) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _attempt(self, text: str) -> AsyncGenerator[AudioChunk, None]:
        """One request: the audio in chunks as it arrives, or a ProviderError."""
        create = self._client.audio.speech.with_streaming_response.create
        instructions = self.instructions if not self.model.startswith("tts-1") else None
        request = create(
            model=self.model,
            input=text,
            voice=self.voice,
            response_format="pcm",
            instructions=instructions or omit,
            speed=self.speed if self.speed is not None else omit,
            extra_headers=self._headers,
        )
        min_bytes = max(OPENAI_PCM_RATE * self.min_chunk_ms // 1000, 1) * 2
        pending = bytearray()
        received = 0
        async with streamed(request, provider=self._provider, policy=self._policy) as (
            response,
            data,
        ):
            content_type = media_type(response.headers)
            if content_type == "application/json" or content_type.startswith("text/"):
                detail, _ = vendor_detail(await response.read())
                raise self._malformed(f"expected PCM audio, got {content_type}: {detail}")
            async for piece in data:
                received += len(piece)
                pending += piece
                if len(pending) >= min_bytes:
                    usable = len(pending) & ~1
                    yield _chunk(pending[:usable])
                    del pending[:usable]
        if len(pending) % 2:
            raise self._malformed(f"odd PCM byte count ({received})")
        if pending:
            yield _chunk(pending)
        elif received == 0:
            raise self._malformed("no audio in the response")

    def _malformed(self, what: str) -> ProviderError:
        return bad_response(self._provider, VENDOR, what)


def _chunk(data: bytearray) -> AudioChunk:
    return AudioChunk(np.frombuffer(bytes(data), dtype="<i2").astype(np.int16), OPENAI_PCM_RATE)
