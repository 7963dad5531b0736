"""The server's CPU during ``bench load``, per call: idle, per speaking call, by thread.

The readings come from /proc (benchmarks/procstat.py): the server's process tree, and its
threads by the names it gives them in the OS (musetalk_core/os_threads.py).
"""

from __future__ import annotations


def speaking_cpu_pct_per_call(
    samples: list[tuple[float, float]],
    spans: list[tuple[float, float]],
    idle_cores_per_call: float,
    calls: int,
) -> float | None:
    """Server CPU of one speaking call, % of one core.

    Over each interval between two CPU samples, k calls are speaking (their reply's speech
    covers the interval's middle): what the interval cost beyond the n - k calls that were
    not speaking (at the idle rate), per speaking call. None: nobody spoke between samples.
    """
    spent, speaking_s = 0.0, 0.0
    for (t0, c0), (t1, c1) in zip(samples, samples[1:], strict=False):
        mid = (t0 + t1) / 2
        k = sum(1 for a, b in spans if a <= mid < b)
        if k:
            spent += (c1 - c0) - idle_cores_per_call * (calls - k) * (t1 - t0)
            speaking_s += k * (t1 - t0)
    return spent / speaking_s * 100 if speaking_s else None


def speaking_cpu_by_thread(
    samples: list[tuple[float, dict[str, float]]],
    spans: list[tuple[float, float]],
    idle: dict[str, float] | None,
    calls: int,
) -> dict[str, float] | None:
    """:func:`speaking_cpu_pct_per_call` for each thread name: ``idle`` is each name's idle
    rate per call (% of a core, :func:`cpu_per_call_by_thread` over the idle window)."""
    if idle is None or len(samples) < 2:
        return None
    out = {}
    for name in samples[-1][1]:
        series = [(t, cpu.get(name, 0.0)) for t, cpu in samples]
        pct = speaking_cpu_pct_per_call(series, spans, idle.get(name, 0.0) / 100, calls)
        if pct is not None and pct > 0:
            out[name] = round(pct, 2)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def cpu_per_call_by_thread(
    before: dict[str, float] | None, after: dict[str, float] | None, seconds: float, calls: int
) -> dict[str, float] | None:
    """The server's CPU between two readings of :func:`~benchmarks.procstat.cpu_by_thread`, by
    thread name, in % of a core per call, largest first; None without both readings."""
    if before is None or after is None or seconds <= 0 or calls <= 0:
        return None
    spent = {n: (cpu - before.get(n, 0.0)) / seconds / calls * 100 for n, cpu in after.items()}
    return {n: round(v, 2) for n, v in sorted(spent.items(), key=lambda kv: -kv[1]) if v > 0}
