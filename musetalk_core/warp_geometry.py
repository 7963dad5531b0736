"""The warp engine's geometry, from the face mesh: where the lips part, how the jaw moves, the
eyelids, and the colours the renderer paints with.

Everything here runs once per picture (:func:`musetalk_core.warp_avatar.prepare_avatar`) and
returns arrays in the coordinates of small crops that :mod:`musetalk_core.warp` combines per
frame. The proportions the renderer was tuned in are those of a square face box as wide as the
face at the cheeks (mesh points 234 and 454), its bottom ``1.15`` box heights below the top at
the chin; :func:`face_box` builds that box from the mesh.

* **Lips.** The corners are the mesh's outer lip corners (61, 291). The seam, where the lips
  part, follows the inner lip contours column by column: the top of the lower lip when the
  picture's mouth is open (so teeth that show stay with the upper jaw), the middle of the two
  inner contours when the lips are closed. Beyond the corners it is flat.
* **Jaw.** Below the seam each pixel follows the jaw drop fully for the upper 45 % of the way
  to the jaw line of its own column (the face outline round the chin), then less and less, to
  nothing 0.1 face heights below the jaw line: the chin moves with the lower lip and the neck
  stretches. The region the mouth animation writes to is the lower face (face outline from
  cheek to cheek round the chin, and that band below it), below the nose, feathered.
* **Eyelids.** Each eye's upper and lower lid contours (16 mesh points); a blink brings the
  upper lid down to the lower one: the picture's own lid, lashes and crease slide down, drawn
  inside the eye opening only.
"""

from __future__ import annotations

from typing import Any

import cv2
import numpy as np
import numpy.typing as npt

from .boxes import Box
from .landmarks import (
    EYE_LOWER,
    EYE_UPPER,
    FACE_OVAL,
    LIPS_INNER_LOWER,
    LIPS_INNER_UPPER,
    LIPS_OUTER_LOWER,
    LIPS_OUTER_UPPER,
    MOUTH_CORNERS,
    NOSE_OUTLINE,
    FaceLandmarks,
)

__all__ = ["eye_geometry", "face_box", "mouth_box", "mouth_geometry", "skin_colour"]

F32 = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]

_CHIN = 1.15
"""Chin row below the top of the face box, in face box heights."""
_SUBNASALE = 2
"""Mesh point under the tip of the nose, where the upper lip begins."""
_CHEEKS = (50, 280)
_LOWER_OUTLINE = FACE_OVAL[FACE_OVAL.index(454) : FACE_OVAL.index(234) + 1]


def _clip_box(box: tuple[float, float, float, float], width: int, height: int) -> Box:
    x0 = max(0, round(box[0]))
    y0 = max(0, round(box[1]))
    x1 = min(width, round(box[0] + box[2]))
    y1 = min(height, round(box[1] + box[3]))
    return Box(x0, y0, max(1, x1 - x0), max(1, y1 - y0))


def face_box(face: FaceLandmarks, width: int, height: int) -> Box:
    """The square face box the renderer's proportions are in (see the module docstring)."""
    left, right = face.xy(234), face.xy(454)
    side = float(np.hypot(*(right - left)))
    chin = float(face.xy(152)[1])
    cx = float((left[0] + right[0]) / 2)
    return _clip_box((cx - side / 2, chin - _CHIN * side, side, side), width, height)


def mouth_box(face: FaceLandmarks, width: int, height: int) -> Box:
    """The lips' bounding box, a little larger."""
    pts = face.xy(LIPS_OUTER_UPPER + LIPS_OUTER_LOWER)
    lo, hi = pts.min(axis=0), pts.max(axis=0)
    pad = 0.1 * (hi - lo)
    return _clip_box((*(lo - pad), *(hi - lo + 2 * pad)), width, height)


def _region(img: U8, box: tuple[float, float, float, float]) -> F32:
    h, w = img.shape[:2]
    x0, y0, bw, bh = _clip_box(box, w, h)
    return img[y0 : y0 + bh, x0 : x0 + bw].reshape(-1, 3).astype(np.float32)


