"""What the front and its workers agree on: the start-up spec, the status route, the headers."""

from __future__ import annotations

from dataclasses import dataclass

from rtc_server.config import ServerConfig

STATUS_PATH = "/_worker/status"
"""A worker's own route (session ids, readiness). It answers only requests that carry the
front's secret in STATUS_SECRET (404 otherwise, as if it were not there); the front drops that
header from every request it forwards, and refuses the path itself."""
INTERNAL_PREFIX = "/_worker/"
STATUS_SECRET = "X-Avatar-Rtc-Worker-Secret"
FORWARDED_FOR = "X-Forwarded-For"
FORWARDED_PROTO = "X-Forwarded-Proto"
"""Set by the front on every forwarded request (a client's own values are dropped); a worker
listens only on a unix socket in the front's private directory, so only the front sets them."""


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """Pickled to the worker's stdin: the whole resolved configuration, secrets included, so
    none of it appears on a command line (``ps``) and the worker sees exactly what the front
    parsed."""

    config: ServerConfig
    socket_path: str
    index: int
    parent_pid: int
    secret: str
    verbose: int = 0
