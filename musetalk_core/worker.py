"""One inference thread per process, batching MuseTalk frames across every call.

Each call's engine is a :class:`WorkSource`. The worker asks every source how many frames it
could render now (``poll``), takes a share from each (``take``: that source's audio features
for its next frames, with the avatar latents to pair them with), runs one UNet + VAE batch over
all of them, and hands every source back exactly its own faces (``deliver``), in order. A
source never sees another's frames: requests carry their source, and faces are split by the
request sizes they were concatenated from.

Batching policy: a source at the start of an utterance gets at most ``first_batch`` frames
(the first frame is what the caller waits for); after that, the sources share ``max_batch``.
Sources are visited round-robin so a long reply cannot starve a new one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .inference import StageTimes, infer_batch
from .models import MuseTalkModels
from .os_threads import name_this_thread

__all__ = ["InferenceWorker", "RenderRequest", "WorkSource"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RenderRequest:
    """``count`` consecutive frames of one utterance of one source."""

    source: WorkSource
    token: object
    """The source's own bookkeeping (utterance, first frame index, generation)."""
    latents: torch.Tensor
    """(count, 8, 32, 32) UNet input: masked and reference latents of the avatar frames."""
    audio: torch.Tensor
    """(count, 50, 384) audio prompts."""

    @property
    def count(self) -> int:
        return int(self.latents.shape[0])


class WorkSource(Protocol):
    """A call's side of the worker. Every method runs on the worker thread."""

    def poll(self) -> tuple[int, bool]:
        """(frames renderable now, whether they start an utterance)."""
        ...

    def take(self, count: int) -> RenderRequest | None:
        """Features and latents for the next ``count`` frames (``None``: nothing after all)."""
        ...

    def deliver(self, request: RenderRequest, faces: torch.Tensor, times: StageTimes) -> None:
        """The (count, 256, 256, 3) uint8 faces rendered for ``request``."""
        ...

    def fail(self, exc: BaseException) -> None:
        """The batch holding this source's frames raised ``exc``."""
        ...


@dataclass(slots=True)
class WorkerStats:
    batches: int = 0
    frames: int = 0
    last: StageTimes = field(default_factory=StageTimes)
    batch_sizes: list[int] = field(default_factory=list)


class InferenceWorker:
    """The process's inference thread; see the module docstring."""

    def __init__(
        self,
        models: MuseTalkModels,
        *,
        max_batch: int = 16,
        first_batch: int = 2,
        on_batch: Callable[[StageTimes], None] | None = None,
    ) -> None:
        if max_batch < 1 or first_batch < 1:
            raise ValueError("batch sizes must be positive")
        self.models = models
        self.max_batch = max_batch
        self.first_batch = min(first_batch, max_batch)
        self.stats = WorkerStats()
        self._on_batch = on_batch
        self._sources: list[WorkSource] = []
        self._next = 0
        self._wake = threading.Condition()
        self._pending = False
        self._stop = False
        self._thread: threading.Thread | None = None

    def attach(self, source: WorkSource) -> None:
        with self._wake:
            self._sources.append(source)
            if self._thread is None:
                self._stop = False
                self._thread = threading.Thread(
                    target=self._run, name="musetalk-worker", daemon=True
                )
                self._thread.start()

    def detach(self, source: WorkSource) -> None:
        with self._wake:
            if source in self._sources:
                self._sources.remove(source)

    @property
    def attached(self) -> int:
        return len(self._sources)

    def notify(self) -> None:
        """Some source has new work (thread-safe, cheap)."""
        with self._wake:
            self._pending = True
            self._wake.notify()

    def close(self, timeout: float = 120.0) -> None:
        """Stop after the batch in progress (a torch call cannot be interrupted; leaving the
        thread inside one while the interpreter exits aborts the process)."""
        with self._wake:
            self._stop = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        name_this_thread("musetalk")
        while True:
            with self._wake:
                while not self._pending and not self._stop:
                    self._wake.wait()
                if self._stop:
                    return
                self._pending = False
                sources = list(self._sources)
            try:
                while self._step(sources):
                    with self._wake:
                        if self._stop:
                            return
                        sources = list(self._sources)
            except Exception:  # a bug in a source, not in a batch: keep the worker alive
                logger.exception("MuseTalk worker step failed")

    def _plan(self, sources: list[WorkSource]) -> list[tuple[WorkSource, int]]:
        wanted: list[tuple[WorkSource, int]] = []
        if not sources:
            return wanted
        start = self._next % len(sources)
        self._next += 1
        for source in sources[start:] + sources[:start]:
            try:
                count, starting = source.poll()
            except Exception as exc:
                source.fail(exc)
                continue
            if count > 0:
                wanted.append((source, min(count, self.first_batch) if starting else count))
        budget = self.max_batch
        plan = []
        for i, (source, count) in enumerate(wanted):
            share = max(1, budget // (len(wanted) - i))
            n = min(count, share, budget)
            if n > 0:
                plan.append((source, n))
                budget -= n
        return plan

    def _step(self, sources: list[WorkSource]) -> bool:
        """One batch over every source with work; False when there was none."""
        times = StageTimes()
        t0 = time.perf_counter()
        requests: list[RenderRequest] = []
        for source, count in self._plan(sources):
            try:
                request = source.take(count)
            except Exception as exc:
                source.fail(exc)
                continue
            if request is not None and request.count > 0:
                requests.append(request)
        if not requests:
            return False
        times.features_ms = (time.perf_counter() - t0) * 1000
        try:
            latents = torch.cat([r.latents for r in requests])
            audio = torch.cat([r.audio for r in requests])
            faces = infer_batch(self.models, latents, audio, times)
        except Exception as exc:  # out of memory, a bad weight: every caller in the batch
            logger.exception("MuseTalk batch of %d frames failed", sum(r.count for r in requests))
            for r in requests:
                r.source.fail(exc)
            return True
        offset = 0
        for r in requests:
            t = time.perf_counter()
            r.source.deliver(r, faces[offset : offset + r.count], times)
            times.blend_ms += (time.perf_counter() - t) * 1000
            offset += r.count
        self.stats.batches += 1
        self.stats.frames += offset
        self.stats.batch_sizes.append(offset)
        del self.stats.batch_sizes[:-1000]
        self.stats.last = times
        if self._on_batch is not None:
            self._on_batch(times)
        return True
