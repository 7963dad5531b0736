"""Admission by headroom: take a new call only while the running ones stay in real time.

A process measures itself: how late its event loop wakes up (every media packet of every call
goes through that loop), how much CPU it uses, and how much of that each call costs. A new call
is refused with ``503 at_capacity`` and ``Retry-After`` when

- the loop is already late most of the time (median lag over the last window above
  ``lag_limit_s``: the calls it carries are at the edge of real time; a single hiccup, such as
  a call being set up, does not count), or
- the CPU it uses plus what one more call is measured to cost would pass ``cpu_limit`` cores, or
- its calls and the new one, all speaking at once, would pass ``cpu_limit`` cores (a call that
  listens now costs a fifth of one that speaks; admitting by the CPU of listening calls took
  fourteen on two cores, which fell behind real time as soon as their avatars spoke); a
  process alone on its machine counts with them what the rest of the machine uses now (the
  machine's busy cores less its own: other programs take cores its calls would need), or
- the lip-sync engine, where the calls share one (MuseTalk batching every call on a GPU), is
  not keeping up (the share of speech instants whose frame was not ready, over the window,
  above ``held_limit``).

The per-call cost is learned from the process itself: CPU above the idle baseline (none until
the process has idled a window), divided by the calls it carries, smoothed; until it has been
measured a prior is used (``prior_call_cpu``). A speaking call's cost is learned the same way
from the windows where the avatars spoke (the share of the calls' video instants that carried
speech says how many calls spoke): the CPU above the idle baseline less what the listening
calls are measured to cost (nothing while unmeasured, which overstates it), divided by the
speaking calls; ``prior_speaking_call_cpu`` until then.

With ``--workers N`` each worker judges its own calls against its share of the cores, and sees
neither the other workers nor the rest of the machine (the front, other programs). The front
therefore also judges the machine (:func:`machine_refusal`): every worker's calls and the new
one all speaking, plus what everything else on the machine uses now (its busy cores from
``/proc/stat`` less what the workers use), against the workers' limits together.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from rtc_server.cpu_priority import cores

__all__ = ["Headroom", "HeadroomSettings", "MachineCpu", "Refusal", "WorkerLoad", "machine_refusal"]

SPEAKING_CALLS_TO_LEARN = 0.5
"""Calls speaking on average over a window (their share of instants times the calls) from which
the window teaches a speaking call's cost."""
QUIET_SHARE = 0.05
"""A window whose instants carried speech less than this teaches a listening call's cost."""


@dataclass(frozen=True, slots=True)
class HeadroomSettings:
    cpu_limit: float
    """Cores this process may use before it takes no more calls."""
    lag_limit_s: float = 0.020
    """Event-loop lag (median over the window) above which the process takes no more calls."""
    held_limit: float = 0.10
    """Share of speech instants without their frame above which it takes no more calls."""
    prior_call_cpu: float = 0.15
    """Cores one call is taken to cost until the process has measured it."""
    prior_speaking_call_cpu: float = 0.25
    """Cores one speaking call is taken to cost until measured (23-25 % of a core on the
    2-core machine of the project's figures, the CPU engine with the offline models)."""
    window_s: float = 5.0
    interval_s: float = 0.1


@dataclass(frozen=True, slots=True)
class Refusal:
    reason: str
    retry_after_s: int


