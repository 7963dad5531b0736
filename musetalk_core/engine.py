"""The ``musetalk`` lip-sync engine: MuseTalk 1.5 behind the same interface as ``warp``.

:class:`MuseTalkEngine` is the per-call part, a :class:`~musetalk_core.types.LipSyncEngine`,
and needs no torch: it renders through a :class:`RenderLink`, the process's
:class:`~musetalk_core.runtime.MuseTalkRuntime` (the models, the prepared avatar, the one
:class:`~musetalk_core.worker.InferenceWorker` thread) or an engine process's client.

Threads. The event loop only queues work: ``push_audio``/``end_segment``/``clear`` send
operations down the call's :class:`RenderChannel` and wake the worker. The worker thread owns
everything heavy (:class:`~musetalk_core.render_side.RenderSide`): resampling to 16 kHz, the
streaming whisper features, the UNet batch, the VAE decode and the blend into the full frame;
finished frames come back to the loop with ``call_soon_threadsafe``, or, from the engine
process, through shared memory (:mod:`musetalk_core.engine_server`).

Pacing. ``frames()`` yields idle frames (the avatar's loop)
until the first frame of an utterance is rendered, so the reply's audio never starts ahead of
its video; the first batch is small (``first_batch``) for that reason. After that each speaking
frame waits at most ``frame_wait`` for its face; a face still missing then (an engine slower
than real time, e.g. on CPU) is replaced by the idle image of that instant, with the audio
played as usual: the voice never stalls or tears, the video degrades.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from .segments import SegmentQueue
from .types import AudioChunk, AvatarFrame, EngineError

__all__ = ["Arrive", "MuseTalkEngine", "RenderChannel", "RenderLink"]

logger = logging.getLogger(__name__)

U8 = npt.NDArray[np.uint8]


Arrive = Callable[[int, int, int, list[U8]], None]
"""``arrive(generation, segment_id, first_index, images)``: rendered frames, on the loop."""


class RenderChannel(Protocol):
    """One call's line to its renderer: operations in (as :meth:`RenderSide.queue` takes
    them), the presentation mark for catch-up, and a close."""

    def send(self, *op: Any) -> None: ...

    def mark(self, segment_id: int, presented: int) -> None: ...

    def close(self) -> None: ...


class RenderLink(Protocol):
    """Where calls' MuseTalk frames are rendered: what a :class:`MuseTalkEngine` needs."""

    @property
    def fps(self) -> int: ...

    @property
    def sample_rate(self) -> int: ...

    @property
    def frame_size(self) -> tuple[int, int]: ...

    @property
    def latency(self) -> float: ...

    @property
    def idle_frames(self) -> Sequence[U8]: ...

    def open(self, arrive: Arrive, failed: Callable[[BaseException], None]) -> RenderChannel: ...


