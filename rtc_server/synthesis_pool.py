"""The threads that synthesize every call's replies, taking the most pressing work first.

A process's calls share one small pool for speech synthesis (Piper) and the work around it
(resampling, mouth timing). A plain thread pool runs jobs in the order they came: when several
callers' replies start together, a reply that is already playing queues its next piece behind
the other replies' first ones, and may run out of audio before it comes (a gap inside its
speech, filled with silence). Here each job carries a deadline and the pool runs the earliest
first. A reply's later pieces are due when the audio queued before them has played
(:func:`due_in`, set by rtc_server/speech.py); everything else is due :data:`DEFAULT_SLACK_S`
after it was submitted, so a caller waiting for a reply to begin waits for a playing reply
only as long as that one has audio to spare.
"""

from __future__ import annotations

import contextlib
import contextvars
import heapq
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from typing import Any, ParamSpec, TypeVar

__all__ = ["DEFAULT_SLACK_S", "DeadlinePool", "current_deadline", "due_in"]

P = ParamSpec("P")
T = TypeVar("T")

DEFAULT_SLACK_S = 1.0
"""How soon work without a deadline of its own (a reply's first piece, resampling, a model
load) is due after it is submitted."""

_due: contextvars.ContextVar[float | None] = contextvars.ContextVar("synthesis_due", default=None)


def current_deadline() -> float | None:
    """The deadline (``time.monotonic()``) of work this task submits now; None: the default."""
    return _due.get()


@contextlib.contextmanager
def due_in(seconds: float) -> Iterator[None]:
    """Work submitted inside the block (in this task) is due ``seconds`` from now."""
    token = _due.set(time.monotonic() + max(0.0, seconds))
    try:
        yield
    finally:
        _due.reset(token)


class DeadlinePool(Executor):
    """``max_workers`` threads that run the submitted job with the earliest deadline first
    (in submission order among equal deadlines)."""

    def __init__(
        self,
        max_workers: int,
        *,
        thread_name_prefix: str = "synthesis",
        initializer: Callable[[], None] | None = None,
    ) -> None:
        if max_workers < 1:
            raise ValueError("max_workers must be at least 1")
        self._max_workers = max_workers
        self._prefix = thread_name_prefix
        self._initializer = initializer
        self._queue: list[tuple[float, int, Future[Any], Callable[[], Any]]] = []
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._shutdown = False

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        due = current_deadline()
        deadline = due if due is not None else time.monotonic() + DEFAULT_SLACK_S
        future: Future[T] = Future()
        with self._cond:
            if self._shutdown:
                raise RuntimeError("cannot schedule new work after shutdown")
            heapq.heappush(
                self._queue, (deadline, next(self._order), future, lambda: fn(*args, **kwargs))
            )
            self._cond.notify()
            # An idle thread that was woken but has not yet taken its job still counts as idle:
            # more jobs than idle threads need one more thread, up to max_workers.
            if len(self._queue) > self._idle and len(self._threads) < self._max_workers:
                thread = threading.Thread(
                    target=self._work, name=f"{self._prefix}_{len(self._threads)}", daemon=True
                )
                self._threads.append(thread)
                thread.start()
        return future

    def _work(self) -> None:
        if self._initializer is not None:
            self._initializer()
        while True:
            with self._cond:
                while not self._queue and not self._shutdown:
                    self._idle += 1
                    self._cond.wait()
                    self._idle -= 1
                if not self._queue:
                    return  # shut down, nothing left
                _, _, future, job = heapq.heappop(self._queue)
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = job()
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._cond:
            self._shutdown = True
            if cancel_futures:
                for _, _, future, _ in self._queue:
                    future.cancel()
                self._queue.clear()
            self._cond.notify_all()
            threads = list(self._threads)
        if wait:
            for thread in threads:
                if thread is not threading.current_thread():
                    thread.join()
