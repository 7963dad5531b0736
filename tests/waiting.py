"""Waiting for something to happen in a test: one helper, bounded by time, never a speed test.

The bounds are generous on purpose (``make test`` runs on busy machines): a condition that
should come true is given its time, and only one that never does fails.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

POLL_S = 0.02


async def holds_within(condition: Callable[[], object], timeout: float) -> bool:
    """Whether ``condition()`` became true within ``timeout`` seconds (checked every 20 ms)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() >= deadline:
            return bool(condition())
        await asyncio.sleep(POLL_S)
    return True


async def wait_until(
    condition: Callable[[], object], timeout: float = 10.0, what: str | Callable[[], str] = ""
) -> None:
    """Return once ``condition()`` is true; fail with ``what`` (or a callable giving the
    message, read at the timeout) if it is not within ``timeout`` seconds."""
    if not await holds_within(condition, timeout):
        message = what() if callable(what) else what
        raise AssertionError(f"not within {timeout:.0f} s: {message or 'the condition'}")


async def probe_until(
    probe: Callable[[], Awaitable[T]],
    done: Callable[[T], object],
    timeout: float,
    what: str | Callable[[], str] = "",
    every: float = 0.5,
) -> T:
    """Await ``probe()`` every ``every`` seconds until ``done(result)``; return that result.
    For conditions that take a request to read (a process's stats); fails like
    :func:`wait_until`, with the last result in the message."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not done(result := await probe()):
        if loop.time() >= deadline:
            message = what() if callable(what) else what
            raise AssertionError(
                f"not within {timeout:.0f} s: {message or 'the condition'}; {result}"
            )
        await asyncio.sleep(every)
    return result


async def wait_for_video(client: object, frames: int, timeout: float = 15.0) -> None:
    """Until ``client`` (a ``benchmarks.client.CallClient``) has received ``frames`` frames."""
    video = client.received.video  # type: ignore[attr-defined]
    await wait_until(
        lambda: len(video) >= frames,
        timeout,
        lambda: f"{frames} video frames; only {len(video)} arrived",
    )
