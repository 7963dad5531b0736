"""TTS: ElevenLabs' HTTP streaming endpoint with timestamps, raw PCM output (no MP3 to decode).

The stream answers one JSON object per line: a piece of the audio (``audio_base64``, s16le in
the requested ``output_format``) and when the characters it speaks sound (``alignment``, and
``normalized_alignment`` for the text as spoken, numbers spelled out: preferred). The
characters become phonemes (``char_phonemes.py``), so the chunks yielded carry the phonemes of
their own samples: a chunk goes out once its audio and the timing of that audio are both in.
Audio is never held for timing that does not come: a stream with no alignment at all flows at
once without phonemes (the speech output then estimates them from the sound), and audio more
than :data:`MAX_HOLD_S` ahead of its timing goes out without it.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any
from urllib.parse import quote

import aiohttp
import numpy as np

from musetalk_core.types import AudioChunk, PhonemeSpan
from rtc_server.providers.char_phonemes import CharacterTiming
from rtc_server.providers.http import (
    DEFAULT_POLICY,
    ELEVENLABS_BASE_URL,
    HTTPPolicy,
    VendorClient,
    bad_response,
)

# The s16le mono PCM output formats the API lists; pcm_44100 needs a Pro plan or above.
PCM_FORMATS = {
    f"pcm_{rate}": rate for rate in (8_000, 16_000, 22_050, 24_000, 32_000, 44_100, 48_000)
}

MAX_HOLD_S = 0.5
"""Longest audio waits for its character timing (which may lag it by a message or two)."""
MAX_LINE_BYTES = 4 << 20
"""Longest line of the stream: a message is tens of kilobytes."""

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
            f"/v1/text-to-speech/{quote(self.voice_id, safe='')}/stream/with-timestamps",
            self._read,
            json_body={"text": text, "model_id": self.model_id},
            params={"output_format": self.output_format},
        )
        # aclosing: when our caller stops early, the request must be closed now, not at GC.
        async with aclosing(chunks):
            async for chunk in chunks:
                yield chunk

    async def _read(self, response: aiohttp.ClientResponse) -> AsyncGenerator[AudioChunk, None]:
        provider, vendor = self._client.provider, self._client.vendor
        out = _TimedAudio(self.sample_rate, self.min_chunk_ms, provider, vendor)
        line = bytearray()
        async for data in response.content.iter_any():
            line += data
            while (end := line.find(b"\n")) >= 0:
                message = bytes(line[:end]).strip()
                del line[: end + 1]
                if message:
                    out.take(_message(message, provider, vendor))
                    for chunk in out.ready():
                        yield chunk
            if len(line) > MAX_LINE_BYTES:
                raise bad_response(provider, vendor, "a stream line over 4 MiB")
        if line.strip():
            out.take(_message(bytes(line).strip(), provider, vendor))
        for chunk in out.ready(final=True):
            yield chunk


def _message(line: bytes, provider: str, vendor: str) -> dict[str, Any]:
    try:
        message = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise bad_response(provider, vendor, f"a stream line is not JSON: {line[:80]!r}") from None
    if not isinstance(message, dict):
        raise bad_response(provider, vendor, "a stream line is not a JSON object")
    return message


class _TimedAudio:
    """The stream's audio and its phonemes, given out as chunks that carry both."""

    def __init__(self, rate: int, min_chunk_ms: int, provider: str, vendor: str) -> None:
        self.rate = rate
        self.provider, self.vendor = provider, vendor
        self.min_samples = max(1, rate * min_chunk_ms // 1000)
        self.timing = CharacterTiming()
        self.timed = False
        """Some message had character timing."""
        self.pending = np.zeros(0, np.int16)
        self.pending_from = 0
        """The stream sample of ``pending[0]``."""
        self.spans: list[PhonemeSpan] = []
        self.odd = b""

    def take(self, message: dict[str, Any]) -> None:
        provider, vendor = self.provider, self.vendor
        audio = message.get("audio_base64")
        if audio is not None:
            if not isinstance(audio, str):
                raise bad_response(provider, vendor, "audio_base64 is not a string")
            try:
                data = self.odd + base64.b64decode(audio, validate=True)
            except (binascii.Error, ValueError):
                raise bad_response(provider, vendor, "audio_base64 is not base64") from None
            usable = len(data) & ~1
            self.odd = data[usable:]
            pcm = np.frombuffer(data[:usable], dtype="<i2").astype(np.int16)
            self.pending = np.concatenate([self.pending, pcm])
        alignment = message.get("normalized_alignment") or message.get("alignment")
        if alignment:
            try:
                chars = alignment["characters"]
                starts = alignment["character_start_times_seconds"]
                ends = alignment["character_end_times_seconds"]
                self.timing.add(chars, starts, ends)
            except (KeyError, TypeError, ValueError) as exc:
                raise bad_response(provider, vendor, f"a malformed alignment: {exc}") from None
            self.timed = True
        self.spans += self.timing.take()

    def ready(self, *, final: bool = False) -> list[AudioChunk]:
        if final:
            if self.odd:
                raise bad_response(self.provider, self.vendor, "odd PCM byte count")
            end = (self.pending_from + len(self.pending)) / self.rate
            self.timing.finish(end)
            self.spans += self.timing.take()
        total = self.pending_from + len(self.pending)
        known = int(self.timing.known_until * self.rate + 1e-6) if self.timed else 0
        out: list[AudioChunk] = []
        if known > self.pending_from:
            out += self._give(min(known, total), timed=True, final=final)
        # Untimed: all of it when no timing ever came (after the first message), or what has
        # waited longer than MAX_HOLD_S for it.
        hold = 0 if final or not self.timed else int(MAX_HOLD_S * self.rate)
        if total - hold > self.pending_from:
            out += self._give(total - hold, timed=False, final=final)
        return out

    def _give(self, until: int, *, timed: bool, final: bool) -> list[AudioChunk]:
        n = until - self.pending_from
        if n <= 0 or (n < self.min_samples and not final):
            return []
        pcm, self.pending = self.pending[:n], self.pending[n:]
        a, b = self.pending_from / self.rate, until / self.rate
        self.pending_from = until
        phonemes: tuple[PhonemeSpan, ...] = ()
        if timed:
            phonemes = tuple(
                PhonemeSpan(s.phoneme, max(s.start, a) - a, min(s.end, b) - a)
                for s in self.spans
                if s.end > a and s.start < b
            )
        self.spans = [s for s in self.spans if s.end > b]
        return [AudioChunk(pcm, self.rate, phonemes)]
