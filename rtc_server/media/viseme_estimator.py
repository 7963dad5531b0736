"""Mouth shapes estimated from the audio itself, for speech that comes without phoneme timing.

Cloud voices (OpenAI's TTS, ElevenLabs without timestamps) send audio only. This small model
hears it and writes phonemes, one representative symbol per class of mouth shape (:data:`CLASSES`:
rest, lips closed, lip to teeth, open, rounded, spread, hiss, other consonants), so everything
downstream (the visemes, the warp engine, the viseme stream) works as for a voice that reports
its timing; the classes are what a viewer reads on lips, not what was said.

The model: log-mel frames at 100 Hz from 16 kHz audio, :data:`PAST` frames of context behind
and :data:`AHEAD` ahead, one hidden layer, run in numpy. ``benchmarks/train_visemes.py`` trains
it on speech the bundled Piper voice aligned itself and writes ``viseme_estimator.npz`` (shipped
in the package, about 100 KB). Streaming: :meth:`EstimatorStream.feed` takes a voice's chunks as
they come and returns spans covering exactly each chunk, the last few frames of a chunk judged
with the future they can see; the audio is never held back.
"""

from __future__ import annotations

import functools
import logging
import threading
from pathlib import Path

import numpy as np
import numpy.typing as npt

from musetalk_core.types import PhonemeSpan
from rtc_server.media.resample import StreamResampler

__all__ = ["CLASSES", "SYMBOLS", "EstimatorStream", "VisemeEstimator", "shared_estimator"]

logger = logging.getLogger(__name__)

F32 = npt.NDArray[np.float32]

RATE = 16_000
HOP = 160
"""Samples per frame: 10 ms."""
WINDOW = 400
FFT = 512
MELS = 32
PAST = 10
AHEAD = 8
CONTEXT = PAST + 1 + AHEAD
CLASSES = ("rest", "closed", "teeth", "open", "round", "spread", "hiss", "other")
SYMBOLS = ("_", "p", "f", "a", "o", "e", "s", "t")
"""A phoneme per class whose viseme is the class's shape (sil, PP, FF, aa, oh, E, SS, DD)."""
MIN_FRAMES = 2
"""Shorter runs of a class are taken for noise and join the run before them."""
WEIGHTS = Path(__file__).with_name("viseme_estimator.npz")


def _mel_filters() -> F32:
    def mel(f: npt.ArrayLike) -> np.ndarray:
        return 2595.0 * np.log10(1.0 + np.asarray(f, np.float64) / 700.0)

    edges = 700.0 * (10 ** (np.linspace(mel(60.0), mel(7600.0), MELS + 2) / 2595.0) - 1.0)
    bins = np.fft.rfftfreq(FFT, 1 / RATE)
    out = np.zeros((MELS, len(bins)), np.float32)
    for i in range(MELS):
        lo, mid, hi = edges[i], edges[i + 1], edges[i + 2]
        rise = (bins - lo) / (mid - lo)
        fall = (hi - bins) / (hi - mid)
        out[i] = np.clip(np.minimum(rise, fall), 0.0, None)
    return out


_FILTERS = _mel_filters()
_WINDOW = np.hanning(WINDOW).astype(np.float32)


def log_mel(audio: F32, first: int, count: int, offset: int = 0) -> F32:
    """(count, MELS) log-mel frames of 16 kHz ``audio`` (float, full scale 1) whose first
    sample is sample ``offset`` of the stream: frame k is centred on stream sample
    ``(first + k) * HOP + HOP // 2``; samples outside ``audio`` are 0."""
    if count <= 0:
        return np.zeros((0, MELS), np.float32)
    starts = (first + np.arange(count)) * HOP + HOP // 2 - WINDOW // 2 - offset
    index = starts[:, None] + np.arange(WINDOW)[None, :]
    inside = (index >= 0) & (index < len(audio))
    frames = np.where(inside, audio[np.clip(index, 0, max(0, len(audio) - 1))], 0.0)
    if not len(audio):
        frames = np.zeros(index.shape, np.float32)
    spectrum = np.abs(np.fft.rfft(frames * _WINDOW, FFT)) ** 2
    out: F32 = np.log(spectrum.astype(np.float32) @ _FILTERS.T + 1e-8).astype(np.float32)
    return out


def stack_context(features: F32, past: F32 | None = None) -> F32:
    """Each frame with :data:`PAST` frames before it and :data:`AHEAD` after (edges repeated),
    flattened: the model's input. ``past``: frames before ``features`` (a stream's history)."""
    before = past if past is not None and len(past) else features[:1]
    if len(before) < PAST:
        before = np.concatenate([np.repeat(before[:1], PAST - len(before), axis=0), before])
    padded = np.concatenate([before[-PAST:], features, np.repeat(features[-1:], AHEAD, axis=0)])
    n = len(features)
    return np.stack([padded[j : j + n] for j in range(CONTEXT)], axis=1).reshape(n, -1)