def skin_colour(img: U8, face: FaceLandmarks, fw: int) -> F32:
    """Median colour of the two cheeks."""
    s = 0.12 * fw
    cheeks = np.concatenate(
        [_region(img, (x - s / 2, y - s / 2, s, s)) for x, y in face.xy(_CHEEKS)]
    )
    return np.asarray(np.median(cheeks, axis=0), np.float32)


def _luma(pixels: F32) -> F32:
    weights = np.array([0.299, 0.587, 0.114], np.float32)
    return (pixels @ weights).astype(np.float32)


def _extreme_mean(pixels: F32, fraction: float, *, darkest: bool) -> F32:
    """Mean colour of the darkest (or brightest) ``fraction`` of ``pixels``."""
    order = np.argsort(_luma(pixels))
    n = max(1, int(len(order) * fraction))
    pick = order[:n] if darkest else order[-n:]
    return np.asarray(pixels[pick].mean(axis=0), np.float32)


def _smoothstep(v: F32) -> F32:
    v = np.clip(v, 0.0, 1.0)
    return (v * v * (3.0 - 2.0 * v)).astype(np.float32)


def _curve(points: F32, cols: F32) -> F32:
    """``points`` (n, 2) as a function of x, sampled at ``cols``; flat beyond its ends."""
    order = np.argsort(points[:, 0], kind="stable")
    return np.asarray(np.interp(cols, points[order, 0], points[order, 1]), np.float32)


def _fill(shape: tuple[int, int], polygons: list[F32], origin: tuple[float, float]) -> F32:
    canvas = np.zeros(shape, np.uint8)
    for poly in polygons:
        pts = np.round((poly - np.array(origin, np.float32)) * 16).astype(np.int32)
        cv2.fillPoly(canvas, [pts], 255, cv2.LINE_AA, 4)
    return (canvas.astype(np.float32) / 255.0).astype(np.float32)


def _feather(region: F32, sigma: float) -> F32:
    """``region`` blurred by ``sigma`` and faded to 0 at the crop border; values too small to
    change a uint8 pixel are exactly 0, so those pixels stay bit-identical to the picture."""
    mask = np.asarray(cv2.GaussianBlur(region, (0, 0), sigmaX=max(0.5, sigma)), np.float32)
    h, w = mask.shape
    edge = max(1.0, 2.0 * sigma)
    ry = np.minimum(np.arange(h), np.arange(h)[::-1]).astype(np.float32) / edge
    rx = np.minimum(np.arange(w), np.arange(w)[::-1]).astype(np.float32) / edge
    mask *= np.clip(ry, 0.0, 1.0)[:, None] * np.clip(rx, 0.0, 1.0)[None, :]
    mask[mask < 1.0 / 512] = 0.0
    return np.clip(mask, 0.0, 1.0).astype(np.float32)


def _teeth_show(img: U8, face: FaceLandmarks) -> bool:
    """Whether the picture's lips are apart with teeth between them: a row of the gap between
    the inner lip contours, mid-mouth, clearly brighter than the lips around it."""
    top, bottom = face.xy(13), face.xy(14)
    gap = float(bottom[1] - top[1])
    if gap < 2.0:
        return False
    left, right = face.xy(MOUTH_CORNERS)
    x0 = float(left[0] + 0.3 * (right[0] - left[0]))
    x1 = float(left[0] + 0.7 * (right[0] - left[0]))
    bx, by, bw, bh = _clip_box((x0, top[1], x1 - x0, gap), img.shape[1], img.shape[0])
    # The brightest row of the gap: at a small scale the mesh may be a pixel off the teeth.
    gap_px = img[by : by + bh, bx : bx + bw].astype(np.float32)
    brightest = float(np.median(_luma(gap_px), axis=1).max())
    upper_lip = (float(face.xy(0)[1]), float(top[1]))
    lower_lip = (float(bottom[1]), float(face.xy(17)[1]))
    lips = np.concatenate(
        [
            _luma(_region(img, (x0, a + 0.25 * (b - a), x1 - x0, max(1.0, 0.5 * (b - a)))))
            for a, b in (upper_lip, lower_lip)
        ]
    )
    return brightest > 1.15 * float(np.median(lips))


