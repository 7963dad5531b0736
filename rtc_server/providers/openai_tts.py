"""TTS: OpenAI's speech endpoint, streamed as raw PCM (no MP3 to decode)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

import aiohttp

from musetalk_core.types import AudioChunk
from rtc_server.providers.http import (
    DEFAULT_POLICY,
    OPENAI_BASE_URL,
    HTTPPolicy,
    openai_client,
    read_pcm,
)

OPENAI_PCM_RATE = 24_000  # Hz; response_format "pcm" is always 24 kHz s16le mono, no header


class OpenAITTS:
    """Synthesizes with ``POST {base_url}/audio/speech`` and ``response_format: "pcm"``.

    The body is chunked as it is generated; chunks of at least ``min_chunk_ms`` are yielded as
    they arrive.

    Args:
        session: the app's shared connection pool.
        api_key: sent as ``Authorization: Bearer``; "" sends none (local compatible servers).
        base_url: up to and including ``/v1``.
        model: ``gpt-4o-mini-tts`` (steerable with ``instructions``), ``tts-1`` or ``tts-1-hd``.
        voice: a built-in voice such as ``alloy``, ``coral`` or ``verse``.
        instructions: how to speak (tone, pace); ignored by the ``tts-1`` models, so not sent.
        speed: 0.25 to 4.0; None sends none (1.0).
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        *,
        api_key: str,
        base_url: str = OPENAI_BASE_URL,
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
        self._client = openai_client(
            session, provider="openai-tts", api_key=api_key, base_url=base_url, policy=policy
        )

    @property
    def name(self) -> str:
        return "openai"

    @property
    def sample_rate(self) -> int:
        return OPENAI_PCM_RATE

    async def synthesize(self, text: str) -> AsyncGenerator[AudioChunk, None]:
        if not text.strip():
            return
        body: dict[str, Any] = {
            "model": self.model,
            "input": text,
            "voice": self.voice,
            "response_format": "pcm",
        }
        if self.instructions and not self.model.startswith("tts-1"):
            body["instructions"] = self.instructions
        if self.speed is not None:
            body["speed"] = self.speed
        # aclosing: when our caller stops early, the request must be closed now, not at GC.
        async with aclosing(self._client.stream("/audio/speech", self._read, json_body=body)) as it:
            async for chunk in it:
                yield chunk

    def _read(self, response: aiohttp.ClientResponse) -> AsyncGenerator[AudioChunk, None]:
        return read_pcm(
            response,
            OPENAI_PCM_RATE,
            provider=self._client.provider,
            vendor=self._client.vendor,
            min_chunk_ms=self.min_chunk_ms,
        )
