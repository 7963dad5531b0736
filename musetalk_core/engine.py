"""The ``musetalk`` lip-sync engine: MuseTalk 1.5 behind the same interface as ``warp``.

:class:`MuseTalkRuntime` is the per-process part: the models, the prepared avatar (latents on
the model's device) and the one :class:`~musetalk_core.worker.InferenceWorker` thread.
:class:`MuseTalkEngine` is the per-call part, a :class:`~musetalk_core.types.LipSyncEngine`.

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
import torch

from .blending import blend_crop, blend_crop_torch
from .boxes import Corners
from .features import DEFAULT_LOOKAHEAD_S, WhisperFeatures
from .models import MuseTalkModels
from .musetalk_avatar import MuseTalkAvatar
from .render_side import RenderSide, render_now
from .segments import SegmentQueue
from .types import AudioChunk, AvatarFrame, EngineError
from .worker import InferenceWorker

__all__ = ["MuseTalkEngine", "MuseTalkRuntime", "RenderChannel", "RenderLink"]

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


class MuseTalkRuntime:
    """Models, avatar and worker, shared by every call of the process."""

    def __init__(
        self,
        models: MuseTalkModels,
        avatar: MuseTalkAvatar,
        *,
        fps: int = 25,
        sample_rate: int = 48_000,
        max_batch: int = 16,
        first_batch: int = 2,
        lookahead_s: float = DEFAULT_LOOKAHEAD_S,
    ) -> None:
        self.models = models
        self.avatar = avatar
        self.fps = fps
        self.sample_rate = sample_rate
        self.lookahead_s = lookahead_s
        place = models.placement
        self.latents = torch.from_numpy(np.ascontiguousarray(avatar.latents)).to(
            device=place.device, dtype=place.dtype
        )
        self.features = WhisperFeatures(
            models.whisper_encoder, models.feature_extractor, device=place.device, dtype=place.dtype
        )
        self.worker = InferenceWorker(models, max_batch=max_batch, first_batch=first_batch)
        self.batch_ms = 0.0
        """Measured wall time of a first-size batch (features, UNet, VAE, blend)."""
        self._device_frames: torch.Tensor | None = None
        self._device_masks: list[torch.Tensor] = []
        if place.device.type == "cuda":
            # Blend on the GPU: the avatar's frames and masks live there once, and decoded
            # faces never go back to the CPU before they are pasted.
            self._device_frames = torch.from_numpy(np.stack(avatar.frames)).to(place.device)
            self._device_masks = [torch.from_numpy(m).to(place.device) for m in avatar.masks]

    def blend(self, faces: torch.Tensor, cycle: list[int]) -> list[U8]:
        """Paste decoded (B, 256, 256, 3) faces into the avatar frames at ``cycle`` indices."""
        av = self.avatar
        boxes = [Corners(*(int(v) for v in av.face_boxes[i])) for i in cycle]
        crops = [Corners(*(int(v) for v in av.crop_boxes[i])) for i in cycle]
        if self._device_frames is not None and faces.device.type == "cuda":
            index = torch.tensor(cycle, device=faces.device)
            out = blend_crop_torch(
                self._device_frames[index],
                faces,
                boxes,
                crops,
                [self._device_masks[i] for i in cycle],
            )
            return list(out.cpu().numpy())
        host = faces.cpu().numpy()
        return [
            blend_crop(av.frames[i], face, box, crop, av.masks[i])
            for face, i, box, crop in zip(host, cycle, boxes, crops, strict=True)
        ]

    @property
    def frame_size(self) -> tuple[int, int]:
        h, w = self.avatar.frames[0].shape[:2]
        return w, h

    @property
    def cycle(self) -> int:
        return len(self.avatar.frames)

    @property
    def idle_frames(self) -> Sequence[U8]:
        return self.avatar.frames

    @property
    def latency(self) -> float:
        # Frame f needs audio to 40 f + 120 ms (two frames of right context) plus look-ahead,
        # then a first-size batch.
        return 0.12 + self.lookahead_s + self.batch_ms / 1000

    def open(self, arrive: Arrive, failed: Callable[[BaseException], None]) -> RenderChannel:
        """A call's line to this process's worker; ``arrive``/``failed`` run on the caller's
        event loop."""
        loop = asyncio.get_running_loop()

        def publish(generation: int, segment_id: int, first: int, images: list[U8]) -> None:
            with contextlib.suppress(RuntimeError):  # the call's loop is gone: nobody waits
                loop.call_soon_threadsafe(arrive, generation, segment_id, first, images)

        def on_fail(exc: BaseException) -> None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(failed, exc)

        return _LocalChannel(RenderSide(self, publish, on_fail), self.worker)

    def render_now(self, pcm48: npt.NDArray[np.int16]) -> list[U8]:
        """Render one utterance synchronously on this thread (warm-up and benchmarks)."""
        return render_now(self, pcm48)

    def warm_up(self) -> float:
        """Render a first-size batch twice (the first run pays one-off costs); the second
        run's wall ms is kept as ``batch_ms`` and returned."""
        silence = np.zeros(self.worker.first_batch * self.sample_rate // self.fps, np.int16)
        for _ in range(2):
            t0 = time.perf_counter()
            self.render_now(silence)
            self.batch_ms = (time.perf_counter() - t0) * 1000
        return self.batch_ms

    def close(self) -> None:
        self.worker.close()


class _LocalChannel:
    """A call's :class:`RenderChannel` to the worker thread of this process."""

    def __init__(self, side: RenderSide, worker: InferenceWorker) -> None:
        self._side = side
        self._worker = worker
        worker.attach(side)

    def send(self, *op: Any) -> None:
        self._side.queue(*op)
        self._worker.notify()

    def mark(self, segment_id: int, presented: int) -> None:
        self._side.mark = (segment_id, presented)

    def close(self) -> None:
        self._worker.detach(self._side)


class MuseTalkEngine:
    """One call's MuseTalk engine; see the module docstring.

    ``link`` is where its frames are rendered: a :class:`MuseTalkRuntime` in this process, or
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
