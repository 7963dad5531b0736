"""STT: OpenAI's transcription endpoint, one VAD-segmented utterance per request."""

from __future__ import annotations

import io
import json
import wave

import aiohttp
import numpy as np

from rtc_server.providers.base import ProviderError
from rtc_server.providers.http import (
    DEFAULT_POLICY,
    OPENAI_BASE_URL,
    HTTPPolicy,
    bad_response,
    openai_client,
)


def wav_bytes(pcm: np.ndarray, sample_rate: int) -> bytes:
    """A mono 16-bit WAV file of ``pcm`` (int16), built in memory."""
    if pcm.dtype != np.int16 or pcm.ndim != 1:
        raise ValueError(f"expected mono int16 PCM, got {pcm.dtype} with shape {pcm.shape}")
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(sample_rate)
        wav.writeframes(pcm.astype("<i2", copy=False).tobytes())
    return buffer.getvalue()


class OpenAISTT:
    """Transcribes with ``POST {base_url}/audio/transcriptions`` (multipart, JSON answer).

    The utterance goes up as a WAV file at its own sample rate; the service resamples.

    Args:
        session: the app's shared connection pool.
        api_key: sent as ``Authorization: Bearer``; "" sends none (local compatible servers).
        base_url: up to and including ``/v1``.
        model: ``gpt-4o-mini-transcribe`` (fast, cheap) or ``whisper-1``.
        language: ISO-639-1 hint, which improves accuracy and latency; None lets it detect.
        prompt: optional context, e.g. names the user is likely to say.
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        *,
        api_key: str,
        base_url: str = OPENAI_BASE_URL,
        model: str = "gpt-4o-mini-transcribe",
        language: str | None = "en",
        prompt: str | None = None,
        policy: HTTPPolicy = DEFAULT_POLICY,
    ) -> None:
        self.model = model
        self.language = language
        self.prompt = prompt
        self._client = openai_client(
            session, provider="openai-stt", api_key=api_key, base_url=base_url, policy=policy
        )

    @property
    def name(self) -> str:
        return "openai"

    async def transcribe(self, pcm: np.ndarray, sample_rate: int) -> str:
        if len(pcm) == 0:
            return ""
        audio = wav_bytes(pcm, sample_rate)

        def form() -> aiohttp.FormData:
            data = aiohttp.FormData()
            data.add_field("file", audio, filename="utterance.wav", content_type="audio/wav")
            data.add_field("model", self.model)
            data.add_field("response_format", "json")
            if self.language:
                data.add_field("language", self.language)
            if self.prompt:
                data.add_field("prompt", self.prompt)
            return data

        return await self._client.call("/audio/transcriptions", self._read, form=form)

    async def _read(self, response: aiohttp.ClientResponse) -> str:
        body = await response.read()
        try:
            parsed = json.loads(body)
        except ValueError as exc:
            raise self._malformed(f"invalid JSON {body[:80]!r}") from exc
        text = parsed.get("text") if isinstance(parsed, dict) else None
        if not isinstance(text, str):
            raise self._malformed(f"no text in {body[:80]!r}")
        return text.strip()

    def _malformed(self, what: str) -> ProviderError:
        return bad_response(self._client.provider, self._client.vendor, what)