def mouth_geometry(img: U8, face: FaceLandmarks, fbox: Box, skin: F32) -> dict[str, Any]:
    height, width = img.shape[:2]
    _, _, fw, fh = fbox
    left, right = face.xy(MOUTH_CORNERS)
    teeth_visible = _teeth_show(img, face)
    inner_upper = face.xy(LIPS_INNER_UPPER[1:-1])
    inner_lower = face.xy(LIPS_INNER_LOWER[1:-1])
    corners = np.stack([left, right])
    lip_x = float((left[0] + right[0]) / 2)
    nose_bottom = float(face.xy(_SUBNASALE)[1])
    outline = face.xy(_LOWER_OUTLINE)
    jaw_low = float(outline[:, 1].max())
    sigma = 0.035 * fw
    x_0 = lip_x - 0.65 * fw
    y_0 = min(nose_bottom - 3 * sigma, float(left[1] + right[1]) / 2 - 0.3 * fh)
    y_1 = max(jaw_low + 0.1 * fh + 3 * sigma, float(left[1] + right[1]) / 2 + 0.5 * fh)
    crop = _clip_box((x_0, y_0, 1.3 * fw, y_1 - y_0), width, height)
    cx0, cy0, cw, ch = crop

    cols = np.arange(cw, dtype=np.float32)
    image_cols = cols + cx0
    lower_line = _curve(np.concatenate([corners, inner_lower]), image_cols)
    upper_line = _curve(np.concatenate([corners, inner_upper]), image_cols)
    seam_img = lower_line
    if not teeth_visible:
        seam_img = np.asarray((upper_line + lower_line) / 2, np.float32)
    seam = np.asarray(seam_img - cy0, np.float32)
    # How far the picture's lips are apart at each column (what closing them must cover); lips
    # the mesh finds within 2 px of each other mid-mouth are closed already.
    apart = float(face.xy(14)[1] - face.xy(13)[1]) >= 2.0
    gap = np.asarray(np.clip(lower_line - upper_line, 0.0, None) * apart, np.float32)
    lip_y = float(np.interp(lip_x - cx0, cols, seam))

    u = np.where(
        cols < lip_x - cx0,
        (cols - (lip_x - cx0)) / max(lip_x - float(left[0]), 1.0),
        (cols - (lip_x - cx0)) / max(float(right[0]) - lip_x, 1.0),
    ).astype(np.float32)
    rows = np.arange(ch, dtype=np.float32)
    dy = rows[:, None] - seam[None, :]
    # The jaw line of each column, limited to the lower face: the outline climbs to the
    # cheeks, where there is no jaw below the lips to move.
    jaw = _curve(outline, image_cols) - cy0
    to_jaw = np.maximum(jaw - seam, 0.0)
    hold = 0.45 * to_jaw
    end = np.maximum(to_jaw + 0.1 * fh, hold + 1.0)
    fade = np.clip((dy - hold[None, :]) / (end - hold)[None, :], 0.0, 1.0)
    lower = np.where(dy <= hold[None, :], 1.0, 0.5 * (1.0 + np.cos(np.pi * fade)))
    lower = np.where(dy > 0, lower, 0.0).astype(np.float32)
    upper = 0.5 * (1.0 + np.cos(np.pi * np.clip(-dy / (0.15 * fh), 0.0, 1.0)))
    upper = np.where(dy <= 0, upper, 0.0).astype(np.float32)
    jaw_blend = np.where(dy > 0, _smoothstep(dy / (0.12 * fh)), 0.0).astype(np.float32)
    grid_y, grid_x = np.meshgrid(rows, cols, indexing="ij")

    # The lower face and the band below the jaw that stretches, below the nose.
    below = outline + np.array([0.0, 0.1 * fh], np.float32)
    region = _fill((ch, cw), [outline, below], (cx0, cy0))
    region[: max(0, int(np.ceil(nose_bottom - cy0)))] = 0.0
    nose = _fill((ch, cw), [face.xy(NOSE_OUTLINE)], (cx0, cy0))
    region *= 1.0 - np.asarray(cv2.dilate(nose, np.ones((3, 3), np.uint8)), np.float32)
    mask = _feather(region, sigma)

    # The inside of a mouth is a dark red-brown, lit like the face: scale a generic palette by
    # how bright the skin is, so a dim picture does not get a glowing mouth.
    light = float(np.clip(_luma(skin[None])[0] / 170.0, 0.5, 1.3))
    cavity = np.array([[30, 10, 8], [108, 40, 32], [150, 68, 62]], np.float32) * light
    return {
        "mouth_crop": crop,
        "mouth_mask": mask,
        "mouth_grid_x": grid_x.astype(np.float32),
        "mouth_grid_y": grid_y.astype(np.float32),
        "mouth_u": u,
        "mouth_seam": seam,
        "mouth_gap": gap,
        "mouth_lower": lower,
        "mouth_upper": upper,
        "mouth_jaw_blend": jaw_blend,
        "lip_y": lip_y,
        "lip_x": float(lip_x - cx0),
        "max_drop": float(0.09 * fh),
        "max_raise": float(0.02 * fh),
        "teeth_height": float(max(1.5, 0.045 * fh)),
        "teeth_hint": 0.0 if teeth_visible else 0.9,
        "cavity_rgb": cavity.astype(np.float32),
        "teeth_rgb": (np.array([226, 218, 204], np.float32) * min(light, 1.1)).astype(np.float32),
    }


