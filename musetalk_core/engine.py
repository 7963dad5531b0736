"""The ``musetalk`` lip-sync engine: MuseTalk 1.5 behind the same interface as ``warp``.

:class:`MuseTalkRuntime` is the per-process part: the models, the prepared avatar (latents on
the model's device) and the one :class:`~musetalk_core.worker.InferenceWorker` thread.
:class:`MuseTalkEngine` is the per-call part, a :class:`~musetalk_core.types.LipSyncEngine`.

Threads. The event loop only queues work: ``push_audio``/``end_segment``/``clear`` append
operations to a thread-safe queue and wake the worker. The worker thread owns everything
heavy: resampling to 16 kHz, the streaming whisper features, the UNet batch, the VAE decode and
the blend into the full frame; finished frames come back to the loop with
``call_soon_threadsafe``.

Pacing. ``frames()`` yields idle frames (the avatar's loop)
until the first frame of an utterance is rendered, so the reply's audio never starts ahead of
its video; the first batch is small (``first_batch``) for that reason. After that each speaking
frame waits at most ``frame_wait`` for its face; a face still missing then (an engine slower
than real time, e.g. on CPU) is replaced by the idle image of that instant, with the audio
played as usual: the voice never stalls or tears, the video degrades.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from .blending import blend_crop, blend_crop_torch
from .boxes import Corners
from .features import DEFAULT_LOOKAHEAD_S, Downsampler, FeatureStream, WhisperFeatures
from .inference import StageTimes, infer_batch
from .models import MuseTalkModels
from .musetalk_avatar import MuseTalkAvatar
from .segments import SegmentQueue
from .types import AudioChunk, AvatarFrame, EngineError
from .worker import InferenceWorker, RenderRequest

__all__ = ["MuseTalkEngine", "MuseTalkRuntime"]

logger = logging.getLogger(__name__)

U8 = npt.NDArray[np.uint8]


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

    def warm_up(self) -> float:
        """Render a first-size batch twice (the first run pays one-off costs); the second
        run's wall ms is kept as ``batch_ms`` and returned."""
        silence = np.zeros(self.worker.first_batch * self.sample_rate // self.fps, np.int16)
        for _ in range(2):
            t0 = time.perf_counter()
            MuseTalkEngine(self).render_now(silence)
            self.batch_ms = (time.perf_counter() - t0) * 1000
        return self.batch_ms

    def close(self) -> None:
        self.worker.close()


@dataclass(slots=True)
class _Token:
    generation: int
    segment_id: int
    first: int
    cycle: list[int]


class _WorkerSegment:
    """Worker-thread state of one utterance."""

    def __init__(self, segment_id: int, cycle_base: int, runtime: MuseTalkRuntime) -> None:
        self.segment_id = segment_id
        self.cycle_base = cycle_base
        self.resampler = Downsampler()
        self.skip = self.resampler.delay_samples
        """Leading 16 kHz samples still to drop: the filter's delay, so features stay aligned."""
        self.stream = FeatureStream(runtime.features, lookahead_s=runtime.lookahead_s)
        self.taken = 0
        self.ended = False


class MuseTalkEngine:
    """One call's MuseTalk engine; see the module docstring."""

    def __init__(
        self, runtime: MuseTalkRuntime, *, frame_wait: float | None = None, start_wait: float = 5.0
    ) -> None:
        self.runtime = runtime
        self._fps = runtime.fps
        self._rate = runtime.sample_rate
        self._frame_samples = self._rate // self._fps
        self.frame_wait = 1.0 / self._fps if frame_wait is None else frame_wait
        """How long a speaking frame waits for its face before the idle image stands in."""
        self.start_wait = start_wait
        """How long an utterance's first frame may hold the reply back before audio goes first."""
        self._ops: collections.deque[tuple[Any, ...]] = collections.deque()
        self._ops_lock = threading.Lock()
        self._generation = 0
        self._segments: collections.deque[_WorkerSegment] = collections.deque()
        self._speech = SegmentQueue(self._frame_samples)
        """Loop-side copy of the speech, cut into frame slices as the frames go out."""
        self._pushing: int | None = None
        """The segment audio was last pushed for."""
        self._faces: dict[tuple[int, int], U8] = {}
        self._arrived = asyncio.Event()
        self._failure: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cycle_pos = 0
        self._closed = False
        self.degraded_frames = 0
        """Speaking frames shown with the idle image because their face came too late."""
        self.rendered_frames = 0
        self.last_times = StageTimes()
        self._attached = False
        self._worker_generation = 0
        self._sink: list[U8] | None = None
        self._mark: tuple[int, int] = (-1, 0)
        """(utterance, frames presented of it), published by the loop for the worker."""

    # LipSyncEngine -------------------------------------------------------------------------

    @property
    def fps(self) -> int:
        return self._fps

    @property
    def sample_rate(self) -> int:
        return self._rate

    @property
    def frame_size(self) -> tuple[int, int]:
        return self.runtime.frame_size

    @property
    def latency(self) -> float:
        # Frame f needs audio to 40 f + 120 ms (two frames of right context) plus look-ahead,
        # then a first-size batch.
        return 0.12 + self.runtime.lookahead_s + self.runtime.batch_ms / 1000

    def _attach(self) -> None:
        if not self._attached:
            self._loop = asyncio.get_running_loop()
            self.runtime.worker.attach(self)
            self._attached = True

    def _queue(self, *op: Any) -> None:
        with self._ops_lock:
            self._ops.append(op)
        self.runtime.worker.notify()

    async def push_audio(self, chunk: AudioChunk, segment_id: int) -> None:
        if chunk.sample_rate != self._rate:
            raise ValueError(f"MuseTalkEngine takes {self._rate} Hz audio, got {chunk.sample_rate}")
        self._attach()
        pcm = np.ascontiguousarray(chunk.pcm, dtype=np.int16)
        if self._pushing != segment_id:
            self._pushing = segment_id
            # The utterance starts after the idle frames already handed out (about 3 ahead).
            self._queue("start", self._generation, segment_id, self._cycle_pos + 3)
        self._speech.push(pcm, segment_id)
        self._queue("audio", self._generation, segment_id, pcm)

    async def end_segment(self, segment_id: int) -> None:
        self._speech.end(segment_id)
        self._queue("end", self._generation, segment_id)

    def clear(self) -> None:
        self._generation += 1
        self._speech.clear()
        self._pushing = None
        self._faces.clear()
        self._queue("clear", self._generation)

    def render_now(self, pcm48: npt.NDArray[np.int16]) -> list[U8]:
        """Render one utterance synchronously on this thread (warm-up and benchmarks)."""
        g = self._generation
        self._ops.extend(
            [("start", g, 0, 0), ("audio", g, 0, pcm48.astype(np.int16)), ("end", g, 0)]
        )
        frames: list[U8] = []
        self._sink = frames
        while True:
            count, _ = self.poll()
            if count == 0:
                break
            request = self.take(count)
            if request is None:
                break
            faces = infer_batch(self.runtime.models, request.latents, request.audio)
            self.deliver(request, faces, StageTimes())
        self._sink = None
        return frames

    async def frames(self) -> AsyncGenerator[AvatarFrame, None]:
        self._attach()
        idle_audio = AudioChunk(np.zeros(self._frame_samples, np.int16), self._rate)
        waited_since: float | None = None
        while not self._closed:
            if self._failure is not None:
                raise EngineError("MuseTalk inference failed") from self._failure
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
            self._mark = (piece.segment_id, piece.index + 1)
            if face is None:
                self.degraded_frames += 1
                image = self._idle_image()
            else:
                image = face
            self._cycle_pos += 1
            yield AvatarFrame(image, audio, True, piece.segment_id)

    async def aclose(self) -> None:
        self._closed = True
        if self._attached:
            self.runtime.worker.detach(self)
            self._attached = False
        self._speech.clear()
        self._faces.clear()

    # Loop-side helpers ---------------------------------------------------------------------

    def _idle_image(self) -> U8:
        frames = self.runtime.avatar.frames
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

    # WorkSource (worker thread) ------------------------------------------------------------

    def _apply_ops(self) -> None:
        with self._ops_lock:
            ops = list(self._ops)
            self._ops.clear()
        for op in ops:
            kind, generation = op[0], op[1]
            if kind == "clear":
                self._segments.clear()
                self._worker_generation = generation
                continue
            if generation != self._worker_generation:
                continue
            segment_id = op[2]
            if kind == "start":
                self._segments.append(_WorkerSegment(segment_id, op[3], self.runtime))
                continue
            segment = next((s for s in self._segments if s.segment_id == segment_id), None)
            if segment is None or segment.ended:
                continue
            if kind == "audio":
                self._feed(segment, segment.resampler.process(op[3]))
            elif kind == "end":
                # Push the filter's delay of zeros through, so the last samples come out.
                tail = np.zeros(3 * segment.resampler.delay_samples + 2, np.int16)
                self._feed(segment, segment.resampler.process(tail))
                segment.stream.end()
                segment.ended = True

    @staticmethod
    def _feed(segment: _WorkerSegment, pcm16k: npt.NDArray[np.float32]) -> None:
        if segment.skip:
            dropped = min(segment.skip, len(pcm16k))
            segment.skip -= dropped
            pcm16k = pcm16k[dropped:]
        if len(pcm16k):
            segment.stream.push(pcm16k)

    def _current(self) -> _WorkerSegment | None:
        while self._segments:
            segment = self._segments[0]
            if segment.ended and segment.stream.computable() == 0:
                self._segments.popleft()
                continue
            return segment
        return None

    def poll(self) -> tuple[int, bool]:
        self._apply_ops()
        segment = self._current()
        if segment is None:
            return 0, False
        return segment.stream.computable(), segment.taken == 0

    def take(self, count: int) -> RenderRequest | None:
        segment = self._current()
        if segment is None:
            return None
        self._catch_up(segment)
        audio = segment.stream.take(count)
        n = int(audio.shape[0])
        if n == 0:
            return None
        cycle = [(segment.cycle_base + segment.taken + i) % self.runtime.cycle for i in range(n)]
        token = _Token(self._worker_generation, segment.segment_id, segment.taken, cycle)
        segment.taken += n
        latents = self.runtime.latents[torch.tensor(cycle, device=self.runtime.latents.device)]
        return RenderRequest(self, token, latents, audio)

    def _catch_up(self, segment: _WorkerSegment) -> None:
        """Behind the presentation (slower than real time)? Skip to frames still in the future.

        Frames already presented without their face are not rendered any more, nor the ones
        that will be presented before this batch can be done. Features of the skipped frames
        are computed and dropped (the encoder costs the same for any count); their UNet and
        VAE work is saved.
        """
        segment_id, presented = self._mark
        if segment_id != segment.segment_id or presented <= segment.taken:
            return
        ahead = min(self._fps, 1 + int(self.runtime.batch_ms / 1000 * self._fps))
        skip = min(presented + ahead - segment.taken, segment.stream.computable())
        if skip > 0:
            segment.stream.take(skip)
            segment.taken += skip

    def deliver(self, request: RenderRequest, faces: torch.Tensor, times: StageTimes) -> None:
        token = request.token
        assert isinstance(token, _Token)
        images = self.runtime.blend(faces, token.cycle)
        self.last_times = times
        sink = getattr(self, "_sink", None)
        if sink is not None:
            sink.extend(images)
        elif self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the call's loop is gone: nobody waits
                self._loop.call_soon_threadsafe(
                    self._arrive, token.generation, token.segment_id, token.first, images
                )

    def fail(self, exc: BaseException) -> None:
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._failed, exc)
