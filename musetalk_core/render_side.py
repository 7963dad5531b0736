"""The inference thread's side of one call's MuseTalk rendering.

A :class:`RenderSide` is a :class:`~musetalk_core.worker.WorkSource`: it takes the call's
operations (``start``, ``audio``, ``end``, ``clear``, queued from any thread), turns the
speech into whisper features, hands the worker the next frames' features with the avatar
latents to pair them with, blends the faces the worker renders into the avatar frames and
publishes them. Where they go is the caller's choice: back to the call's event loop in this
process (:meth:`~musetalk_core.runtime.MuseTalkRuntime.open`), or into shared memory for a call
in a media worker process (:mod:`musetalk_core.engine_server`).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch

from .features import Downsampler, FeatureStream
from .inference import StageTimes, infer_batch
from .worker import RenderRequest

if TYPE_CHECKING:
    from .runtime import MuseTalkRuntime

__all__ = ["Publish", "RenderSide", "render_now"]

U8 = npt.NDArray[np.uint8]

Publish = Callable[[int, int, int, list[U8]], None]
"""``publish(generation, segment_id, first_index, images)``, called on the worker thread."""


@dataclass(slots=True)
class _Token:
    generation: int
    segment_id: int
    first: int
    cycle: list[int]


class _Segment:
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


class RenderSide:
    """One call's work for the inference worker; see the module docstring."""

    def __init__(
        self,
        runtime: MuseTalkRuntime,
        publish: Publish,
        on_fail: Callable[[BaseException], None],
    ) -> None:
        self.runtime = runtime
        self._publish = publish
        self._on_fail = on_fail
        self._ops: collections.deque[tuple[Any, ...]] = collections.deque()
        self._lock = threading.Lock()
        self._segments: collections.deque[_Segment] = collections.deque()
        self._generation = 0
        self.mark: tuple[int, int] = (-1, 0)
        """(utterance, frames presented of it), published by the call for catch-up."""
        self.last_times = StageTimes()

    def queue(self, *op: Any) -> None:
        """Add an operation (any thread): ``("start", generation, segment, cycle_base)``,
        ``("audio", generation, segment, pcm48)``, ``("end", generation, segment)`` or
        ``("clear", generation)``. The caller wakes the worker."""
        with self._lock:
            self._ops.append(op)

    # WorkSource ----------------------------------------------------------------------------

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
        token = _Token(self._generation, segment.segment_id, segment.taken, cycle)
        segment.taken += n
        latents = self.runtime.latents[torch.tensor(cycle, device=self.runtime.latents.device)]
        return RenderRequest(self, token, latents, audio)

    def deliver(self, request: RenderRequest, faces: torch.Tensor, times: StageTimes) -> None:
        token = request.token
        assert isinstance(token, _Token)
        images = self.runtime.blend(faces, token.cycle)
        self.last_times = times
        self._publish(token.generation, token.segment_id, token.first, images)

    def fail(self, exc: BaseException) -> None:
        self._on_fail(exc)

    # Internals -----------------------------------------------------------------------------

    def _apply_ops(self) -> None:
        with self._lock:
            ops = list(self._ops)
            self._ops.clear()
        for op in ops:
            kind, generation = op[0], op[1]
            if kind == "clear":
                self._segments.clear()
                self._generation = generation
                continue
            if generation != self._generation:
                continue
            segment_id = op[2]
            if kind == "start":
                self._segments.append(_Segment(segment_id, op[3], self.runtime))
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
    def _feed(segment: _Segment, pcm16k: npt.NDArray[np.float32]) -> None:
        if segment.skip:
            dropped = min(segment.skip, len(pcm16k))
            segment.skip -= dropped
            pcm16k = pcm16k[dropped:]
        if len(pcm16k):
            segment.stream.push(pcm16k)

    def _current(self) -> _Segment | None:
        while self._segments:
            segment = self._segments[0]
            if segment.ended and segment.stream.computable() == 0:
                self._segments.popleft()
                continue
            return segment
        return None

    def _catch_up(self, segment: _Segment) -> None:
        """Behind the presentation (slower than real time)? Skip to frames still in the future.

        Frames already presented without their face are not rendered any more, nor the ones
        that will be presented before this batch can be done. Features of the skipped frames
        are computed and dropped (the encoder costs the same for any count); their UNet and
        VAE work is saved.
        """
        segment_id, presented = self.mark
        if segment_id != segment.segment_id or presented <= segment.taken:
            return
        fps = self.runtime.fps
        ahead = min(fps, 1 + int(self.runtime.batch_ms / 1000 * fps))
        skip = min(presented + ahead - segment.taken, segment.stream.computable())
        if skip > 0:
            segment.stream.take(skip)
            segment.taken += skip


def render_now(runtime: MuseTalkRuntime, pcm48: npt.NDArray[np.int16]) -> list[U8]:
    """Render one utterance synchronously on this thread (warm-up and benchmarks)."""
    frames: list[U8] = []

    def keep(_generation: int, _segment: int, _first: int, images: list[U8]) -> None:
        frames.extend(images)

    def raise_it(exc: BaseException) -> None:
        raise exc

    side = RenderSide(runtime, keep, raise_it)
    side.queue("start", 0, 0, 0)
    side.queue("audio", 0, 0, pcm48.astype(np.int16))
    side.queue("end", 0, 0)
    while True:
        count, _ = side.poll()
        if count == 0:
            break
        request = side.take(count)
        if request is None:
            break
        faces = infer_batch(runtime.models, request.latents, request.audio)
        side.deliver(request, faces, StageTimes())
    return frames
