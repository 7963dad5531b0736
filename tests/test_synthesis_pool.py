"""The synthesis pool runs the most pressing job first: a playing reply's next piece before
replies that have not begun; the speech output gives a reply's later pieces their deadline."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncGenerator

import numpy as np
import pytest

from musetalk_core.types import AudioChunk
from rtc_server.synthesis_pool import DEFAULT_SLACK_S, DeadlinePool, current_deadline, due_in


def _blocked(pool: DeadlinePool) -> threading.Event:
    """Occupy the pool's only thread until the returned event is set."""
    release = threading.Event()
    started = threading.Event()

    def hold() -> None:
        started.set()
        release.wait(10)

    pool.submit(hold)
    assert started.wait(10)
    return release


def test_the_earliest_deadline_runs_first_and_equal_ones_in_order() -> None:
    pool = DeadlinePool(1)
    release = _blocked(pool)
    ran: list[str] = []
    futures = [pool.submit(ran.append, "first piece A"), pool.submit(ran.append, "first piece B")]
    with due_in(5.0):
        futures.append(pool.submit(ran.append, "later piece, 5 s of audio ahead"))
    with due_in(0.0):
        futures.append(pool.submit(ran.append, "later piece, audio running out"))
    release.set()
    for f in futures:
        f.result(10)
    assert ran == [
        "later piece, audio running out",
        "first piece A",
        "first piece B",
        "later piece, 5 s of audio ahead",
    ]
    pool.shutdown()


def test_results_errors_cancels_and_shutdown() -> None:
    named: list[str] = []
    pool = DeadlinePool(2, initializer=lambda: named.append(threading.current_thread().name))
    assert pool.submit(pow, 2, 10).result(10) == 1024
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: 1 / 0).result(10)
    release = _blocked(pool)
    _blocked(pool)  # both threads busy now
    queued = pool.submit(time.sleep, 0)
    assert len(named) == 2  # no more threads than max_workers, each set up once
    pool.shutdown(wait=False, cancel_futures=True)
    assert queued.cancelled()
    with pytest.raises(RuntimeError):
        pool.submit(pow, 2, 2)
    release.set()
    with pytest.raises(ValueError):
        DeadlinePool(0)


def test_jobs_submitted_together_run_side_by_side_on_free_threads() -> None:
    pool = DeadlinePool(2)
    pool.submit(time.sleep, 0).result(10)  # one thread made, idle now
    both = threading.Barrier(2, timeout=10)
    # Each waits for the other: they pass only if the pool runs them at the same time.
    jobs = [pool.submit(both.wait) for _ in range(2)]
    assert sorted(f.result(10) for f in jobs) == [0, 1]
    pool.shutdown()


async def test_a_task_s_deadline_reaches_the_executor_it_awaits() -> None:
    pool = DeadlinePool(1)
    loop = asyncio.get_running_loop()
    assert await loop.run_in_executor(pool, current_deadline) is None  # on the pool's thread
    seen = []

    def submitted_with() -> None:
        seen.append(time.monotonic())

    before = time.monotonic()
    with due_in(3.0):
        await loop.run_in_executor(pool, submitted_with)
    # The job ran long before its deadline: deadlines order the queue, they do not delay.
    assert seen[0] - before < 3.0
    release = _blocked(pool)
    order: list[str] = []
    late = loop.run_in_executor(pool, order.append, "default")
    with due_in(DEFAULT_SLACK_S / 4):
        urgent = loop.run_in_executor(pool, order.append, "due sooner")
    release.set()
    await asyncio.gather(late, urgent)
    assert order == ["due sooner", "default"]
    pool.shutdown()


async def test_a_replys_later_pieces_are_due_when_the_audio_before_them_has_played() -> None:
    from rtc_server.media.clock import ManualClock
    from rtc_server.media.scheduler import AVScheduler
    from rtc_server.speech import SpeechOutput, Utterance
    from tests.fakes import CountingEngine

    rate = 48_000
    deadlines: list[float | None] = []

    class Voice:
        name = "recording"
        sample_rate = rate

        async def synthesize(
            self, text: str, *, previous_text: str = ""
        ) -> AsyncGenerator[AudioChunk, None]:
            deadlines.append(current_deadline())
            yield AudioChunk(np.full(rate, 1000, np.int16), rate)  # 1 s of audio a piece

    async def pieces() -> AsyncGenerator[str, None]:
        for text in ("You said:", "what is the capital of France.", "And more."):
            yield text

    engine = CountingEngine()
    scheduler = AVScheduler(engine, ManualClock())
    utterance = Utterance()
    start = time.monotonic()
    await SpeechOutput(scheduler).speak(Voice(), pieces(), utterance)  # type: ignore[arg-type]
    end = time.monotonic()
    assert deadlines[0] is None  # the first piece: the pool's default
    # Nothing played yet (the clock stands still): the second piece is due after the first
    # second queued, the third after two.
    assert deadlines[1] is not None and deadlines[2] is not None
    assert start + 1.0 <= deadlines[1] <= end + 1.0
    assert start + 2.0 <= deadlines[2] <= end + 2.0
    assert abs(utterance.unplayed_s - 3.0) < 0.05
    await scheduler.aclose()


async def test_piper_asks_the_pool_once_a_sentence_and_not_again_at_the_end() -> None:
    """The job after the last sentence would only find the end, after waiting its turn behind
    other calls' work: the reply's next piece waited for it."""
    from concurrent.futures import Future, ThreadPoolExecutor
    from typing import Any

    from rtc_server.providers.piper_tts import PiperTTS

    class Counting(ThreadPoolExecutor):
        jobs = 0

        def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
            Counting.jobs += 1
            return super().submit(fn, *args, **kwargs)

    pool = Counting(1)
    tts = PiperTTS.load(pool, deterministic=True)
    chunks = [c async for c in tts.synthesize("Hello there. How are you today?")]
    assert len(chunks) == 2 and all(len(c.pcm) > 1000 for c in chunks)
    assert Counting.jobs == 2
    assert [c async for c in tts.synthesize("...")] == []  # nothing to say: one job
    assert Counting.jobs == 3
    pool.shutdown()
