"""Server-side voice activity detection: Silero's ONNX model on onnxruntime, with hysteresis.

The model file comes from the ``silero-vad`` package, located without importing it: importing
``silero_vad`` pulls in torch and sets torch's thread count for the whole process.
"""

from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np

from musetalk_core.package_data import package_dir

SAMPLE_RATE = 16_000
CHUNK = 512
"""Samples per model step at 16 kHz (32 ms), fixed by the model."""
CONTEXT = 64
"""Samples of the previous chunk the model expects in front of each chunk."""
QUIET_PEAK = 32
"""A chunk whose every sample is within this of zero (-60 dBFS, int16) is silence without
asking the model: the microphone of a caller who is not talking, after the browser's noise
suppression, is mostly such chunks, and the model costs 0.15 ms a chunk, 31 a second per call,
on the event loop. One sample past it and the model runs."""


def silero_model_path() -> Path:
    root = package_dir("silero_vad")
    if root is None:
        raise RuntimeError("the 'silero-vad' package is not installed: pip install silero-vad")
    path = root / "data" / "silero_vad.onnx"
    if not path.is_file():
        raise RuntimeError(f"silero-vad is installed but {path} is missing")
    return path


class SileroModel:
    """One Silero VAD model session; share it between calls, give each call a ``SileroState``.

    :meth:`shared` gives the process's one instance (a model per app would leave its native
    memory behind each time an app is made).
    """

    @staticmethod
    @functools.lru_cache(maxsize=1)
    def shared() -> SileroModel:
        return SileroModel()

    def __init__(self, path: Path | None = None) -> None:
        import onnxruntime

        options = onnxruntime.SessionOptions()
        # 0.1 ms a chunk: threads would only cost more than they save.
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        self._session = onnxruntime.InferenceSession(
            str(path or silero_model_path()),
            sess_options=options,
            providers=["CPUExecutionProvider"],
        )
        self._sr = np.array(SAMPLE_RATE, dtype=np.int64)

    def new_state(self) -> SileroState:
        return SileroState(self)

    def run(self, x: np.ndarray, state: np.ndarray) -> tuple[float, np.ndarray]:
        out: Any = self._session.run(None, {"input": x, "state": state, "sr": self._sr})
        return float(out[0][0, 0]), out[1]


class SileroState:
    """The recurrent state and context of one audio stream."""

    def __init__(self, model: SileroModel) -> None:
        self._model = model
        self.reset()

    def reset(self) -> None:
        self._state = np.zeros((2, 1, 128), np.float32)
        self._context = np.zeros((1, CONTEXT), np.float32)

    def probability(self, chunk: np.ndarray) -> float:
        """Speech probability of one 512-sample float32 chunk in [-1, 1]."""
        x = np.concatenate([self._context, chunk.reshape(1, CHUNK)], axis=1)
        prob, self._state = self._model.run(x, self._state)
        self._context = x[:, -CONTEXT:]
        return prob

    def skip(self, chunk: np.ndarray) -> None:
        """A chunk (as :meth:`probability` takes it) not given to the model: it is still the
        next chunk's context."""
        self._context = chunk[-CONTEXT:].reshape(1, CONTEXT)


@dataclass(frozen=True, slots=True, kw_only=True)
class VADParams:
    threshold: float = 0.5
    """Probability at which a chunk counts as speech."""
    neg_threshold: float = 0.35
    """Probability under which a chunk counts as silence (hysteresis in between)."""
    min_speech_ms: int = 200
    """Speech shorter than this is noise: no utterance starts."""
    hangover_ms: int = 500
    """Silence that ends the user's turn."""
    pre_roll_ms: int = 200
    """Audio kept from before the detected start, so the first syllable is not cut."""

    def __post_init__(self) -> None:
        if not 0 < self.neg_threshold <= self.threshold < 1:
            raise ValueError("need 0 < neg_threshold <= threshold < 1")
        if self.min_speech_ms < 0 or self.hangover_ms < 0 or self.pre_roll_ms < 0:
            raise ValueError("VAD durations must be >= 0")


class VADState(Enum):
    QUIET = "quiet"
    STARTING = "starting"
    SPEAKING = "speaking"
    STOPPING = "stopping"


@dataclass(frozen=True, slots=True)
class SpeechStart:
    at: float
    """Stream time (s) where speech began."""


@dataclass(frozen=True, slots=True, eq=False)
class SpeechEnd:
    at: float
    """Stream time (s) where speech ended (before the hang-over)."""
    detected_at: float
    """Stream time (s) when the hang-over ran out and the turn ended."""
    audio: np.ndarray
    """int16 16 kHz: the utterance, pre-roll included."""


@dataclass(frozen=True, slots=True, eq=False)
class SpeechPause:
    """Speech stopped; the turn ends if the silence lasts the hang-over.

    Carries the utterance so far, so a transcription can start while the hang-over runs.
    """

    audio: np.ndarray


@dataclass(frozen=True, slots=True)
class SpeechResume:
    """Speech went on after a pause: the utterance is not over."""


VADEvent = SpeechStart | SpeechPause | SpeechResume | SpeechEnd


