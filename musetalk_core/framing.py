"""Framing: which part of the avatar's picture the caller sees, and at what size.

With ``head`` framing (the default) both engines' avatar preparation
(:mod:`musetalk_core.warp_avatar`, :mod:`musetalk_core.musetalk_avatar`) first cuts a square
around the face, head and shoulders, and scales it to :data:`FRAME_SIDE` pixels; the engine then
finds the face again in that picture and works there. ``full`` keeps the whole picture, as
given (scaled to at most 720 pixels by :func:`musetalk_core.warp_avatar.normalise_size`).

The rule, from the face mesh (:mod:`musetalk_core.landmarks`):

* The face (the x extent of its outline, cheek to cheek) spans :data:`FACE_FRACTION` of the
  frame's width: a third to a half, as talking-head products frame it.
* The face's centre sits at :data:`FACE_CENTRE_Y` of the frame's height, on the face's own
  vertical line: the hair above, the neck and shoulders below.
* The square never leaves the picture (no invented pixels: it slides inwards at an edge and
  shrinks to the picture's shorter side), nor zooms in more than :data:`MAX_ZOOM` times.
* The output is :data:`FRAME_SIDE` square (the built-in avatar's size before framing, so the
  encoder's work per frame is unchanged), fewer pixels only when :data:`MAX_ZOOM` would be
  exceeded; always even sides, as H.264's I420 needs.

For a video the crop moves with the head, smoothly: its size is one for the whole clip (the
median face width: a zoom that breathes with every nod is worse than none) and its centre
follows the tracked face through a Gaussian of :data:`SMOOTH_S` seconds (the clip mirrored at
its ends, where the idle loop turns round), placed with sub-pixel accuracy, so the landmarks'
frame-to-frame noise never shows as a jitter of the picture.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from .landmarks import FaceLandmarks

# The face mesh (and OpenCV) load when a picture is framed, not on import: the server's
# configuration takes FRAMINGS from here.

__all__ = [
    "FACE_CENTRE_Y",
    "FACE_FRACTION",
    "FRAME_SIDE",
    "FRAMINGS",
    "MAX_ZOOM",
    "SMOOTH_S",
    "Crop",
    "check_framing",
    "face_fraction",
    "face_width",
    "frame_pictures",
    "head_crops",
]

U8 = npt.NDArray[np.uint8]
F32 = npt.NDArray[np.float32]

FRAMINGS = ("head", "full")
"""``head``: head and shoulders, the face a third to a half of the width; ``full``: the whole
picture."""
FRAME_SIDE = 512
"""Width and height of a head-framed avatar (the built-in portrait's size before framing)."""
FACE_FRACTION = 0.42
"""The face's width over the frame's width: between a third and a half, with room either way
for the mesh's own spread."""
FACE_CENTRE_Y = 0.42
"""Height of the face's centre, as a fraction of the frame's height from the top."""
MAX_ZOOM = 3.0
"""Most pixels out per source pixel: a smaller face is framed wider rather than blurred."""
SMOOTH_S = 0.3
"""Standard deviation, in seconds, of the Gaussian the crop's centre follows the head with."""


def check_framing(framing: str) -> str:
    """``framing`` if it is one of :data:`FRAMINGS`; ValueError otherwise."""
    if framing not in FRAMINGS:
        raise ValueError(f"framing must be one of {', '.join(FRAMINGS)}, not {framing!r}")
    return framing


@dataclass(frozen=True)
class Crop:
    """A region of a source picture, ``(x, y, w, h)`` in source pixels (fractional), and the
    ``out_w`` x ``out_h`` picture it is scaled to."""

    x: float
    y: float
    w: float
    h: float
    out_w: int
    out_h: int

    @classmethod
    def whole(cls, width: int, height: int) -> Crop:
        return cls(0.0, 0.0, float(width), float(height), width, height)

    @classmethod
    def from_array(cls, values: npt.ArrayLike) -> Crop:
        x, y, w, h, out_w, out_h = (float(v) for v in np.asarray(values).ravel())
        return cls(x, y, w, h, round(out_w), round(out_h))

    def as_array(self) -> F32:
        """(6,) ``x, y, w, h, out_w, out_h``: how avatars record it (and cache it)."""
        return np.asarray(
            [self.x, self.y, self.w, self.h, self.out_w, self.out_h], dtype=np.float32
        )

    @property
    def zoom(self) -> float:
        """Framed pixels per source pixel (the same both ways: crops are square or whole)."""
        return self.out_w / self.w

    def to_frame(self, points: npt.ArrayLike) -> F32:
        """Source-picture points (..., 2) in the framed picture's pixels."""
        p = np.asarray(points, np.float64)
        scale = np.asarray([self.out_w / self.w, self.out_h / self.h])
        return np.asarray((p - [self.x, self.y]) * scale, np.float32)

    def to_source(self, points: npt.ArrayLike) -> F32:
        """Framed-picture points (..., 2) in the source picture's pixels."""
        p = np.asarray(points, np.float64)
        scale = np.asarray([self.w / self.out_w, self.h / self.out_h])
        return np.asarray(p * scale + [self.x, self.y], np.float32)

    def apply(self, image: U8) -> U8:
        """The framed picture: uint8 RGB ``(out_h, out_w, 3)``."""
        import cv2

        height, width = image.shape[:2]
        if (self.x, self.y, self.w, self.h) == (0.0, 0.0, width, height) and (
            self.out_w,
            self.out_h,
        ) == (width, height):
            return image
        sx, sy = self.out_w / self.w, self.out_h / self.h
        src = image
        ox, oy = self.x, self.y
        if sx < 1.0 or sy < 1.0:
            # Shrinking: average the whole picture down first (no aliasing), then place the
            # crop in it with sub-pixel accuracy.
            size = (max(1, round(width * sx)), max(1, round(height * sy)))
            src = np.asarray(cv2.resize(image, size, interpolation=cv2.INTER_AREA), np.uint8)
            fx, fy = size[0] / width, size[1] / height
            ox, oy = self.x * fx, self.y * fy
            sx, sy = self.out_w / (self.w * fx), self.out_h / (self.h * fy)
        # Pixel centres: output pixel i samples source (i + 0.5) / s - 0.5 + origin.
        matrix = np.asarray(
            [
                [sx, 0.0, -ox * sx + 0.5 * sx - 0.5],
                [0.0, sy, -oy * sy + 0.5 * sy - 0.5],
            ],
            np.float64,
        )
        out = cv2.warpAffine(
            src,
            matrix,
            (self.out_w, self.out_h),
            flags=cv2.INTER_CUBIC,
            borderMode=cv2.BORDER_REPLICATE,
        )
        return np.ascontiguousarray(out, dtype=np.uint8)


def face_width(points: npt.ArrayLike) -> float:
    """Width of the face: the x extent of the mesh's face outline, cheek to cheek."""
    from .landmarks import FACE_OVAL

    xs = np.asarray(points, np.float64)[list(FACE_OVAL), 0]
    return float(xs.max() - xs.min())


def face_fraction(image: U8) -> float:
    """The face's width over the picture's width, from the face mesh found in ``image``."""
    from .landmarks import find_landmarks

    marks = find_landmarks(image)
    return face_width(marks.points) / float(image.shape[1])


def head_crops(
    points: Sequence[npt.ArrayLike],
    width: int,
    height: int,
    *,
    fps: float = 25.0,
) -> list[Crop]:
    """One head-and-shoulders crop per frame of a ``width`` x ``height`` source, from each
    frame's face mesh ``(468, 2)``: one size for all, the centre smoothed over time."""
    from .landmarks import FACE_OVAL

    if not points:
        raise ValueError("no landmarks to frame")
    outline = np.stack([np.asarray(p, np.float64)[list(FACE_OVAL)] for p in points])
    lo, hi = outline.min(axis=1), outline.max(axis=1)  # (n, 2)
    widths = hi[:, 0] - lo[:, 0]
    centres = (lo + hi) / 2
    side = float(np.median(widths)) / FACE_FRACTION
    out_side = FRAME_SIDE
    side = min(side, float(width), float(height))
    if out_side > side * MAX_ZOOM:
        # A small face in a small picture: frame it wider than the rule, not blurrier.
        side = min(out_side / MAX_ZOOM, float(width), float(height))
        out_side = min(out_side, int(side * MAX_ZOOM) // 2 * 2)
    if len(points) > 1:
        centres = _smoothed(centres, sigma=SMOOTH_S * fps)
    crops = []
    for cx, cy in centres:
        x = float(np.clip(cx - side / 2, 0.0, width - side))
        y = float(np.clip(cy - side * FACE_CENTRE_Y, 0.0, height - side))
        crops.append(Crop(x, y, side, side, out_side, out_side))
    return crops


def _smoothed(values: npt.NDArray[np.float64], *, sigma: float) -> npt.NDArray[np.float64]:
    """A centred Gaussian along axis 0, the ends mirrored (a clip's first and last frames are
    where its idle loop turns round)."""
    n = len(values)
    radius = max(1, min(n - 1, round(3 * sigma)))
    taps = np.exp(-0.5 * (np.arange(-radius, radius + 1) / max(sigma, 1e-6)) ** 2)
    taps /= taps.sum()
    padded = np.concatenate([values[radius:0:-1], values, values[-2 : -radius - 2 : -1]])
    return np.stack(
        [np.convolve(padded[:, k], taps, mode="valid") for k in range(values.shape[1])], axis=1
    )


def frame_pictures(
    frames: Sequence[U8],
    framing: str,
    source: str = "the image",
    *,
    fps: float | None = 25.0,
    min_face: int = 24,
) -> tuple[list[U8], list[Crop]]:
    """``frames`` (all the same size) framed by ``framing``, and the crop of each.

    ``full`` returns them as they are. ``head`` finds the face (one picture) or tracks it (a
    video; frames without a face take the nearest frame's); where no frame shows a face the
    frames come back whole, and the engine's own preparation says why. Raises ValueError for
    an unknown ``framing``.
    """
    from .landmarks import find_landmarks, track_landmarks
    from .types import NoFaceError

    check_framing(framing)
    pictures = list(frames)
    height, width = pictures[0].shape[:2]
    whole = [Crop.whole(width, height)] * len(pictures)
    if framing == "full":
        return pictures, whole
    found: list[FaceLandmarks | None]
    if len(pictures) == 1:
        try:
            found = [find_landmarks(pictures[0], source, min_face=min_face)]
        except NoFaceError:
            return pictures, whole
    else:
        found = track_landmarks(pictures, source, min_face=min_face)
    good = [i for i, f in enumerate(found) if f is not None]
    if not good:
        return pictures, whole
    nearest = [found[min(good, key=lambda g: abs(g - i))] for i in range(len(found))]
    crops = head_crops([f.points for f in nearest if f is not None], width, height, fps=fps or 25.0)
    return [c.apply(p) for c, p in zip(crops, pictures, strict=True)], crops
