"""MuseTalk 1.5's geometry from face landmarks: the face box, the 256x256 crops, the blend mask.

Upstream (``musetalk/utils/preprocessing.py``, ``blending.py``, ``face_parsing``) takes these
from DWPose's 68 face landmarks and BiSeNet face parsing. We take them from MediaPipe's face
mesh (:mod:`musetalk_core.landmarks`) by the same rules:

* **Face box.** ``x`` spans the jaw line (the 68-point scheme's outline, mesh points
  :data:`~musetalk_core.landmarks.JAW_68`); the bottom is the chin; the top mirrors the chin
  about the half-face point, the nose ridge point 29 of the 68-point scheme (mesh point 5)
  moved down by ``bbox_shift``: ``top = 2 * (nose + shift) - chin``. So the half-mask line, the
  middle of the 256x256 crop that the UNet repaints below, sits on the nose ridge, and
  ``bbox_shift`` moves it (and so how wide MuseTalk opens the mouth). v1.5 then adds
  ``extra_margin`` pixels below the chin so an opening jaw stays inside the box.
* **Blend mask.** Upstream's ``jaw`` parsing mode keeps face skin, lips and mouth, not the nose,
  grows the skin a little (its cone kernel), cuts the result to the face box, zeroes everything
  above ``upper_boundary_ratio = 0.5`` of the 1.5x crop box and blurs it with an odd kernel of
  0.1 x the crop side. Ours draws the lower face from the mesh: the face outline from cheek to
  cheek round the chin, grown by 1.2 % of the crop side (upstream's growth at its 512 px
  parsing size), less the nose outline, then the same cut, boundary and blur.
  :func:`blend_mask` without a :class:`LowerFace` gives the ellipse inscribed in the face box,
  our earlier stand-in, kept for synthetic boxes (benchmarks) and for the comparison picture in
  ``docs/musetalk-mask.png``.
* **Frame edges.** Upstream's PIL crop pads outside the picture implicitly; we clip the crop
  box (and its mask) to the frame.
"""

from __future__ import annotations

from dataclasses import dataclass

import cv2
import numpy as np
import numpy.typing as npt

from .boxes import Corners
from .landmarks import CHIN, FACE_OVAL, JAW_68, NOSE_MID, NOSE_OUTLINE, FaceLandmarks
from .types import AvatarError

__all__ = [
    "CROP_EXPAND",
    "FACE_SIZE",
    "UPPER_BOUNDARY_RATIO",
    "LowerFace",
    "blend_mask",
    "crop_box",
    "face_crop",
    "masked_crop",
    "musetalk_box",
]

U8 = npt.NDArray[np.uint8]
F32 = npt.NDArray[np.float32]

FACE_SIZE = 256
"""Side of the square face crop the VAE sees."""
CROP_EXPAND = 1.5
"""Blend crop box side over the face box's longer side (upstream ``expand``)."""
UPPER_BOUNDARY_RATIO = 0.5
"""The blend mask is zero above this fraction of the crop box height."""
_GROW = 0.012
"""Growth of the lower-face region, over the crop side."""
_NOSE_GROW = 0.01
"""Growth of the nose cut out of it, over the crop side."""

_CHEEK_TO_CHEEK = FACE_OVAL[FACE_OVAL.index(454) : FACE_OVAL.index(234) + 1]
"""The outline from the image-right cheek down round the chin to the image-left cheek."""


@dataclass(frozen=True)
class LowerFace:
    """The part of one frame's face MuseTalk may repaint, as two outlines in frame pixels."""

    outline: F32
    """(n, 2): the face outline from cheek to cheek round the chin (closed across the top)."""
    nose: F32
    """(m, 2): the nose outline, cut out of the region."""

    @classmethod
    def from_landmarks(cls, face: FaceLandmarks) -> LowerFace:
        return cls(face.xy(_CHEEK_TO_CHEEK), face.xy(NOSE_OUTLINE))


def musetalk_box(
    face: FaceLandmarks, frame_size: tuple[int, int], *, bbox_shift: int = 0, extra_margin: int = 10
) -> Corners:
    """MuseTalk's face box ``(x1, y1, x2, y2)`` from landmarks, clipped to ``frame_size``.

    Raises :class:`AvatarError` when ``bbox_shift`` moves the half-face line to the chin.
    """
    width, height = frame_size
    jaw = face.xy(JAW_68)
    chin = float(max(jaw[:, 1].max(), face.xy(CHIN)[1]))
    half = float(face.xy(NOSE_MID)[1]) + bbox_shift
    if half >= chin - 1:
        raise AvatarError(
            f"bbox_shift={bbox_shift} moves the half-face line (row {half:.0f}) to the chin "
            f"(row {chin:.0f}); use a smaller value"
        )
    top = round(2 * half - chin)
    bottom = round(chin) + extra_margin
    x1, x2 = int(np.floor(jaw[:, 0].min())), int(np.ceil(jaw[:, 0].max()))
    return Corners(max(0, x1), max(0, top), min(width, x2), min(height, bottom))


