"""``bench visemes``: what the mouth's phonemes cost, side by side in one run.

* **Timing from the voice**: the bundled Piper voice synthesizing the same sentences as
  published and patched to report its phoneme durations (CPU per second of speech, both), and
  the spans made from them.
* **Estimated from the audio**: the viseme estimator on the held-out sentences (as spoken by
  the voice): how many of the voice's own bilabials and labiodentals it finds within 40 ms,
  how many it finds are real, and its CPU per second of speech.
* **From character timing** (ElevenLabs): the held-out sentences' characters, timed 15 a
  second, turned into phonemes with the word cache empty (CPU per second of speech).
* **The viseme stream**: a scheduler playing speech with phonemes on a hand-moved clock, with
  and without a viseme stream in both forms (CPU per second of speech).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import numpy as np

from benchmarks.clip import PARAGRAPH
from benchmarks.viseme_sentences import HELD_OUT
from musetalk_core.synctest import SyncTestEngine
from musetalk_core.types import AudioChunk, PhonemeSpan
from musetalk_core.visemes import viseme_of
from rtc_server.media.clock import ManualClock
from rtc_server.media.resample import resample_int16
from rtc_server.media.scheduler import AVScheduler
from rtc_server.media.viseme_estimator import VisemeEstimator
from rtc_server.providers.piper_tts import PiperTTS
from rtc_server.viseme_stream import VisemeStream

LIPS = ("PP", "FF")
TOLERANCE_S = 0.040


def lip_marks(spans: list[PhonemeSpan] | tuple[PhonemeSpan, ...]) -> list[tuple[str, float]]:
    """(viseme, midpoint) of the spans that close the lips or put them to the teeth."""
    out = []
    for s in spans:
        v = viseme_of(s.phoneme)
        if v in LIPS:
            out.append((v, (s.start + s.end) / 2))
    return out


def matched(truth: list[tuple[str, float]], found: list[tuple[str, float]]) -> tuple[int, int]:
    """(true marks found, found marks true): the same viseme, midpoints within 40 ms."""

    def near(a: tuple[str, float], pool: list[tuple[str, float]]) -> bool:
        return any(v == a[0] and abs(t - a[1]) <= TOLERANCE_S for v, t in pool)

    return sum(near(t, found) for t in truth), sum(near(f, truth) for f in found)


def _estimation(tts: PiperTTS) -> dict[str, Any]:
    model = VisemeEstimator.load()
    truth_n = found_n = hits = correct = 0
    cpu = speech = 0.0
    for text in HELD_OUT:
        chunks = asyncio.run(_synthesize(tts, [text]))[2]
        spans: list[PhonemeSpan] = []
        at = 0.0
        for c in chunks:
            spans += [PhonemeSpan(s.phoneme, s.start + at, s.end + at) for s in c.phonemes]
            at += c.duration
        pcm = np.concatenate([c.pcm for c in chunks])
        started = time.process_time()
        estimated = model.estimate(pcm, chunks[0].sample_rate)
        cpu += time.process_time() - started
        speech += at
        truth, found = lip_marks(spans), lip_marks(estimated)
        h, c_ = matched(truth, found)
        truth_n, found_n, hits, correct = (
            truth_n + len(truth),
            found_n + len(found),
            hits + h,
            correct + c_,
        )
    return {
        "sentences": len(HELD_OUT),
        "lip_phonemes": truth_n,
        "found": hits / truth_n,
        "precision": correct / max(1, found_n),
        "cpu_ms_per_s": cpu / speech * 1000,
    }


def _characters() -> dict[str, Any]:
    from rtc_server.providers.char_phonemes import CharacterTiming, phonemize_word

    phonemize_word.cache_clear()
    seconds = 0.0
    spans = 0
    cpu = time.process_time()
    for text in HELD_OUT:
        step = 1 / 15
        timing = CharacterTiming()
        timing.add(
            list(text),
            [i * step for i in range(len(text))],
            [(i + 1) * step for i in range(len(text))],
        )
        timing.finish(len(text) * step)
        spans += len(timing.take())
        seconds += len(text) * step
    cpu = time.process_time() - cpu
    return {"speech_s": seconds, "spans": spans, "cpu_ms_per_s": cpu / seconds * 1000}


async def _synthesize(tts: PiperTTS, texts: list[str]) -> tuple[float, float, list[AudioChunk]]:
    """(CPU seconds, seconds of speech, chunks) of ``texts`` spoken one after another."""
    chunks: list[AudioChunk] = []
    cpu = time.process_time()
    for text in texts:
        chunks += [c async for c in tts.synthesize(text)]
    return time.process_time() - cpu, sum(c.duration for c in chunks), chunks


def _timing(repeats: int) -> dict[str, Any]:
    texts = [PARAGRAPH] * repeats
    plain = PiperTTS.load(deterministic=True, timing=False)
    timed = PiperTTS.load(deterministic=True)
    asyncio.run(_synthesize(timed, texts[:1]))  # warm both sessions up
    asyncio.run(_synthesize(plain, texts[:1]))
    plain_cpu, speech_s, _ = asyncio.run(_synthesize(plain, texts))
    timed_cpu, timed_s, chunks = asyncio.run(_synthesize(timed, texts))
    spans = sum(len(c.phonemes) for c in chunks)
    return {
        "voice_has_timing": timed.has_timing,
        "speech_s": speech_s,
        "plain_cpu_ms_per_s": plain_cpu / speech_s * 1000,
        "timed_cpu_ms_per_s": timed_cpu / timed_s * 1000,
        "timing_cpu_ms_per_s": (timed_cpu / timed_s - plain_cpu / speech_s) * 1000,
        "phonemes_per_s": spans / timed_s,
    }


class _Channel:
    """Stands in for the ``visemes`` data channel: takes the binary frames."""

    label = "visemes"
    readyState = "open"

    def __init__(self) -> None:
        self.bytes = 0

    def send(self, data: bytes) -> None:
        self.bytes += len(data)


async def _stream_cost(chunks: list[AudioChunk], on: bool) -> tuple[float, float]:
    """(CPU seconds, seconds played) of a scheduler playing ``chunks``, with a stream if ``on``."""
    clock = ManualClock()
    scheduler = AVScheduler(SyncTestEngine(size=(16, 16)), clock)
    stream = VisemeStream(scheduler)
    sent: list[int] = []
    if on:
        stream.json = lambda event: sent.append(len(json.dumps(event)))
        stream.attach(_Channel())  # type: ignore[arg-type]
    scheduler.on_queued, scheduler.on_clear = stream.on_queued, stream.on_clear
    for chunk in chunks:
        pcm = resample_int16(chunk.pcm, chunk.sample_rate, 48_000)
        await scheduler.push_audio(AudioChunk(pcm, 48_000, chunk.phonemes), 0)
    await scheduler.end_segment(0)
    units = round(sum(c.duration for c in chunks) * 25) + 10
    cpu = time.process_time()
    for k in range(units):
        clock.advance(1 / 25)
        unit = scheduler.unit(k, "audio")
        stream.on_unit(k, unit)
    return time.process_time() - cpu, units / 25


def _stream(chunks: list[AudioChunk]) -> dict[str, Any]:
    off_cpu, played = asyncio.run(_stream_cost(chunks, on=False))
    on_cpu, _ = asyncio.run(_stream_cost(chunks, on=True))
    return {
        "played_s": played,
        "scheduler_cpu_ms_per_s": off_cpu / played * 1000,
        "with_stream_cpu_ms_per_s": on_cpu / played * 1000,
        "stream_cpu_ms_per_s": (on_cpu - off_cpu) / played * 1000,
    }


def run(repeats: int = 3) -> dict[str, Any]:
    timing = _timing(repeats)
    tts = PiperTTS.load(deterministic=True)
    chunks = asyncio.run(_synthesize(tts, [PARAGRAPH] * 2))[2]
    return {
        "timing": timing,
        "estimate": _estimation(tts),
        "characters": _characters(),
        "stream": _stream(chunks),
    }


def rows(result: dict[str, Any]) -> list[tuple[str, float, str]]:
    """(what, CPU ms per second of speech, note) for the table and the plot."""
    t, s = result["timing"], result["stream"]
    return [
        ("Piper, as published", t["plain_cpu_ms_per_s"], "synthesis"),
        ("Piper, with phoneme timing", t["timed_cpu_ms_per_s"], "synthesis"),
        ("estimated from the audio", result["estimate"]["cpu_ms_per_s"], "viseme estimator"),
        ("from character timing", result["characters"]["cpu_ms_per_s"], "ElevenLabs, no cache"),
        ("scheduler alone", s["scheduler_cpu_ms_per_s"], "playing"),
        ("scheduler + viseme stream", s["with_stream_cpu_ms_per_s"], "playing, JSON + binary"),
    ]


def table(result: dict[str, Any]) -> str:
    t, s = result["timing"], result["stream"]
    lines = [f"speech {t['speech_s']:.1f} s, {t['phonemes_per_s']:.1f} phonemes/s"]
    found = rows(result)
    width = max(len(name) for name, _, _ in found)
    lines.append(f"{'':<{width}}  CPU ms per s of speech")
    lines += [f"{name:<{width}}  {value:8.2f}  {note}" for name, value, note in found]
    lines.append(
        f"phoneme timing's cost {t['timing_cpu_ms_per_s']:+.2f} ms/s; "
        f"the viseme stream's {s['stream_cpu_ms_per_s']:+.2f} ms/s"
    )
    e = result["estimate"]
    lines.append(
        f"estimator on {e['sentences']} held-out sentences: {e['found']:.0%} of "
        f"{e['lip_phonemes']} bilabials and labiodentals found within 40 ms, "
        f"{e['precision']:.0%} of those it marked real"
    )
    return "\n".join(lines)
