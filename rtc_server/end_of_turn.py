"""A semantic end of turn: Smart Turn v3.2 decides whether the caller has finished speaking.

A fixed hang-over makes a finished question wait as long as a pause in the middle of a sentence.
Smart Turn (Daily's BSD-2 model, 8 MB int8 ONNX, a Whisper-tiny encoder with a classifier) reads
the last 8 s of the caller's audio, prosody and words alike, and gives the probability that the
turn is complete. The VAD then ends a turn it judges complete after a short hang-over and waits
longer for one it judges unfinished (:class:`EndOfTurn`, driven by the turn controller).

The model file ships inside the ``pipecat-ai`` wheel on PyPI, installed without its
dependencies (the Makefile); it is found here without importing the package.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from musetalk_core.os_threads import namer
from musetalk_core.package_data import package_dir
from rtc_server.config import ConfigError
from rtc_server.cpu_priority import side_by_side

__all__ = [
    "MODEL_FILE",
    "EndOfTurnParams",
    "SmartTurnModel",
    "judge_pause",
    "judges_at_once",
    "load_end_of_turn",
    "log_mel_features",
    "smart_turn_model_path",
]

logger = logging.getLogger(__name__)

MODEL_FILE = "smart-turn-v3.2-cpu.onnx"
SAMPLE_RATE = 16_000
WINDOW_S = 8
"""The model reads the turn's last 8 s; a shorter turn is padded with silence before it."""

_N_FFT = 400
_HOP = 160
_N_MELS = 80


@dataclass(frozen=True, slots=True, kw_only=True)
class EndOfTurnParams:
    complete_hangover_ms: int = 300
    """Silence that ends a turn the model judges finished."""
    incomplete_hangover_ms: int = 1200
    """Silence that ends a turn the model judges unfinished (the caller may go on)."""
    threshold: float = 0.5
    """Probability of a finished turn at which the short hang-over applies."""

    def __post_init__(self) -> None:
        if not 0 <= self.complete_hangover_ms <= self.incomplete_hangover_ms <= 10_000:
            raise ValueError("need 0 <= complete_hangover_ms <= incomplete_hangover_ms <= 10000")
        if not 0 < self.threshold < 1:
            raise ValueError("the end-of-turn threshold must be in (0, 1)")

    def hangover_ms(self, probability: float) -> int:
        """The hang-over of a pause the model scored ``probability`` (of a finished turn)."""
        finished = probability >= self.threshold
        return self.complete_hangover_ms if finished else self.incomplete_hangover_ms


def smart_turn_model_path() -> Path:
    """The model file inside the installed ``pipecat-ai`` package (its code never imported)."""
    root = package_dir("pipecat")
    if root is None:
        raise RuntimeError(
            "the end-of-turn model comes from the 'pipecat-ai' wheel: "
            "pip install --no-deps pipecat-ai==1.14.0 (make install does)"
        )
    path = root / "audio" / "turn" / "smart_turn" / "data" / MODEL_FILE
    if not path.is_file():
        raise RuntimeError(f"pipecat-ai is installed but {path} is missing")
    return path


def _slaney_mel(hz: np.ndarray) -> np.ndarray:
    """Hertz to the Slaney mel scale: linear to 1 kHz, logarithmic above."""
    hz = np.asarray(hz, np.float64)
    linear = hz * 3.0 / 200.0
    log = 15.0 + np.log(np.maximum(hz, 1e-9) / 1000.0) / (np.log(6.4) / 27.0)
    return np.where(hz >= 1000.0, log, linear)


def _slaney_hz(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, np.float64)
    linear = mel * 200.0 / 3.0
    log = 1000.0 * np.exp((np.log(6.4) / 27.0) * (mel - 15.0))
    return np.where(mel >= 15.0, log, linear)


@functools.lru_cache(maxsize=1)
def _mel_filters() -> np.ndarray:
    """(mels, bins): triangles evenly spaced in mel from 0 to 8 kHz, each of unit area."""
    bins = np.linspace(0.0, SAMPLE_RATE / 2, _N_FFT // 2 + 1)
    edges = _slaney_hz(np.linspace(0.0, float(_slaney_mel(np.array(SAMPLE_RATE / 2))), _N_MELS + 2))
    lower, centre, upper = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    rising = (bins[None, :] - lower) / (centre - lower)
    falling = (upper - bins[None, :]) / (upper - centre)
    triangles = np.maximum(0.0, np.minimum(rising, falling))
    filters: np.ndarray = triangles * (2.0 / (upper - lower))
    return filters


@functools.lru_cache(maxsize=1)
def _hann() -> np.ndarray:
    """A periodic Hann window of the FFT's length."""
    return 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(_N_FFT) / _N_FFT)