class VADStream:
    """Feeds one call's 16 kHz audio through Silero and a four-state hysteresis.

    Not thread-safe; one per call, driven from that call's single-thread executor.
    """

    def __init__(self, model: SileroModel, params: VADParams | None = None) -> None:
        self.params = params or VADParams()
        self._silero = model.new_state()
        self.state = VADState.QUIET
        self._pending = np.zeros(0, np.int16)
        self._samples = 0
        """Samples consumed so far: the stream clock."""
        ms = SAMPLE_RATE // 1000
        self._pre_roll: deque[np.ndarray] = deque(
            maxlen=max(1, self.params.pre_roll_ms * ms // CHUNK)
        )
        self._utterance: list[np.ndarray] = []
        self._start = 0
        self._speech_run = 0
        self._last_speech_end = 0
        self._quiet_run = 0
        self._pause_hangover_ms: int | None = None
        """The hang-over of the pause under way, when something judged it (None: the
        default of the params)."""
        self.last_probability = 0.0

    @property
    def time(self) -> float:
        return self._samples / SAMPLE_RATE

    def end_pause_after(self, hangover_ms: int) -> None:
        """End the pause under way (after a :class:`SpeechPause`) once its silence lasts
        ``hangover_ms``, instead of the params' hang-over; at once, at the next chunk, if it
        already has. The next pause starts from the params' again. Outside a pause: nothing."""
        if self.state is VADState.STOPPING:
            self._pause_hangover_ms = hangover_ms

    def feed(self, pcm: np.ndarray) -> list[VADEvent]:
        """Consume int16 16 kHz samples; return the events they complete, in order."""
        data = np.concatenate([self._pending, pcm.astype(np.int16, copy=False)])
        events: list[VADEvent] = []
        n = len(data) // CHUNK * CHUNK
        for i in range(0, n, CHUNK):
            event = self._step(data[i : i + CHUNK])
            if event is not None:
                events.append(event)
        self._pending = data[n:]
        return events

    def _step(self, chunk: np.ndarray) -> VADEvent | None:
        p = self.params
        x = chunk.astype(np.float32) / 32768.0
        if -QUIET_PEAK <= int(chunk.min()) and int(chunk.max()) <= QUIET_PEAK:
            # Near-digital silence: 0, and the model's state waits for the next sound.
            prob = 0.0
            self._silero.skip(x)
        else:
            prob = self._silero.probability(x)
        self.last_probability = prob
        start_of_chunk = self._samples
        self._samples += CHUNK
        speech = prob >= p.threshold
        silence = prob < p.neg_threshold
        ms = SAMPLE_RATE // 1000

        if self.state is VADState.QUIET:
            if speech:
                self.state = VADState.STARTING
                self._start = start_of_chunk
                self._speech_run = CHUNK
                self._utterance = [*self._pre_roll, chunk]
            else:
                self._pre_roll.append(chunk)
                self._quiet_run += CHUNK
                if self._quiet_run > 5 * SAMPLE_RATE:
                    # Silero's recurrent state drifts over long silences; start it afresh.
                    self._silero.reset()
                    self._quiet_run = 0
            return None

        self._utterance.append(chunk)
        if self.state is VADState.STARTING:
            if silence:
                self.state = VADState.QUIET
                self._pre_roll.extend(self._utterance)
                self._utterance = []
                return None
            if speech:
                self._speech_run += CHUNK
            if speech:
                self._last_speech_end = self._samples
            if self._speech_run >= p.min_speech_ms * ms:
                self.state = VADState.SPEAKING
                self._quiet_run = 0
                return SpeechStart(self._start / SAMPLE_RATE)
            return None

        # Speech ends where the last confident chunk ended; the model's fading tail between the
        # two thresholds is not speech, but it does not end the turn either.
        if speech:
            self._last_speech_end = self._samples
        if self.state is VADState.SPEAKING:
            if silence:
                self.state = VADState.STOPPING
                return SpeechPause(np.concatenate(self._utterance))
            return None

        # STOPPING: anything but clear silence reopens the utterance, so a transcription
        # started at the pause never misses a softly spoken ending.
        if not silence:
            self.state = VADState.SPEAKING
            self._pause_hangover_ms = None
            return SpeechResume()
        return self._maybe_end()

    def _maybe_end(self) -> SpeechEnd | None:
        p = self.params
        ms = SAMPLE_RATE // 1000
        hangover = p.hangover_ms if self._pause_hangover_ms is None else self._pause_hangover_ms
        if self._samples - self._last_speech_end >= hangover * ms:
            self.state = VADState.QUIET
            self._pause_hangover_ms = None
            audio = np.concatenate(self._utterance)
            self._utterance = []
            self._pre_roll.clear()
            end = self._last_speech_end - _energy_tail(audio, self._samples - self._last_speech_end)
            return SpeechEnd(
                at=end / SAMPLE_RATE,
                detected_at=self._samples / SAMPLE_RATE,
                audio=audio,
            )
        return None


_TAIL_WINDOW = SAMPLE_RATE // 100
"""10 ms windows for the energy refinement of the end of speech."""
_MAX_TAIL = 4 * CHUNK
"""Silero stays confident for up to about three chunks after the voice stops."""


def _energy_tail(audio: np.ndarray, after: int) -> int:
    """Samples at the end of the confident speech that are quieter than the speech itself.

    ``audio`` ends ``after`` samples past the last confident chunk. Walks back from that chunk
    at most ``_MAX_TAIL`` samples, while the 10 ms level stays 35 dB under the utterance's
    peak: the model's own lag, measured on the waveform. Loud background keeps it at 0.
    """
    speech = audio[: len(audio) - after].astype(np.float32)
    n = len(speech) // _TAIL_WINDOW
    if n < 2:
        return 0
    windows = speech[len(speech) - n * _TAIL_WINDOW :].reshape(n, _TAIL_WINDOW)
    rms = np.sqrt((windows**2).mean(axis=1))
    floor = rms.max() * 10 ** (-35 / 20)
    quiet = 0
    for level in rms[::-1]:
        if level > floor or (quiet + 1) * _TAIL_WINDOW > _MAX_TAIL:
            break
        quiet += 1
    return quiet * _TAIL_WINDOW
