"""Silero VAD on synthesized speech: segments within 100 ms of truth, noise starts nothing."""

from __future__ import annotations

import asyncio
import sys

import numpy as np
import pytest

from rtc_server.media.resample import resample_int16
from rtc_server.providers.piper_tts import PiperTTS
from rtc_server.vad import SileroModel, SpeechEnd, SpeechStart, VADParams, VADStream

RATE = 16_000


@pytest.fixture(scope="module")
def model() -> SileroModel:
    return SileroModel()


def _speech(text: str) -> np.ndarray:
    async def synth() -> np.ndarray:
        tts = PiperTTS.load(deterministic=True)
        parts = [resample_int16(c.pcm, c.sample_rate, RATE) async for c in tts.synthesize(text)]
        return np.concatenate(parts)

    return asyncio.run(synth())


def _voiced_span(pcm: np.ndarray) -> tuple[float, float]:
    """Truth: first and last 10 ms window whose level is above -40 dBFS."""
    frames = pcm[: len(pcm) // 160 * 160].astype(np.float32).reshape(-1, 160) / 32768
    loud = np.flatnonzero(np.sqrt((frames**2).mean(axis=1)) > 0.01)
    return loud[0] * 0.01, (loud[-1] + 1) * 0.01


def _noise(seconds: float, level: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.normal(0, level * 32768, int(seconds * RATE))).astype(np.int16)


def test_silero_is_found_without_importing_silero_vad(model: SileroModel) -> None:
    assert "silero_vad" not in sys.modules


def test_segments_within_100_ms_of_truth(model: SileroModel) -> None:
    phrases = ["What is the capital of France?", "Tell me a short story.", "Thank you."]
    track = _noise(1.0, 0.003)
    truth = []
    for i, phrase in enumerate(phrases):
        speech = _speech(phrase)
        start, end = _voiced_span(speech)
        offset = len(track) / RATE
        truth.append((offset + start, offset + end))
        track = np.concatenate([track, speech, _noise(1.5, 0.003, seed=i + 1)])
    mixed = np.clip(track.astype(np.int32) + _noise(len(track) / RATE, 0.003, 9), -32768, 32767)

    vad = VADStream(model, VADParams(hangover_ms=500))
    events = []
    for i in range(0, len(mixed), 320):  # 20 ms pieces, as they come off the network
        events += vad.feed(mixed[i : i + 320].astype(np.int16))
    starts = [e.at for e in events if isinstance(e, SpeechStart)]
    ends = [e for e in events if isinstance(e, SpeechEnd)]
    assert len(starts) == len(ends) == len(phrases), events
    for (t0, t1), s, e in zip(truth, starts, ends, strict=True):
        assert abs(s - t0) <= 0.1, (s, t0)
        assert abs(e.at - t1) <= 0.1, (e.at, t1)
        # The turn ends one hang-over after the last confident chunk, which lies at most four
        # chunks after the refined end; the utterance audio covers the speech.
        assert 0.5 <= e.detected_at - e.at <= 0.5 + 4 * 0.032 + 0.04
        assert len(e.audio) / RATE >= t1 - t0


@pytest.mark.parametrize("level", [0.003, 0.03, 0.1])
def test_noise_alone_starts_no_turn(model: SileroModel, level: float) -> None:
    vad = VADStream(model)
    events = vad.feed(_noise(8.0, level, seed=3))
    assert events == []


def test_clicks_shorter_than_min_speech_start_nothing(model: SileroModel) -> None:
    speech = _speech("Hi.")
    click = speech[len(speech) // 2 - 800 : len(speech) // 2 + 800]  # 100 ms of a word
    vad = VADStream(model, VADParams(min_speech_ms=300))
    events = vad.feed(np.concatenate([_noise(1, 0.002), click, _noise(2, 0.002, 1)]))
    assert not any(isinstance(e, SpeechStart) for e in events)


def test_params_are_validated() -> None:
    with pytest.raises(ValueError):
        VADParams(threshold=0.3, neg_threshold=0.5)
    with pytest.raises(ValueError):
        VADParams(hangover_ms=-1)


def test_pause_shorter_than_the_hangover_keeps_one_utterance(model: SileroModel) -> None:
    from rtc_server.vad import SpeechPause, SpeechResume

    first, second = _speech("What is the capital"), _speech("of France?")
    track = np.concatenate(
        [_noise(1, 0.003), first, _noise(0.25, 0.003, 1), second, _noise(1.5, 0.003, 2)]
    )
    events = VADStream(model, VADParams(hangover_ms=500)).feed(track)
    kinds = [type(e).__name__ for e in events]
    assert kinds[0] == "SpeechStart" and kinds[-1] == "SpeechEnd"
    assert kinds.count("SpeechStart") == 1 and kinds.count("SpeechEnd") == 1
    assert "SpeechResume" in kinds
    # The last pause before the end carries all of the speech the end does.
    last_pause = [e for e in events if isinstance(e, SpeechPause)][-1]
    end = events[-1]
    assert isinstance(end, SpeechEnd)
    assert not any(isinstance(e, SpeechResume) for e in events[events.index(last_pause) :])
    assert len(last_pause.audio) / RATE >= end.at - 1.0 - 0.2


class CountingModel(SileroModel):
    """The real model, counting the chunks it is asked about."""

    def __init__(self) -> None:
        super().__init__()
        self.runs = 0

    def run(self, x: np.ndarray, state: np.ndarray) -> tuple[float, np.ndarray]:
        self.runs += 1
        return super().run(x, state)


@pytest.mark.parametrize("floor", ["zeros", "dither"])
def test_a_silent_microphone_costs_no_model_run_and_speech_after_it_is_found(floor: str) -> None:
    """Chunks within -60 dBFS of zero are silence without the model; speech after them is
    found where it is after a noisy floor."""
    model = CountingModel()
    rng = np.random.default_rng(5)
    quiet = (
        np.zeros(2 * RATE, np.int16)
        if floor == "zeros"
        else rng.integers(-20, 21, 2 * RATE).astype(np.int16)
    )
    speech = _speech("What is the capital of Italy?")
    vad = VADStream(model, VADParams(hangover_ms=500))
    assert vad.feed(quiet) == []
    assert model.runs == 0
    start, end = _voiced_span(speech)
    events = vad.feed(np.concatenate([speech, quiet]))
    starts = [e.at for e in events if isinstance(e, SpeechStart)]
    ends = [e.at for e in events if isinstance(e, SpeechEnd)]
    assert len(starts) == len(ends) == 1, events
    assert abs(starts[0] - (2.0 + start)) <= 0.1
    assert abs(ends[0] - (2.0 + end)) <= 0.1
    # The model heard the speech, not the silence around it.
    voiced_chunks = len(speech) // 512 + 1
    assert 0.5 * voiced_chunks <= model.runs <= voiced_chunks + 1


def test_a_full_scale_chunk_is_never_taken_for_silence() -> None:
    model = CountingModel()
    vad = VADStream(model)
    vad.feed(np.full(512, -32768, np.int16))
    vad.feed(np.full(512, 33, np.int16))
    assert model.runs == 2


def _end_after_pause(model: SileroModel, speech: np.ndarray, hangover_ms: int | None) -> float:
    """Where the turn ended (stream time of the SpeechEnd) when the pause is given
    ``hangover_ms`` as it begins (None: the params' 500 ms)."""
    from rtc_server.vad import SpeechPause

    vad = VADStream(model, VADParams(hangover_ms=500))
    track = np.concatenate([_noise(1, 0.003), speech, _noise(3, 0.003, 1)])
    for i in range(0, len(track), 320):  # the microphone's 20 ms frames
        for event in vad.feed(track[i : i + 320]):
            if isinstance(event, SpeechPause) and hangover_ms is not None:
                vad.end_pause_after(hangover_ms)
            if isinstance(event, SpeechEnd):
                return event.detected_at
    raise AssertionError("the turn never ended")


def test_a_pause_ends_after_the_hang_over_it_was_given(model: SileroModel) -> None:
    speech = _speech("What is the capital of France?")
    default = _end_after_pause(model, speech, None)
    short = _end_after_pause(model, speech, 150)
    long = _end_after_pause(model, speech, 1200)
    assert default - short == pytest.approx(0.35, abs=0.033)  # one 32 ms chunk
    assert long - default == pytest.approx(0.7, abs=0.033)


def test_a_judged_pause_does_not_carry_over_to_the_next(model: SileroModel) -> None:
    from rtc_server.vad import SpeechPause, SpeechResume

    first, second = _speech("What is the capital"), _speech("of France?")
    track = np.concatenate(
        [_noise(1, 0.003), first, _noise(0.3, 0.003, 1), second, _noise(2, 0.003, 2)]
    )
    vad = VADStream(model, VADParams(hangover_ms=500))
    events = []
    for i in range(0, len(track), 320):
        for event in vad.feed(track[i : i + 320]):
            events.append(event)
            if isinstance(event, SpeechPause) and not any(
                isinstance(e, SpeechResume) for e in events
            ):
                vad.end_pause_after(2000)  # only the first pause is judged unfinished
    ends = [e for e in events if isinstance(e, SpeechEnd)]
    assert len(ends) == 1 and any(isinstance(e, SpeechResume) for e in events)
    assert ends[0].detected_at - ends[0].at < 0.5 + 0.2  # the last pause had the default
    vad.end_pause_after(100)  # outside a pause: nothing
    assert vad._pause_hangover_ms is None
