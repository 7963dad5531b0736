"""TTS: ElevenLabs' HTTP streaming endpoint with raw PCM output (no MP3 to decode)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from urllib.parse import quote

import aiohttp

from musetalk_core.types import AudioChunk
from rtc_server.providers.http import (
    DEFAULT_POLICY,
    ELEVENLABS_BASE_URL,
    HTTPPolicy,
    VendorClient,
    read_pcm,
)

# The s16le mono PCM output formats the API lists; pcm_44100 needs a Pro plan or above.
PCM_FORMATS = {
    f"pcm_{rate}": rate for rate in (8_000, 16_000, 22_050, 24_000, 32_000, 44_100, 48_000)
}

DEFAULT_VOICE_ID = "JBFqnCBsd6RMkjVDRZzb"  # "George", the premade voice of ElevenLabs' examples


class ElevenLabsTTS:
    """Synthesizes with ``POST {base_url}/v1/text-to-speech/{voice_id}/stream``.

    Audio comes back as raw PCM in the requested ``output_format`` and is yielded in chunks of
    at least ``min_chunk_ms`` as it arrives.

    Args:
        session: the app's shared connection pool.
        api_key: sent in the ``xi-api-key`` header.
        base_url: the API root, without ``/v1``.
        voice_id: a voice from the account's voice library.
        model_id: ``eleven_flash_v2_5`` has the lowest latency; ``eleven_turbo_v2_5`` and
            ``eleven_multilingual_v2`` trade latency for quality.
        output_format: one of :data:`PCM_FORMATS`; sets :attr:`sample_rate`.
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        *,
        api_key: str,
        base_url: str = ELEVENLABS_BASE_URL,
        voice_id: str = DEFAULT_VOICE_ID,
        model_id: str = "eleven_flash_v2_5",
        output_format: str = "pcm_24000",
        min_chunk_ms: int = 20,
        policy: HTTPPolicy = DEFAULT_POLICY,
    ) -> None:
        if output_format not in PCM_FORMATS:
            raise ValueError(
                f"output_format must be raw PCM, one of {sorted(PCM_FORMATS)}: {output_format!r}"
            )
        if not voice_id:
            raise ValueError("voice_id is required")
        self.voice_id = voice_id
        self.model_id = model_id
        self.output_format = output_format
        self.min_chunk_ms = min_chunk_ms
        self._client = VendorClient(
            session,
            provider="elevenlabs-tts",
            vendor="ElevenLabs",
            base_url=base_url,
            headers={"xi-api-key": api_key},
            policy=policy,
            secret=api_key,
        )

    @property
    def name(self) -> str:
        return "elevenlabs"

    @property
    def sample_rate(self) -> int:
        return PCM_FORMATS[self.output_format]

    async def synthesize(self, text: str) -> AsyncGenerator[AudioChunk, None]:
        if not text.strip():
            return
        chunks = self._client.stream(
            f"/v1/text-to-speech/{quote(self.voice_id, safe='')}/stream",
            self._read,
            json_body={"text": text, "model_id": self.model_id},
            params={"output_format": self.output_format},
        )
        # aclosing: when our caller stops early, the request must be closed now, not at GC.
        async with aclosing(chunks):
            async for chunk in chunks:
                yield chunk

    def _read(self, response: aiohttp.ClientResponse) -> AsyncGenerator[AudioChunk, None]:
        return read_pcm(
            response,
            self.sample_rate,
            provider=self._client.provider,
            vendor=self._client.vendor,
            min_chunk_ms=self.min_chunk_ms,
        )
