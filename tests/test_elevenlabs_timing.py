"""ElevenLabs speech with its phonemes: the stream's character timing turned into phonemes
that cover each chunk exactly, against a local server speaking the stream-with-timestamps
wire format."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from musetalk_core.types import PhonemeSpan
from musetalk_core.visemes import viseme_of
from rtc_server.providers.base import ProviderError
from rtc_server.providers.char_phonemes import CharacterTiming, phonemize_word
from rtc_server.providers.elevenlabs_tts import ElevenLabsTTS
from rtc_server.providers.http import HTTPPolicy
from tests.vendor_servers import (
    ELEVENLABS,
    ELEVENLABS_KEY,
    Reply,
    VendorServer,
    elevenlabs_line,
    tone,
)

FAST = HTTPPolicy(connect_timeout_s=1.0, read_timeout_s=0.5, total_timeout_s=5.0, max_attempts=1)
TEXT = "My mother bought a big blue map for five pounds."


@pytest.fixture
async def server() -> AsyncIterator[VendorServer]:
    async with VendorServer(speech_seconds=2.0) as vendor:
        yield vendor
        assert vendor.violations == []


def _client(session: aiohttp.ClientSession, server: VendorServer) -> ElevenLabsTTS:
    return ElevenLabsTTS(
        session, api_key=ELEVENLABS_KEY, base_url=server.elevenlabs_base, policy=FAST
    )


def _covers(spans: tuple[PhonemeSpan, ...], duration: float) -> bool:
    return (
        spans[0].start == 0.0
        and abs(spans[-1].end - duration) < 1e-9
        and all(abs(a.end - b.start) < 1e-9 for a, b in zip(spans, spans[1:], strict=False))
    )


async def test_phonemes_cover_every_chunk_and_add_up_to_the_audio(server: VendorServer) -> None:
    async with aiohttp.ClientSession() as session:
        chunks = [c async for c in _client(session, server).synthesize(TEXT)]
    assert len(chunks) > 3  # streamed
    assert sum(len(c.pcm) for c in chunks) == len(tone(2.0, 24_000)) // 2
    for c in chunks:
        assert c.phonemes and _covers(c.phonemes, c.duration), c.phonemes
    # Each bilabial sits inside its word's characters (the server spreads them evenly).
    step = 2.0 / len(TEXT)
    words, at = [], 0
    for word in TEXT.rstrip(".").split(" "):
        words.append((word, at * step, (at + len(word)) * step))
        at += len(word) + 1
    absolute, t = [], 0.0
    for c in chunks:
        absolute += [PhonemeSpan(s.phoneme, s.start + t, s.end + t) for s in c.phonemes]
        t += c.duration
    bilabials = [s for s in absolute if viseme_of(s.phoneme) == "PP"]
    assert len(bilabials) >= 7  # my, mother, bought, big, blue, map, pounds
    for s in bilabials:
        middle = (s.start + s.end) / 2
        assert any(a <= middle <= b and set(w.lower()) & set("mbp") for w, a, b in words), s


async def test_audio_waits_only_for_the_timing_of_its_own_words(server: VendorServer) -> None:
    async with aiohttp.ClientSession() as session:
        tts = _client(session, server)
        tts.min_chunk_ms = 1
        chunks = [c async for c in tts.synthesize(TEXT)]
    # Chunks as the messages come, each cut where the timing known so far ends (at a word's
    # end) or where the audio does: never inside a word.
    assert len(chunks) >= 10
    step = 2.0 / len(TEXT)
    edges = {round(i * step, 3) for i, ch in enumerate(TEXT) if ch in " ."}
    edges |= {round((i + 1) * step, 3) for i, ch in enumerate(TEXT) if ch in " ."}
    t = 0.0
    for c in chunks[:-1]:
        t += c.duration
        at_edge = min(abs(t - e) for e in edges) < 1 / 24_000 + 1e-3
        assert at_edge or c.phonemes[-1].phoneme == "_", (t, c.phonemes[-1])
        assert _covers(c.phonemes, c.duration)


async def test_timing_that_lags_its_audio_still_times_it(server: VendorServer) -> None:
    pcm = tone(0.6, 24_000)  # the lag stays under MAX_HOLD_S
    third = len(pcm) // 3 // 2 * 2
    text = "Bob moved maps."
    step = 0.6 / len(text)
    starts = [i * step for i in range(len(text))]
    ends = [(i + 1) * step for i in range(len(text))]
    first = [i for i in range(len(text)) if starts[i] < 0.2]
    rest = [i for i in range(len(text)) if starts[i] >= 0.2]
    server.script(
        ELEVENLABS,
        Reply(
            pieces=[
                elevenlabs_line(
                    pcm[:third],
                    [text[i] for i in first],
                    [starts[i] for i in first],
                    [ends[i] for i in first],
                ),
                elevenlabs_line(pcm[third:]),  # audio ahead of its characters...
                elevenlabs_line(  # ...which come a message later
                    b"",
                    [text[i] for i in rest],
                    [starts[i] for i in rest],
                    [ends[i] for i in rest],
                ),
            ]
        ),
    )
    async with aiohttp.ClientSession() as session:
        chunks = [c async for c in _client(session, server).synthesize(text)]
    assert sum(len(c.pcm) for c in chunks) * 2 == len(pcm)
    assert all(c.phonemes and _covers(c.phonemes, c.duration) for c in chunks)
    assert {viseme_of(s.phoneme) for c in chunks for s in c.phonemes} >= {"PP", "sil"}


async def test_a_stream_without_timing_flows_at_once_without_phonemes(
    server: VendorServer,
) -> None:
    pcm = tone(1.0, 24_000)
    lines = [elevenlabs_line(pcm[i : i + 4800]) for i in range(0, len(pcm), 4800)]
    server.script(ELEVENLABS, Reply(pieces=lines))
    async with aiohttp.ClientSession() as session:
        chunks = [c async for c in _client(session, server).synthesize(TEXT)]
    assert len(chunks) == len(lines) and all(c.phonemes == () for c in chunks)
    assert sum(len(c.pcm) for c in chunks) * 2 == len(pcm)


@pytest.mark.parametrize(
    ("line", "why"),
    [
        (b"not json\n", "not JSON"),
        (b"[1, 2]\n", "not a JSON object"),
        (b'{"audio_base64": "@@@"}\n', "not base64"),
        (b'{"audio_base64": 7}\n', "not a string"),
        (b'{"audio_base64": "AAA=", "alignment": {"characters": ["a"]}}\n', "malformed alignment"),
        (b'{"audio_base64": "AAAA", "alignment": null}\n{"audio_base64": "AAA="}\n', "odd PCM"),
    ],
)
async def test_a_malformed_stream_is_a_clear_provider_error(
    server: VendorServer, line: bytes, why: str
) -> None:
    server.script(ELEVENLABS, Reply(pieces=[line]))
    async with aiohttp.ClientSession() as session:
        with pytest.raises(ProviderError) as info:
            _ = [c async for c in _client(session, server).synthesize(TEXT)]
    assert info.value.code == "bad_response" and why in str(info.value)


def test_words_split_across_messages_are_timed_once_whole() -> None:
    timing = CharacterTiming()
    timing.add(list("my mo"), [0.0, 0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.3, 0.4, 0.5])
    first = timing.take()
    assert [s.phoneme for s in first if s.phoneme != "_"] == list(phonemize_word("my")) or first
    assert timing.known_until == pytest.approx(0.3)  # "mo" may go on
    timing.add(list("ther."), [0.5, 0.6, 0.7, 0.8, 0.9], [0.6, 0.7, 0.8, 0.9, 1.0])
    timing.finish(1.2)
    spans = first + timing.take()
    assert spans[0].start == 0.0 and spans[-1].end == pytest.approx(1.2)
    mother = [s for s in spans if 0.3 <= s.start < 0.9]
    assert mother[0].phoneme == "m" and mother[0].start == pytest.approx(0.3)
    assert all(abs(a.end - b.start) < 1e-9 for a, b in zip(spans, spans[1:], strict=False))


def test_phonemizing_a_word_is_cheap_and_cached() -> None:
    words = [f"word{i}" for i in range(50)] + ["mother", "violin", "pumpkin"] * 10
    phonemize_word.cache_clear()
    started = time.process_time()
    for w in words:
        phonemize_word(w)
    per_word = (time.process_time() - started) / phonemize_word.cache_info().misses
    print(f"phonemizing: {per_word * 1000:.3f} ms CPU per new word")
    assert phonemize_word("mother")[0] == "m" and phonemize_word.cache_info().hits >= 27