class VisemeEstimator:
    """The trained model: frames of audio to classes of mouth shape."""

    def __init__(self, weights: dict[str, np.ndarray]) -> None:
        self._mean = weights["mean"].astype(np.float32)
        self._std = weights["std"].astype(np.float32)
        self._w1, self._b1 = weights["w1"].astype(np.float32), weights["b1"].astype(np.float32)
        self._w2, self._b2 = weights["w2"].astype(np.float32), weights["b2"].astype(np.float32)
        if self._w2.shape[1] != len(CLASSES) or self._w1.shape[0] != CONTEXT * MELS:
            raise ValueError("the weights are for another model layout")

    @classmethod
    def load(cls, path: Path = WEIGHTS) -> VisemeEstimator:
        with np.load(path) as data:
            return cls({k: data[k] for k in data.files})

    def classify(self, context: F32) -> np.ndarray:
        """Class probabilities of each stacked frame (see :func:`stack_context`)."""
        x = (context - self._mean) / self._std
        hidden = np.maximum(x @ self._w1 + self._b1, 0.0)
        logits = hidden @ self._w2 + self._b2
        logits -= logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        return np.asarray(p / p.sum(axis=1, keepdims=True), np.float32)

    def stream(self, sample_rate: int) -> EstimatorStream:
        return EstimatorStream(self, sample_rate)

    def estimate(self, pcm: np.ndarray, sample_rate: int) -> tuple[PhonemeSpan, ...]:
        """The spans of one whole piece of speech."""
        return self.stream(sample_rate).feed(pcm, final=True)


class EstimatorStream:
    """One voice stream (a sentence): its chunks in, spans covering each chunk out."""

    def __init__(self, model: VisemeEstimator, sample_rate: int) -> None:
        self._model = model
        self._rate = sample_rate
        self._resampler = StreamResampler(sample_rate, RATE)
        self._audio = np.zeros(0, np.float32)
        self._audio_from = 0
        """The 16 kHz sample index of ``_audio[0]``."""
        self._received = 0
        """Input samples fed so far."""
        self._frames = 0
        """Frames classified so far."""
        self._history = np.zeros((0, MELS), np.float32)
        self._smooth = np.zeros((0, len(CLASSES)), np.float32)
        self._label = 0
        self._run = MIN_FRAMES

    def feed(self, pcm: np.ndarray, *, final: bool = False) -> tuple[PhonemeSpan, ...]:
        """Spans for ``pcm``, on its own clock (0 = its first sample), covering it end to end."""
        start_s = self._received / self._rate
        self._received += len(pcm)
        end_s = self._received / self._rate
        new = self._resampler.feed(np.asarray(pcm, np.int16))
        if final:
            new = np.concatenate([new, self._resampler.flush()])
        self._audio = np.concatenate([self._audio, new.astype(np.float32) / 32768.0])
        # The frames whose 10 ms fall in this chunk; judged with what audio there is.
        upto = int(np.ceil(end_s * 100 - 1e-9))
        count = upto - self._frames
        labels = self._labels(count) if count > 0 else np.zeros(0, np.int64)
        return self._spans(labels, start_s, end_s)

    def _labels(self, count: int) -> np.ndarray:
        first = self._frames
        self._frames += count
        feats = log_mel(self._audio, first, count, self._audio_from)
        probs = self._model.classify(stack_context(feats, self._history))
        self._history = np.concatenate([self._history, feats])[-PAST:]
        # A three-frame moving average of the probabilities, then runs of at least MIN_FRAMES.
        both = np.concatenate([self._smooth, probs])
        smooth = np.stack([both[max(0, i - 2) : i + 1].mean(axis=0) for i in range(len(both))])
        smooth = smooth[len(self._smooth) :]
        self._smooth = probs[-2:]
        out = np.empty(count, np.int64)
        for i, p in enumerate(smooth):
            best = int(np.argmax(p))
            if best == self._label:
                self._run += 1
            elif self._run >= MIN_FRAMES or p[best] > 0.8:
                self._label, self._run = best, 1
            else:
                self._run += 1
            out[i] = self._label
        # Keep the audio the next frames' windows reach back to.
        keep_from = max(0, (self._frames * HOP) + HOP // 2 - WINDOW // 2 - HOP)
        drop = keep_from - self._audio_from
        if drop > 0:
            self._audio = self._audio[drop:]
            self._audio_from += drop
        return out

    def _spans(self, labels: np.ndarray, start_s: float, end_s: float) -> tuple[PhonemeSpan, ...]:
        duration = end_s - start_s
        if duration <= 0:
            return ()
        first = self._frames - len(labels)
        spans: list[PhonemeSpan] = []
        for i, label in enumerate(labels):
            a = max(0.0, (first + i) / 100 - start_s)
            b = min(duration, (first + i + 1) / 100 - start_s)
            symbol = SYMBOLS[int(label)]
            if spans and spans[-1].phoneme == symbol:
                spans[-1] = PhonemeSpan(symbol, spans[-1].start, b)
            elif b > a:
                spans.append(PhonemeSpan(symbol, a, b))
        if not spans:
            return (PhonemeSpan(SYMBOLS[self._label], 0.0, duration),)
        spans[0] = PhonemeSpan(spans[0].phoneme, 0.0, spans[0].end)
        spans[-1] = PhonemeSpan(spans[-1].phoneme, spans[-1].start, duration)
        return tuple(spans)


_lock = threading.Lock()


@functools.lru_cache(maxsize=1)
def _shared(path: Path) -> VisemeEstimator | None:
    try:
        return VisemeEstimator.load(path)
    except (OSError, ValueError, KeyError) as exc:
        logger.warning("no viseme estimator (%s): speech without timing opens by loudness", exc)
        return None


def shared_estimator(path: Path = WEIGHTS) -> VisemeEstimator | None:
    """The process's estimator, loaded once; None (with a warning) when it cannot be."""
    with _lock:
        return _shared(path)