class Headroom:
    """Samples this process's loop lag and CPU; answers whether one more call fits."""

    def __init__(self, settings: HeadroomSettings, machine: MachineCpu | None = None) -> None:
        """``machine``: the machine's CPU, whose use by other processes the all-speaking
        judgement counts (None: this process judges its own calls only, as a worker does,
        whose front judges the machine)."""
        self.settings = settings
        self.machine = machine
        samples = max(1, round(settings.window_s / settings.interval_s))
        self._lags: collections.deque[float] = collections.deque(maxlen=samples)
        self._cpu: collections.deque[tuple[float, float, int]] = collections.deque()
        """(monotonic time, process CPU seconds, calls) samples over the window."""
        self._speech: collections.deque[tuple[float, int, int, int]] = collections.deque()
        """(monotonic time, speech instants, held instants, all instants) totals over the
        window."""
        self._idle_cpu: float | None = None
        """Cores the process uses with no call (smoothed)."""
        self._call_cpu: float | None = None
        """Cores one call costs (smoothed)."""
        self._listening_call_cpu: float | None = None
        """Cores one call costs while no avatar speaks (smoothed)."""
        self._speaking_call_cpu: float | None = None
        """Cores one call costs while its avatar speaks (smoothed)."""
        self._task: asyncio.Task[None] | None = None
        self._speech_totals: Callable[[], tuple[int, int, int]] | None = None
        self.calls = 0
        self.helper_cpu: Callable[[], float] | None = None
        """CPU seconds so far of the processes that work for this one's calls (the local
        language model's), counted as its own: a reply's tokens cost as much as its frames."""

    @staticmethod
    def default_cpu_limit(workers: int = 1) -> float:
        """90 % of this process's share of the machine's cores, at most one event loop's worth
        plus the threads that encode and render beside it."""
        return 0.9 * max(1.0, cores() / max(1, workers))

    def start(self, speech_totals: Callable[[], tuple[int, int, int]] | None = None) -> None:
        """Sample from now on; ``speech_totals`` gives (speech instants, held, all instants)
        over all calls."""
        self._speech_totals = speech_totals
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="headroom")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        interval = self.settings.interval_s
        while True:
            before = time.monotonic()
            await asyncio.sleep(interval)
            self._lags.append(max(0.0, time.monotonic() - before - interval))
            self._sample_cpu()
            if self.machine is not None:
                self.machine.sample()
            if self._speech_totals is not None:
                self.note_speech(*self._speech_totals())

    def _cpu_seconds(self) -> float:
        helpers = self.helper_cpu() if self.helper_cpu is not None else 0.0
        return time.process_time() + helpers

    def _sample_cpu(self) -> None:
        now = time.monotonic()
        self._cpu.append((now, self._cpu_seconds(), self.calls))
        while self._cpu and now - self._cpu[0][0] > self.settings.window_s:
            self._cpu.popleft()
        if len(self._cpu) < 2 or now - self._cpu[0][0] < self.settings.window_s / 2:
            return
        t0, c0, calls0 = self._cpu[0]
        cores = (self._cpu_seconds() - c0) / (now - t0)
        if any(calls != calls0 for _, _, calls in self._cpu):
            return  # calls came or went during the window: no clean figure
        if calls0 == 0:
            self._idle_cpu = _smooth(self._idle_cpu, cores)
            return
        # A process whose first call came before it had idled a window has no baseline: its
        # calls are charged with it (an overstatement, on the safe side) until it has one.
        above_idle = max(0.0, cores - self.idle_cpu)
        self._call_cpu = _smooth(self._call_cpu, above_idle / calls0)
        share = self.speaking_share
        if share is None:
            return
        speaking = share * calls0
        if speaking < SPEAKING_CALLS_TO_LEARN:
            if share < QUIET_SHARE:
                self._listening_call_cpu = _smooth(self._listening_call_cpu, above_idle / calls0)
            return
        listening = (calls0 - speaking) * (self._listening_call_cpu or 0.0)
        self._speaking_call_cpu = _smooth(
            self._speaking_call_cpu, max(0.0, above_idle - listening) / speaking
        )

    def note_speech(self, instants: int, held: int, units: int) -> None:
        """Running totals of speech instants presented and held, and of all instants (speech
        or not), over all calls."""
        now = time.monotonic()
        self._speech.append((now, instants, held, units))
        while self._speech and now - self._speech[0][0] > self.settings.window_s:
            self._speech.popleft()

    @property
    def loop_lag_s(self) -> float:
        """Median of the event loop's wake-up lag over the window."""
        return self.loop_lag_quantile(0.5)

    def loop_lag_quantile(self, q: float) -> float:
        if not self._lags:
            return 0.0
        ordered = sorted(self._lags)
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

    @property
    def cpu_cores(self) -> float:
        """Cores this process used over the window."""
        if len(self._cpu) < 2:
            return 0.0
        t0, c0, _ = self._cpu[0]
        t1, c1, _ = self._cpu[-1]
        return (c1 - c0) / (t1 - t0) if t1 > t0 else 0.0

    @property
    def call_cpu(self) -> float:
        """Cores one call costs: measured, or the prior until then."""
        return self._call_cpu if self._call_cpu is not None else self.settings.prior_call_cpu

    @property
    def speaking_call_cpu(self) -> float:
        """Cores one call costs while its avatar speaks: measured, or the prior until then."""
        if self._speaking_call_cpu is not None:
            return self._speaking_call_cpu
        return self.settings.prior_speaking_call_cpu

    @property
    def held_share(self) -> float:
        if len(self._speech) < 2:
            return 0.0
        _, i0, h0, _ = self._speech[0]
        _, i1, h1, _ = self._speech[-1]
        return (h1 - h0) / (i1 - i0) if i1 > i0 else 0.0

    @property
    def speaking_share(self) -> float | None:
        """The share of the calls' instants that carried speech over the window (the share of
        the calls speaking, on average); None before any instant was presented."""
        if len(self._speech) < 2:
            return None
        _, i0, _, u0 = self._speech[0]
        _, i1, _, u1 = self._speech[-1]
        return (i1 - i0) / (u1 - u0) if u1 > u0 else None

    def refusal(self, *, engine_shared: bool = True) -> Refusal | None:
        """Why one more call would not fit now, or None if it would. A process with no call
        always takes one: whatever else runs on the machine, the first call is served."""
        s = self.settings
        if self.calls == 0:
            return None
        if self.loop_lag_s > s.lag_limit_s:
            return Refusal(f"the event loop is {self.loop_lag_s * 1000:.0f} ms late", 5)
        if engine_shared and self.held_share > s.held_limit:
            return Refusal("the lip-sync engine is not keeping up", 5)
        if self.cpu_cores + self.call_cpu > s.cpu_limit:
            return Refusal(
                f"{self.cpu_cores:.2f} cores in use, one more call costs about "
                f"{self.call_cpu:.2f}, the limit is {s.cpu_limit:.2f}",
                10,
            )
        all_speaking = self.all_speaking_cpu(self.calls + 1)
        others = self.others_cpu
        if others + all_speaking > s.cpu_limit:
            return Refusal(
                f"{self.calls + 1} calls speaking at once would need about {all_speaking:.2f} "
                f"cores ({self.speaking_call_cpu:.2f} a call) and the rest of the machine uses "
                f"{others:.2f}; the limit is {s.cpu_limit:.2f}",
                10,
            )
        return None

    @property
    def others_cpu(self) -> float:
        """Cores the rest of the machine used over the window (0 without a machine to read)."""
        busy = None if self.machine is None else self.machine.busy_cores
        return 0.0 if busy is None else max(0.0, busy - self.cpu_cores)

    @property
    def idle_cpu(self) -> float:
        """Cores this process uses with no call (0 until measured: calls are then charged
        with it)."""
        return self._idle_cpu or 0.0

    def all_speaking_cpu(self, calls: int) -> float:
        """Cores this process would use with ``calls`` calls all speaking: its idle baseline
        and a speaking call's cost each."""
        return self.idle_cpu + calls * self.speaking_call_cpu

    def snapshot(self) -> dict[str, float | int | None]:
        return {
            "calls": self.calls,
            "loop_lag_ms": round(self.loop_lag_s * 1000, 1),
            "loop_lag_p95_ms": round(self.loop_lag_quantile(0.95) * 1000, 1),
            "cpu_cores": round(self.cpu_cores, 3),
            "cpu_limit": round(self.settings.cpu_limit, 3),
            "call_cpu": round(self.call_cpu, 3),
            "call_cpu_measured": self._call_cpu is not None,
            "speaking_call_cpu": round(self.speaking_call_cpu, 3),
            "speaking_call_cpu_measured": self._speaking_call_cpu is not None,
            "idle_cpu": None if self._idle_cpu is None else round(self._idle_cpu, 3),
            "held_share": round(self.held_share, 3),
            "others_cpu": None if self.machine is None else round(self.others_cpu, 3),
        }


