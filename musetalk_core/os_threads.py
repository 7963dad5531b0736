"""Thread names the operating system knows, so that the parts of a process can be told apart
from outside it: ``top -H``, ``ps -L``, ``py-spy`` and ``/proc/<pid>/task/<tid>/comm``, where
``avatar-rtc bench load`` reads how much CPU each part of the server spent.

Python's thread names are Python's own: to the kernel every thread carries the name of the
thread that started it (the process's name, for threads started from the main thread). Threads
that native libraries start inherit the name of the thread that created them: CTranslate2's,
made while the Whisper model loads on an ``stt`` thread, are ``stt`` too. Linux only;
elsewhere the calls do nothing.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable
from pathlib import Path

__all__ = ["NAME_BYTES", "name_this_thread", "namer", "os_thread_name"]

NAME_BYTES = 15
"""The kernel keeps this many bytes of a thread's name (16 with the terminating zero)."""


def _comm() -> Path:
    return Path(f"/proc/self/task/{threading.get_native_id()}/comm")


def os_thread_name() -> str | None:
    """The calling thread's name in the OS; None where it cannot be read."""
    try:
        return _comm().read_text().rstrip("\n")
    except OSError:
        return None


def name_this_thread(name: str) -> None:
    """Name the calling thread ``name`` in the OS (cut to :data:`NAME_BYTES`); threads it
    starts afterwards inherit the name."""
    if not name:
        raise ValueError("a thread's name cannot be empty")
    data = name.encode()[:NAME_BYTES]
    # A write of a cut multi-byte character would be refused; names here are ASCII.
    with contextlib.suppress(OSError):
        _comm().write_bytes(data)


def namer(name: str) -> Callable[[], None]:
    """An ``initializer`` for a ``ThreadPoolExecutor`` that names each of its threads ``name``."""
    return functools.partial(name_this_thread, name)
