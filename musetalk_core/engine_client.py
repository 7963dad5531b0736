"""A media worker's connection to the engine process (:mod:`musetalk_core.engine_server`).

An :class:`EngineClient` is a :class:`~musetalk_core.engine.RenderLink`: a
``MuseTalkEngine(client)`` is a call like any other, whose frames are rendered in the engine
process, batched with the calls of every other media worker. Frames arrive in shared memory and
are copied out as they arrive; the avatar's idle frames are read in place. When the engine
process goes away, every call's engine fails (``EngineError``), which the media server answers
by handing the call to its CPU engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .engine import Arrive, RenderChannel
from .engine_protocol import Kind, pack, read_message
from .frame_ring import FrameRing
from .types import EngineError

__all__ = ["EngineClient", "EngineConnection"]

logger = logging.getLogger(__name__)

U8 = npt.NDArray[np.uint8]
Failed = Callable[[BaseException], None]


class EngineClient:
    """One media worker's side of the engine process; see the module docstring."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        hello: dict[str, Any],
    ) -> None:
        self._reader = reader
        self._writer = writer
        shape = tuple(int(v) for v in hello["frame_shape"])
        self._ring = FrameRing.attach(hello["ring"], int(hello["slots"]), shape)
        self._avatar = FrameRing.attach(hello["avatar"], int(hello["avatar_frames"]), shape)
        self._idle = [self._avatar.view(i) for i in range(self._avatar.slots)]
        self._fps = int(hello["fps"])
        self._rate = int(hello["sample_rate"])
        self._frame_size = (shape[1], shape[0])
        self._latency = float(hello["latency"])
        self._calls: dict[int, tuple[Arrive, Failed]] = {}
        self._numbers = itertools.count(1)
        self._stats: asyncio.Future[dict[str, Any]] | None = None
        self.closed = False
        self._task = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def connect(cls, path: str | Path) -> EngineClient:
        """Connect to the engine process listening on ``path`` (wrap in a timeout)."""
        reader, writer = await asyncio.open_unix_connection(str(path))
        kind, hello, _ = await read_message(reader)
        if kind is not Kind.HELLO:
            writer.close()
            raise EngineError(f"the engine process answered {kind.name}, not HELLO")
        client = cls(reader, writer, hello)
        writer.write(pack(Kind.READY))
        return client

    # RenderLink ----------------------------------------------------------------------------

    @property
    def fps(self) -> int:
        return self._fps

    @property
    def sample_rate(self) -> int:
        return self._rate

    @property
    def frame_size(self) -> tuple[int, int]:
        return self._frame_size

    @property
    def latency(self) -> float:
        return self._latency

    @property
    def idle_frames(self) -> Sequence[U8]:
        return self._idle

    def open(self, arrive: Arrive, failed: Failed) -> RenderChannel:
        call = next(self._numbers)
        self._calls[call] = (arrive, failed)
        if self.closed:
            failed(EngineError("the engine process is gone"))
        else:
            self._writer.write(pack(Kind.OPEN, {"call": call}))
        return _RemoteChannel(self, call)

    # The rest ------------------------------------------------------------------------------

    async def stats(self) -> dict[str, Any]:
        """The engine process's counters (batches, frames, mixed_batches, workers, calls)."""
        self._stats = asyncio.get_running_loop().create_future()
        self._writer.write(pack(Kind.STATS))
        return await asyncio.wait_for(self._stats, 10)

    async def aclose(self) -> None:
        self.close()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    def close(self) -> None:
        self._writer.close()
        self._task.cancel()
        self._ring.close()
        self._avatar.close()

    def _write(self, kind: Kind, header: dict[str, Any], payload: bytes = b"") -> None:
        if not self.closed:
            self._writer.write(pack(kind, header, payload))

    def _forget(self, call: int) -> None:
        if self._calls.pop(call, None) is not None:
            self._write(Kind.CLOSE, {"call": call})

    async def _read(self) -> None:
        try:
            while True:
                kind, header, _ = await read_message(self._reader)
                if kind is Kind.FACES:
                    slots = [int(s) for s in header["slots"]]
                    images = [self._ring.copy(s) for s in slots]
                    self._write(Kind.RELEASE, {"slots": slots})
                    callbacks = self._calls.get(int(header["call"]))
                    if callbacks is not None:
                        g, s, f = header["generation"], header["segment"], header["first"]
                        callbacks[0](int(g), int(s), int(f), images)
                elif kind is Kind.FAILED:
                    callbacks = self._calls.get(int(header["call"]))
                    if callbacks is not None:
                        callbacks[1](EngineError(f"the engine process: {header['message']}"))
                elif kind is Kind.STATS and self._stats is not None and not self._stats.done():
                    self._stats.set_result(header)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            logger.warning("the engine process closed its connection: %r", exc)
        finally:
            self.closed = True
            gone = EngineError("the engine process is gone")
            for _, failed in list(self._calls.values()):
                failed(gone)
            if self._stats is not None and not self._stats.done():
                self._stats.set_exception(gone)


class EngineConnection:
    """Keeps one :class:`EngineClient` connected to the engine process at ``path``: made on the
    event loop by :meth:`start`, and made again whenever the engine process went away (it is
    restarted by whoever started it). :attr:`client` is None while there is none."""

    RETRY_S = 1.0

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.client: EngineClient | None = None
        self._task: asyncio.Task[None] | None = None
        self._connected = asyncio.Event()

    @property
    def usable(self) -> EngineClient | None:
        client = self.client
        return client if client is not None and not client.closed else None

    async def start(self, wait_s: float) -> bool:
        """Start connecting; True once connected within ``wait_s`` seconds."""
        self._task = asyncio.get_running_loop().create_task(self._keep())
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                await self._connected.wait()
        return self.usable is not None

    async def _keep(self) -> None:
        while True:
            if self.usable is None:
                try:
                    async with asyncio.timeout(10):
                        self.client = await EngineClient.connect(self.path)
                    logger.info("connected to the MuseTalk engine process at %s", self.path)
                    self._connected.set()
                except (OSError, TimeoutError, EngineError, asyncio.IncompleteReadError):
                    pass
            await asyncio.sleep(self.RETRY_S)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self.client is not None:
            self.client.close()


class _RemoteChannel:
    """A call's :class:`RenderChannel` to the engine process."""

    def __init__(self, client: EngineClient, call: int) -> None:
        self._client = client
        self._call = call
        self._marked: tuple[int, int] | None = None

    def send(self, *op: Any) -> None:
        if op[0] == "audio":
            pcm = np.ascontiguousarray(op[3], np.int16)
            self._client._write(Kind.OP, {"call": self._call, "op": list(op[:3])}, pcm.tobytes())
        else:
            self._client._write(Kind.OP, {"call": self._call, "op": list(op)})

    def mark(self, segment_id: int, presented: int) -> None:
        mark = (segment_id, presented)
        if mark != self._marked:
            self._marked = mark
            self._client._write(
                Kind.MARK, {"call": self._call, "segment": segment_id, "presented": presented}
            )

    def close(self) -> None:
        self._client._forget(self._call)
