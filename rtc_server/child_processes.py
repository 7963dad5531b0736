"""Stopping the helper processes a server runs (MuseTalk engines, the local model)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterable


async def stop_processes(processes: Iterable[asyncio.subprocess.Process], timeout_s: float) -> None:
    """SIGTERM to each that still runs, then wait; one still there after ``timeout_s`` is
    killed."""
    running = [p for p in processes if p.returncode is None]
    for process in running:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
    for process in running:
        try:
            async with asyncio.timeout(timeout_s):
                await process.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
