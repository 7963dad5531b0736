"""Log lines of the server: each call's lines carry its id."""

from __future__ import annotations

import logging
from typing import Any


class CallLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """A call's logger: every line starts with ``session <first 8 of its id>:``, whatever the
    log format, so one call's lines can be picked out of a busy server's log."""

    def process(self, msg: object, kwargs: Any) -> tuple[object, Any]:
        return f"session {self.extra['session']}: {msg}", kwargs  # type: ignore[index]
