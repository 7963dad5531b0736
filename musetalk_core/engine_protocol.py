"""The messages between a media worker and the engine process, over a Unix stream socket.

A message is ``<I length><B kind><H header length>``, a JSON header, then raw bytes (the
speech's int16 samples). Frames never travel here: they are in shared memory
(:mod:`musetalk_core.frame_ring`), and a message only names their slots.
"""

from __future__ import annotations

import asyncio
import enum
import json
import struct
from typing import Any

__all__ = ["Kind", "pack", "read_message"]

_HEAD = struct.Struct("<IBH")
MAX_MESSAGE = 16 * 2**20


class Kind(enum.IntEnum):
    # engine process -> media worker
    HELLO = 1
    """The engine's shape (fps, rate, frame size, latency) and the names of its two rings."""
    FACES = 2
    """``call, generation, segment, first, slots``: rendered frames, in ring slots."""
    FAILED = 3
    """``call, message``: that call's rendering failed."""
    STATS = 4
    """The engine's batch counters, answering a STATS request."""
    # media worker -> engine process
    READY = 10
    """The worker mapped the rings (the engine may unlink their names)."""
    OPEN = 11
    OP = 12
    """``call, op`` (RenderSide.queue's operations); an ``audio`` op carries its samples."""
    MARK = 13
    CLOSE = 14
    RELEASE = 15
    """``slots``: copied out, free again."""


def pack(kind: Kind, header: dict[str, Any] | None = None, payload: bytes = b"") -> bytes:
    head = json.dumps(header or {}, separators=(",", ":")).encode()
    return _HEAD.pack(1 + 2 + len(head) + len(payload), kind, len(head)) + head + payload


async def read_message(reader: asyncio.StreamReader) -> tuple[Kind, dict[str, Any], bytes]:
    """The next message; raises ``asyncio.IncompleteReadError`` at the end of the stream."""
    raw = await reader.readexactly(_HEAD.size)
    length, kind, head_length = _HEAD.unpack(raw)
    if not 3 + head_length <= length <= MAX_MESSAGE:
        raise ValueError(f"bad engine message length {length}")
    body = await reader.readexactly(length - 3)
    header = json.loads(body[:head_length]) if head_length else {}
    return Kind(kind), header, body[head_length:]
