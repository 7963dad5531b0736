"""Whisper-tiny audio features for MuseTalk 1.5, whole-utterance and streamed.

What MuseTalk conditions on (upstream ``musetalk/utils/audio_processor.py``):

* Audio at 16 kHz. Whisper's log-mel (``n_fft`` 400, hop 160, 80 mel bins) of one input padded
  or cut to 30 s, i.e. exactly 3000 mel frames: the encoder refuses any other length.
* ``encoder(mel, output_hidden_states=True).hidden_states``: the embedding plus the output of
  each of the 4 layers, each ``[1, 1500, 384]`` at 50 steps per second, stacked to
  ``[1, 1500, 5, 384]``. Longer utterances are cut in 30 s segments whose features are
  concatenated, then trimmed to ``floor(seconds * 50)`` steps.
* Video frame ``f`` (25 fps, 2 steps per frame) reads the 10 steps ``[2f - 4, 2f + 6)``, zero
  outside ``[0, T)``, rearranged time-major and layer-minor to ``[50, 384]``.
* Upstream makes ``floor(seconds * 25)`` frames. Our engine pads the last partial 40 ms frame
  with silence, so a finished utterance here has ``ceil(seconds * 25)`` frames
  (:func:`frame_count`); the extra frame reads the same zero-padded steps upstream would.

Streaming (:class:`FeatureStream`). Every encoder call costs the same, one 30 s window, so each
call encodes as much of the utterance as fits: the 30 s ending at the newest audio (from sample 0
while the utterance is shorter), and returns only the frames whose windows it covers plus
``lookahead_s`` of right context. The encoder's attention is global, so a frame's features
depend on the whole window. Three things separate a streamed frame from the whole-utterance one:

* Right context, the dominant term. Past the newest sample the window is still silence where
  the whole path has the rest of the speech. Frame ``f`` needs audio up to ``40 f + 120`` ms and
  then waits ``lookahead_s`` more. Measured with trained weights (the whisper-tiny.en encoder
  bundled with the STT model: whisper-tiny's architecture, not MuseTalk's own checkpoint) on
  Piper speech, each frame computed the moment it became computable (the worst case), the
  relative error per frame (``||streamed - whole|| / ||whole||`` over its ``[50, 384]`` window)
  was:

  ============  ===========  ===========
  look-ahead    median       worst frame
  ============  ===========  ===========
  0             33-34 %      57-61 %
  0.1 s         20-21 %      46-48 %
  0.2 s         13-15 %      34-44 %
  0.3 s         10-13 %      29-38 %
  0.5 s         9-10 %       22-27 %
  1.0 s         7-9 %        18-23 %
  ============  ===========  ===========

  (two utterances, 5.3 s and 8.9 s; the embedding row, convolutions plus positions, does not
  change, and the error grows with depth: 5, 8, 11 and 19 % for layers 1-4 at 0.2 s). Beyond the
  knee at 0.3 s the error falls slowly towards a floor of about 7-9 %, and that floor is the
  same size as what upstream itself does to a frame whenever an utterance is cut differently:
  the 8.9 s utterance's frames (all but its last 0.5 s) change by a median 5.5 % when 5.9 s of
  other speech follows it in the clip and by 9.4 % when 15 s does. So the default look-ahead is
  0.3 s (:data:`DEFAULT_LOOKAHEAD_S`); it adds 300 ms of latency only while audio arrives no
  faster than real time. A caller that can wait longer should: taking frames later than
  :meth:`FeatureStream.computable` allows only lowers the error. Frames computed after
  :meth:`FeatureStream.end` of an utterance under 30 s are exact.
* The log-mel floor. Whisper clamps the log-mel to ``max - 8`` over the whole window (then maps
  ``x -> (x + 4) / 4``). A streamed window's maximum is the loudest bin heard so far, so a louder
  bin later raises the whole path's floor, and with it the value of every silent padding frame.
  This is measured to be negligible: on the 8.9 s utterance the running maximum reached 1.46
  (log10) within 0.2 s and stayed at 1.47 for seconds, against 1.58 for the whole utterance (a
  shift of 0.03 in the normalised mel), and forcing the whole utterance's maximum onto every
  streamed window changed no frame's error by more than 0.001. The stream therefore keeps no
  state for it.
* Left context and positions: identical while the utterance is under 30 s, since the window
  starts at sample 0 as the whole path's first segment does. Past 30 s the stream slides its
  window, so frames keep up to 30 s of left context (at least :data:`MIN_LEFT_CONTEXT_S` where
  the audio allows) at window positions that differ from upstream's hard cut every 30 s.
  Position matters (the embedding row carries a positional encoding), so past 30 s the two paths
  differ by design. Upstream trains on clip windows that start at 0 s or 4 s, so frames at any
  position in a window are in distribution.

All tensors are returned on the device and in the dtype the caller chose; this module holds no
device policy.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import WhisperFeatureExtractor
from transformers.models.whisper.modeling_whisper import WhisperEncoder

__all__ = [
    "CHUNK_SAMPLES",
    "DEFAULT_LOOKAHEAD_S",
    "FEATURE_DIM",
    "FEATURE_FPS",
    "MIN_LEFT_CONTEXT_S",
    "N_HIDDEN",
    "PAD_LEFT",
    "PAD_RIGHT",
    "PROMPT_TOKENS",
    "SAMPLES_PER_FRAME",
    "SAMPLES_PER_STEP",
    "SAMPLE_RATE",
    "STEPS_PER_FRAME",
    "VIDEO_FPS",
    "WINDOW_STEPS",
    "Downsampler",
    "FeatureDims",
    "FeatureStream",
    "WhisperFeatures",
    "frame_count",
    "frame_windows",
    "step_count",
]

SAMPLE_RATE = 16000
"""Hz of the audio Whisper hears."""
FEATURE_FPS = 50
"""Encoder steps per second (hop 160 samples, then the stride-2 convolution)."""
VIDEO_FPS = 25
STEPS_PER_FRAME = FEATURE_FPS // VIDEO_FPS
"""2 encoder steps per video frame."""
PAD_LEFT = 2
"""Video frames of left context in a frame's window (upstream ``audio_padding_length_left``)."""
PAD_RIGHT = 2
"""Video frames of right context (upstream ``audio_padding_length_right``)."""
WINDOW_STEPS = STEPS_PER_FRAME * (PAD_LEFT + PAD_RIGHT + 1)
"""10 encoder steps per video frame."""
FEATURE_DIM = 384
"""whisper-tiny ``d_model``."""
N_HIDDEN = 5
"""whisper-tiny ``encoder_layers + 1``: the embedding and each layer's output."""
PROMPT_TOKENS = WINDOW_STEPS * N_HIDDEN
"""50 audio tokens per video frame."""
SAMPLES_PER_STEP = SAMPLE_RATE // FEATURE_FPS
"""320 samples (20 ms) per encoder step."""
SAMPLES_PER_FRAME = SAMPLE_RATE // VIDEO_FPS
"""640 samples (40 ms) per video frame."""
CHUNK_SAMPLES = 30 * SAMPLE_RATE
"""One encoder input: 30 s."""
DEFAULT_LOOKAHEAD_S = 0.3
"""Extra right context a streamed frame waits for (see the module docstring)."""