def log_mel_features(audio: np.ndarray) -> np.ndarray:
    """Whisper's log-mel spectrogram of ``audio`` (16 kHz float in [-1, 1], exactly
    ``WINDOW_S`` seconds), as Smart Turn was trained on: the waveform normalized to zero mean
    and unit variance, 25 ms Hann windows every 10 ms (centred, reflected at the edges), 80
    Slaney mel bands, log10 floored 8 decades under the peak and scaled to about [-1, 1].
    Returns (80, 800) float32."""
    x = np.asarray(audio, np.float32)
    if x.shape != (WINDOW_S * SAMPLE_RATE,):
        raise ValueError(f"need {WINDOW_S * SAMPLE_RATE} samples at 16 kHz, got {x.shape}")
    x = (x - x.mean()) / np.sqrt(x.var() + 1e-7)
    padded = np.pad(x.astype(np.float64), _N_FFT // 2, mode="reflect")
    frames = np.lib.stride_tricks.sliding_window_view(padded, _N_FFT)[::_HOP]
    power = np.abs(np.fft.rfft(frames * _hann(), axis=-1)) ** 2
    mel = np.log10(np.maximum(_mel_filters() @ power.T, 1e-10))[:, :-1]
    mel = np.maximum(mel, mel.max() - 8.0)
    features: np.ndarray = ((mel + 4.0) / 4.0).astype(np.float32)
    return features


def last_window(pcm: np.ndarray) -> np.ndarray:
    """The last ``WINDOW_S`` seconds of int16 16 kHz ``pcm`` as float, silence before it."""
    n = WINDOW_S * SAMPLE_RATE
    x = pcm[-n:].astype(np.float32) / 32768.0
    return np.pad(x, (n - len(x), 0)) if len(x) < n else x


class SmartTurnModel:
    """One ONNX session of the model, shared by every call of a process (:meth:`shared`)."""

    @staticmethod
    @functools.lru_cache(maxsize=1)
    def shared() -> SmartTurnModel:
        return SmartTurnModel()

    def __init__(self, path: Path | None = None) -> None:
        import onnxruntime

        options = onnxruntime.SessionOptions()
        # One thread: a call's pause needs one answer, and the media path needs the others.
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        self._session = onnxruntime.InferenceSession(
            str(path or smart_turn_model_path()),
            sess_options=options,
            providers=["CPUExecutionProvider"],
        )
        self._input = self._session.get_inputs()[0].name

    def probability(self, pcm: np.ndarray) -> float:
        """The probability that int16 16 kHz ``pcm`` (the turn so far) is a finished turn."""
        features = log_mel_features(last_window(pcm))[None]
        out: Any = self._session.run(None, {self._input: features})
        return float(np.asarray(out[0]).reshape(-1)[0])


def judges_at_once() -> int:
    """Pauses judged side by side: one per core this process may run on (at most 4)."""
    return side_by_side()


@functools.lru_cache(maxsize=1)
def _executor() -> ThreadPoolExecutor:
    """The model's own threads: not the one encoding video, nor the one synthesizing speech,
    whose work would delay a judgement due within the short hang-over. One per core: callers
    who pause together (a 60 ms judgement each on this CPU) were judged one after the other,
    and three at once had the last verdict 236 ms after its pause, past the hang-over."""
    return ThreadPoolExecutor(
        max_workers=judges_at_once(),
        thread_name_prefix="avatar-rtc-turn",
        initializer=namer("turn-judge"),
    )


async def judge_pause(model: SmartTurnModel, pcm: np.ndarray) -> tuple[float, float]:
    """(probability that the turn in ``pcm`` is finished, milliseconds it took)."""
    start = time.perf_counter()
    probability = await asyncio.get_running_loop().run_in_executor(
        _executor(), model.probability, pcm
    )
    return probability, (time.perf_counter() - start) * 1000


def load_end_of_turn(choice: str) -> SmartTurnModel | None:
    """The model ``--end-of-turn`` asks for (None: turns end after the fixed hang-over).
    ``auto`` takes it when it is installed; ``smart-turn`` without it is a ConfigError."""
    if choice == "off":
        logger.info("end of turn: the fixed hang-over (asked for)")
        return None
    try:
        model = SmartTurnModel.shared()
    except RuntimeError as exc:
        if choice == "smart-turn":
            raise ConfigError(f"--end-of-turn smart-turn: {exc}") from exc
        logger.warning("end of turn: the fixed hang-over (auto: %s)", exc)
        return None
    logger.info("end of turn: Smart Turn v3.2 (%s)", "asked for" if choice != "auto" else "auto")
    return model
