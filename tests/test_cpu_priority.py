"""The speech models run below the media path in CPU priority, their own threads included."""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor

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


def test_whisper_loaded_on_the_speech_executor_runs_its_own_threads_lower() -> None:
    """CTranslate2 makes its worker threads when the model loads: on a lowered executor thread
    they inherit the lower priority, and transcription runs on them."""
    from rtc_server.providers.whisper_stt import WhisperSTT

    base = thread_nice()
    executor = ThreadPoolExecutor(max_workers=1, initializer=lower_this_thread)
    try:
        before = _threads()
        # A model size of its own (threads=1, parallel=3): a fresh load, not another test's.
        stt = executor.submit(WhisperSTT.load, executor, parallel=3).result()
        created = _threads() - before
        assert created, "loading the model started no thread"
        nice = {tid: thread_nice(tid) for tid in created}
        assert set(nice.values()) == {min(19, base + SPEECH_NICE)}, nice
        assert asyncio.run(stt.transcribe(np.zeros(16000, np.int16), 16000)) == ""
    finally:
        executor.shutdown(wait=True)


async def test_the_servers_speech_threads_run_lower_and_its_loop_does_not(
    live_server: LiveServer,
) -> None:
    assert live_server.manager.ready
    speech = [t for t in threading.enumerate() if t.name.startswith("avatar-rtc-speech_")]
    assert speech, "the models were loaded on no speech thread"
    base = thread_nice()  # the event loop's thread
    for t in speech:
        assert t.native_id is not None
        assert thread_nice(t.native_id) == min(19, base + SPEECH_NICE), t.name
