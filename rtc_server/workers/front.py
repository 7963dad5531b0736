"""The HTTP front of ``--workers N``: one address for callers, N workers behind it.

- ``/offer`` goes to the ready worker with the fewest calls; the front decides the 503s
  (``not_ready``, ``draining``, ``at_capacity`` for the whole server's ``--max-sessions``)
  after the token check, and the worker does the rest (SDP, the call).
- ``/sessions/{id}...`` goes to the worker that answered that offer; an id the front does not
  know goes to any worker, which answers as a single server would (404, or 401 with auth).
- ``/healthz``, ``/readyz`` and ``/metrics`` are the front's own; everything else (pages,
  ``/token``, ``/ice-servers``) goes to any ready worker.
- Access: origins, preflights, the rate limit and the live calls per client and per token
  are checked here (once for the whole server, by the client address the front sees); tokens
  and a session's token are checked by the worker too, which gets the client's address and
  scheme from the front.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import signal
from collections.abc import Sequence

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from yarl import URL

from rtc_server.config import ServerConfig
from rtc_server.internal_site import add_internal_routes, start_internal
from rtc_server.workers.pool import Worker, WorkerPool
from rtc_server.workers.protocol import (
    FORWARDED_FOR,
    FORWARDED_PROTO,
    INTERNAL_PREFIX,
    STATUS_SECRET,
)
from signaling.access import access_middleware
from signaling.errors import MAX_BODY_BYTES, SignalingError, error_middleware
from signaling.headers import security_headers_middleware
from signaling.quota import Reservation, client_key

logger = logging.getLogger(__name__)

FORWARD_TIMEOUT_S = 30.0
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "host",
        FORWARDED_FOR.lower(),
        FORWARDED_PROTO.lower(),
        "x-forwarded-host",  # the front has applied it (from a trusted proxy) or ignored it
        "forwarded",
        STATUS_SECRET.lower(),
    }
)
NOT_RETURNED = frozenset({"server", "date"})
POOL = web.AppKey("pool", WorkerPool)


def create_front_app(pool: WorkerPool, config: ServerConfig) -> web.Application:
    access = config.access.build_policy()
    app = web.Application(
        middlewares=[
            security_headers_middleware(access),
            error_middleware,
            config.access.client_view(config.server.host).middleware(),
            access_middleware(access),
        ],
        client_max_size=MAX_BODY_BYTES,
    )
    app[POOL] = pool

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(request: web.Request) -> web.Response:
        statuses = await asyncio.gather(*(pool.refresh(w) for w in pool.workers))
        if pool.draining:
            raise SignalingError(503, "draining", "the server is shutting down")
        for worker, status in zip(pool.workers, statuses, strict=True):
            if status is not None and status.load_error is not None:
                raise SignalingError(
                    503,
                    "load_failed",
                    f"worker {worker.index}: model loading failed: {status.load_error}",
                )
        waiting = [
            w.index for w, s in zip(pool.workers, statuses, strict=True) if not s or not s.ready
        ]
        if waiting:
            raise SignalingError(
                503,
                "not_ready",
                f"workers {', '.join(map(str, waiting))} of {len(pool.workers)} are not ready "
                "(models loading, or restarting)",
            )
        workers = [
            {
                "worker": w.index,
                "pid": s.pid,
                "sessions": len(s.sessions),
                "rss_mb": round(w.rss_mb() or 0.0),
                "cpu_cores": round(s.cpu_cores, 3),
                "idle_cpu": round(s.idle_cpu, 3),
                "speaking_call_cpu": round(s.speaking_call_cpu, 3),
                "cpu_limit": round(s.cpu_limit, 3),
            }
            for w, s in zip(pool.workers, statuses, strict=True)
            if s is not None
        ]
        loads = pool.worker_loads()
        busy = pool.machine.busy_cores
        return web.json_response(
            {
                "status": "ready",
                "sessions": sum(int(w["sessions"]) for w in workers),
                "workers": workers,
                # What the front judges the machine by (headroom.machine_refusal).
                "machine": {
                    "busy_cores": None if busy is None else round(busy, 3),
                    "workers_cpu_cores": round(sum(w.cpu_cores for w in loads), 3),
                    "all_speaking_cpu": round(sum(w.all_speaking_cpu for w in loads), 3),
                    "cpu_limit": round(sum(w.cpu_limit for w in loads), 3),
                },
            }
        )

    async def metrics(request: web.Request) -> web.Response:
        texts = await asyncio.gather(*(pool.get_text(w, "/metrics") for w in pool.workers))
        pool.metrics.workers.set(sum(w.alive for w in pool.workers))
        pool.metrics.workers_ready.set(sum(w.ready for w in pool.workers))
        merged = merge_metrics(
            [(w.index, t) for w, t in zip(pool.workers, texts, strict=True) if t is not None]
        )
        body = generate_latest(pool.metrics.registry) + merged.encode()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def offer(request: web.Request) -> web.StreamResponse:
        grant = access.require_token(request)  # 401 before anything else, as a single server
        if pool.draining:
            raise SignalingError(
                503,
                "draining",
                "the server is shutting down and takes no new calls; try again",
                headers={"Retry-After": "2"},
            )
        workers = pool.ready_by_load()
        if not workers:
            raise SignalingError(
                503, "not_ready", "models are still loading", headers={"Retry-After": "2"}
            )
        if pool.total_load() >= config.server.max_sessions:
            raise SignalingError(
                503,
                "at_capacity",
                f"the server is at its limit of {config.server.max_sessions} calls",
                headers={"Retry-After": "5"},
            )
        refusal = pool.machine_refusal() if config.server.headroom else None
        if refusal is not None:
            pool.metrics.machine_refusals.inc()
            raise SignalingError(
                503,
                "at_capacity",
                f"no room for another call on this machine: {refusal.reason}",
                headers={"Retry-After": str(refusal.retry_after_s)},
            )
        body = await read_body(request)
        with await admit(request, None if grant is None else grant.id) as reservation:
            # The least-loaded worker first; one with no headroom left (503 at_capacity)
            # passes the call to the next. The last refusal is the answer when none has room.
            for worker in workers:
                worker.inflight += 1
                try:
                    status, headers, payload = await forward(worker, request, body)
                    if status == 200:
                        session_id = str(json.loads(payload)["session_id"])
                        worker.sessions[session_id] = asyncio.get_running_loop().time()
                        if reservation is not None:
                            reservation.bind(session_id)
                finally:
                    worker.inflight -= 1
                if not _at_capacity(status, payload):
                    break
        return web.Response(status=status, headers=headers, body=payload)

    async def admit(
        request: web.Request, token_id: str | None
    ) -> contextlib.AbstractContextManager[Reservation | None]:
        """The call counted against its client's and token's limits (429 when over): the
        front owns them for the whole server, its workers do not count again."""
        quota = access.quota
        if quota is None:
            return contextlib.nullcontext()
        client = client_key(request.remote)
        live = lambda s: pool.worker_of(s) is not None  # noqa: E731
        quota.keep_only(live)
        if quota.over(client, token_id) is not None:
            # Calls that ended since the last poll still count: ask the workers now.
            await asyncio.gather(*(pool.refresh(w) for w in pool.workers if w.alive))
            quota.keep_only(live)
        return quota.admit(client, token_id)

    async def session_route(request: web.Request) -> web.StreamResponse:
        session_id = request.match_info["session_id"]
        worker = pool.worker_of(session_id)
        if worker is None and session_id in pool.ended:
            raise SignalingError(
                404,
                "unknown_session",
                f"no session {session_id!r}: the call ended when worker "
                f"{pool.ended[session_id]} stopped",
            )
        body = await read_body(request)
        target = worker or _any(pool)
        try:
            status, headers, payload = await forward(target, request, body)
        except SignalingError:
            if worker is None or worker.alive:
                raise  # a slow worker is not a dead one: 503, try again
            raise SignalingError(
                404,
                "unknown_session",
                f"no session {session_id!r}: the call ended when worker {worker.index} stopped",
            ) from None
        if request.method == "DELETE" and status == 204 and worker is not None:
            worker.sessions.pop(session_id, None)
            if access.quota is not None:
                access.quota.end(session_id)
        return web.Response(status=status, headers=headers, body=payload)

    async def other(request: web.Request) -> web.StreamResponse:
        if request.path.startswith(INTERNAL_PREFIX):
            raise SignalingError(404, "not_found", "Not Found")
        body = await read_body(request)
        status, headers, payload = await forward(_any(pool), request, body)
        return web.Response(status=status, headers=headers, body=payload)

    app.router.add_get("/healthz", healthz)
    add_internal_routes(app, config, readyz=readyz, metrics=metrics)
    app.router.add_post("/offer", offer)
    app.router.add_route("*", "/sessions/{session_id}", session_route)
    app.router.add_route("*", "/sessions/{session_id}/{action:.*}", session_route)
    app.router.add_route("*", "/{tail:.*}", other)
    return app


def _any(pool: WorkerPool) -> Worker:
    worker = pool.any_worker()
    if worker is None:
        raise SignalingError(
            503, "not_ready", "no worker is serving yet", headers={"Retry-After": "2"}
        )
    return worker


async def read_body(request: web.Request) -> bytes | None:
    """The body to forward, refused here as a worker would refuse it (never inflated)."""
    if not request.can_read_body:
        return None
    if request.headers.get("Content-Encoding", "").strip().lower() not in ("", "identity"):
        raise SignalingError(
            415, "unsupported_encoding", "request bodies must not be compressed (Content-Encoding)"
        )
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        raise SignalingError(413, "body_too_large", f"body is over {MAX_BODY_BYTES} bytes")
    try:
        return await request.read()
    except web.RequestPayloadError as exc:
        raise SignalingError(400, "bad_body", f"the body could not be read: {exc}") from exc
    except ConnectionResetError as exc:
        raise SignalingError(400, "bad_body", "the connection closed during the body") from exc


async def forward(
    worker: Worker, request: web.Request, body: bytes | None
) -> tuple[int, CIMultiDict[str], bytes]:
    """``request`` sent on to ``worker``; its status, headers (hop-by-hop ones left out), body."""
    connection_listed = {
        token.strip().lower() for token in request.headers.get("Connection", "").split(",")
    }
    headers: CIMultiDict[str] = CIMultiDict(
        (k, v)
        for k, v in request.headers.items()
        if k.lower() not in HOP_BY_HOP and k.lower() not in connection_listed
    )
    # The worker judges origins against its own: the host and scheme the caller used.
    headers["Host"] = request.host
    headers[FORWARDED_FOR] = request.remote or ""
    headers[FORWARDED_PROTO] = request.scheme
    http = worker.http
    if http is None:
        raise SignalingError(
            503, "worker_unavailable", "the worker is restarting", headers={"Retry-After": "2"}
        )
    try:
        async with http.request(
            request.method,
            URL("http://worker" + request.raw_path, encoded=True),
            headers=headers,
            data=body,
            allow_redirects=False,
            skip_auto_headers=("Accept", "Accept-Encoding", "User-Agent", "Content-Type"),
            timeout=aiohttp.ClientTimeout(total=FORWARD_TIMEOUT_S),
        ) as resp:
            payload = await resp.read()
            out: CIMultiDict[str] = CIMultiDict(
                (k, v)
                for k, v in resp.headers.items()
                if k.lower() not in HOP_BY_HOP and k.lower() not in NOT_RETURNED
            )
            if request.method == "HEAD" and "Content-Length" in resp.headers:
                # A HEAD answer has no body to measure: the length is the worker's.
                out["Content-Length"] = resp.headers["Content-Length"]
            return resp.status, out, payload
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        logger.warning(
            "worker %d did not answer %s %s: %s", worker.index, request.method, request.path, exc
        )
        raise SignalingError(
            503,
            "worker_unavailable",
            "the worker did not answer; try again",
            headers={"Retry-After": "2"},
        ) from exc


_SAMPLE_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def merge_metrics(texts: Sequence[tuple[int, str]]) -> str:
    """Prometheus text of several workers as one: each sample gets a ``worker`` label, each
    family's HELP/TYPE lines come once, followed by the samples of every worker."""
    headers: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for index, text in texts:
        family = ""
        for line in text.splitlines():
            if line.startswith(("# HELP ", "# TYPE ")):
                family = line.split(" ", 3)[2]
                lines = headers.setdefault(family, [])
                samples.setdefault(family, [])
                if line not in lines:
                    lines.append(line)
            elif line and not line.startswith("#"):
                samples.setdefault(family, []).append(relabel(line, index))
    out = [line for family in samples for line in (*headers.get(family, ()), *samples[family])]
    return "".join(line + "\n" for line in out)