class MuseTalkEngine:
    """One call's MuseTalk engine; see the module docstring.

    ``link`` is where its frames are rendered: a ``MuseTalkRuntime`` in this process, or
    an :class:`~musetalk_core.engine_client.EngineClient` connected to the engine process that
    batches the calls of every media worker on one GPU.
    """

    def __init__(
        self, link: RenderLink, *, frame_wait: float | None = None, start_wait: float = 5.0
    ) -> None:
        self.link = link
        self._fps = link.fps
        self._rate = link.sample_rate
        self._frame_samples = self._rate // self._fps
        self.frame_wait = 1.0 / self._fps if frame_wait is None else frame_wait
        """How long a speaking frame waits for its face before the idle image stands in."""
        self.start_wait = start_wait
        """How long an utterance's first frame may hold the reply back before audio goes first."""
        self._generation = 0
        self._speech = SegmentQueue(self._frame_samples)
        """Loop-side copy of the speech, cut into frame slices as the frames go out."""
        self._pushing: int | None = None
        """The segment audio was last pushed for."""
        self._faces: dict[tuple[int, int], U8] = {}
        self._arrived = asyncio.Event()
        self._failure: BaseException | None = None
        self._channel: RenderChannel | None = None
        self._cycle_pos = 0
        self._closed = False
        self.degraded_frames = 0
        """Speaking frames shown with the idle image because their face came too late."""
        self.rendered_frames = 0

    # LipSyncEngine -------------------------------------------------------------------------

    @property
    def fps(self) -> int:
        return self._fps

    @property
    def sample_rate(self) -> int:
        return self._rate

    @property
    def frame_size(self) -> tuple[int, int]:
        return self.link.frame_size

    @property
    def latency(self) -> float:
        return self.link.latency

    def _line(self) -> RenderChannel:
        if self._channel is None:
            self._channel = self.link.open(self._arrive, self._failed)
        return self._channel

    async def push_audio(self, chunk: AudioChunk, segment_id: int) -> None:
        if chunk.sample_rate != self._rate:
            raise ValueError(f"MuseTalkEngine takes {self._rate} Hz audio, got {chunk.sample_rate}")
        line = self._line()
        pcm = np.ascontiguousarray(chunk.pcm, dtype=np.int16)
        if self._pushing != segment_id:
            self._pushing = segment_id
            # The utterance starts after the idle frames already handed out (about 3 ahead).
            line.send("start", self._generation, segment_id, self._cycle_pos + 3)
        self._speech.push(pcm, segment_id)
        line.send("audio", self._generation, segment_id, pcm)

    async def end_segment(self, segment_id: int) -> None:
        self._speech.end(segment_id)
        self._line().send("end", self._generation, segment_id)

    def clear(self) -> None:
        self._generation += 1
        self._speech.clear()
        self._pushing = None
        self._faces.clear()
        if self._channel is not None:
            self._channel.send("clear", self._generation)

    async def frames(self) -> AsyncGenerator[AvatarFrame, None]:
        self._line()
        idle_audio = AudioChunk(np.zeros(self._frame_samples, np.int16), self._rate)
        waited_since: float | None = None
        while not self._closed:
            if self._failure is not None:
                raise EngineError(f"MuseTalk inference failed: {self._failure}") from self._failure
            key = self._speech.peek()
            if key is None:
                waited_since = None
                yield self._idle(idle_audio)
                await asyncio.sleep(0)
                continue
            if key[1] == 0 and key not in self._faces:
                # Rule 3: the reply starts with its video; idle frames until the first face.
                now = time.monotonic()
                waited_since = now if waited_since is None else waited_since
                if now - waited_since < self.start_wait:
                    yield self._idle(idle_audio)
                    await self._wait_face(key, self.frame_wait)
                    continue
            elif key not in self._faces:
                await self._wait_face(key, self.frame_wait)
            waited_since = None
            if self._speech.peek() != key:
                continue  # cleared while waiting
            piece = self._speech.next_piece()
            assert piece is not None
            face = self._faces.pop(key, None)
            for old in [k for k in self._faces if k < key]:
                del self._faces[old]  # frames of pieces gone by (shown degraded, or cleared)
            audio = AudioChunk(piece.pcm, self._rate)
            if self._channel is not None:
                self._channel.mark(piece.segment_id, piece.index + 1)
            if face is None:
                self.degraded_frames += 1
                image = self._idle_image()
            else:
                image = face
            self._cycle_pos += 1
            yield AvatarFrame(image, audio, True, piece.segment_id)

    async def aclose(self) -> None:
        self._closed = True
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        self._speech.clear()
        self._faces.clear()

    # Loop-side helpers ---------------------------------------------------------------------

    def _idle_image(self) -> U8:
        frames = self.link.idle_frames
        return frames[self._cycle_pos % len(frames)]

    def _idle(self, silence: AudioChunk) -> AvatarFrame:
        image = self._idle_image()
        self._cycle_pos += 1
        return AvatarFrame(image, silence, False, -1)

    async def _wait_face(self, key: tuple[int, int], within: float) -> None:
        if key in self._faces:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within):
                while key not in self._faces and self._failure is None:
                    self._arrived.clear()
                    await self._arrived.wait()

    def _arrive(self, generation: int, segment_id: int, first: int, images: list[U8]) -> None:
        if generation != self._generation or self._closed:
            return
        emitted = self._speech.taken(segment_id)
        if emitted is None:
            return
        for i, image in enumerate(images):
            if first + i >= emitted:  # a frame already shown degraded is not kept
                self._faces[(segment_id, first + i)] = image
        self.rendered_frames += len(images)
        self._arrived.set()

    def _failed(self, exc: BaseException) -> None:
        self._failure = exc
        self._arrived.set()
