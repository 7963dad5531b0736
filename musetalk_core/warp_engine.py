"""The ``warp`` engine: a :class:`~musetalk_core.types.LipSyncEngine` over the CPU renderer.

It slices queued speech into frames (:class:`~musetalk_core.segments.SegmentQueue`), renders
each with :class:`~musetalk_core.warp.WarpRenderer` in a private worker thread and yields
(image, audio) pairs. Frame k always shows the sound of its own audio slice k: there is no
smoothing across frames, so the mouth cannot lag the voice.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import time
import weakref
from collections.abc import AsyncGenerator

import numpy as np
import numpy.typing as npt

from .i420 import PatchCache, i420_fits
from .os_threads import namer
from .segments import Piece, SegmentQueue
from .types import AudioChunk, AvatarFrame, EngineError
from .visemes import DECAY_S
from .warp import PIXEL_FORMATS, SHUT, WarpRenderer, mouth_opening, mouth_shape
from .warp_avatar import WarpAvatar

__all__ = ["WarpEngine"]

OPENNESS_STEPS = 64
"""The engine opens the mouth in steps of 1/64 (0.3 px of jaw on the built-in avatar, whose
jaw drops 19 px at most): frames then repeat mouths drawn before, whose converted pixels are
reused (:class:`~musetalk_core.i420.PatchCache`) instead of being drawn and converted again."""

MOUTH_PATCHES_BYTES = 32 << 20
"""The converted mouths kept for reuse: about 420 of the built-in avatar's (76 KB each). In eight
varied sentences of one call, 58 % of the frames after the first sentence found theirs."""

Mouth = tuple[float, float, float, float]
"""(openness, roundness, closed, tucked), as :meth:`~musetalk_core.warp.WarpRenderer.render`
takes them."""

F32 = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]


class WarpEngine:
    """CPU :class:`~musetalk_core.types.LipSyncEngine` for a prepared :class:`WarpAvatar`.

    Frames are rendered on demand in a private single-thread executor, one per pull of
    :meth:`frames`; pacing is the consumer's job. One consumer of :meth:`frames` at a time.
    Audio of a new ``segment_id`` implicitly ends the previous segment (its last partial frame
    is padded), since frames never mix two utterances.
    """

    def __init__(
        self,
        avatar: WarpAvatar,
        *,
        fps: int = 25,
        sample_rate: int = 48000,
        seed: int = 0,
        sway_px: float = 0.0,
        pixel_format: str = "rgb24",
        patches: PatchCache | None = None,
    ) -> None:
        """``pixel_format``: one of :data:`PIXEL_FORMATS`; ``yuv420p`` for an H.264 sender.
        ``patches``: the converted mouths of ``avatar`` (``yuv420p`` only), shared by its
        engines; by default each engine keeps its own."""
        if pixel_format not in PIXEL_FORMATS:
            raise ValueError(f"pixel_format is one of {PIXEL_FORMATS}, not {pixel_format!r}")
        if pixel_format == "yuv420p" and not i420_fits(avatar.frame_size):
            raise ValueError(
                f"yuv420p needs an even width and a height that is a multiple of 4, "
                f"not {avatar.frame_size}"
            )
        if fps <= 0 or sample_rate <= 0 or sample_rate % fps:
            raise ValueError(
                f"sample_rate ({sample_rate}) must be a positive multiple of fps ({fps})"
            )
        self._fps = fps
        self._sample_rate = sample_rate
        self._samples_per_frame = sample_rate // fps
        self._i420 = pixel_format == "yuv420p"
        if self._i420 and patches is None:
            patches = PatchCache(MOUTH_PATCHES_BYTES)
        self._renderer = WarpRenderer(
            avatar, seed=seed, sway_px=sway_px, patches=patches if self._i420 else None
        )
        # Made here, before the loop and the render thread share the renderer.
        self._still = self._renderer.still_i420 if self._i420 else self._renderer.still
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="warp-render", initializer=namer("warp-render")
        )
        # An engine dropped without aclose() must not leave its idle worker thread behind.
        weakref.finalize(self, self._executor.shutdown, wait=False)
        self._queue = SegmentQueue(self._samples_per_frame)
        self._generation = 0
        self._index = 0
        self._render_s = 0.005  # first guess until frames are timed: a few ms on one core
        self._closed = False
        self._last_mouth: Mouth = (0.0, 0.0, 0.0, 0.0)
        """The mouth of the last speaking frame yielded."""
        self._relax_step = 0
        """Idle frames yielded since it."""

    def _relaxing(self) -> Mouth | None:
        """The mouth of the next idle frame while it relaxes to rest after speech (ended, cut
        by :meth:`clear`, or run dry), over :data:`~musetalk_core.visemes.DECAY_S`; None at
        rest."""
        frames = max(1, round(DECAY_S * self._fps))
        step = self._relax_step + 1
        if step >= frames or not any(v > SHUT for v in self._last_mouth):
            return None
        x = step / frames
        keep = 1.0 - x * x * (3.0 - 2.0 * x)
        o, r, c, k = self._last_mouth
        return (o * keep, r, c * keep, k * keep)

    @property
    def patches(self) -> PatchCache | None:
        """The converted mouths this engine reuses (None for RGB frames), with its counts."""
        return self._renderer.patches

    @property
    def fps(self) -> int:
        return self._fps

    @property
    def sample_rate(self) -> int:
        return self._sample_rate

    @property
    def frame_size(self) -> tuple[int, int]:
        return self._renderer.frame_size

    @property
    def latency(self) -> float:
        """From speech pushed to its first frame rendered: the running render-time estimate,
        plus 5 ms for the event loop to hand it over. (The avatar at rest is not rendered at
        all, so there is rarely an idle render under way to wait for; and the audio of a slice
        is whole by then: the scheduler plays a slice only once all its samples are in.)"""
        return self._render_s + 0.005

    @property
    def queued_seconds(self) -> float:
        """Speech audio waiting to be framed."""
        return self._queue.queued_samples / self._sample_rate

    async def push_audio(self, chunk: AudioChunk, segment_id: int) -> None:
        """Queue mono int16 speech at exactly :attr:`sample_rate` for utterance ``segment_id``."""
        if self._closed:
            raise EngineError("WarpEngine is closed")
        if chunk.sample_rate != self._sample_rate:
            raise ValueError(
                f"audio at {chunk.sample_rate} Hz; this engine takes {self._sample_rate} Hz"
            )
        pcm = np.asarray(chunk.pcm)
        if pcm.dtype != np.int16 or pcm.ndim != 1:
            raise ValueError(f"audio must be mono int16, got {pcm.dtype} shape {pcm.shape}")
        if segment_id < 0:
            raise ValueError("segment_id must be >= 0; -1 marks idle frames")
        self._queue.push_chunk(AudioChunk(pcm, chunk.sample_rate, chunk.phonemes), segment_id)

    async def end_segment(self, segment_id: int) -> None:
        """No more audio for ``segment_id``: its last partial frame is padded with silence."""
        self._queue.end(segment_id)

    def clear(self) -> None:
        """Drop all queued audio; the next frame yielded is idle."""
        self._queue.clear()
        self._generation += 1

    def _render(
        self, piece: Piece | None, t: float, relax: Mouth | None
    ) -> tuple[U8, float, Mouth]:
        """One frame: the mouth from the visemes of its speech where they came with it (see
        :mod:`musetalk_core.visemes`), else from the loudness and spectrum of its audio; an
        idle frame right after speech shows ``relax``, the mouth on its way to rest."""
        start = time.perf_counter()
        closed = tucked = 0.0
        if piece is None:
            openness, roundness, closed, tucked = relax if relax is not None else (0.0,) * 4
        elif piece.timeline is not None and len(piece.timeline):
            mouth = piece.timeline.mouth(piece.time)
            loud = mouth_opening(piece.pcm)
            # The shape from the phonemes, how far it opens also from the voice's loudness:
            # a stressed vowel opens wider than the same vowel unstressed.
            roundness, closed, tucked = float(mouth[1]), float(mouth[3]), float(mouth[4])
            # A lip on the teeth holds the jaw nearly shut, however loud the sound: the square
            # root would let a tenth of an opening through as a third.
            openness = math.sqrt(float(mouth[0]) * loud) * (1.0 - 0.8 * tucked)
        else:
            openness, roundness = mouth_shape(piece.pcm, self._sample_rate)
        openness = round(openness * OPENNESS_STEPS) / OPENNESS_STEPS
        render = self._renderer.render_i420 if self._i420 else self._renderer.render
        image = render(openness, roundness, t, closed=closed, tucked=tucked)
        return image, time.perf_counter() - start, (openness, roundness, closed, tucked)

    async def frames(self) -> AsyncGenerator[AvatarFrame, None]:
        """Yield (image, 1/fps of audio) pairs forever; idle frames when nothing is queued."""
        loop = asyncio.get_running_loop()
        silence = np.zeros(self._samples_per_frame, np.int16)
        while not self._closed:
            generation = self._generation
            # Never waits for audio that may not come: a partial frame waits, the video goes on
            # with an idle frame.
            audio = self._queue.next_piece()
            t = self._index / self._fps
            relax = self._relaxing() if audio is None else None
            if audio is None and relax is None and self._renderer.is_still(0.0, t):
                # At rest: the shared still picture, no render and no thread round trip.
                image = self._still
                await asyncio.sleep(0)
            else:
                try:
                    image, elapsed, mouth = await loop.run_in_executor(
                        self._executor, self._render, audio, t, relax
                    )
                except RuntimeError:
                    return  # the executor was shut down by aclose()
                self._render_s = 0.9 * self._render_s + 0.1 * elapsed
            if self._closed:
                return
            if audio is not None and generation != self._generation:
                continue  # clear() came during the render: this speech was dropped with it
            self._index += 1
            if audio is not None:
                self._last_mouth, self._relax_step = mouth, 0
            elif relax is not None:
                self._relax_step += 1
            if audio is None:
                yield AvatarFrame(
                    image=image,
                    audio=AudioChunk(silence.copy(), self._sample_rate),
                    speaking=False,
                    segment_id=-1,
                )
            else:
                yield AvatarFrame(
                    image=image,
                    audio=AudioChunk(audio.pcm, self._sample_rate),
                    speaking=True,
                    segment_id=audio.segment_id,
                )

    async def aclose(self) -> None:
        """Stop rendering; :meth:`frames` ends at its next step."""
        self._closed = True
        self._queue.clear()
        # No cancel_futures: a cancelled render would surface in frames() as CancelledError,
        # which its consumer would take for its own cancellation. One render is a few ms.
        self._executor.shutdown(wait=False)
