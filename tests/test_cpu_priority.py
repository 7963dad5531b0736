"""The speech models run below the media path in CPU priority, their own threads included."""

from __future__ import annotations

import asyncio
import os
import threading

import numpy as np

from rtc_server.cpu_priority import SPEECH_NICE, lower_this_thread, thread_nice
from tests.conftest import LiveServer


def _threads() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def test_a_lowered_thread_and_the_threads_it_starts_run_lower() -> None:
    base = thread_nice()
    seen: dict[str, int] = {}

    def child() -> None:
        seen["child"] = thread_nice()

    def work() -> None:
        lower_this_thread()
        seen["self"] = thread_nice()
        t = threading.Thread(target=child)
        t.start()
        t.join()

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    expected = min(19, base + SPEECH_NICE)
    assert seen == {"self": expected, "child": expected}
    assert thread_nice() == base  # the calling thread is untouched


def test_whisper_runs_on_threads_of_its_own_below_the_loop() -> None:
    """CTranslate2 makes its worker threads when the model loads: loaded on the lowered STT
    executor, they inherit the lower priority, and transcription runs on them."""
    from rtc_server.providers.whisper_stt import WhisperSTT

    base = thread_nice()
    before = _threads()
    # A model size of its own (threads=1, parallel=3): a fresh load, not another test's.
    stt = WhisperSTT.load(parallel=3)
    created = _threads() - before
    assert created, "loading the model started no thread"
    nice = {tid: thread_nice(tid) for tid in created}
    assert set(nice.values()) == {min(19, base + SPEECH_NICE)}, nice
    assert asyncio.run(stt.transcribe(np.zeros(16000, np.int16), 16000)) == ""
    assert thread_nice() == base


async def test_the_server_transcribes_below_its_loop_and_synthesizes_beside_it(
    live_server: LiveServer,
) -> None:
    assert live_server.manager.ready
    base = thread_nice()  # the event loop's thread
    names = {t.name: t.native_id for t in threading.enumerate()}
    stt = [tid for name, tid in names.items() if name.startswith("avatar-rtc-stt_")]
    app = [tid for name, tid in names.items() if name.startswith("avatar-rtc_")]
    assert stt and app, names
    assert {thread_nice(t) for t in stt if t} == {min(19, base + SPEECH_NICE)}
    assert {thread_nice(t) for t in app if t} == {base}  # synthesis: the media path's priority
