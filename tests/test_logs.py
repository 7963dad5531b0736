"""Log lines: a call's carry its session id, as text or as JSON."""

from __future__ import annotations

import json
import logging

import pytest

from rtc_server.logs import CallLog, JsonFormatter, configure_logging


def _record(logger: logging.Logger, handler: logging.Handler) -> None:
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def test_a_calls_lines_carry_its_session_as_text_and_as_a_json_field() -> None:
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(self.format(record))

    text, as_json = Keep(), Keep()
    text.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    as_json.setFormatter(JsonFormatter())
    logger = logging.getLogger("test-logs-call")
    _record(logger, text)
    logger.addHandler(as_json)
    log = CallLog(logger, {"session": "abcd1234"})
    log.info("connection %s", "connected")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("failed")
    assert lines[0] == "INFO session abcd1234: connection connected"
    entry = json.loads(lines[1])
    assert entry["message"] == "session abcd1234: connection connected"
    assert entry["session"] == "abcd1234" and entry["level"] == "INFO"
    assert entry["logger"] == "test-logs-call" and entry["time"].endswith("+00:00")
    failed = json.loads(lines[3])
    assert failed["level"] == "ERROR" and "RuntimeError: boom" in failed["exception"]
    plain = logging.LogRecord("x", logging.WARNING, __file__, 1, "no call %d", (7,), None)
    assert "session" not in json.loads(JsonFormatter().format(plain))  # not a call's line


def test_an_unknown_log_format_is_refused() -> None:
    with pytest.raises(ValueError, match="text, json"):
        configure_logging(0, "xml")
