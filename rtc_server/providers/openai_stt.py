"""STT: OpenAI's transcription endpoint, one VAD-segmented utterance per request."""

from __future__ import annotations

import asyncio
import io
import json
import wave
from typing import TYPE_CHECKING

import numpy as np
from openai import omit

from rtc_server.providers.base import ProviderError
from rtc_server.providers.http import DEFAULT_POLICY, HTTPPolicy, bad_response
from rtc_server.providers.openai_sdk import VENDOR, request_headers, retrier, sdk_errors

if TYPE_CHECKING:
    from openai import AsyncOpenAI


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

    The utterance goes up as a WAV file at its own sample rate; the service resamples. The
    answer is read here rather than by the SDK, which accepts any body (an HTML error page, a
    JSON list) without a word: only an object with a ``text`` string is a transcript, anything
    else is ``bad_response``, worth another try.

    Args:
        client: the app's SDK client (``openai_sdk.openai_client``), pointed at a base URL up to
            and including ``/v1``; never closed here.
        model: ``gpt-4o-mini-transcribe`` (fast, cheap) or ``whisper-1``.
        language: ISO-639-1 hint, which improves accuracy and latency; None lets it detect.
        prompt: optional context, e.g. names the user is likely to say.
        policy: retries and the limit on one attempt; the client has the other timeouts.
    """

    def __init__(
        self,
        client: AsyncOpenAI,
        *,
        model: str = "gpt-4o-mini-transcribe",
        language: str | None = "en",
        prompt: str | None = None,
        policy: HTTPPolicy = DEFAULT_POLICY,
    ) -> None:
        self.model = model
        self.language = language
        self.prompt = prompt
        self._client = client
        self._headers = request_headers(client)
        self._policy = policy
        self._provider = "openai-stt"
        self._retrier = retrier(client, provider=self._provider, policy=policy)

    @property
    def name(self) -> str:
        return "openai"

    async def transcribe(self, pcm: np.ndarray, sample_rate: int) -> str:
        if len(pcm) == 0:
            return ""
        audio = wav_bytes(pcm, sample_rate)
        return await self._retrier.call(lambda: self._attempt(audio))

    async def _attempt(self, audio: bytes) -> str:
        """One request: the transcript, or a ProviderError."""
        create = self._client.audio.transcriptions.with_raw_response.create
        with sdk_errors(self._provider):
            async with asyncio.timeout(self._policy.total_timeout_s):
                response = await create(
                    file=("utterance.wav", audio, "audio/wav"),
                    model=self.model,
                    response_format="json",
                    language=self.language or omit,
                    prompt=self.prompt or omit,
                    extra_headers=self._headers,
                )
        return self._read(response.content)

    def _read(self, body: bytes) -> str:
        try:
            parsed = json.loads(body)
        except ValueError as exc:
            raise self._malformed(f"invalid JSON {body[:80]!r}") from exc
        text = parsed.get("text") if isinstance(parsed, dict) else None
        if not isinstance(text, str):
            raise self._malformed(f"no text in {body[:80]!r}")
        return text.strip()

    def _malformed(self, what: str) -> ProviderError:
        return bad_response(self._provider, VENDOR, what)
