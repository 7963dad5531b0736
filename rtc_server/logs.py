"""Log lines of the server: plain text or one JSON object a line; each call's lines carry its id."""

from __future__ import annotations

import datetime
import json
import logging
from typing import Any

LOG_FORMATS = ("text", "json")


class CallLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """A call's logger: every line starts with ``session <first 8 of its id>:``, whatever the
    log format, so one call's lines can be picked out of a busy server's log; the JSON format
    also has it as its own ``session`` field."""

    def process(self, msg: object, kwargs: Any) -> tuple[object, Any]:
        session = self.extra["session"]  # type: ignore[index]
        kwargs["extra"] = {**kwargs.get("extra", {}), "session": session}
        return f"session {session}: {msg}", kwargs


class JsonFormatter(logging.Formatter):
    """``{"time", "level", "logger", "message"[, "session"][, "exception"]}`` per line."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        session = getattr(record, "session", None)
        if session is not None:
            entry["session"] = session
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(verbose: int, log_format: str = "text") -> None:
    """The process's logging: INFO (DEBUG at -vv), aiortc, aioice and access logs quieter."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, not {log_format!r}")
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.DEBUG if verbose > 1 else logging.INFO, handlers=[handler])
    if verbose < 2:
        for noisy in ("aioice", "aiortc", "aiohttp.access"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
