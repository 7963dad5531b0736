"""MuseTalk's per-process part: the models, the prepared avatar and the inference worker.

:class:`MuseTalkRuntime` holds the models, the avatar's latents on the model's device, the one
:class:`~musetalk_core.worker.InferenceWorker` thread every call of the process feeds, and the
blend of rendered faces into the avatar frames (on the GPU where the models are). It is the
:class:`~musetalk_core.engine.RenderLink` of calls rendered in this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from .blending import blend_crop, blend_crop_torch
from .boxes import Corners
from .engine import Arrive, RenderChannel
from .features import DEFAULT_LOOKAHEAD_S, WhisperFeatures
from .models import MuseTalkModels
from .musetalk_avatar import MuseTalkAvatar
from .render_side import RenderSide, render_now
from .worker import InferenceWorker

__all__ = ["MuseTalkRuntime"]

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
