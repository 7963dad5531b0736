"""Whisper in a window of the utterance's own length, and when it falls back to the full one."""

from __future__ import annotations

import asyncio
import wave
from pathlib import Path

import numpy as np
import pytest

from benchmarks.clip import speech_pcm
from benchmarks.latency import QUESTIONS
from rtc_server.cpu_priority import blas_on_calling_thread
from rtc_server.providers.whisper_stt import WhisperSTT, _repeats

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def stt() -> WhisperSTT:
    # As in the server (rtc_server/app.py): BLAS on the calling thread. The mel features are
    # computed with it, and their last bits change with its thread count: alone, with two
    # threads, the short window was sure of "Italy" in the clip below, where the server's
    # (and the suite's, once an earlier test had set it) heard "ability".
    blas_on_calling_thread()
    return WhisperSTT.load()


def _audio(text: str) -> np.ndarray:
    pcm = asyncio.run(speech_pcm(text, 16_000))
    return pcm.astype(np.float32) / 32768.0


def _words(text: str) -> list[str]:
    return "".join(c for c in text.lower() if c.isalnum() or c.isspace()).split()


@pytest.mark.parametrize("question", QUESTIONS)
def test_a_short_window_hears_what_the_full_one_hears(stt: WhisperSTT, question: str) -> None:
    audio = _audio(question)
    windowed = stt._windowed(audio)
    assert windowed is not None  # decoded in the short window, no fall-back
    assert _words(windowed) == _words(stt._full(audio))
    heard = set(_words(windowed))
    assert sum(w in heard for w in _words(question)) >= 0.8 * len(_words(question))


def test_no_speech_falls_back_to_the_full_window(stt: WhisperSTT) -> None:
    hum = (0.05 * np.sin(2 * np.pi * 100 * np.arange(32_000) / 16_000)).astype(np.float32)
    assert stt._windowed(hum) is None  # a short window hears "you" in it
    pcm = (hum * 32767).astype(np.int16)
    assert stt._run(pcm, 16_000) == ""


def test_an_utterance_too_long_for_a_shorter_window_takes_the_full_one(stt: WhisperSTT) -> None:
    assert stt._windowed(np.zeros(28 * 16_000, np.float32)) is None


def test_a_decoder_that_repeats_itself_is_caught() -> None:
    hello = [15496, 30, 18435, 30]
    assert _repeats(hello * 2, 4)
    assert not _repeats([1, 2, 3, 4, 5, 6, 7, 8], 4)
    assert not _repeats([7, 7, 7], 4)  # shorter than a run


def test_a_short_window_unsure_of_its_words_falls_back_to_the_full_one(stt: WhisperSTT) -> None:
    # "What is the capital of Italy?" as the server took it from Chromium's microphone (the
    # browser's noise suppression and gain control, Opus, the VAD's cut). The short window hears
    # "What is the capital of the ability?", "ability" a guess (log-probability -2.69); the full
    # one hears "Italy".
    with wave.open(str(DATA / "italy_through_chromium.wav"), "rb") as clip:
        assert clip.getframerate() == 16_000
        pcm = np.frombuffer(clip.readframes(clip.getnframes()), np.int16)
    assert stt._windowed(pcm.astype(np.float32) / 32768.0) is None
    assert {"capital", "italy"} <= set(_words(stt._run(pcm, 16_000)))
