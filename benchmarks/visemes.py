"""``bench visemes``: what the mouth's phonemes cost, side by side in one run.

* **Timing from the voice**: the bundled Piper voice synthesizing the same sentences as
  published and patched to report its phoneme durations (CPU per second of speech, both), and
  the spans made from them.
* **The viseme stream**: a scheduler playing speech with phonemes on a hand-moved clock, with
  and without a viseme stream in both forms (CPU per second of speech).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from benchmarks.clip import PARAGRAPH
from musetalk_core.synctest import SyncTestEngine
from musetalk_core.types import AudioChunk
from rtc_server.media.clock import ManualClock
from rtc_server.media.resample import resample_int16
from rtc_server.media.scheduler import AVScheduler
from rtc_server.providers.piper_tts import PiperTTS
from rtc_server.viseme_stream import VisemeStream


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
    chunks = asyncio.run(_synthesize(PiperTTS.load(deterministic=True), [PARAGRAPH] * 2))[2]
    return {"timing": timing, "stream": _stream(chunks)}


def rows(result: dict[str, Any]) -> list[tuple[str, float, str]]:
    """(what, CPU ms per second of speech, note) for the table and the plot."""
    t, s = result["timing"], result["stream"]
    return [
        ("Piper, as published", t["plain_cpu_ms_per_s"], "synthesis"),
        ("Piper, with phoneme timing", t["timed_cpu_ms_per_s"], "synthesis"),
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
    return "\n".join(lines)
