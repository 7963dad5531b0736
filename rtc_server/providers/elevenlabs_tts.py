"""TTS: ElevenLabs' HTTP streaming endpoint with timestamps, raw PCM output (no MP3 to decode).

The stream answers one JSON object per line: a piece of the audio (``audio_base64``, s16le in
the requested ``output_format``) and when the characters it speaks sound (``alignment``, and
``normalized_alignment`` for the text as spoken, numbers spelled out: preferred when present),
times from the start of the request's audio. The characters become phonemes
(``char_phonemes.py``), so each chunk yielded carries the phonemes of its own samples, on its
own clock, cut where the chunk is cut and covering it end to end; or none at all, for audio
whose timing never came. The rules:

* A chunk goes out once its audio and that audio's phonemes are both in: audio is held while
  its word is still being spoken (up to ``char_phonemes.MAX_WORD_S``), and audio the service
  has not timed yet waits at most :data:`MAX_HOLD_S` for its characters, which may come a
  message after it.
* Audio is not held for timing that is not coming. Before the first character arrives, and
  after the characters fell more than :data:`MAX_HOLD_S` behind, audio flows as it comes,
  without phonemes (the speech output then estimates them from the sound), until characters
  arrive again for audio not yet given out.
* At the end, the last word is timed and everything left goes out; audio past the last
  character (beyond the millisecond the times are rounded to) goes without phonemes.

A sample split between two messages is joined; a stream whose bytes do not add up to whole
samples, a line that is not a JSON object, audio that is not base64 or an alignment that is
not one are the provider's ``bad_response`` errors, as is a stream without audio.
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
"""Longest audio the service has not timed yet waits for its characters (which may come a
message or two after it) before it goes out without them."""
_ROUNDING_S = 0.002
"""The service gives its times to the millisecond: a tail this short past the last character is
the rounding, and rests."""
MAX_LINE_BYTES = 4 << 20
"""Longest line of the stream: a message is tens of kilobytes."""

DEFAULT_VOICE_ID = "JBFqnCBsd6RMkjVDRZzb"  # "George", the premade voice of ElevenLabs' examples


class ElevenLabsTTS:
    """Synthesizes with ``POST {base_url}/v1/text-to-speech/{voice_id}/stream/with-timestamps``.

    Audio comes back as raw PCM in the requested ``output_format`` and is yielded in chunks of
    at least ``min_chunk_ms`` (but maybe the last, and one cut where timed audio meets untimed)
    as it arrives, each with its phonemes (see the module docstring).

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

    async def synthesize(
        self, text: str, *, previous_text: str = ""
    ) -> AsyncGenerator[AudioChunk, None]:
        """``previous_text``, when not blank, goes as the request's ``previous_text``: the
        service speaks ``text`` as what follows it (a reply's sentence in the reply's tone)."""
        if not text.strip():
            return
        body = {"text": text, "model_id": self.model_id}
        if previous_text.strip():
            body["previous_text"] = previous_text
        chunks = self._client.stream(
            f"/v1/text-to-speech/{quote(self.voice_id, safe='')}/stream/with-timestamps",
            self._read,
            json_body=body,
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
        self.hold = round(MAX_HOLD_S * rate)
        self.timing = CharacterTiming()
        self.flowing = True
        """Audio goes out as it comes, timed or not: no timing yet, or it fell behind."""
        self.pending = np.zeros(0, np.int16)
        self.pending_from = 0
        """The stream sample of ``pending[0]``."""
        self.received = 0
        """Bytes of audio in the stream so far."""
        self.spans: list[PhonemeSpan] = []
        """Phonemes on the stream's clock, from before ``pending_from`` on."""
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
            self.received += len(data) - len(self.odd)
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
            if self._samples(self.timing.chars_until) > self.pending_from:
                self.flowing = False  # timing for audio still here: worth waiting for
        self.spans += self.timing.take()

    def ready(self, *, final: bool = False) -> list[AudioChunk]:
        """The chunks that can go out now; with ``final``, all that is left."""
        total = self.pending_from + len(self.pending)
        if final:
            if self.odd:
                raise bad_response(self.provider, self.vendor, "odd PCM byte count")
            if not self.received:
                raise bad_response(self.provider, self.vendor, "no audio in the response")
            self.timing.finish()
            tail = total / self.rate - self.timing.known_until
            if self.timing.chars_until > 0 and tail <= _ROUNDING_S:
                self.timing.finish(total / self.rate)
            self.spans += self.timing.take()
        known = min(total, self._samples(self.timing.known_until))
        timed_by_service = max(known, self._samples(self.timing.chars_until))
        if not (final or self.flowing) and total - timed_by_service > self.hold:
            self.flowing = True  # the timing fell behind: stop holding audio for it
        untimed = total - max(known, self.pending_from)
        untimed_out = (final or self.flowing) and untimed >= (1 if final else self.min_samples)
        out: list[AudioChunk] = []
        # Timed audio waits to make a chunk of min_chunk_ms, unless untimed audio follows now.
        if known - self.pending_from >= (1 if final or untimed_out else self.min_samples):
            out.append(self._give(known, timed=True))
        if untimed_out:
            out.append(self._give(total, timed=False))
        return out

    def _samples(self, seconds: float) -> int:
        return int(seconds * self.rate + 1e-6)

    def _give(self, until: int, *, timed: bool) -> AudioChunk:
        n = until - self.pending_from
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
        return AudioChunk(pcm, self.rate, phonemes)
