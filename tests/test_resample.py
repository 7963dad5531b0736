"""Streamed audio resampled as one stream: the pieces of a chunked cloud TTS stream give the
samples of the whole sentence resampled at once, no click at the joins, no sample gained or lost."""

from __future__ import annotations

import numpy as np
import pytest

from rtc_server.media.resample import StreamResampler, resample_int16


def _speechlike(rate: int, seconds: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(round(rate * seconds)) / rate
    x = 9000 * np.sin(2 * np.pi * 220 * t) * (1 + np.sin(2 * np.pi * 3 * t)) / 2
    return np.clip(x + rng.normal(0, 1500, len(t)), -32768, 32767).astype(np.int16)


def _streamed(x: np.ndarray, rate: int, sizes: list[int]) -> np.ndarray:
    resampler = StreamResampler(rate, 48_000)
    out, at = [], 0
    for size in sizes:
        out.append(resampler.feed(x[at : at + size]))
        at += size
    out.append(resampler.feed(x[at:]))
    out.append(resampler.flush())
    return np.concatenate(out)


@pytest.mark.parametrize("rate", [16_000, 22_050, 24_000, 44_100])
def test_a_chunked_stream_gives_the_whole_signals_samples(rate: int) -> None:
    x = _speechlike(rate, 1.5)
    whole = resample_int16(x, rate, 48_000)
    rng = np.random.default_rng(rate)
    # Network-sized chunks, odd sizes, single samples and empty ones among them.
    sizes = [int(s) for s in rng.integers(0, rate // 20, 60)] + [1, 1, 0, 3]
    got = _streamed(x, rate, sizes)
    assert len(got) == len(whole) == -(-len(x) * 48_000 // rate)  # no sample gained or lost
    assert np.abs(got.astype(np.int32) - whole).max() <= 1  # rounding only


def test_chunk_by_chunk_resampling_clicks_and_drifts_where_the_stream_does_not() -> None:
    rate, chunk = 24_000, 600  # 25 ms chunks, as a cloud TTS sends them
    t = np.arange(rate) / rate
    x = (np.sin(2 * np.pi * 437 * t) * 12_000).astype(np.int16)  # joins mid-wave
    whole = resample_int16(x, rate, 48_000).astype(np.int32)
    per_chunk = np.concatenate(
        [resample_int16(x[i : i + chunk], rate, 48_000) for i in range(0, len(x), chunk)]
    ).astype(np.int32)
    streamed = _streamed(x, rate, [chunk] * (len(x) // chunk)).astype(np.int32)
    assert np.abs(per_chunk - whole).max() > 1000  # the old way: a click at every join
    assert np.abs(streamed - whole).max() <= 1
    # 22.05 kHz in 25 ms chunks: each chunk's length rounds on its own.
    rate = 22_050
    x = _speechlike(rate, 2.0)
    chunk = 551
    per_chunk_len = sum(
        len(resample_int16(x[i : i + chunk], rate, 48_000)) for i in range(0, len(x), chunk)
    )
    assert per_chunk_len - len(resample_int16(x, rate, 48_000)) >= 16
    assert len(_streamed(x, rate, [chunk] * (len(x) // chunk))) == len(
        resample_int16(x, rate, 48_000)
    )


def test_output_follows_the_input_within_a_few_samples() -> None:
    rate = 22_050
    x = _speechlike(rate, 0.5)
    resampler = StreamResampler(rate, 48_000)
    made = 0
    for i in range(0, len(x), 441):  # 20 ms pieces
        made += len(resampler.feed(x[i : i + 441]))
        expected = min(len(x), i + 441) * 48_000 / rate
        assert expected - made <= 11 * 48_000 / rate + 1  # ~10 input samples held back
    made += len(resampler.flush())
    assert made == len(resample_int16(x, rate, 48_000))


def test_the_same_rate_passes_through_and_bad_rates_are_refused() -> None:
    x = _speechlike(48_000, 0.1)
    resampler = StreamResampler(48_000, 48_000)
    assert np.array_equal(resampler.feed(x), x) and len(resampler.flush()) == 0
    with pytest.raises(ValueError, match="positive"):
        StreamResampler(0, 48_000)


@pytest.mark.parametrize("rate", [16_000, 22_050, 24_000])
async def test_a_cloud_voices_chunks_reach_the_engine_as_one_stream(rate: int) -> None:
    """Through the speech output: a voice that streams 25 ms chunks is heard as its whole
    sentence resampled at once."""
    from collections.abc import AsyncGenerator

    from musetalk_core.types import AudioChunk
    from rtc_server.media.clock import ManualClock
    from rtc_server.media.scheduler import AVScheduler
    from rtc_server.speech import SpeechOutput, Utterance
    from tests.fakes import CountingEngine

    sentence = _speechlike(rate, 1.2, seed=3)
    step = rate // 40

    class ChunkedVoice:
        name = "chunked"
        sample_rate = rate

        async def synthesize(
            self, text: str, *, previous_text: str = ""
        ) -> AsyncGenerator[AudioChunk, None]:
            for i in range(0, len(sentence), step):
                yield AudioChunk(sentence[i : i + step], rate)

    async def one() -> AsyncGenerator[str, None]:
        yield "A sentence."

    engine = CountingEngine()
    scheduler = AVScheduler(engine, ManualClock())
    await SpeechOutput(scheduler).speak(ChunkedVoice(), one(), Utterance())  # type: ignore[arg-type]
    heard = np.concatenate([c.pcm for c in engine.pushed]).astype(np.int32)
    whole = resample_int16(sentence, rate, 48_000).astype(np.int32)
    assert len(heard) == len(whole)
    assert np.abs(heard - whole).max() <= 1
    await scheduler.aclose()


@pytest.mark.parametrize(("rate", "to"), [(48_000, 16_000), (48_000, 24_000), (44_100, 16_000)])
def test_a_stream_brought_down_gives_the_whole_signals_samples(rate: int, to: int) -> None:
    # The microphone's way (48 kHz in 20 ms frames to the VAD's 16 kHz, the speech model's
    # 24 kHz), with odd pieces among them; 44.1 kHz takes the general path.
    x = _speechlike(rate, 1.5, seed=2)
    whole = resample_int16(x, rate, to)
    rng = np.random.default_rng(to)
    sizes = [rate // 50] * 20 + [int(s) for s in rng.integers(0, rate // 20, 20)] + [1, 0, 2]
    resampler = StreamResampler(rate, to)
    out, at = [], 0
    for size in sizes:
        out.append(resampler.feed(x[at : at + size]))
        at += size
    out += [resampler.feed(x[at:]), resampler.flush()]
    got = np.concatenate(out)
    assert len(got) == len(whole) == -(-len(x) * to // rate)
    assert np.abs(got.astype(np.int32) - whole).max() <= 1