def _smooth(old: float | None, new: float, weight: float = 0.3) -> float:
    return new if old is None else (1 - weight) * old + weight * new


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """A worker's figures as the front sees them."""

    calls: int
    """Calls it holds, and offers forwarded to it and not answered yet."""
    cpu_cores: float
    """Cores it used over its window."""
    idle_cpu: float
    """Cores it uses with no call (0 until measured)."""
    speaking_call_cpu: float
    """Cores one of its calls costs while the avatar speaks (its prior until measured)."""
    cpu_limit: float
    """Cores it may use (its share of the machine)."""

    @property
    def all_speaking_cpu(self) -> float:
        """Cores it would use with all its calls speaking."""
        return self.idle_cpu + self.calls * self.speaking_call_cpu


def machine_refusal(workers: list[WorkerLoad], busy_cores: float | None) -> Refusal | None:
    """Why one more call would not fit on the machine, or None: every worker's calls and the
    new one all speaking, plus what the rest of the machine uses now (``busy_cores``, the
    machine's, less the workers'; None where it cannot be read: the rest counts nothing),
    against the workers' limits together. The first call is always taken."""
    calls = sum(w.calls for w in workers)
    if calls == 0:
        return None
    used = sum(w.cpu_cores for w in workers)
    others = 0.0 if busy_cores is None else max(0.0, busy_cores - used)
    speaking = sum(w.all_speaking_cpu for w in workers)
    need = others + speaking + max(w.speaking_call_cpu for w in workers)
    limit = sum(w.cpu_limit for w in workers)
    if need <= limit:
        return None
    return Refusal(
        f"{calls + 1} calls speaking at once would need about {need - others:.2f} cores and "
        f"the rest of the machine uses {others:.2f}; the workers' limit is {limit:.2f}",
        10,
    )