def crop_box(face: Corners, expand: float = CROP_EXPAND) -> Corners:
    """The square blend crop box around ``face`` (upstream ``get_crop_box``), not clipped."""
    x1, y1, x2, y2 = face
    xc, yc = (x1 + x2) // 2, (y1 + y2) // 2
    s = int(max(x2 - x1, y2 - y1) // 2 * expand)
    return Corners(xc - s, yc - s, xc + s, yc + s)


def _clip(box: Corners, frame_size: tuple[int, int]) -> Corners:
    width, height = frame_size
    x1, y1, x2, y2 = box
    return Corners(max(0, x1), max(0, y1), min(width, x2), min(height, y2))


def _fill(canvas: U8, polygon: F32, origin: tuple[int, int]) -> None:
    """Fill ``polygon`` (frame pixels) into ``canvas`` whose pixel (0, 0) is frame ``origin``."""
    shift = 4  # 1/16 px precision
    pts = np.round((polygon - np.array(origin, np.float32)) * 16).astype(np.int32)
    cv2.fillPoly(canvas, [pts], 255, cv2.LINE_8, shift)


def _ellipse(canvas: U8, face: Corners, origin: tuple[int, int]) -> None:
    x1, y1, x2, y2 = face
    a, b = max(x2 - x1, 1) / 2, max(y2 - y1, 1) / 2
    ex, ey = (x1 + x2) / 2 - origin[0], (y1 + y2) / 2 - origin[1]
    cols = (np.arange(canvas.shape[1], dtype=np.float32) + 0.5 - ex) / a
    rows = (np.arange(canvas.shape[0], dtype=np.float32) + 0.5 - ey) / b
    canvas[rows[:, None] ** 2 + cols[None, :] ** 2 <= 1.0] = 255


def blend_mask(
    face: Corners,
    frame_size: tuple[int, int],
    lower_face: LowerFace | None = None,
    *,
    expand: float = CROP_EXPAND,
    upper_boundary_ratio: float = UPPER_BOUNDARY_RATIO,
) -> tuple[Corners, U8]:
    """The blend crop box (clipped to the frame) and its uint8 mask (upstream
    ``get_image_prepare_material``).

    With ``lower_face`` the region is the lower face less the nose, as above; without, the
    ellipse inscribed in the face box. Either is cut to the face box. The mask is laid out on
    the unclipped crop box, so a face at the frame edge keeps the mask it would have in the
    middle, and then cut to the clipped box.
    """
    full = crop_box(face, expand)
    cx1, cy1, cx2, cy2 = full
    side_w, side_h = cx2 - cx1, cy2 - cy1
    region = np.zeros((side_h, side_w), np.uint8)
    if lower_face is None:
        _ellipse(region, face, (cx1, cy1))
    else:
        _fill(region, lower_face.outline, (cx1, cy1))
        grow = max(1, round(_GROW * side_w))
        region = np.asarray(
            cv2.dilate(region, cv2.getStructuringElement(cv2.MORPH_ELLIPSE, (2 * grow + 1,) * 2)),
            np.uint8,
        )
        nose = np.zeros_like(region)
        _fill(nose, lower_face.nose, (cx1, cy1))
        grow = max(1, round(_NOSE_GROW * side_w))
        disc = cv2.getStructuringElement(cv2.MORPH_ELLIPSE, (2 * grow + 1,) * 2)
        region[np.asarray(cv2.dilate(nose, disc)) > 0] = 0
    mask = np.zeros_like(region)
    x1, y1, x2, y2 = face
    fx1, fy1 = max(x1, cx1) - cx1, max(y1, cy1) - cy1
    fx2, fy2 = min(x2, cx2) - cx1, min(y2, cy2) - cy1
    if fx2 > fx1 and fy2 > fy1:
        mask[fy1:fy2, fx1:fx2] = region[fy1:fy2, fx1:fx2]
    # Only the talking part: nothing above upper_boundary_ratio of the crop.
    mask[: int(side_h * upper_boundary_ratio)] = 0
    kernel = int(0.1 * side_w // 2 * 2) + 1
    mask = np.asarray(cv2.GaussianBlur(mask, (kernel, kernel), 0), np.uint8)
    clipped = _clip(full, frame_size)
    kx1, ky1, kx2, ky2 = clipped
    cut = mask[ky1 - cy1 : ky2 - cy1, kx1 - cx1 : kx2 - cx1]
    return clipped, np.ascontiguousarray(cut)


def face_crop(frame: U8, face: Corners) -> U8:
    """The face box of ``frame`` resized to 256x256 with Lanczos (as upstream)."""
    x1, y1, x2, y2 = face
    region = frame[y1:y2, x1:x2]
    if region.size == 0:
        raise AvatarError(f"empty face box {face} in a {frame.shape[1]}x{frame.shape[0]} frame")
    resized = cv2.resize(region, (FACE_SIZE, FACE_SIZE), interpolation=cv2.INTER_LANCZOS4)
    return np.asarray(resized, np.uint8)


def masked_crop(crops: U8) -> U8:
    """Copy of 256x256 crops (one or a batch) with the lower half black.

    Upstream multiplies the [0, 1] image by ``get_mask_tensor`` (ones in rows ``:128``) before
    normalising, so the lower half reaches the VAE as black, which is 0 in uint8.
    """
    out = crops.copy()
    out[..., FACE_SIZE // 2 :, :, :] = 0
    return out
