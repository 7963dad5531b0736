"""The tasks of one call: named after it, logged when they fail, all cancelled when it ends."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Iterator
from typing import Any


class CallTasks:
    """Every task a call starts goes through :meth:`spawn`, so its close can end them all."""

    def __init__(self, call_id: str, log: logging.Logger | logging.LoggerAdapter[Any]) -> None:
        self._prefix = f"session-{call_id[:8]}-"
        self._log = log
        self._tasks: set[asyncio.Task[Any]] = set()
        self._quiet: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Awaitable[Any], name: str, *, quiet: bool = False) -> asyncio.Task[Any]:
        """Run ``coro`` as one of the call's tasks. ``quiet``: its failure is not logged here
        (another task awaits it and reports it)."""
        task: asyncio.Task[Any] = asyncio.ensure_future(coro)
        task.set_name(self._prefix + name)
        self._tasks.add(task)
        if quiet:
            self._quiet.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        quiet = task in self._quiet
        self._quiet.discard(task)
        if task.cancelled() or task.exception() is None or quiet:
            return
        self._log.error("task %s failed", task.get_name(), exc_info=task.exception())

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        return iter(list(self._tasks))

    async def cancel_all(self) -> None:
        """Cancel every task but the caller's own and wait for them to end."""
        current = asyncio.current_task()
        tasks = [t for t in self._tasks if t is not current]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
