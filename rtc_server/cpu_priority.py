"""How the server's threads share the CPU: transcription below the media path, OpenCV on the
calling thread, numpy's BLAS too.

A call's audio is paced on the event loop, its video encoded on the loop's default executor and
its reply synthesized on the app's executor; transcription (faster-whisper) waits on an
executor of its own, and CTranslate2's threads are made by it when the model loads. On a busy
machine the kernel shares the cores between all of them alike, so a burst of transcriptions
(several callers' turns ending together) delays frame encodes: the frames leave late and arrive
unevenly. Those threads therefore run at a lower priority (a higher nice value): they get the
CPU the media path leaves, and all of it when nothing else wants it, so one call alone is not
slower. Synthesis stays at the media path's priority: a reply's next sentence is due while its
first one plays. Raising a thread's nice value needs no privilege; lowering it back would.

OpenCV splits each call of its own over a pool of one thread per core, whose threads spin
(``sched_yield``) between jobs. A call's picture is drawn on that call's render thread in
small pieces (a mouth crop, a blend), so the pool only adds hand-offs and spinning: on one
speaking call it burned 3 % of a core yielding. :func:`kernels_on_calling_thread` turns it
off; calls are spread over the cores by their own threads (as x264 is, one thread a call).

The BLAS libraries loaded with numpy, SciPy and OpenCV (three copies of OpenBLAS) do the same:
a thread per core, busy-waiting after each call for the next. The server's matrix products are
small (Whisper's mel filter bank, the viseme estimator's layer), so the spinning is all they
add: one transcription cost 230 ms of CPU for 130 ms of wall time, 130 with one thread, at the
same wall time; six calls asking in turn, the server spent 90-98 % of a core over the turns
against 74-86 % (``bench load``'s step, three runs each). :func:`blas_on_calling_thread`.
"""

from __future__ import annotations

import logging
import os
import threading

__all__ = [
    "SPEECH_NICE",
    "blas_on_calling_thread",
    "cores",
    "kernels_on_calling_thread",
    "lower_this_thread",
    "side_by_side",
    "thread_nice",
]

logger = logging.getLogger(__name__)

SPEECH_NICE = 5
"""How much lower transcription runs: at +5 the kernel gives a nice-0 thread about three times
its share of a contended core."""


def cores() -> int:
    """CPUs this process may run on (a container's CPU set, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def side_by_side(share: float | None = None) -> int:
    """How many model runs of one kind (transcriptions, end-of-turn judgements) go side by
    side: one per core of ``share`` (the cores this process may use; default all it may run
    on), at least one and at most four."""
    return max(1, min(4, round(share or cores())))


def thread_nice(native_id: int | None = None) -> int:
    """The nice value of a thread of this process (default: the calling one)."""
    return os.getpriority(os.PRIO_PROCESS, native_id or threading.get_native_id())


def lower_this_thread(by: int = SPEECH_NICE) -> None:
    """Raise the calling thread's nice value by ``by`` (threads it starts later inherit it)."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, thread_nice(tid) + by))
    except OSError as exc:  # a platform without per-thread priorities: run as we are
        logger.warning("could not lower the transcription threads' CPU priority: %s", exc)


def kernels_on_calling_thread() -> None:
    """OpenCV and the BLAS libraries run each function on the thread that calls it, without
    their worker pools."""
    import cv2

    cv2.setNumThreads(0)
    blas_on_calling_thread()


def blas_on_calling_thread() -> None:
    """Every OpenBLAS of the process (numpy's, SciPy's, OpenCV's: they are loaded here first)
    computes on the calling thread alone."""
    import cv2  # noqa: F401
    import numpy  # noqa: F401
    import scipy.signal  # noqa: F401
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=1, user_api="blas")
