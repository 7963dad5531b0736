"""Test faces with hand-checked points: two shipped by packages, two generated from them.

* ``astronaut``: scikit-image's ``astronaut`` (Eileen Collins, NASA, public domain), the
  built-in avatar: smiling with teeth, a small face (about 95 px wide) near the top left.
* ``hopper``: matplotlib's sample ``grace_hopper.jpg`` (US Navy, public domain): an older face,
  glasses, thin closed lips, twice the size, centred.
* ``dark``: the astronaut re-toned to a deep brown skin, shrunk to 0.7 and moved to the lower
  right of a wider frame.
* ``tilted``: Grace Hopper turned by 12 degrees and moved up, so the mesh must follow a roll.

The points of the two pictures were read by eye from 8-10x magnified crops with a pixel grid:
mouth corners where the lips meet, the lip seam and the bottom of the lower lip on the column
half-way between the corners, the bottom of the chin. The generated faces carry the same points
through the transform that made them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import cv2
import numpy as np

from benchmarks.portraits import grace_hopper


@dataclass(frozen=True)
class Face:
    name: str
    image: np.ndarray
    points: dict[str, tuple[float, float]]
    """``mouth_left``, ``mouth_right``, ``seam`` (y at the mouth's centre column),
    ``lip_bottom`` (same column), ``chin``."""
    scale: float = 1.0
    """Of the picture the points were read on: tolerances scale with it."""


ASTRONAUT_POINTS = {
    "mouth_left": (203.0, 141.0),
    "mouth_right": (244.0, 141.0),
    # Teeth show: the seam is where the teeth end and the lower lip begins.
    "seam": (223.5, 149.0),
    "lip_bottom": (223.5, 155.0),
    "chin": (222.0, 178.0),
}
HOPPER_POINTS = {
    "mouth_left": (231.0, 281.0),
    "mouth_right": (302.0, 276.0),
    "seam": (266.5, 279.0),
    "lip_bottom": (266.5, 294.0),
    "chin": (270.0, 329.0),
}


def astronaut() -> Face:
    from musetalk_core.warp_avatar import builtin_portrait

    return Face("astronaut", builtin_portrait(), ASTRONAUT_POINTS)


@functools.cache
def _hopper_image() -> np.ndarray:
    picture = grace_hopper()
    assert picture is not None, "matplotlib's sample grace_hopper.jpg"
    return picture


def hopper() -> Face:
    return Face("hopper", _hopper_image().copy(), HOPPER_POINTS)


def _moved(points: dict[str, tuple[float, float]], m: np.ndarray) -> dict[str, tuple[float, float]]:
    out = {}
    for k, (x, y) in points.items():
        px, py = m @ np.array([x, y, 1.0])
        out[k] = (float(px), float(py))
    return out


def dark() -> Face:
    src = astronaut().image.astype(np.float32) / 255.0
    # A deep brown: darker and warmer, with the contrast of the original kept.
    toned = np.clip((src**1.6) * np.array([0.62, 0.42, 0.32]) * 255.0, 0, 255).astype(np.uint8)
    scale, ox, oy = 0.7, 330.0, 170.0
    m = np.array([[scale, 0.0, ox], [0.0, scale, oy]])
    canvas = np.full((540, 720, 3), (58, 72, 96), np.uint8)
    cv2.warpAffine(
        toned, m, (720, 540), dst=canvas, flags=cv2.INTER_AREA, borderMode=cv2.BORDER_TRANSPARENT
    )
    return Face("dark", canvas, _moved(ASTRONAUT_POINTS, m), scale)


def tilted() -> Face:
    src = _hopper_image()
    m = cv2.getRotationMatrix2D((256.0, 300.0), 12.0, 1.0)
    m[1, 2] -= 40.0
    image = cv2.warpAffine(src, m, (src.shape[1], src.shape[0]), borderMode=cv2.BORDER_REFLECT)
    return Face("tilted", np.ascontiguousarray(image), _moved(HOPPER_POINTS, m))


ALL = (astronaut, hopper, dark, tilted)


def framed(face: Face, source_crop: np.ndarray) -> Face:
    """``face`` as a prepared avatar shows it: its points carried through the avatar's framing
    (``source_crop``: :meth:`musetalk_core.framing.Crop.as_array`), tolerances with the zoom."""
    from musetalk_core.framing import Crop

    crop = Crop.from_array(source_crop)
    points = {k: tuple(float(v) for v in crop.to_frame(p)) for k, p in face.points.items()}
    return Face(face.name, face.image, points, face.scale * crop.zoom)
