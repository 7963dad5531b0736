"""ElevenLabs speech with its phonemes: the stream's character timing turned into phonemes
that cover each chunk exactly, against a local server speaking the stream-with-timestamps
wire format."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from benchmarks.vendor_standin import (
    ELEVENLABS,
    ELEVENLABS_KEY,
    Reply,
    VendorServer,
    elevenlabs_line,
    tone,
)
from musetalk_core.types import AudioChunk, PhonemeSpan
from musetalk_core.visemes import viseme_of
from rtc_server.providers.base import ProviderError
from rtc_server.providers.char_phonemes import MAX_WORD_S, CharacterTiming, phonemize_word
from rtc_server.providers.elevenlabs_tts import ElevenLabsTTS
from rtc_server.providers.http import HTTPPolicy

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
    assert [s.phoneme for s in first if s.phoneme != "_"] == [
        p for p in phonemize_word("my") if viseme_of(p)
    ]
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


def _lines(
    pcm: bytes, text: str, timed_s: float, *, rate: int = 24_000, samples: int = 2400
) -> list[bytes]:
    """``pcm`` in messages of ``samples``, ``text`` spoken evenly over its first ``timed_s``
    seconds, each character sent with the audio it sounds in; none after that."""
    step = timed_s / len(text)
    lines = []
    for at in range(0, len(pcm) // 2, samples):
        a, b = at / rate, (at + samples) / rate
        mine = [i for i in range(len(text)) if a <= i * step < b]
        piece = pcm[2 * at : 2 * (at + samples)]
        chars = [text[i] for i in mine]
        lines.append(
            elevenlabs_line(piece, chars, [i * step for i in mine], [(i + 1) * step for i in mine])
        )
    return lines


async def _synthesize(server: VendorServer, text: str = TEXT) -> list[AudioChunk]:
    async with aiohttp.ClientSession() as session:
        return [c async for c in _client(session, server).synthesize(text)]


async def test_a_word_longer_than_the_hold_keeps_its_timing(server: VendorServer) -> None:
    # One word of 1.4 s, its characters in step with its audio: the audio waits for the
    # word's end (its timing), not MAX_HOLD_S for timing that is in fact coming.
    text = "Incomprehensibilities."
    pcm = tone(1.5, 24_000)
    server.script(ELEVENLABS, Reply(pieces=_lines(pcm, text, 1.5)))
    chunks = await _synthesize(server, text)
    assert sum(len(c.pcm) for c in chunks) * 2 == len(pcm)
    assert all(c.phonemes and _covers(c.phonemes, c.duration) for c in chunks)
    assert "PP" in {viseme_of(s.phoneme) for c in chunks for s in c.phonemes}  # the "m"


async def test_audio_flows_once_the_timing_stops(server: VendorServer) -> None:
    # The service times the first 0.5 s, then sends audio alone. Everything up to the gate
    # must come out before the server sends the rest: untimed audio is not held for long.
    rate = 24_000
    pcm = tone(1.5, rate)
    lines = _lines(pcm, "Bob moved maps.", 0.5)
    before = 12  # 1.2 s: 0.7 s of it untimed, more than MAX_HOLD_S
    gate = asyncio.Event()
    server.script(ELEVENLABS, Reply(pieces=[b"".join(lines[:before]), *lines[before:]], gate=gate))
    chunks: list[AudioChunk] = []
    async with aiohttp.ClientSession() as session, asyncio.timeout(5):
        async for chunk in _client(session, server).synthesize("Bob moved maps."):
            chunks.append(chunk)
            if sum(len(c.pcm) for c in chunks) >= before * 2400:
                gate.set()
    assert gate.is_set() and sum(len(c.pcm) for c in chunks) * 2 == len(pcm)
    timed = [c for c in chunks if c.phonemes]
    assert all(_covers(c.phonemes, c.duration) for c in timed)
    assert sum(c.duration for c in timed) == pytest.approx(0.5, abs=1e-3)
    assert chunks[: len(timed)] == timed  # timed first, then the rest without phonemes
    assert "PP" in {viseme_of(s.phoneme) for c in timed for s in c.phonemes}


async def test_audio_past_the_last_character_has_no_phonemes(server: VendorServer) -> None:
    pcm = tone(0.5, 24_000)
    line = elevenlabs_line(pcm, list("Hi."), [0.0, 0.1, 0.2], [0.1, 0.2, 0.3])
    server.script(ELEVENLABS, Reply(pieces=[line]))
    chunks = await _synthesize(server, "Hi.")
    assert [round(c.duration, 6) for c in chunks] == [0.3, 0.2]
    assert _covers(chunks[0].phonemes, 0.3) and chunks[1].phonemes == ()


async def test_phonemes_crossing_chunk_boundaries_are_split(server: VendorServer) -> None:
    # All the characters first, then the audio in 30 ms pieces: chunks are cut by the audio,
    # inside phonemes, and each piece of a phoneme goes with its own chunk.
    rate = 24_000
    pcm = tone(1.0, rate)
    text = "My mother bought a big blue map."
    step = 1.0 / len(text)
    starts = [i * step for i in range(len(text))]
    ends = [(i + 1) * step for i in range(len(text))]
    audio = [elevenlabs_line(pcm[i : i + 1440]) for i in range(0, len(pcm), 1440)]
    server.script(ELEVENLABS, Reply(pieces=[elevenlabs_line(b"", text, starts, ends), *audio]))
    chunks = await _synthesize(server, text)
    assert len(chunks) == len(audio)
    assert all(c.phonemes and _covers(c.phonemes, c.duration) for c in chunks)
    rejoined: list[PhonemeSpan] = []
    t = 0.0
    for c in chunks:
        for s in c.phonemes:
            span = PhonemeSpan(s.phoneme, s.start + t, s.end + t)
            last = rejoined[-1] if rejoined else None
            if last is not None and abs(s.start) < 1e-12 and last.phoneme == s.phoneme:
                rejoined[-1] = PhonemeSpan(s.phoneme, last.start, span.end)  # a split one
            else:
                rejoined.append(span)
        t += c.duration
    whole = CharacterTiming()
    whole.add(list(text), starts, ends)
    whole.finish()
    expected = whole.take()
    assert [s.phoneme for s in rejoined] == [s.phoneme for s in expected]
    for got, want in zip(rejoined, expected, strict=True):
        assert got.start == pytest.approx(want.start, abs=2e-3)
        assert got.end == pytest.approx(want.end, abs=2e-3)
    assert sum(1 for c in chunks for s in c.phonemes) > len(expected)  # some were split


async def test_normalized_alignment_is_preferred(server: VendorServer) -> None:
    pcm = tone(0.3, 24_000)
    times = ([0.0, 0.1, 0.2], [0.1, 0.2, 0.3])
    both = json.loads(elevenlabs_line(pcm, list("Hi!"), *times))
    both["normalized_alignment"]["characters"] = list("Bob")
    only_raw = elevenlabs_line(pcm, list("Bob"), *times, normalized=False)
    server.script(ELEVENLABS, Reply(pieces=[json.dumps(both).encode() + b"\n"]))
    server.script(ELEVENLABS, Reply(pieces=[only_raw]))
    for _ in range(2):
        chunks = await _synthesize(server, "Hi!")
        assert _covers(chunks[0].phonemes, chunks[0].duration)
        assert "PP" in {viseme_of(s.phoneme) for c in chunks for s in c.phonemes}


async def test_a_sample_split_between_messages_is_joined(server: VendorServer) -> None:
    pcm = tone(0.4, 24_000)
    cut = 4801  # inside a sample
    text = "Bob."
    first = elevenlabs_line(pcm[:cut], list(text[:2]), [0.0, 0.1], [0.1, 0.2])
    second = elevenlabs_line(pcm[cut:], list(text[2:]), [0.2, 0.3], [0.3, 0.4])
    server.script(ELEVENLABS, Reply(pieces=[first, second]))
    chunks = await _synthesize(server, text)
    assert b"".join(c.pcm.tobytes() for c in chunks) == pcm
    assert all(c.phonemes and _covers(c.phonemes, c.duration) for c in chunks)


@pytest.mark.parametrize(
    "pieces",
    [[], [b"\n\n"], [elevenlabs_line(b"", list("Hi"), [0.0, 0.1], [0.1, 0.2])]],
    ids=["empty", "blank-lines", "timing-only"],
)
async def test_a_stream_without_audio_is_an_error(
    server: VendorServer, pieces: list[bytes]
) -> None:
    server.script(ELEVENLABS, Reply(pieces=pieces))
    with pytest.raises(ProviderError) as info:
        await _synthesize(server)
    assert (info.value.code, info.value.retryable) == ("bad_response", True)
    assert "no audio" in str(info.value)


def test_a_lone_article_is_not_read_as_its_letter() -> None:
    assert phonemize_word("a") == ("ɐ",)
    timing = CharacterTiming()
    timing.add(list("A map"), [0.0, 0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.3, 0.4, 0.5])
    timing.finish()
    assert [s.phoneme for s in timing.take()][:2] == ["ɐ", "_"]


def test_text_without_spaces_is_timed_in_pieces() -> None:
    timing = CharacterTiming()
    n = 40
    step = 0.1  # 4 s of letters without a break
    timing.add(["m"] * n, [i * step for i in range(n)], [(i + 1) * step for i in range(n)])
    assert timing.known_until >= 4.0 - MAX_WORD_S - step
    assert all(s.end - s.start > 0 for s in timing.take())


def test_bad_character_times_are_refused() -> None:
    timing = CharacterTiming()
    with pytest.raises(ValueError):
        timing.add(["a"], [float("nan")], [0.1])
    with pytest.raises(ValueError):
        timing.add(["a", "b"], [0.0], [0.1])
