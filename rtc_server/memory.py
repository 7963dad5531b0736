"""Hand the memory of ended calls back to the operating system.

Two things keep a process's memory up after its calls have ended:

- **Reference cycles.** A call's objects (aiortc's transports, tasks and packets; the
  session, its scheduler and the frames it holds) form cycles, which only Python's full
  collection frees. With the server's ~160,000 long-lived objects that runs rarely, so the
  garbage of dozens of calls (about 5 MB each, mostly 512x512 frames) piled up: RSS swung by
  up to 250 MB in a soak. A full collection takes 70-170 ms on the 2-core development
  machine, too long to stall calls in progress (a video frame is 40 ms), so it runs only
  when the last call has ended.

  Python also starts full collections of its own, whenever the objects that survived younger
  collections grow by a quarter: with eight calls on the development machine one came every
  minute or two and held every thread of the process for 50-110 ms (measured with
  ``gc.callbacks``), long enough to make the callers hear holes. :func:`freeze_startup_objects`
  moves everything alive out of the collector's reach, so that a full collection walks only
  what calls made (12-35 thousand objects with eight calls, where there were 190,000; in
  ``bench load`` at one to eight calls no full collection then fell inside a step). A server
  that owns its process (``avatar-rtc serve``, each worker of ``--workers``) calls it once,
  when its models are in and before it takes calls; servers built many to a process (the
  tests') do not: there each freeze would also make permanent whatever earlier servers left
  behind (with one at every server start, 2 of 3 clean runs of the suite failed a real-time
  test). :class:`CollectorPauses` times every collection
  (``avatar_rtc_gc_pause_seconds``).
- **glibc's arenas.** malloc keeps freed memory in per-thread arenas (aiortc's encoder
  threads, VAD, TTS, onnxruntime) and returns only what lies at the top of a heap, so the
  high-water mark of a burst of calls stays, and fragmentation ratchets it up: RSS grew by
  about 180 MB over 75 calls in rounds of 8 at once. ``malloc_trim(0)`` (3-25 ms, in a
  worker thread, after every call) gives it back; elsewhere than glibc it does nothing.
  Each arena fragments on its own, and glibc makes up to 8 per core: after 100 calls in a
  row, rounds of 8 at once settled 0-40 MB higher than before them, run to run. With two
  arenas (:func:`limit_arenas`, as ``MALLOC_ARENA_MAX=2`` would) the same runs stayed within
  10 MB, for the same CPU time. A ``MALLOC_ARENA_MAX`` in the environment wins.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import gc
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Executor

logger = logging.getLogger(__name__)


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        trim: Callable[[int], int] = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None  # not glibc (musl, macOS)
    return trim


MALLOC_TRIM = _malloc_trim()
M_ARENA_MAX = -8  # glibc's mallopt() parameter number


def freeze_startup_objects() -> int:
    """Collect, then make every object alive now permanent for the collector (``gc.freeze``).

    Call once the server has loaded what it keeps for its lifetime; returns how many objects
    are frozen. Later full collections no longer walk them (see the module docstring).
    """
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("%d start-up objects moved out of the garbage collector's reach", frozen)
    return frozen


class CollectorPauses:
    """Times each collection of Python's garbage collector while installed (a ``with`` block
    puts it in ``gc.callbacks``); :meth:`drain` hands over what it timed.

    Every thread of the process waits for a collection: it holds the GIL, and collections
    never overlap. The callback only appends to a deque and takes no lock: a collection can
    start in any thread at any allocation, also in one that holds the lock a metrics library
    takes to record it (prometheus_client copies its children under its lock when scraped),
    and a callback that waited for that lock would wait for ever.
    """

    def __init__(self, keep: int = 10_000) -> None:
        self._started: float | None = None
        self._timed: collections.deque[tuple[int, float]] = collections.deque(maxlen=keep)
        """(generation, seconds) of each collection not yet drained; the oldest go first."""

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            started, self._started = self._started, None
            self._timed.append((info.get("generation", 2), time.perf_counter() - started))

    def drain(self, observe: Callable[[int, float], None]) -> int:
        """Hand each collection timed since the last drain to ``observe`` (generation,
        seconds), oldest first; returns how many."""
        count = 0
        while True:
            try:
                generation, seconds = self._timed.popleft()
            except IndexError:
                return count
            observe(generation, seconds)
            count += 1

    def __enter__(self) -> CollectorPauses:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self)


def limit_arenas(count: int = 2) -> bool:
    """Let glibc's malloc make at most ``count`` arenas from now on (see the module docstring).

    Process-wide; does nothing when ``MALLOC_ARENA_MAX`` is set or the libc is not glibc.
    """
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        mallopt: Callable[[int, int], int] = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_ARENA_MAX, count))


class MemoryReleaser:
    """After calls end: a full collection if none is left, then a trim; requests coalesce.

    ``idle`` says whether no call is running (or being set up) now.
    """

    def __init__(
        self, executor: Executor, idle: Callable[[], bool], *, delay_s: float = 1.0
    ) -> None:
        self._executor = executor
        self._idle = idle
        self._delay_s = delay_s
        self._timer: asyncio.TimerHandle | None = None
        self.collections = 0
        self.trims = 0

    def release_soon(self) -> None:
        """Release ``delay_s`` from now (calls ending together are released once)."""
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._delay_s, self._release)

    def _release(self) -> None:
        self._timer = None
        if self._idle():
            gc.collect()
            self.collections += 1
        if MALLOC_TRIM is not None:
            try:
                asyncio.get_running_loop().run_in_executor(self._executor, MALLOC_TRIM, 0)
            except RuntimeError:  # the executor is shut down: so is the server
                return
            self.trims += 1

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
