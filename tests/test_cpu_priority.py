"""The speech models run below the media path in CPU priority, their own threads included;
OpenCV and the BLAS libraries compute on the thread that calls them."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from benchmarks.procstat import MAIN_THREAD, UNNAMED, cpu_by_thread
from musetalk_core.os_threads import namer, os_thread_name
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
    # Named "stt" in the OS, as the executor thread that loaded them.
    assert {_os_name(tid) for tid in created} == {"stt"}
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
    # Named for the OS too (top -H, bench load's CPU by thread).
    assert {_os_name(t) for t in stt} == {"stt"} and {_os_name(t) for t in app} == {"reply-speech"}


def _os_name(tid: int | None) -> str:
    with open(f"/proc/self/task/{tid}/comm") as f:
        return f.read().strip()


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_threads_carry_their_names_in_the_os_and_their_cpu_is_read_by_name() -> None:
    process = os_thread_name()
    started: dict[str, str | None] = {}

    def child() -> None:
        started["child"] = os_thread_name()

    def start_child() -> None:
        t = threading.Thread(target=child)
        t.start()
        t.join()

    with ThreadPoolExecutor(max_workers=1, initializer=namer("test-part")) as pool:
        assert pool.submit(os_thread_name).result() == "test-part"
        # A thread it starts (as native libraries do) inherits the name.
        pool.submit(start_child).result()
        before = cpu_by_thread(os.getpid())
        pool.submit(_spin, 0.3).result()
        after = cpu_by_thread(os.getpid())
    assert started == {"child": "test-part"}
    assert after["test-part"] - before.get("test-part", 0.0) >= 0.2
    # This test's own thread is the process's main one, or carries the process's name.
    assert os_thread_name() == process
    assert MAIN_THREAD in after or UNNAMED in after


def test_names_are_cut_to_what_the_kernel_keeps() -> None:
    with ThreadPoolExecutor(max_workers=1, initializer=namer("a-much-longer-name-than-fits")) as p:
        assert p.submit(os_thread_name).result() == "a-much-longer-n"
    with pytest.raises(ValueError):
        namer("")()


_ELSEWHERE = """
import os, sys, threading, time
import numpy as np
from threadpoolctl import threadpool_info
from rtc_server.cpu_priority import kernels_on_calling_thread
if sys.argv[2] == "server":
    kernels_on_calling_thread()
    assert {i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"} == {1}
def cpu(tid):
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])
def snapshot():
    return {int(t): cpu(t) for t in os.listdir("/proc/self/task")}
if sys.argv[1] == "opencv":
    import cv2
    image = np.random.default_rng(0).integers(0, 255, (1500, 1500, 3), np.uint8)
    def work():
        cv2.GaussianBlur(image, (15, 15), 0)
else:
    a = np.random.default_rng(0).random((400, 400))
    def work():
        a @ a
        time.sleep(0.001)  # small products now and then, as the server makes them
work()  # any pool is started
me = threading.get_native_id()
before = snapshot()
end = time.thread_time() + 1.0
while time.thread_time() < end:
    work()
after = snapshot()
own = after[me] - before[me]
others = sum(v - before.get(t, 0) for t, v in after.items() if t != me)
print(others / max(1, own))
"""


def _elsewhere(kernels: str, mode: str) -> float:
    """CPU that ``kernels`` ("opencv", "blas") spent on other threads (their pools, computing
    and spinning), per unit spent on the thread that called them."""
    out = subprocess.run(
        [sys.executable, "-c", _ELSEWHERE, kernels, mode],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout.strip())


@pytest.mark.parametrize(
    "kernels",
    [
        # A call's picture is drawn on its own render thread: OpenCV's pool of a thread per
        # core would only add hand-offs and spinning (3 % of a core on one speaking call).
        "opencv",
        # numpy's, SciPy's and OpenCV's OpenBLAS busy-wait after each product: one
        # transcription cost 230 ms of CPU for 130 ms of wall time with them, 130 without.
        "blas",
    ],
)
def test_opencv_and_blas_work_on_the_calling_thread_in_the_server(kernels: str) -> None:
    in_server = _elsewhere(kernels, "server")
    print(kernels, "CPU on other threads per own:", in_server)
    assert in_server < 0.1
    if (os.cpu_count() or 1) >= 2:  # the pools exist only with two cores or more
        assert _elsewhere(kernels, "default") > 0.3  # what the measurement sees with them
