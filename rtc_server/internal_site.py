"""``/metrics`` and ``/readyz``'s details, on the main port or on a listener of their own.

Metrics and the readiness report (models, engine, workers, their memory) tell an attacker
what runs and how loaded it is. With ``--metrics-port`` they move to a second listener, on
``--metrics-host`` (127.0.0.1 by default) where only the operator's monitoring reaches them;
the main port keeps ``/readyz`` for load balancers and probes, with the status alone.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from rtc_server.config import ServerConfig
from signaling.errors import SignalingError, error_middleware

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

INTERNAL = web.AppKey("internal", web.Application)
"""The listener's own application, when it has one."""
INTERNAL_ADDRESS = web.AppKey("internal_address", tuple)


def add_internal_routes(
    app: web.Application, config: ServerConfig, *, readyz: Handler, metrics: Handler
) -> None:
    """``/readyz`` and ``/metrics`` on ``app``, or, with a metrics port, on a listener of
    their own and a ``/readyz`` without details on ``app``."""
    if not config.server.metrics_port:
        app.router.add_get("/readyz", readyz)
        app.router.add_get("/metrics", metrics)
        return

    async def status_only(request: web.Request) -> web.Response:
        try:
            await readyz(request)
        except SignalingError as exc:
            # The code (not_ready, draining, load_failed) is what a probe needs; the reason
            # is on the metrics listener.
            raise SignalingError(exc.status, exc.code, "not ready") from None
        return web.json_response({"status": "ready"})

    async def not_here(request: web.Request) -> web.Response:
        # Routed, not missing: behind the front, a path it has no route for goes to a worker.
        raise SignalingError(404, "not_found", "Not Found")

    app.router.add_get("/readyz", status_only)
    app.router.add_get("/metrics", not_here)
    internal = web.Application(middlewares=[error_middleware])
    internal.router.add_get("/readyz", readyz)
    internal.router.add_get("/metrics", metrics)
    app[INTERNAL] = internal
    app[INTERNAL_ADDRESS] = (config.server.metrics_host, config.server.metrics_port)


async def start_internal(app: web.Application) -> web.AppRunner | None:
    """Start ``app``'s metrics listener, if it has one; the runner to clean up."""
    internal = app.get(INTERNAL)
    if internal is None:
        return None
    host, port = app[INTERNAL_ADDRESS]
    runner = web.AppRunner(internal, access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
