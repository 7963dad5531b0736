"""``bench load``: how many calls this machine carries smoothly.

Calls are added one step at a time to a server in its own process; at each step every caller
asks a question at once. A step is smooth while, for every caller over the step, the mean
video frame interval stays at most 42 ms and the longest at most 80 ms (by packet arrival),
and the reply latency p95 stays within twice the one-call figure.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from benchmarks.analysis import first_loud_after, voiced_span
from benchmarks.client import CallClient, Microphone
from benchmarks.clip import speech_pcm
from benchmarks.latency import QUESTIONS, connect_caller, spawn_server
from benchmarks.report import summary

MAX_MEAN_INTERVAL_MS = 42.0
MAX_INTERVAL_MS = 80.0


async def _ask(client: CallClient, mic: Microphone, pcm: np.ndarray) -> float | None:
    _, voiced_end = voiced_span(pcm, 48_000)
    start = len(client.received.audio)
    handle = mic.play(pcm)
    await client.wait_event(lambda e: e.get("type") == "turn", timeout=60)
    await client.wait_state("listening", timeout=60)
    end = mic.sent_at(handle, voiced_end)
    first = first_loud_after(client.received.audio[start:], end or 0.0)
    return None if first is None or end is None else (first - end) * 1000


async def _step(callers: list[tuple[CallClient, Microphone]], pcm: np.ndarray) -> dict[str, Any]:
    marks = [len(c.received.video) for c, _ in callers]
    latencies = await asyncio.gather(*(_ask(c, m, pcm) for c, m in callers))
    means, maxes = [], []
    for (client, _), mark in zip(callers, marks, strict=True):
        arrivals = np.asarray([a for a, _, _ in client.received.video[mark:]])
        intervals = np.diff(arrivals) * 1000
        means.append(float(intervals.mean()))
        maxes.append(float(intervals.max()))
    return {
        "calls": len(callers),
        "latency_ms": summary([x for x in latencies if x is not None]),
        "worst_mean_interval_ms": max(means),
        "worst_max_interval_ms": max(maxes),
    }


async def _measure(max_calls: int, url: str | None) -> dict[str, Any]:
    process = None
    if url is None:
        url, process = await spawn_server()
    pcm = await speech_pcm(QUESTIONS[1])
    callers: list[tuple[CallClient, Microphone]] = []
    steps: list[dict[str, Any]] = []
    largest = 0
    try:
        for n in range(1, max_calls + 1):
            callers.append(await connect_caller(url, record_video=False))
            step = await _step(callers, pcm)
            base = steps[0]["latency_ms"].get("p95") if steps else step["latency_ms"].get("p95")
            step["smooth"] = (
                step["worst_mean_interval_ms"] <= MAX_MEAN_INTERVAL_MS
                and step["worst_max_interval_ms"] <= MAX_INTERVAL_MS
                and step["latency_ms"].get("p95", float("inf")) <= 2 * (base or float("inf"))
            )
            steps.append(step)
            print(
                f"  {n} call(s): mean interval {step['worst_mean_interval_ms']:.1f} ms, "
                f"max {step['worst_max_interval_ms']:.0f} ms, reply p95 "
                f"{step['latency_ms'].get('p95', float('nan')):.0f} ms"
                f"{'' if step['smooth'] else '  <- not smooth'}",
                flush=True,
            )
            if not step["smooth"]:
                break
            largest = n
    finally:
        for client, _ in callers:
            await client.close()
        if process is not None:
            process.terminate()
            await process.wait()
    return {"largest_smooth_calls": largest, "max_calls_tried": len(steps), "steps": steps}


def run(max_calls: int = 8, url: str | None = None) -> dict[str, Any]:
    return asyncio.run(_measure(max_calls, url))
