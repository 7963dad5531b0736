"""The engine process: one MuseTalk runtime on one device, rendering for every media worker.

With several media worker processes, each loading MuseTalk would split one GPU's batches by
process. Instead one engine process per GPU holds the models and the inference worker, and the
media workers connect to it (:class:`~musetalk_core.engine_client.EngineClient`) over a Unix
socket: their calls' speech goes in as messages (:mod:`musetalk_core.engine_protocol`), each
call becomes a :class:`~musetalk_core.render_side.RenderSide` of the one worker, so frames of
every worker's calls share batches, and the rendered frames come back in shared memory (one
:class:`~musetalk_core.frame_ring.FrameRing` per worker connection, plus one holding the
avatar's own frames, which the workers show while idle).

``python -m musetalk_core.engine_server --socket PATH --weights-dir DIR ...`` runs one; it
prints ``ready`` once the models are warm and serves until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .engine_protocol import Kind, pack, read_message
from .frame_ring import FrameRing, SlotsExhausted
from .framing import FRAMINGS
from .render_side import RenderSide
from .runtime import MuseTalkRuntime

__all__ = ["EngineServer", "main"]

logger = logging.getLogger(__name__)

U8 = npt.NDArray[np.uint8]

RING_SLOTS = 128
"""Frame slots per media worker: about five seconds of 25 fps frames in flight."""
SLOT_WAIT_S = 2.0
"""How long a rendered batch waits for a worker to hand slots back before it is dropped."""


@dataclass(eq=False)
class _Worker:
    """One connected media worker."""

    number: int
    writer: asyncio.StreamWriter
    ring: FrameRing
    calls: dict[int, RenderSide] = field(default_factory=dict)
    closed: bool = False


class EngineServer:
    """Serves ``runtime`` to media workers; see the module docstring."""

    def __init__(self, runtime: MuseTalkRuntime, *, ring_slots: int = RING_SLOTS) -> None:
        self.runtime = runtime
        self.ring_slots = ring_slots
        frames = list(runtime.avatar.frames)
        self._shape = tuple(frames[0].shape)
        self.avatar_ring = FrameRing.create(len(frames), self._shape)
        self.avatar_ring.fill(frames)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._workers: set[_Worker] = set()
        self._count = 0
        self.mixed_batches = 0
        """Batches that held frames of more than one media worker's calls."""
        self.dropped_frames = 0
        """Frames rendered but dropped: their worker handed no slot back in time."""
        self._batch_workers: tuple[int, set[int]] = (-1, set())

    async def serve(self, path: str | Path) -> asyncio.Server:
        self._loop = asyncio.get_running_loop()
        return await asyncio.start_unix_server(self._connected, path=str(path))

    def close(self) -> None:
        self.avatar_ring.unlink()
        self.avatar_ring.close()

    def stats(self) -> dict[str, Any]:
        worker = self.runtime.worker.stats
        return {
            "batches": worker.batches,
            "frames": worker.frames,
            "mixed_batches": self.mixed_batches,
            "dropped_frames": self.dropped_frames,
            "workers": len(self._workers),
            "calls": sum(len(w.calls) for w in self._workers),
        }

    # One media worker ----------------------------------------------------------------------

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._count += 1
        worker = _Worker(self._count, writer, FrameRing.create(self.ring_slots, self._shape))
        self._workers.add(worker)
        rt = self.runtime
        hello = {
            "fps": rt.fps,
            "sample_rate": rt.sample_rate,
            "frame_shape": list(self._shape),
            "latency": rt.latency,
            "ring": worker.ring.name,
            "slots": worker.ring.slots,
            "avatar": self.avatar_ring.name,
            "avatar_frames": self.avatar_ring.slots,
        }
        try:
            writer.write(pack(Kind.HELLO, hello))
            kind, _, _ = await read_message(reader)
            if kind is not Kind.READY:
                raise ValueError(f"a media worker sent {kind.name} before READY")
            worker.ring.unlink()  # both sides have it mapped: nothing to leave behind
            while True:
                kind, header, payload = await read_message(reader)
                self._handle(worker, kind, header, payload)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except Exception:
            logger.exception("media worker %d sent what the engine cannot take", worker.number)
        finally:
            worker.closed = True
            for side in worker.calls.values():
                rt.worker.detach(side)
            worker.calls.clear()
            self._workers.discard(worker)
            worker.ring.unlink()
            worker.ring.close()
            writer.close()

    def _handle(self, worker: _Worker, kind: Kind, header: dict[str, Any], payload: bytes) -> None:
        rt = self.runtime
        if kind is Kind.OP:
            side = worker.calls.get(header["call"])
            if side is None:
                return
            op = list(header["op"])
            if op[0] == "audio":
                op.append(np.frombuffer(payload, np.int16).copy())
            side.queue(*op)
            rt.worker.notify()
        elif kind is Kind.MARK:
            side = worker.calls.get(header["call"])
            if side is not None:
                side.mark = (int(header["segment"]), int(header["presented"]))
        elif kind is Kind.RELEASE:
            worker.ring.release([int(s) for s in header["slots"]])
        elif kind is Kind.OPEN:
            call = int(header["call"])
            side = RenderSide(
                rt, partial(self._publish, worker, call), partial(self._failed, worker, call)
            )
            worker.calls[call] = side
            rt.worker.attach(side)
        elif kind is Kind.CLOSE:
            closed = worker.calls.pop(int(header["call"]), None)
            if closed is not None:
                rt.worker.detach(closed)
        elif kind is Kind.STATS:
            worker.writer.write(pack(Kind.STATS, self.stats()))
        else:
            raise ValueError(f"unexpected {kind.name} from a media worker")

    # The inference thread's side -----------------------------------------------------------

    def _publish(
        self,
        worker: _Worker,
        call: int,
        generation: int,
        segment: int,
        first: int,
        images: list[U8],
    ) -> None:
        batch = self.runtime.worker.stats.batches  # counted once the batch is delivered
        number, seen = self._batch_workers
        if number != batch:
            self._batch_workers = (batch, {worker.number})
        elif worker.number not in seen:
            seen.add(worker.number)
            if len(seen) == 2:
                self.mixed_batches += 1
        if worker.closed:
            return
        try:
            slots = worker.ring.put(images, SLOT_WAIT_S)
        except SlotsExhausted:
            self.dropped_frames += len(images)
            logger.warning("media worker %d holds every frame slot; frames dropped", worker.number)
            return
        if not slots:
            return  # the worker went away meanwhile
        header = {"call": call, "generation": generation, "segment": segment, "first": first}
        self._send(worker, pack(Kind.FACES, {**header, "slots": slots}))

    def _failed(self, worker: _Worker, call: int, exc: BaseException) -> None:
        self._send(worker, pack(Kind.FAILED, {"call": call, "message": str(exc) or repr(exc)}))

    def _send(self, worker: _Worker, message: bytes) -> None:
        if self._loop is None or worker.closed:
            return

        def write() -> None:
            if not worker.closed:
                worker.writer.write(message)

        with contextlib.suppress(RuntimeError):  # the loop is gone: the process is ending
            self._loop.call_soon_threadsafe(write)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m musetalk_core.engine_server")
    p.add_argument("--socket", required=True, type=Path, help="Unix socket to listen on")
    p.add_argument("--weights-dir", required=True, type=Path)
    p.add_argument("--avatar", type=Path, help="portrait or video (unset: the built-in one)")
    p.add_argument("--cache-dir", required=True, type=Path, help="avatar material cache")
    p.add_argument("--framing", choices=FRAMINGS, default="head", help="head or full picture")
    p.add_argument("--device", default="auto", help="auto, cuda, cuda:N or cpu")
    p.add_argument("--batch", type=int, default=16, help="largest batch, over every call")
    p.add_argument("--compile", action="store_true", help="torch.compile the UNet and VAE")
    return p


async def _serve(server: EngineServer, path: Path) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    listening = await server.serve(path)
    print("ready", flush=True)
    await stop.wait()
    listening.close()


def main(argv: list[str] | None = None) -> int:
    from .loading import load_musetalk
    from .warp_avatar import builtin_portrait

    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="engine %(levelname)s %(message)s")
    loaded = load_musetalk(
        args.weights_dir,
        args.avatar if args.avatar is not None else builtin_portrait(),
        cache_dir=args.cache_dir,
        device=args.device,
        compile_models=args.compile,
        framing=args.framing,
    )
    runtime = loaded.runtime(max_batch=args.batch)
    runtime.warm_up()
    server = EngineServer(runtime)
    try:
        asyncio.run(_serve(server, args.socket))
    finally:
        runtime.close()
        server.close()
        args.socket.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