class MachineCpu:
    """The busy cores, over a window, of the CPUs this process may run on (its CPU set: in a
    container, the container's), from ``/proc/stat``. None where that cannot be read (not
    Linux), and where a CPU quota caps this process's cgroup below its CPUs (``cpu.max``): the
    other tenants of those CPUs then do not take from what the quota grants."""

    def __init__(
        self,
        window_s: float = 5.0,
        path: str = "/proc/stat",
        cpus: set[int] | None = None,
        quota_path: str = "/sys/fs/cgroup/cpu.max",
    ) -> None:
        self.window_s = window_s
        self.path = path
        self.cpus = _affinity() if cpus is None else cpus
        self.capped = _cpu_quota_set(quota_path)
        self._samples: collections.deque[tuple[float, float]] = collections.deque()
        """(monotonic time, busy CPU seconds of all cores) over the window."""

    def sample(self) -> None:
        busy = None if self.capped else _busy_seconds(self.path, self.cpus)
        if busy is None:
            return
        now = time.monotonic()
        self._samples.append((now, busy))
        while self._samples and now - self._samples[0][0] > self.window_s:
            self._samples.popleft()

    @property
    def busy_cores(self) -> float | None:
        if len(self._samples) < 2:
            return None
        (t0, b0), (t1, b1) = self._samples[0], self._samples[-1]
        return (b1 - b0) / (t1 - t0) if t1 > t0 else None


def _busy_seconds(path: str, cpus: set[int]) -> float | None:
    """CPU seconds ``cpus`` spent busy since boot: their ``cpuN`` lines of ``/proc/stat`` less
    idle and iowait (guest time is counted in user time already); None without any of them."""
    try:
        with open(path) as stat:
            lines = stat.read().splitlines()
    except OSError:
        return None
    busy, found = 0, False
    for line in lines:
        if not line.startswith("cpu"):
            break  # the cpu lines come first; the rest (interrupt counts) is long
        fields = line.split()
        if len(fields) < 9 or not fields[0][3:].isdigit():
            continue
        if int(fields[0][3:]) not in cpus:
            continue
        ticks = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
        busy += sum(ticks) - ticks[3] - ticks[4]
        found = True
    return busy / _CLOCK_TICKS if found else None


def _affinity() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def _cpu_quota_set(path: str) -> bool:
    """Does cgroup v2 cap this process's CPU time (``cpu.max`` other than ``max ...``)?"""
    try:
        with open(path) as f:
            return f.read().split()[0] != "max"
    except (OSError, IndexError):
        return False


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
