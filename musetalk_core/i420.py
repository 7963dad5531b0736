"""RGB pictures as I420 (``yuv420p``), the H.264 encoder's own pixel format.

An RGB frame handed to aiortc's H.264 encoder goes through libswscale before x264 sees it:
0.6 ms of CPU for every 512x512 frame of a talking avatar (about 1.5 % of a core per speaking
call at 25 fps, measured with ``perf``). An engine whose frames differ from one base picture in
a few known rectangles (the warp engine's mouth and eyes) converts the base once and then only
those rectangles, on its own render thread.

The conversion is the one libswscale makes by default: BT.601, limited range (Y 16-235), each
chroma sample the mean of its 2x2 block.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import cv2
import numpy as np
import numpy.typing as npt

from .boxes import Box

__all__ = [
    "I420Canvas",
    "Patch",
    "PatchCache",
    "even_corners",
    "i420_fits",
    "i420_planes",
    "rgb_to_i420",
]

U8 = npt.NDArray[np.uint8]

# BT.601 limited range, as rows acting on (R, G, B, 1).
_CHROMA = np.array(
    [
        [-37.797 / 255, -74.203 / 255, 112.0 / 255, 128.0],
        [112.0 / 255, -93.786 / 255, -18.214 / 255, 128.0],
    ],
    np.float32,
)


def rgb_to_i420(rgb: U8) -> U8:
    """An (H, W, 3) uint8 RGB picture, both sides even, as an (H * 3 // 2, W) I420 array:
    the Y plane, then U and V at half size (PyAV's ``yuv420p`` ndarray layout)."""
    h, w = rgb.shape[:2]
    if rgb.ndim != 3 or rgb.shape[2] != 3 or h % 2 or w % 2:
        raise ValueError(f"need an RGB picture with even sides, not shape {rgb.shape}")
    out = np.empty((h * 3 // 2, w), np.uint8)
    y, u, v = i420_planes(out, w, h)
    # OpenCV's I420 luma is libswscale's to within 1; its chroma takes one pixel of each 2x2
    # block, so the chroma planes come from the block means instead.
    y[...] = cv2.cvtColor(np.ascontiguousarray(rgb), cv2.COLOR_RGB2YUV_I420)[:h]
    means = cv2.resize(rgb, (w // 2, h // 2), interpolation=cv2.INTER_AREA)
    uv = cv2.transform(means, _CHROMA)
    u[...] = uv[:, :, 0]
    v[...] = uv[:, :, 1]
    return out


def i420_fits(frame_size: tuple[int, int]) -> bool:
    """Can a ``(width, height)`` picture travel as an I420 array? PyAV's ``from_ndarray``
    reads the height of a ``yuv420p`` array as ``rows // 6 * 4``, so it must be a multiple of
    4 (and the width even)."""
    width, height = frame_size
    return width % 2 == 0 and height % 4 == 0


def even_corners(box: Box, width: int, height: int) -> tuple[int, int, int, int] | None:
    """``box`` widened to even edges and cut to a ``width`` x ``height`` picture, as (x0, y0,
    x1, y1) with x1, y1 exclusive; None when nothing of it is left. Converted alone, such a
    rectangle has whole chroma blocks."""
    x0, y0 = max(0, box.x) & ~1, max(0, box.y) & ~1
    x1 = min(width, box.x + box.w + 1) & ~1
    y1 = min(height, box.y + box.h + 1) & ~1
    return None if x1 <= x0 or y1 <= y0 else (x0, y0, x1, y1)


def i420_planes(i420: U8, width: int, height: int) -> tuple[U8, U8, U8]:
    """Views of the Y, U and V planes of an I420 array of a ``width`` x ``height`` picture."""
    flat = i420.reshape(-1)
    luma = width * height
    quarter = luma // 4
    return (
        flat[:luma].reshape(height, width),
        flat[luma : luma + quarter].reshape(height // 2, width // 2),
        flat[luma + quarter : luma + 2 * quarter].reshape(height // 2, width // 2),
    )


class I420Canvas:
    """Converts pictures that differ from one ``base`` only inside given rectangles."""

    def __init__(self, base: U8) -> None:
        self.height, self.width = base.shape[:2]
        self._base = rgb_to_i420(base)
        self._base.flags.writeable = False

    @property
    def base(self) -> U8:
        """The base picture in I420 (read-only)."""
        return self._base

    def convert(self, rgb: U8, changed: Sequence[Box] | None) -> U8:
        """``rgb`` in I420, given that it equals the base outside ``changed`` (None: anywhere).

        Each rectangle is widened to even edges, so its chroma blocks are whole and the result
        is exactly :func:`rgb_to_i420` of the whole picture.
        """
        if changed is None:
            return rgb_to_i420(rgb)
        out = self._base.copy()
        for box in changed:
            patch = self.patch(rgb, box)
            if patch is not None:
                self.paste(out, patch)
        return out

    def patch(self, rgb: U8, box: Box) -> Patch | None:
        """The I420 of ``rgb`` (a whole picture) inside ``box`` widened to even edges."""
        corners = even_corners(box, self.width, self.height)
        if corners is None:
            return None
        x0, y0, x1, y1 = corners
        planes = rgb_to_i420(rgb[y0:y1, x0:x1])
        planes.flags.writeable = False
        return Patch(x0, y0, x1, y1, planes)

    def paste(self, out: U8, patch: Patch) -> None:
        """Write ``patch`` into ``out``, an I420 picture of this canvas's size."""
        x0, y0, x1, y1 = patch.x0, patch.y0, patch.x1, patch.y1
        planes = i420_planes(out, self.width, self.height)
        py, pu, pv = i420_planes(patch.planes, x1 - x0, y1 - y0)
        planes[0][y0:y1, x0:x1] = py
        planes[1][y0 // 2 : y1 // 2, x0 // 2 : x1 // 2] = pu
        planes[2][y0 // 2 : y1 // 2, x0 // 2 : x1 // 2] = pv


@dataclass(frozen=True, slots=True)
class Patch:
    """A rectangle of an I420 picture with even edges (x1, y1 exclusive), as a read-only I420
    array of its own."""

    x0: int
    y0: int
    x1: int
    y1: int
    planes: U8

    @property
    def nbytes(self) -> int:
        return int(self.planes.nbytes)


class PatchCache:
    """Converted patches by what drew them, up to ``budget_bytes``, shared between threads
    (the render threads of every call of one avatar); the oldest go first when it is full."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._patches: dict[Hashable, Patch] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: Hashable) -> Patch | None:
        with self._lock:
            patch = self._patches.get(key)
            if patch is None:
                self.misses += 1
            else:
                self.hits += 1
            return patch

    def put(self, key: Hashable, patch: Patch) -> None:
        if patch.nbytes > self.budget_bytes:
            return
        with self._lock:
            old = self._patches.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            while self._patches and self._bytes + patch.nbytes > self.budget_bytes:
                self._bytes -= self._patches.pop(next(iter(self._patches))).nbytes
            self._patches[key] = patch
            self._bytes += patch.nbytes

    @property
    def nbytes(self) -> int:
        """What the patches held now take."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._patches)
