"""The reply's Opus encoder: mono, silence replayed after its warm-up, speech intact around it."""

from __future__ import annotations

import fractions

import av
import numpy as np
import pytest
from aiortc.codecs.opus import OpusDecoder
from aiortc.jitterbuffer import JitterFrame

from rtc_server.media.opus import SILENCE_WARMUP, ReplyOpusEncoder

FRAME = 960
DELAY = 312
"""libopus's look-ahead at 48 kHz: decoded audio lags its source by this many samples."""


def _frame(pcm: np.ndarray, index: int) -> av.AudioFrame:
    frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
    frame.sample_rate = 48_000
    frame.pts = index * FRAME
    frame.time_base = fractions.Fraction(1, 48_000)
    return frame


def _voice(seconds: float, seed: int) -> np.ndarray:
    """A voiced sound with a moving pitch and syllable envelope (not a steady tone)."""
    t = np.arange(int(48_000 * seconds)) / 48_000
    pitch = 140 + 30 * np.sin(2 * np.pi * 0.7 * t + seed)
    phase = 2 * np.pi * np.cumsum(pitch) / 48_000
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 3.1 * t + seed) ** 2
    wave = sum(np.sin(k * phase) / k for k in range(1, 12))
    return (6000 * envelope * wave).astype(np.int16)


def _run(encoder: ReplyOpusEncoder, pcm: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """Encode ``pcm`` frame by frame, decode as a browser-side Opus decoder would."""
    decoder = OpusDecoder()
    out, stamps = [], []
    for i in range(len(pcm) // FRAME):
        payloads, timestamp = encoder.encode(_frame(pcm[i * FRAME : (i + 1) * FRAME], i))
        stamps.append(timestamp)
        for payload in payloads:
            for frame in decoder.decode(JitterFrame(payload, timestamp)):
                assert isinstance(frame, av.AudioFrame)
                out.append(frame.to_ndarray().reshape(-1, 2)[:, 0])
    return np.concatenate(out), stamps


def _envelope(pcm: np.ndarray) -> np.ndarray:
    frames = pcm[: len(pcm) // FRAME * FRAME].reshape(-1, FRAME).astype(np.float64)
    return np.sqrt((frames**2).mean(axis=1))


def test_silence_is_replayed_after_its_warm_up_and_the_speech_after_it_is_intact() -> None:
    first, second = _voice(1.0, 0), _voice(1.0, 1)
    pause = np.zeros(FRAME * 100, np.int16)
    signal = np.concatenate([first, pause, second])
    encoder = ReplyOpusEncoder()
    decoded, stamps = _run(encoder, signal)
    frames = len(signal) // FRAME
    assert stamps == [i * FRAME for i in range(frames)]  # RTP time is the frame's own
    assert encoder.replayed == 100 - SILENCE_WARMUP and encoder.encoded == frames - encoder.replayed
    assert len(decoded) == len(signal)
    # The pause decodes to silence, the speech after it to the speech: its loudness frame by
    # frame follows the source, once Opus's own delay (312 samples) is taken off.
    assert np.abs(decoded[len(first) + 2 * FRAME : len(first) + len(pause)]).max() <= 2
    after = decoded[len(first) + len(pause) + DELAY :]
    source, heard = _envelope(second)[2:-2], _envelope(after)[2:-1]
    source = source[: len(heard)]
    assert np.corrcoef(source, heard)[0, 1] > 0.97
    assert 0.8 < heard.mean() / source.mean() < 1.2
    # And as if every silent frame had been encoded: the replay is not heard.
    every, _ = _run(ReplyOpusEncoder(silence_warmup=10**9), signal)
    every_after = every[len(first) + len(pause) + DELAY :]
    assert np.corrcoef(_envelope(every_after)[2:-1], heard)[0, 1] > 0.99
    again, _ = _run(ReplyOpusEncoder(), signal)
    assert np.array_equal(again, decoded)  # deterministic


def test_short_pauses_are_encoded_in_full() -> None:
    pcm = np.concatenate(
        [_voice(0.4, 0), np.zeros(FRAME * SILENCE_WARMUP, np.int16), _voice(0.4, 2)]
    )
    encoder = ReplyOpusEncoder()
    _run(encoder, pcm)
    assert encoder.replayed == 0


def test_frames_it_cannot_take_are_refused_clearly() -> None:
    encoder = ReplyOpusEncoder()
    stereo = av.AudioFrame.from_ndarray(
        np.zeros((1, 2 * FRAME), np.int16), format="s16", layout="stereo"
    )
    stereo.sample_rate, stereo.pts, stereo.time_base = 48_000, 0, fractions.Fraction(1, 48_000)
    with pytest.raises(ValueError, match="48 kHz mono s16"):
        encoder.encode(stereo)
    untimed = _frame(np.zeros(FRAME, np.int16), 0)
    untimed.pts = None
    with pytest.raises(TypeError, match="timed"):
        encoder.encode(untimed)