def relabel(line: str, index: int) -> str:
    """``name{a="b"} 1`` -> ``name{worker="0",a="b"} 1``; ``name 1`` -> ``name{worker="0"} 1``."""
    match = _SAMPLE_NAME.match(line)
    if match is None:
        return line
    name, rest = match.group(), line[match.end() :]
    label = f'worker="{index}"'
    if rest.startswith("{}"):
        return f"{name}{{{label}}}{rest[2:]}"
    if rest.startswith("{"):
        return f"{name}{{{label},{rest[1:]}"
    return f"{name}{{{label}}}{rest}"


def run_front(config: ServerConfig, *, workers: int, verbose: int = 0) -> int:
    """Serve ``workers`` workers behind the front until SIGTERM; drain them all; exit code."""
    return asyncio.run(_run(config, workers, verbose))


async def _run(config: ServerConfig, count: int, verbose: int) -> int:
    from rtc_server.cli import server_ssl_context

    ssl_context = server_ssl_context(config)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = 0

    pool = WorkerPool(config, count, verbose=verbose)

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        if stop.is_set():
            pool.drain()  # a second signal: the workers cut their drains short
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    runner: web.AppRunner | None = None
    internal: web.AppRunner | None = None
    try:
        code = await pool.start_first()
        if code is not None:
            logger.error("worker 0 stopped during start-up (exit code %d)", code)
            return code if code > 0 else 1
        runner = web.AppRunner(
            create_front_app(pool, config),
            access_log=None,
            handle_signals=False,
            shutdown_timeout=5.0,
        )
        await runner.setup()
        site = web.TCPSite(runner, config.server.host, config.server.port, ssl_context=ssl_context)
        await site.start()
        internal = await start_internal(runner.app)
        scheme = "https" if ssl_context else "http"
        print(
            f"avatar-rtc: serving on {scheme}://{config.server.host}:{config.server.port} "
            f"({count} workers)",
            flush=True,
        )
        if not stop.is_set():  # a signal during start-up: drain worker 0 and stop
            pool.start_rest()
        await stop.wait()
        logger.info("draining %d workers", count)
        pool.drain()
        await pool.wait_exited()
        return 0
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await pool.close()
        if internal is not None:
            await internal.cleanup()
        if runner is not None:
            await runner.cleanup()


def _at_capacity(status: int, payload: bytes) -> bool:
    """Is this a worker's ``503 at_capacity`` (no headroom for the call), not another 503?"""
    if status != 503:
        return False
    try:
        body = json.loads(payload)
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("error", {}).get("code") == "at_capacity"
