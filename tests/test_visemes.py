"""Phoneme timing from the Piper voice itself, and visemes with co-articulation from it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from musetalk_core import visemes as vm
from musetalk_core.types import AudioChunk, PhonemeSpan
from rtc_server.providers.piper_tts import PiperTTS, phoneme_spans

# Held out of any tuning of the viseme constants (musetalk_core/visemes.py says which sentences
# set them).
SENTENCES = (
    "Hi.",
    "Bob met a vain friend at the bus stop.",
    "Please move the five heavy boxes above the old map before the evening.",
    "A brave farmer from Vermont bought a pair of blue boots, and we might buy some more "
    "of them for the members of our family next February.",
)
BILABIAL = set("pbm")
LABIODENTAL = set("fv")
OPEN_VOWELS = set("aɑæʌ")


@pytest.fixture(scope="module")
def tts(tmp_path_factory: pytest.TempPathFactory) -> PiperTTS:
    return PiperTTS.load(deterministic=True, cache_dir=tmp_path_factory.mktemp("cache"))


def _speak(tts: PiperTTS, text: str) -> list[AudioChunk]:
    async def go() -> list[AudioChunk]:
        return [c async for c in tts.synthesize(text)]

    return asyncio.run(go())


def test_the_voice_is_patched_once_into_the_cache(tmp_path: Path) -> None:
    PiperTTS.load(cache_dir=tmp_path)
    patched = list((tmp_path / "piper").glob("*-aligned.onnx"))
    assert len(patched) == 1 and patched[0].stat().st_size > 10_000_000
    assert not list((tmp_path / "piper").glob("*.tmp"))


@pytest.mark.parametrize("text", SENTENCES, ids=lambda t: f"{len(t)}chars")
def test_phoneme_timing_adds_up_to_the_audio_exactly(tts: PiperTTS, text: str) -> None:
    assert tts.has_timing
    chunks = _speak(tts, text)
    assert chunks
    for chunk in chunks:
        spans = chunk.phonemes
        assert spans and spans[0].start == 0.0
        assert spans[-1].end * chunk.sample_rate == pytest.approx(len(chunk.pcm), abs=1e-6)
        for a, b in zip(spans, spans[1:], strict=False):
            assert a.end == b.start and a.end > a.start
        # Every symbol is one the viseme table knows: a shape, rest, or a transparent mark.
        for s in spans:
            shape = vm.viseme_of(s.phoneme)
            assert shape != "sil" or s.phoneme in "^$.,;:!?", s.phoneme


def test_timing_that_does_not_add_up_is_dropped() -> None:
    class A:
        def __init__(self, p: str, n: int) -> None:
            self.phoneme, self.num_samples = p, n

    assert phoneme_spans([A("m", 100), A("a", 100)], 1000, 200) == (
        PhonemeSpan("m", 0.0, 0.1),
        PhonemeSpan("a", 0.1, 0.2),
    )
    assert phoneme_spans([A("m", 100)], 1000, 200) == ()
    assert phoneme_spans(None, 1000, 200) == ()


def _timeline(chunks: list[AudioChunk]) -> tuple[vm.VisemeTimeline, list[tuple[str, float]]]:
    """The timeline of a reply, and (phoneme, midpoint) on its clock."""
    timeline = vm.VisemeTimeline()
    mids = []
    at = 0.0
    for c in chunks:
        timeline.add(c.phonemes, at)
        mids += [(s.phoneme, at + (s.start + s.end) / 2) for s in c.phonemes]
        at += c.duration
    return timeline, mids


def test_lips_close_for_bilabials_tuck_for_labiodentals_open_for_open_vowels(
    tts: PiperTTS,
) -> None:
    closed, tucked, opened = [], [], []
    for text in SENTENCES:
        timeline, mids = _timeline(_speak(tts, text))
        for p, t in mids:
            m = timeline.mouth(t)
            if p in BILABIAL:
                closed.append(m[3] >= 0.9 and m[0] <= 0.05)
            elif p in LABIODENTAL:
                tucked.append(m[4] >= 0.9)
            elif p in OPEN_VOWELS:
                opened.append(m[0] >= 0.3)  # a gap of 30 % of the full opening at least
    assert len(closed) >= 20 and len(tucked) >= 10 and len(opened) >= 10
    assert np.mean(closed) >= 0.9, closed
    assert np.mean(tucked) >= 0.9, tucked
    assert np.mean(opened) >= 0.9, opened


def test_shapes_start_before_their_sound_and_blend_with_neighbours() -> None:
    spans = (
        PhonemeSpan("^", 0.0, 0.06),
        PhonemeSpan("a", 0.06, 0.2),
        PhonemeSpan("m", 0.2, 0.26),
        PhonemeSpan("a", 0.26, 0.4),
        PhonemeSpan("$", 0.4, 0.46),
    )
    timeline = vm.VisemeTimeline()
    timeline.add(spans, 0.0)
    pp = vm.VISEMES.index("PP")
    early, just_before, inside = timeline.weights([0.14, 0.19, 0.23])[:, pp]
    assert early < just_before < inside
    assert just_before > 0.25, "the lips are already closing before the m sounds"
    assert inside > 0.6
    # Mid-vowel the vowel leads, with some of the m beside it.
    w = timeline.weights(0.13)
    assert int(np.argmax(w)) == vm.VISEMES.index("aa")


def test_weights_sum_to_one_and_the_mouth_rests_outside_speech() -> None:
    timeline = vm.VisemeTimeline()
    assert timeline.weights(1.0)[0] == 1.0, "nothing added: rest"
    timeline.add((PhonemeSpan("a", 0.0, 0.2), PhonemeSpan("u", 0.2, 0.4)), at=1.0)
    w = timeline.weights(np.linspace(0.0, 2.0, 201))
    assert np.allclose(w.sum(axis=1), 1.0, atol=1e-5) and (w >= 0).all()
    assert w[0, 0] == 1.0 and w[-1, 0] == 1.0, "rest well before and well after"
    assert timeline.weights(1.1)[vm.VISEMES.index("aa")] > 0.8


def test_a_cut_relaxes_the_mouth_to_rest() -> None:
    timeline = vm.VisemeTimeline()
    timeline.add((PhonemeSpan("a", 0.0, 1.0),), at=0.0)
    timeline.cut(0.5)
    assert timeline.end == 0.5
    before, during, after = timeline.weights([0.45, 0.5 + vm.DECAY_S / 2, 0.5 + vm.DECAY_S])[:, 0]
    assert before < 0.1 and 0.3 < during < 0.7 and after == 1.0
    # Phonemes added for after the cut stay unshaped.
    timeline.add((PhonemeSpan("u", 0.0, 0.3),), at=1.0)
    assert timeline.weights(1.1)[0] == 1.0


def test_arkit_weights_follow_the_visemes() -> None:
    assert vm.ARKIT.shape == (len(vm.VISEMES), len(vm.BLEND_SHAPES))
    assert ((vm.ARKIT >= 0) & (vm.ARKIT <= 1)).all()
    shape = {name: i for i, name in enumerate(vm.BLEND_SHAPES)}
    timeline = vm.VisemeTimeline()
    timeline.add((PhonemeSpan("m", 0.0, 0.1), PhonemeSpan("ɑ", 0.1, 0.3)), at=0.0)
    m, a = timeline.arkit([0.05, 0.25])
    assert m[shape["mouthClose"]] > 0.3 and a[shape["jawOpen"]] > 0.4
    assert a[shape["jawOpen"]] > m[shape["jawOpen"]]


async def test_phonemes_reach_the_engine_with_the_speech(tts: PiperTTS) -> None:
    """Through the speech output and the scheduler: trimmed of the voice's leading silence and
    resampled to the call's rate, each chunk still has its phonemes, covering it end to end."""
    from rtc_server.media.clock import ManualClock
    from rtc_server.media.scheduler import AVScheduler
    from rtc_server.speech import SpeechOutput, Utterance
    from tests.fakes import CountingEngine

    engine = CountingEngine()
    scheduler = AVScheduler(engine, ManualClock())
    speech = SpeechOutput(scheduler)

    async def sentences():  # type: ignore[no-untyped-def]
        yield "Hi there."
        yield "My mother bought a big blue map."

    await speech.speak(tts, sentences(), Utterance())
    # Each sentence: its sound with its phonemes, then the resampler's last samples (its
    # filter's tail, under a millisecond), which carry none of their own.
    timed = [c for c in engine.pushed if c.phonemes]
    tails = [c for c in engine.pushed if not c.phonemes]
    assert len(timed) == len(tails) == 2 and all(t.duration < 0.001 for t in tails)
    raw = [c async for c in tts.synthesize("Hi there.")]
    raw += [c async for c in tts.synthesize("My mother bought a big blue map.")]
    for got, tail, before in zip(timed, tails, raw, strict=True):
        assert got.sample_rate == 48_000 and got.phonemes
        assert got.phonemes[0].start == 0.0
        assert abs(got.phonemes[-1].end - got.duration - tail.duration) < 2 / got.sample_rate
        # The leading silence went, and the phonemes moved with the sound.
        cut = before.duration - got.duration - tail.duration
        assert cut > 0
        kept = [s for s in before.phonemes if s.end > cut]
        assert [s.phoneme for s in got.phonemes] == [s.phoneme for s in kept]
        # (the cut is read off durations resampled to 48 kHz: within a sample of the voice)
        assert abs(got.phonemes[1].start - (kept[1].start - cut)) < 1 / before.sample_rate
    await scheduler.aclose()
