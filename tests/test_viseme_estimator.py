"""The viseme estimator: mouth shapes from audio alone, measured against the Piper voice's own
phoneme timing on sentences its training never saw."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from benchmarks.viseme_sentences import HELD_OUT
from benchmarks.visemes import lip_marks, matched
from musetalk_core.types import AudioChunk, PhonemeSpan
from musetalk_core.visemes import viseme_of
from rtc_server.media.viseme_estimator import SYMBOLS, VisemeEstimator, shared_estimator
from rtc_server.providers.piper_tts import PiperTTS


@pytest.fixture(scope="module")
def spoken() -> list[tuple[np.ndarray, int, list[PhonemeSpan]]]:
    tts = PiperTTS.load(deterministic=True)
    assert tts.has_timing

    async def speak(text: str) -> tuple[np.ndarray, int, list[PhonemeSpan]]:
        chunks = [c async for c in tts.synthesize(text)]
        spans, at = [], 0.0
        for c in chunks:
            spans += [PhonemeSpan(s.phoneme, s.start + at, s.end + at) for s in c.phonemes]
            at += c.duration
        return np.concatenate([c.pcm for c in chunks]), chunks[0].sample_rate, spans

    return [asyncio.run(speak(text)) for text in HELD_OUT]


def _measure(
    spoken: list[tuple[np.ndarray, int, list[PhonemeSpan]]], chunk_s: float | None
) -> tuple[float, float, int]:
    model = VisemeEstimator.load()
    truth_n = found_n = hits = correct = 0
    rng = np.random.default_rng(1)
    for pcm, rate, spans in spoken:
        if chunk_s is None:
            estimated = list(model.estimate(pcm, rate))
        else:
            stream, estimated, at = model.stream(rate), [], 0
            while at < len(pcm):
                n = int(rate * rng.uniform(chunk_s, 3 * chunk_s))
                part = pcm[at : at + n]
                got = stream.feed(part)
                assert got[0].start == 0.0 and abs(got[-1].end - len(part) / rate) < 1e-9
                assert all(a.end == b.start for a, b in zip(got, got[1:], strict=False))
                estimated += [
                    PhonemeSpan(s.phoneme, s.start + at / rate, s.end + at / rate) for s in got
                ]
                at += n
        truth, found = lip_marks(spans), lip_marks(estimated)
        h, c = matched(truth, found)
        truth_n, found_n, hits, correct = (
            truth_n + len(truth),
            found_n + len(found),
            hits + h,
            correct + c,
        )
    return hits / truth_n, correct / max(1, found_n), truth_n


def test_the_estimator_finds_the_voices_closed_and_tucked_lips(spoken: list) -> None:  # type: ignore[type-arg]
    recall, precision, n = _measure(spoken, None)
    print(
        f"held out: {n} bilabials and labiodentals, found {recall:.0%}, precision {precision:.0%}"
    )
    assert n >= 40
    assert recall >= 0.8
    assert precision >= 0.6  # not lips closed everywhere


def test_streamed_chunks_are_covered_and_found_as_well(spoken: list) -> None:  # type: ignore[type-arg]
    one_shot, _, _ = _measure(spoken, None)
    recall, precision, _ = _measure(spoken, 0.1)  # chunks of 100 to 300 ms
    print(f"streamed in 100-300 ms chunks: found {recall:.0%}, precision {precision:.0%}")
    assert recall >= one_shot - 0.1 and recall >= 0.75


def test_silence_is_rest_and_every_rate_works() -> None:
    model = VisemeEstimator.load()
    for rate in (16_000, 22_050, 24_000, 44_100, 48_000):
        spans = model.estimate(np.zeros(rate, np.int16), rate)
        assert {s.phoneme for s in spans} == {"_"}
        assert spans[0].start == 0.0 and spans[-1].end == pytest.approx(1.0)
    assert {viseme_of(s) for s in SYMBOLS} == {"sil", "PP", "FF", "aa", "oh", "E", "SS", "DD"}


def test_estimation_costs_little(spoken: list) -> None:  # type: ignore[type-arg]
    model = VisemeEstimator.load()
    seconds = sum(len(p) / r for p, r, _ in spoken)
    cpu = time.process_time()
    for pcm, rate, _ in spoken:
        model.estimate(pcm, rate)
    per_second = (time.process_time() - cpu) / seconds
    print(f"estimation: {per_second * 1000:.1f} ms CPU per second of speech")
    assert shared_estimator() is shared_estimator()


async def test_speech_without_timing_reaches_the_engine_with_estimated_phonemes(
    spoken: list,  # type: ignore[type-arg]
) -> None:
    from collections.abc import AsyncGenerator

    from rtc_server.media.clock import ManualClock
    from rtc_server.media.scheduler import AVScheduler
    from rtc_server.speech import SpeechOutput, Utterance
    from tests.fakes import CountingEngine

    pcm, rate, spans = spoken[1]

    class CloudVoice:
        name = "cloud"
        sample_rate = rate

        def __init__(self, timed: bool) -> None:
            self.timed = timed

        async def synthesize(
            self, text: str, *, previous_text: str = ""
        ) -> AsyncGenerator[AudioChunk, None]:
            step = rate // 10
            for i in range(0, len(pcm), step):
                part = pcm[i : i + step]
                mine = tuple(
                    PhonemeSpan(
                        s.phoneme,
                        max(0.0, s.start - i / rate),
                        min(len(part) / rate, s.end - i / rate),
                    )
                    for s in spans
                    if s.end > i / rate and s.start < (i + len(part)) / rate
                )
                yield AudioChunk(part, rate, mine if self.timed else ())

    async def one() -> AsyncGenerator[str, None]:
        yield HELD_OUT[1]

    for timed in (False, True):
        engine = CountingEngine()
        scheduler = AVScheduler(engine, ManualClock())
        await SpeechOutput(scheduler).speak(CloudVoice(timed), one(), Utterance())  # type: ignore[arg-type]
        sounding = [c for c in engine.pushed if c.duration > 0.01]
        assert sounding and all(c.phonemes for c in sounding)
        symbols = {s.phoneme for c in sounding for s in c.phonemes}
        if timed:
            assert symbols <= {s.phoneme for s in spans}  # the voice's own, passed on
        else:
            assert symbols <= set(SYMBOLS) and "p" in symbols  # estimated
        await scheduler.aclose()
