"""A call's ``events`` data channel: the caller's messages in, the avatar's events out (JSON)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from aiortc import RTCDataChannel

from signaling.errors import SignalingError
from signaling.messages import MAX_TEXT_CHARS, ClientEvent, parse_client_event

LABEL = "events"


class EventChannel:
    """Until the caller opens the channel, events are dropped (the state is sent on open)."""

    def __init__(
        self,
        on_event: Callable[[ClientEvent], None],
        log: logging.Logger | logging.LoggerAdapter[Any],
        *,
        max_chars: int = MAX_TEXT_CHARS,
    ) -> None:
        self.channel: RTCDataChannel | None = None
        self._on_event = on_event
        self._log = log
        self._max_chars = max_chars

    def attach(self, channel: RTCDataChannel, greeting: list[dict[str, Any]]) -> bool:
        """Take ``channel`` if it is the events channel, and send it ``greeting``."""
        if channel.label != LABEL:
            return False
        self.channel = channel
        channel.on("message", self._on_message)
        for event in greeting:
            self.send(event)
        return True

    def send(self, event: dict[str, Any]) -> None:
        channel = self.channel
        if channel is not None and channel.readyState == "open":
            channel.send(json.dumps(event))

    def error(self, code: str, message: str) -> None:
        self.send({"type": "error", "code": code, "message": message})

    def _on_message(self, message: str | bytes) -> None:
        # Called inside aiortc's DTLS receive loop: an exception escaping from here ends that
        # loop, and with it every later message and packet of the call, without a word.
        try:
            event = parse_client_event(message, max_chars=self._max_chars)
        except SignalingError as exc:
            self.error(exc.code, exc.message)
            return
        try:
            self._on_event(event)
        except SignalingError as exc:  # refused: over the rate, a full queue
            self.error(exc.code, exc.message)
        except Exception:
            self._log.exception("data-channel message failed")
            self.error("internal", "the message could not be handled")
