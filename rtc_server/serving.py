"""Serving until told to stop: SIGTERM (or Ctrl-C) drains the calls, then the process exits.

aiohttp's ``web.run_app`` stops at once on SIGTERM, cutting every call. Here the first signal
makes ``/readyz`` and ``/offer`` answer 503 (``draining``) while the HTTP server stays up, so
running calls keep their ``say`` and ``DELETE`` routes until they end or the drain timeout
passes; a second signal cuts the wait short.
"""

from __future__ import annotations

import asyncio
import signal
import ssl
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from musetalk_core.os_threads import namer
from rtc_server.app import MANAGER
from rtc_server.internal_site import start_internal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


async def serve(
    app: web.Application,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    drain_timeout_s: float,
    path: str | None = None,
    ssl_context: ssl.SSLContext | None = None,
    on_started: Callable[[], None] | None = None,
) -> None:
    """Serve ``app`` until SIGTERM/SIGINT, drain its calls, then clean up and return.

    ``path``: listen on this unix socket instead of ``host``:``port`` (a worker behind the
    front of ``--workers N``, rtc_server/workers/).
    """
    loop = asyncio.get_running_loop()
    # aiortc encodes every call's frames on the loop's default executor: named for the OS, so
    # that their CPU can be told from the rest (musetalk_core/os_threads.py). asyncio.run shuts
    # it down as it would its own.
    loop.set_default_executor(
        ThreadPoolExecutor(thread_name_prefix="media-encode", initializer=namer("media-encode"))
    )
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=5.0)
    await runner.setup()
    internal: web.AppRunner | None = None
    stop = asyncio.Event()
    cut_short = asyncio.Event()

    def on_signal() -> None:
        if stop.is_set():
            cut_short.set()
        stop.set()

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal)
    try:
        site: web.BaseSite
        if path is not None:
            site = web.UnixSite(runner, path)
        else:
            site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
        await site.start()
        internal = await start_internal(app)
        if on_started is not None:
            on_started()
        await stop.wait()
        await app[MANAGER].drain(drain_timeout_s, cut_short)
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
        if internal is not None:
            await internal.cleanup()
        await runner.cleanup()
