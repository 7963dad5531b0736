"""One worker process: ``python -m rtc_server.workers.child`` with a pickled WorkerSpec on stdin.

The whole single-process server (``rtc_server.app``) on a unix socket, with three additions:
the forwarded client address and scheme are trusted (only the front can reach the socket, and
it has checked the host name),
the rate limit and the calls per client and per token are the front's (counted for the whole
server, not per worker), and ``/_worker/status`` tells the front which calls it holds. A
worker whose front has gone drains as on SIGTERM.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import pickle
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from rtc_server.workers.protocol import (
    FORWARDED_FOR,
    FORWARDED_PROTO,
    STATUS_PATH,
    STATUS_SECRET,
    WorkerSpec,
)

PARENT_POLL_S = 1.0
ORPHAN_GRACE_S = 15.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def forwarded_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The caller's address (rate limits, logs) and scheme (the server's own origin) as the
    front saw them."""
    proto = request.headers.get(FORWARDED_PROTO)
    remote = request.headers.get(FORWARDED_FOR)
    # One clone: a clone starts again from the request as received, without earlier overrides.
    if proto not in ("http", "https"):
        proto = None
    if proto and remote:
        request = request.clone(scheme=proto, remote=remote)
    elif proto:
        request = request.clone(scheme=proto)
    elif remote:
        request = request.clone(remote=remote)
    return await handler(request)


def add_worker_parts(
    app: web.Application, parent_pid: int, secret: str, drain_timeout_s: float
) -> None:
    from rtc_server.app import LOADING, MANAGER

    app.middlewares.insert(0, forwarded_middleware)
    # Its calls against its share of the cores; the front judges the machine, whose other
    # processes include the other workers.
    app[MANAGER].headroom.machine = None

    async def status(request: web.Request) -> web.Response:
        given = request.headers.get(STATUS_SECRET, "").encode("utf-8", "surrogatepass")
        if not hmac.compare_digest(given, secret.encode()):
            raise web.HTTPNotFound()
        manager = app[MANAGER]
        loading = app.get(LOADING)
        error = None
        if loading is not None and loading.done() and not loading.cancelled():
            exc = loading.exception()
            error = None if exc is None else str(exc)
        return web.json_response(
            {
                "pid": os.getpid(),
                "ready": manager.ready,
                "draining": manager.draining,
                "load_error": error,
                "sessions": list(manager.sessions),
                # For the front's judgement of the machine (headroom.machine_refusal).
                "cpu_cores": manager.headroom.cpu_cores,
                "idle_cpu": manager.headroom.idle_cpu,
                "speaking_call_cpu": manager.headroom.speaking_call_cpu,
                "cpu_limit": manager.headroom.settings.cpu_limit,
            }
        )

    async def watch_parent(app: web.Application) -> AsyncIterator[None]:
        async def watch() -> None:
            while True:
                await asyncio.sleep(PARENT_POLL_S)
                if os.getppid() != parent_pid:
                    break
            # The front is gone (killed): nobody can reach our HTTP routes any more. Drain,
            # as on SIGTERM, so the calls we hold end when they end or at the drain timeout;
            # and nobody will kill us if the drain hangs, so do it ourselves.
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.sleep(drain_timeout_s + ORPHAN_GRACE_S)
            os.kill(os.getpid(), signal.SIGKILL)

        task = asyncio.ensure_future(watch())
        yield
        task.cancel()

    app.router.add_get(STATUS_PATH, status)
    app.cleanup_ctx.append(watch_parent)


def main() -> int:
    spec = pickle.loads(sys.stdin.buffer.read())
    if not isinstance(spec, WorkerSpec):
        print("avatar-rtc worker: no WorkerSpec on stdin", file=sys.stderr)
        return 2
    from musetalk_core.warp_avatar import AvatarError
    from rtc_server.app import create_app
    from rtc_server.cli import prepare, quiet_telemetry
    from rtc_server.logs import configure_logging
    from rtc_server.serving import serve

    configure_logging(spec.verbose, spec.config.server.log_format)
    try:
        factory = prepare(spec.config)
    except (ValueError, AvatarError) as exc:
        print(f"avatar-rtc: error: {exc}", file=sys.stderr)
        return 2
    quiet_telemetry()
    # TLS ends at the front; the front enforces the rate limit and the calls per client and
    # per token for the whole server.
    config = spec.config.replace(
        rate_limit_per_min=0,
        max_calls_per_client=0,
        max_calls_per_token=0,
        metrics_port=0,  # the front serves them, from every worker's
        cert_file=None,
        key_file=None,
    )
    app = create_app(config, engine_loader=lambda: factory, behind_front=True, owns_process=True)
    add_worker_parts(app, spec.parent_pid, spec.secret, config.server.drain_timeout_s)
    asyncio.run(serve(app, path=spec.socket_path, drain_timeout_s=config.server.drain_timeout_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