def eye_geometry(img: U8, face: FaceLandmarks) -> dict[str, Any]:
    height, width = img.shape[:2]
    uppers = [face.xy(EYE_UPPER[i]) for i in (0, 1)]
    lowers = [face.xy(EYE_LOWER[i]) for i in (0, 1)]
    widths = [float(np.hypot(*(u[-1] - u[0]))) for u in uppers]
    size = max(widths)
    opening = max(float((lo[:, 1] - up[:, 1]).max()) for up, lo in zip(uppers, lowers, strict=True))
    sigma = max(0.6, 0.04 * size)
    cw = min(width, int(np.ceil(1.3 * size + 6 * sigma)))
    ch = min(height, int(np.ceil(max(opening, 0.2 * size) + 0.6 * size + 6 * sigma)))
    crops, centres, axes, masks, tops, bottoms, boxes, dark = [], [], [], [], [], [], [], []
    for up, lo, w_eye in zip(uppers, lowers, widths, strict=True):
        pts = np.concatenate([up, lo])
        ecx, ecy = (pts.min(axis=0) + pts.max(axis=0)) / 2
        # Shift, never shrink, a crop at the border: both eyes keep one size so they stack.
        x0 = int(np.clip(round(ecx - cw / 2), 0, width - cw))
        y0 = int(np.clip(round(ecy - ch / 2), 0, height - ch))
        crops.append((x0, y0, cw, ch))
        centres.append((ecx - x0, ecy - y0))
        half_open = float((lo[:, 1] - up[:, 1]).max()) / 2
        axes.append((w_eye / 2, max(half_open, 0.5)))
        cols = np.arange(cw, dtype=np.float32) + x0
        top = _curve(up, cols)
        bottom = np.maximum(_curve(lo, cols), top)
        tops.append(top - y0)
        bottoms.append(bottom - y0)
        opening_poly = np.concatenate([up, lo[::-1]])
        region = _fill((ch, cw), [opening_poly], (x0, y0))
        region = np.asarray(cv2.dilate(region, np.ones((3, 3), np.uint8)), np.float32)
        masks.append(_feather(region, sigma))
        lo_xy, hi_xy = pts.min(axis=0), pts.max(axis=0)
        pad = 0.15 * w_eye
        boxes.append(_clip_box((*(lo_xy - pad), *(hi_xy - lo_xy + 2 * pad)), width, height))
        dark.append(_extreme_mean(_region(img, (*lo_xy, *(hi_xy - lo_xy + 1))), 0.1, darkest=True))
    return {
        "eye_boxes": (boxes[0], boxes[1]),
        "eye_crops": np.asarray(crops, np.int32),
        "eye_masks": np.stack(masks).astype(np.float32),
        "eye_centers": np.asarray(centres, np.float32),
        "eye_axes": np.asarray(axes, np.float32),
        "eye_upper": np.stack(tops).astype(np.float32),
        "eye_lower": np.stack(bottoms).astype(np.float32),
        "lash_rgb": (0.8 * np.mean(dark, axis=0)).astype(np.float32),
    }
