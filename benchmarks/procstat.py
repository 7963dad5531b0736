"""CPU time and resident memory of a process and its descendants, from Linux's /proc; CPU
time by thread name too (the server names its threads for the OS: musetalk_core/os_threads.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

_TICKS = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True, slots=True)
class Usage:
    cpu_s: float
    """User + system CPU seconds of the process tree so far (live processes only)."""
    rss_bytes: int
    """Resident memory of the tree, summed over its processes."""
    processes: int


def _stat(pid: int) -> list[str] | None:
    return _stat_at(f"/proc/{pid}/stat")


def _stat_at(path: str) -> list[str] | None:
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces.
    return text[text.rindex(")") + 2 :].split()


def _children(pid: int) -> list[int] | None:
    """Child processes of ``pid`` (from each of its threads), None when the kernel has no
    ``children`` files (CONFIG_PROC_CHILDREN)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    out: list[int] = []
    for tid in tasks:
        try:
            out.extend(int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split())
        except FileNotFoundError:
            if not Path(f"/proc/{pid}/task/{tid}").exists():
                continue  # the thread just ended
            return None
        except OSError:
            continue
    return out


def _scan_children() -> dict[int, list[int]]:
    parents: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields is not None:
                parents.setdefault(int(fields[1]), []).append(int(entry.name))
    return parents


def _tree(root: int) -> list[int]:
    """``root`` and its live descendants."""
    scanned: dict[int, list[int]] | None = None
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        children = _children(pid) if scanned is None else None
        if children is None:
            scanned = scanned if scanned is not None else _scan_children()
            children = scanned.get(pid, [])
        todo.extend(children)
    return out


def usage(root: int) -> Usage:
    """CPU and RSS of ``root`` and its descendants now.

    CPU of children that already exited is not counted unless ``root`` waited for them (then
    it is in ``root``'s cutime/cstime, which are included).
    """
    cpu, rss, n = 0.0, 0, 0
    for pid in _tree(root):
        fields = _stat(pid)
        if fields is None:
            continue
        # After the name: state(0) ppid(1) ... utime(11) stime(12) cutime(13) cstime(14) ...
        # rss(21), in pages.
        ticks = sum(int(f) for f in fields[11:13])
        if pid == root:
            ticks += sum(int(f) for f in fields[13:15])
        cpu += ticks / _TICKS
        rss += int(fields[21]) * _PAGE
        n += 1
    return Usage(cpu, rss, n)


MAIN_THREAD = "event-loop"
"""The name :func:`cpu_by_thread` gives each process's main thread (the server's event loop)."""
UNNAMED = "other"
"""... and the threads that carry their process's own name (nobody named them)."""
MODEL = "local-model"
"""... and every thread of the local language model's process (``llama-server``)."""


def _comm(pid: int, tid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().rstrip("\n")
    except OSError:
        return None


def cpu_by_thread(root: int) -> dict[str, float]:
    """CPU seconds so far of the live threads of ``root`` and its descendants, summed by the
    threads' OS names (threads that ended are not counted)."""
    out: dict[str, float] = {}
    for pid in _tree(root):
        own = _comm(pid, pid)
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            fields = _stat_at(f"/proc/{pid}/task/{tid}/stat")
            name = _comm(pid, tid)
            if fields is None or name is None:
                continue
            if own == "llama-server":
                label = MODEL
            else:
                label = MAIN_THREAD if tid == pid else UNNAMED if name == own else name
            out[label] = out.get(label, 0.0) + sum(int(f) for f in fields[11:13]) / _TICKS
    return out