MIN_LEFT_CONTEXT_S = 15.0
"""Left context a streamed window keeps before the frames it computes, when it can."""

_N_FFT = 400
_HOP = 160
_LOG_MEL_RANGE = 8.0
_FIRST_STEP = -STEPS_PER_FRAME * PAD_LEFT
"""Frame f's window starts at step 2f - 4."""
_MIN_LEFT_STEPS = round(MIN_LEFT_CONTEXT_S * FEATURE_FPS)


def step_count(n_samples: int) -> int:
    """Encoder steps kept for ``n_samples`` of audio: ``floor(seconds * 50)``, as upstream."""
    return n_samples // SAMPLES_PER_STEP


def frame_count(n_samples: int) -> int:
    """Video frames of a finished utterance: ``ceil(seconds * 25)``.

    Upstream uses ``floor``; our engine pads the last partial 40 ms frame with silence, so that
    frame is animated too.
    """
    return -(-n_samples // SAMPLES_PER_FRAME)


@dataclass(frozen=True, slots=True)
class FeatureDims:
    """Shapes read from a Whisper encoder's config."""

    n_hidden: int
    """``encoder_layers + 1``: 5 for whisper-tiny."""
    feature_dim: int
    """``d_model``: 384 for whisper-tiny."""
    n_mels: int
    """``num_mel_bins``: 80."""
    n_steps: int
    """``max_source_positions``: 1500 encoder steps per 30 s window."""

    @classmethod
    def of(cls, encoder: WhisperEncoder) -> FeatureDims:
        config = encoder.config
        return cls(
            n_hidden=int(config.encoder_layers) + 1,
            feature_dim=int(config.d_model),
            n_mels=int(config.num_mel_bins),
            n_steps=int(config.max_source_positions),
        )

    @property
    def prompt_tokens(self) -> int:
        """Audio tokens per video frame: ``WINDOW_STEPS * n_hidden``."""
        return WINDOW_STEPS * self.n_hidden


def _gather_windows(
    hidden: torch.Tensor, first_step: int, first_frame: int, n_frames: int, valid_steps: int
) -> torch.Tensor:
    """Frame windows from encoder states ``hidden`` ``[S, H, D]`` whose row 0 is ``first_step``.

    Steps outside ``[0, valid_steps)`` read as zeros; every needed valid step must be in
    ``hidden``. Returns ``[n_frames, WINDOW_STEPS * H, D]``, time-major and layer-minor.
    """
    n_rows, n_hidden, dim = hidden.shape
    low = max(0, STEPS_PER_FRAME * first_frame + _FIRST_STEP)
    high = min(
        valid_steps, STEPS_PER_FRAME * (first_frame + n_frames - 1) + _FIRST_STEP + WINDOW_STEPS
    )
    if n_frames > 0 and low < high and (low < first_step or high > first_step + n_rows):
        raise ValueError("a frame window needs encoder steps outside the encoded window")
    frames = torch.arange(first_frame, first_frame + n_frames, device=hidden.device)
    steps = (STEPS_PER_FRAME * frames + _FIRST_STEP)[:, None] + torch.arange(
        WINDOW_STEPS, device=hidden.device
    )
    rows = steps - first_step
    valid = (steps >= 0) & (steps < valid_steps)
    padded = torch.cat([hidden.new_zeros(1, n_hidden, dim), hidden])
    windows = padded[torch.where(valid, rows + 1, 0)]
    return windows.reshape(n_frames, WINDOW_STEPS * n_hidden, dim)


def frame_windows(hidden: torch.Tensor, n_frames: int) -> torch.Tensor:
    """Per-frame conditioning ``[n_frames, 50, 384]`` from utterance features ``[T, 5, 384]``.

    Frame ``f`` reads steps ``[2f - 4, 2f + 6)``, zero outside ``[0, T)`` (upstream pads 4 zero
    steps on the left and zeros on the right), flattened time-major, layer-minor: row
    ``5 * i + l`` is layer ``l`` of step ``2f - 4 + i``.
    """
    if hidden.dim() != 3:
        raise ValueError(f"expected [T, layers, dim] features, got {tuple(hidden.shape)}")
    return _gather_windows(hidden, 0, 0, n_frames, hidden.shape[0])


class WhisperFeatures:
    """Whisper's log-mel and encoder, run on the caller's device and dtype.

    ``model`` is a ``WhisperEncoder`` or anything with ``get_encoder()`` (``WhisperModel``,
    ``WhisperForConditionalGeneration``), already on ``device`` in ``dtype``; ``extractor`` the
    matching ``WhisperFeatureExtractor``, whose mel filters this class reuses. The log-mel is
    computed in torch on ``device`` in float32 exactly as the extractor does (``torch.stft``,
    centred with reflection, the last frame dropped), then cast to ``dtype`` for the encoder.
    """

    def __init__(
        self,
        model: Any,
        extractor: WhisperFeatureExtractor,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        encoder = model if isinstance(model, WhisperEncoder) else model.get_encoder()
        if not isinstance(encoder, WhisperEncoder):
            raise TypeError(f"expected a Whisper encoder, got {type(encoder).__name__}")
        self._encoder = encoder
        self._device = torch.device(device)
        self._dtype = dtype
        weight = encoder.conv1.weight
        if weight.device.type != self._device.type or weight.dtype != dtype:
            raise ValueError(
                f"encoder is on {weight.device} in {weight.dtype}, not {self._device} in {dtype}"
            )
        self.dims = FeatureDims.of(encoder)
        if (
            int(extractor.sampling_rate) != SAMPLE_RATE
            or int(extractor.n_fft) != _N_FFT
            or int(extractor.hop_length) != _HOP
            or int(extractor.n_samples) != CHUNK_SAMPLES
            or int(extractor.feature_size) != self.dims.n_mels
            or 2 * self.dims.n_steps != int(extractor.nb_max_frames)
        ):
            raise ValueError("feature extractor does not match the encoder or 16 kHz / 30 s")
        self._mel_filters = torch.as_tensor(
            np.asarray(extractor.mel_filters, dtype=np.float32).T, device=self._device
        ).contiguous()
        self._window = torch.hann_window(_N_FFT, device=self._device)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def log_mel(self, audio: np.ndarray | torch.Tensor) -> torch.Tensor:
        """Whisper's normalised log-mel ``[80, 3000]`` (float32) of at most 30 s of audio.

        ``audio`` here and below is mono 16 kHz float in [-1, 1].

        Shorter audio is padded with zeros to 30 s first, as the extractor pads. The floor is
        ``max - 8`` over this whole window, padding included.
        """
        wave = torch.as_tensor(audio, dtype=torch.float32).to(self._device).reshape(-1)
        if wave.shape[0] > CHUNK_SAMPLES:
            raise ValueError(f"log_mel takes at most 30 s, got {wave.shape[0]} samples")
        wave = torch.nn.functional.pad(wave, (0, CHUNK_SAMPLES - wave.shape[0]))
        spec = torch.stft(wave, _N_FFT, _HOP, window=self._window, return_complex=True)
        power = (spec[:, :-1].abs() ** 2).contiguous()
        log_spec = torch.clamp(self._mel_filters @ power, min=1e-10).log10()
        log_spec = torch.maximum(log_spec, log_spec.max() - _LOG_MEL_RANGE)
        return (log_spec + 4.0) / 4.0

    def encode(self, audio: np.ndarray | torch.Tensor) -> torch.Tensor:
        """All encoder hidden states ``[1500, 5, 384]`` of one window of at most 30 s."""
        mel = self.log_mel(audio).to(self._dtype)[None]
        with torch.no_grad():
            out = self._encoder(mel, output_hidden_states=True)
            states = torch.stack(tuple(out.hidden_states), dim=2)[0]
        return states

    def hidden_states(self, audio: np.ndarray | torch.Tensor) -> torch.Tensor:
        """Features ``[T, 5, 384]`` of a whole utterance, ``T = floor(seconds * 50)``.

        The reference path, as upstream: 30 s segments encoded on their own and concatenated.
        """
        wave = torch.as_tensor(audio, dtype=torch.float32).reshape(-1)
        n_steps = step_count(wave.shape[0])
        parts = [
            self.encode(wave[start : start + CHUNK_SAMPLES])
            for start in range(0, wave.shape[0], CHUNK_SAMPLES)
        ]
        if not parts:
            dims = self.dims
            return torch.zeros(
                0, dims.n_hidden, dims.feature_dim, device=self._device, dtype=self._dtype
            )
        return torch.cat(parts)[:n_steps]

    def utterance_windows(self, audio: np.ndarray | torch.Tensor) -> torch.Tensor:
        """``[ceil(seconds * 25), 50, 384]``: a whole utterance's per-frame conditioning."""
        wave = torch.as_tensor(audio, dtype=torch.float32).reshape(-1)
        return frame_windows(self.hidden_states(wave), frame_count(wave.shape[0]))


class FeatureStream:
    """One utterance's features, computed while its audio streams in.

    ``push`` and ``end`` only buffer (call them from the event loop); ``take`` runs the encoder
    (call it from the inference worker). One consumer calls ``take``; a lock makes ``push``
    safe alongside it. Frame ``f`` becomes computable once audio reaches ``40 f + 120`` ms plus
    ``lookahead_s``, or once the utterance has ended. See the module docstring for how far a
    streamed frame is from the whole-utterance one.
    """

    def __init__(
        self, features: WhisperFeatures, *, lookahead_s: float = DEFAULT_LOOKAHEAD_S
    ) -> None:
        if lookahead_s < 0:
            raise ValueError("lookahead_s must be >= 0")
        self._features = features
        self._lookahead = round(lookahead_s * SAMPLE_RATE)
        self._lock = threading.Lock()
        self._audio = np.zeros(CHUNK_SAMPLES, dtype=np.float32)
        self._base = 0
        """Utterance sample index of ``_audio[0]``."""
        self._samples = 0
        self._ended = False
        self._emitted = 0
        self._encoder_calls = 0
        self._generation = 0
        """Bumped by reset(), so a take() that overlaps it drops its result."""

    @property
    def lookahead_s(self) -> float:
        return self._lookahead / SAMPLE_RATE

    @property
    def samples(self) -> int:
        """16 kHz samples pushed so far."""
        return self._samples

    @property
    def ended(self) -> bool:
        return self._ended

    @property
    def frames_emitted(self) -> int:
        return self._emitted

    @property
    def frames_total(self) -> int | None:
        """``ceil(seconds * 25)`` once ended, else None."""
        return frame_count(self._samples) if self._ended else None

    @property
    def encoder_calls(self) -> int:
        return self._encoder_calls

    def push(self, pcm: np.ndarray) -> None:
        """Append mono 16 kHz audio: float32 in [-1, 1] or int16 (scaled by 1/32768)."""
        wave = _as_float(pcm)
        with self._lock:
            if self._ended:
                raise RuntimeError("push after end()")
            end = self._samples - self._base
            if end + wave.shape[0] > self._audio.shape[0]:
                self._compact(end + wave.shape[0])
                end = self._samples - self._base
            self._audio[end : end + wave.shape[0]] = wave
            self._samples += wave.shape[0]

    def end(self) -> None:
        """No more audio: the rest becomes computable, zero-padded on the right."""
        with self._lock:
            self._ended = True

    def reset(self) -> None:
        """Forget the utterance; the stream is ready for a new one."""
        with self._lock:
            self._audio = np.zeros(CHUNK_SAMPLES, dtype=np.float32)
            self._base = 0
            self._samples = 0
            self._ended = False
            self._emitted = 0
            self._encoder_calls = 0
            self._generation += 1

    def computable(self) -> int:
        """Frames not yet taken whose features can be computed now."""
        with self._lock:
            return self._computable_locked()

    def take(self, max_frames: int) -> torch.Tensor:
        """Compute the next frames, at most ``max_frames``: ``[n, 50, 384]``, maybe ``n = 0``.

        One encoder call, none when no frame is computable. It never returns more frames than
        one 30 s window covers (about 740). If :meth:`reset` runs meanwhile, the result belongs
        to the forgotten utterance and is dropped: ``n = 0``.
        """
        with self._lock:
            generation = self._generation
            first = self._emitted
            n_frames = min(max_frames, self._computable_locked())
            available = self._samples
            start = _window_start(first, available)
            window_end = start * SAMPLES_PER_STEP + CHUNK_SAMPLES
            if window_end < available:
                # The window stops short of the newest audio: keep only the frames it covers
                # together with their look-ahead.
                n_frames = min(n_frames, _frames_reaching(window_end - self._lookahead) - first)
            if n_frames <= 0:
                return self._empty()
            lo = start * SAMPLES_PER_STEP - self._base
            audio = self._audio[lo : min(window_end, available) - self._base].copy()
        hidden = self._features.encode(audio)
        windows = _gather_windows(hidden, start, first, n_frames, step_count(available))
        with self._lock:
            if generation != self._generation:
                return self._empty()
            self._emitted = first + n_frames
            self._encoder_calls += 1
            self._trim_locked()
        return windows

    def _empty(self) -> torch.Tensor:
        dims = self._features.dims
        return torch.zeros(
            0,
            dims.prompt_tokens,
            dims.feature_dim,
            device=self._features.device,
            dtype=self._features.dtype,
        )

    def _computable_locked(self) -> int:
        if self._ended:
            return frame_count(self._samples) - self._emitted
        return max(0, _frames_reaching(self._samples - self._lookahead) - self._emitted)

    def _trim_locked(self) -> None:
        """Drop audio no later window can start in."""
        keep_from = _window_start(self._emitted, self._samples) * SAMPLES_PER_STEP
        if keep_from - self._base >= CHUNK_SAMPLES // 2:
            self._compact(self._samples - self._base, keep_from)

    def _compact(self, need: int, keep_from: int | None = None) -> None:
        """Move the kept audio to the front of a buffer with room for ``need`` samples."""
        keep = self._base if keep_from is None else keep_from
        kept = self._audio[keep - self._base : self._samples - self._base]
        size = max(self._audio.shape[0], 2 * (need - (keep - self._base)))
        buffer = np.zeros(size, dtype=np.float32)
        buffer[: kept.shape[0]] = kept
        self._audio = buffer
        self._base = keep


def _window_start(first_frame: int, available: int) -> int:
    """First encoder step of the window that computes frames from ``first_frame`` on.

    The 30 s ending at the newest audio (from step 0 while there is less), unless that leaves
    ``first_frame`` under :data:`MIN_LEFT_CONTEXT_S` of left context (the TTS ran more than
    15 s ahead of the frames); then the window starts that far before the frame. Never
    decreases as frames are taken and audio arrives, so older audio can be dropped.
    """
    needed = max(0, STEPS_PER_FRAME * first_frame + _FIRST_STEP)
    newest = -(-max(0, available - CHUNK_SAMPLES) // SAMPLES_PER_STEP)
    return min(newest, max(0, needed - _MIN_LEFT_STEPS))


def _frames_reaching(n_samples: int) -> int:
    """How many frames from frame 0 have their whole window within ``n_samples`` of audio.

    Frame ``f`` reads steps up to ``2f + 5``, i.e. audio up to ``(2f + 6) * 320`` samples.
    """
    last_step_end = (WINDOW_STEPS + _FIRST_STEP) * SAMPLES_PER_STEP
    if n_samples < last_step_end:
        return 0
    return (n_samples - last_step_end) // SAMPLES_PER_FRAME + 1


def _as_float(pcm: np.ndarray) -> np.ndarray:
    wave = np.asarray(pcm).reshape(-1)
    if wave.dtype == np.int16:
        return wave.astype(np.float32) / 32768.0
    return wave.astype(np.float32, copy=False)


class Downsampler:
    """48 kHz int16 to 16 kHz float32, stateful: chunks in, the same samples as one shot out.

    A 389-tap Kaiser-window low-pass, evaluated only at every third input sample (polyphase),
    causal, carrying its last 388 inputs between calls: flat within 0.001 dB to 7.3 kHz, -6 dB
    at 7.65 kHz, below -82 dB from 8 kHz (the new Nyquist): Whisper's mel bands keep their level
    up to 7.3 kHz (its top band, to 8 kHz, loses its upper half) and nothing folds back. Output
    sample ``m`` is emitted once input ``3m + 2`` has arrived, so after ``N`` input samples
    exactly ``N // 3`` have come out whatever the chunking. The filter is linear phase: the
    output lags the input by exactly :attr:`delay_samples` (64 samples, 4 ms). About 0.1 ms of
    CPU per 20 ms chunk.
    """

    ratio = 3
    taps = 389
    cutoff_hz = 7650.0
    kaiser_beta = 8.0

    def __init__(self) -> None:
        from scipy.signal import firwin

        kernel = firwin(self.taps, self.cutoff_hz, window=("kaiser", self.kaiser_beta), fs=48000)
        self._kernel = np.ascontiguousarray(kernel[::-1], dtype=np.float64)
        self._history = np.zeros(self.taps - 1, dtype=np.float64)
        self._phase = 0
        """Input samples since the last emitted output (0, 1 or 2)."""

    @property
    def delay_samples(self) -> int:
        """Output lag in 16 kHz samples: ((taps - 1) / 2 - 2) / 3 = 64."""
        return ((self.taps - 1) // 2 - (self.ratio - 1)) // self.ratio

    def reset(self) -> None:
        self._history[:] = 0.0
        self._phase = 0

    def process(self, pcm: np.ndarray) -> np.ndarray:
        """Resample mono 48 kHz int16 (or float in [-1, 1]) to 16 kHz float32."""
        wave = _as_float(pcm).astype(np.float64)
        buffer = np.concatenate([self._history, wave])
        # The first output of this call ends on the (ratio - 1 - phase)-th new sample.
        first = self.taps - 1 + (self.ratio - 1 - self._phase)
        ends = np.arange(first, buffer.shape[0], self.ratio)
        if ends.size:
            frames = np.lib.stride_tricks.sliding_window_view(buffer, self.taps)
            out = frames[ends - (self.taps - 1)] @ self._kernel
        else:
            out = np.zeros(0)
        self._phase = (self._phase + wave.shape[0]) % self.ratio
        self._history = buffer[buffer.shape[0] - (self.taps - 1) :].copy()
        return out.astype(np.float32)
