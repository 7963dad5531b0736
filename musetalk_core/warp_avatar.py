"""Avatar preparation for the CPU ``warp`` engine: find the face once, precompute the rest.

Everything expensive happens here, once per picture: face, mouth and eye detection, the crop
boxes the renderer touches, feathered blend masks, remap grids and displacement profiles, and
the colours it paints with. The result, a :class:`WarpAvatar`, is a bag of numpy arrays that
:mod:`musetalk_core.warp` combines per frame with a handful of cheap operations. It can be cached
as ``.npz`` keyed by the SHA-256 of the picture, so a second start with the same picture skips
detection.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import logging
import os
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import numpy.typing as npt

from .boxes import Box
from .types import AvatarRtcError

__all__ = [
    "AvatarError",
    "NoFaceError",
    "WarpAvatar",
    "as_rgb",
    "builtin_portrait",
    "detect_face",
    "image_digest",
    "load_portrait",
    "normalise_size",
    "prepare_avatar",
]

logger = logging.getLogger(__name__)

F32 = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]

MAX_SIDE = 720
"""Longest side of a prepared portrait: larger pictures cost encode time and bandwidth only."""

CACHE_VERSION = 2
"""Bump whenever the meaning of a cached array changes, so stale caches are ignored."""

_MIN_FACE_FRACTION = 1 / 12
"""Smallest face searched for, as a fraction of the shorter image side."""


class AvatarError(AvatarRtcError, ValueError):
    """A portrait could not be loaded or prepared."""


class NoFaceError(AvatarError):
    """No frontal face was found in the portrait."""


@dataclass(frozen=True, eq=False)
class WarpAvatar:
    """Everything the warp renderer needs, precomputed from one portrait.

    Boxes are ``(x, y, w, h)`` in full-image pixels. Arrays named ``mouth_*`` are in the
    coordinates of :attr:`mouth_crop`, arrays named ``eye_*`` in those of each :attr:`eye_crops`
    row (both eye crops have the same size so they stack).
    """

    image: U8
    """The base portrait, uint8 RGB (H, W, 3) with even sides."""
    face_box: Box
    mouth_box: Box
    """The mouth as found in the picture; benchmarks measure mouth motion inside it."""
    eye_boxes: tuple[Box, Box]
    """(left-in-image, right-in-image) eye boxes."""

    mouth_crop: Box
    """The only region the mouth animation writes to."""
    mouth_mask: F32
    """Feathered blend weight, 0 on the crop border."""
    mouth_grid_x: F32
    """Base remap grid (crop column of every pixel)."""
    mouth_grid_y: F32
    """Base remap grid (crop row of every pixel)."""
    mouth_u: F32
    """Per column: offset from the mouth centre over the distance to that side's corner
    (0 at the centre, -1 and 1 at the left and right corners)."""
    mouth_seam: F32
    """Per column: crop row of the line where the lips part. It follows the picture's own lip
    line (a smile curves up to the corners), flat beyond the corners."""
    mouth_lower: F32
    """(h, w): how much of the jaw drop each pixel follows (0 above the seam)."""
    mouth_upper: F32
    """(h, w): how much of the upper-lip lift each pixel follows (0 below the seam)."""
    mouth_jaw_blend: F32
    """(h, w): 0 keeps the tapered lip profile, 1 the broader jaw profile (deep below the seam)."""
    lip_y: float
    """Crop row of the seam at the mouth centre."""
    lip_x: float
    """Crop column of the mouth centre, half-way between the corners."""
    max_drop: float
    """Lower-lip drop in pixels at openness 1."""
    max_raise: float
    """Upper-lip lift in pixels at openness 1."""
    teeth_height: float
    """Pixels of the teeth hint painted under the upper lip."""
    teeth_hint: float
    """Opacity of that hint; 0 when the picture already shows teeth above the lip line."""
    cavity_rgb: F32
    """(3, 3) mouth-interior colours: the shadowed back, the lit floor, the tongue."""
    teeth_rgb: F32
    """Colour of the teeth hint."""
    skin_rgb: F32
    """Median cheek colour."""

    eye_crops: npt.NDArray[np.int32]
    """(2, 4) crop boxes, one row per eye."""
    eye_masks: F32
    """(2, h, w) feathered eyelid regions."""
    eye_centers: F32
    """(2, 2) eye centre (x, y) in crop coordinates."""
    eye_axes: F32
    """(2, 2) half-width and half-height of the eyelid region."""
    eyelid_rgb: F32
    """(2, w, 3) colour of each closed eyelid, per crop column."""
    lash_rgb: F32
    """Colour of the lash line drawn along a closing lid."""

    @property
    def frame_size(self) -> tuple[int, int]:
        """(width, height) of the portrait and of every rendered frame."""
        return int(self.image.shape[1]), int(self.image.shape[0])


# --------------------------------------------------------------------------------------------
# Loading


def builtin_portrait() -> U8:
    """The bundled default portrait: scikit-image's astronaut, uint8 RGB 512x512, no network."""
    # Imported here: skimage.data is slow to import and only the default avatar needs it.
    data: Any = importlib.import_module("skimage.data")
    return np.ascontiguousarray(data.astronaut(), dtype=np.uint8)


def load_portrait(path: str | os.PathLike[str]) -> U8:
    """Read an image (PNG, JPEG, ...) or the first frame of a video as uint8 RGB.

    The result is scaled so its longer side is at most 720 pixels and both sides are even.
    Raises :class:`AvatarError` when the file is missing or cannot be decoded.
    """
    p = Path(path)
    if not p.is_file():
        raise AvatarError(f"portrait file not found: {p}")
    rgb: U8 | None = None
    if cv2.haveImageReader(str(p)):
        bgr = cv2.imread(str(p), cv2.IMREAD_COLOR)
        if bgr is not None:
            rgb = np.asarray(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB), np.uint8)
    if rgb is None:
        rgb = _first_video_frame(p)
    if rgb is None:
        raise AvatarError(
            f"cannot read {p} as an image or a video; use a PNG/JPEG portrait or a video file"
        )
    return normalise_size(rgb)


def _first_video_frame(path: Path) -> U8 | None:
    import av

    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                return None
            for frame in container.decode(video=0):
                return np.asarray(frame.to_ndarray(format="rgb24"), np.uint8)
    except (av.error.FFmpegError, OSError, ValueError, IndexError):
        return None
    return None


def normalise_size(image: U8) -> U8:
    """Downscale so the longer side is <= 720 and crop to even sides (H.264 needs them)."""
    h, w = image.shape[:2]
    if h < 2 or w < 2:
        raise AvatarError(f"portrait too small: {w}x{h}")
    scale = MAX_SIDE / max(h, w)
    if scale < 1.0:
        size = (max(2, round(w * scale)), max(2, round(h * scale)))
        image = np.asarray(cv2.resize(image, size, interpolation=cv2.INTER_AREA), np.uint8)
        h, w = image.shape[:2]
    # Cropping one odd row/column keeps the picture sharp; resampling would blur all of it.
    return np.ascontiguousarray(image[: h - h % 2, : w - w % 2])


def as_rgb(image: np.ndarray[Any, Any]) -> U8:
    """``image`` as contiguous uint8 RGB (H, W, 3): grey is repeated, alpha dropped.

    Raises :class:`AvatarError` for other dtypes or shapes.
    """
    if not isinstance(image, np.ndarray) or image.dtype != np.uint8:
        raise AvatarError("portrait must be a uint8 numpy array")
    if image.ndim == 2:
        return np.ascontiguousarray(np.repeat(image[:, :, None], 3, axis=2))
    if image.ndim == 3 and image.shape[2] in (3, 4):
        return np.ascontiguousarray(image[:, :, :3])
    raise AvatarError(f"portrait must be (H, W, 3) RGB, got shape {image.shape}")


# --------------------------------------------------------------------------------------------
# Preparation


def prepare_avatar(
    image: np.ndarray[Any, Any],
    *,
    cache_dir: Path | None = None,
    source: str | None = None,
) -> WarpAvatar:
    """Find face, mouth and eyes in ``image`` and precompute what the renderer needs.

    ``image`` is uint8 RGB (grey and RGBA are converted); it is scaled like
    :func:`load_portrait` does. With ``cache_dir`` the result is stored as
    ``warp-avatar-v<N>-<sha256>.npz`` and loaded from there next time. ``source`` names the
    picture in error messages. Raises :class:`NoFaceError` when no frontal face is found.
    """
    rgb = as_rgb(image)
    digest = image_digest(rgb)
    cache_path = None
    if cache_dir is not None:
        cache_path = Path(cache_dir) / f"warp-avatar-v{CACHE_VERSION}-{digest}.npz"
        cached = _load_cache(cache_path)
        if cached is not None:
            logger.info("avatar loaded from cache %s", cache_path)
            return cached
    avatar = _build(normalise_size(rgb), source or "the image")
    if cache_path is not None:
        _save_cache(avatar, cache_path)
    return avatar


def image_digest(rgb: U8) -> str:
    """SHA-256 hex digest of a picture's pixels and shape (the avatar cache key)."""
    h = hashlib.sha256()
    # The shape is part of the key: the same bytes in another shape are another picture.
    h.update(repr(rgb.shape).encode())
    h.update(rgb.tobytes())
    return h.hexdigest()


def _build(img: U8, source: str) -> WarpAvatar:
    gray = np.asarray(cv2.equalizeHist(cv2.cvtColor(img, cv2.COLOR_RGB2GRAY)), np.uint8)
    face = _detect_face(gray, source)
    mouth_box, found_mouth = _find_mouth(gray, face)
    eyes, found_eyes = _find_eyes(gray, face)
    logger.info(
        "avatar face %s, mouth %s (%s), eyes %s (%s)",
        face,
        mouth_box,
        "cascade" if found_mouth else "face proportions",
        eyes,
        "/".join("cascade" if f else "proportions" for f in found_eyes),
    )
    skin = _skin_colour(img, face)
    mouth = _mouth_geometry(img, face, mouth_box, skin)
    eye = _eye_geometry(img, eyes)
    return WarpAvatar(
        image=img, face_box=face, mouth_box=mouth_box, eye_boxes=eyes, skin_rgb=skin, **mouth, **eye
    )


def detect_face(image: U8, source: str = "the image") -> Box:
    """The largest frontal face in uint8 RGB ``image`` as ``(x, y, w, h)``.

    Uses OpenCV's Haar cascade on the histogram-equalised grey picture, like
    :func:`prepare_avatar`. ``source`` names the picture in the :class:`NoFaceError` raised when
    no face is found.
    """
    gray = np.asarray(cv2.equalizeHist(cv2.cvtColor(image, cv2.COLOR_RGB2GRAY)), np.uint8)
    return _detect_face(gray, source)


def _cascade(name: str) -> cv2.CascadeClassifier:
    path = os.path.join(cv2.data.haarcascades, name)  # type: ignore[attr-defined]
    clf = cv2.CascadeClassifier(path)
    if clf.empty():
        raise AvatarError(
            f"OpenCV Haar cascade {name} is missing (opencv-python-headless<5 ships it)"
        )
    return clf


def _detect_face(gray: U8, source: str) -> Box:
    h, w = gray.shape
    min_side = max(24, int(min(h, w) * _MIN_FACE_FRACTION))
    faces = _cascade("haarcascade_frontalface_default.xml").detectMultiScale(
        gray, scaleFactor=1.1, minNeighbors=5, minSize=(min_side, min_side)
    )
    if len(faces) == 0:
        raise NoFaceError(
            f"no frontal face found in {source} ({w}x{h}); use a frontal portrait, "
            f"face at least {min_side} px wide, well lit, looking at the camera"
        )
    x, y, fw, fh = max(faces, key=lambda r: int(r[2]) * int(r[3]))
    return Box(int(x), int(y), int(fw), int(fh))


def _clip_box(box: tuple[float, float, float, float], width: int, height: int) -> Box:
    x0 = max(0, round(box[0]))
    y0 = max(0, round(box[1]))
    x1 = min(width, round(box[0] + box[2]))
    y1 = min(height, round(box[1] + box[3]))
    return Box(x0, y0, max(1, x1 - x0), max(1, y1 - y0))


def _find_mouth(gray: U8, face: Box) -> tuple[Box, bool]:
    """Mouth box from the smile cascade in the lower face, else from face proportions."""
    x, y, fw, fh = face
    height, width = gray.shape
    expected = (x + 0.5 * fw, y + 0.8 * fh)
    fallback = _clip_box(
        (expected[0] - 0.22 * fw, expected[1] - 0.1 * fh, 0.44 * fw, 0.2 * fh), width, height
    )
    y0 = y + int(0.55 * fh)
    y1 = min(height, y + int(1.1 * fh))
    roi = gray[y0:y1, x : x + fw]
    if roi.size == 0:
        return fallback, False
    found = _cascade("haarcascade_smile.xml").detectMultiScale(
        roi, scaleFactor=1.05, minNeighbors=3, minSize=(max(8, fw // 4), max(4, fw // 10))
    )
    best: Box | None = None
    best_score = float("inf")
    for mx, my, mw, mh in found:
        cx = x + mx + mw / 2
        cy = y0 + my + mh / 2
        # A smile cascade fires on nostrils and chins too: keep boxes of mouth size near where a
        # mouth sits in a frontal face, and of those the one nearest to that spot.
        if not (0.25 * fw <= mw <= 0.75 * fw and abs(cx - expected[0]) <= 0.15 * fw):
            continue
        if not (y + 0.62 * fh <= cy <= y + 1.0 * fh):
            continue
        score = ((cx - expected[0]) / fw) ** 2 + ((cy - expected[1]) / fh) ** 2
        if score < best_score:
            best, best_score = Box(int(x + mx), int(y0 + my), int(mw), int(mh)), score
    if best is None:
        return fallback, False
    return _clip_box(best, width, height), True


def _find_eyes(gray: U8, face: Box) -> tuple[tuple[Box, Box], tuple[bool, bool]]:
    """Eye boxes from the eye cascade in the upper face; a missing eye mirrors the other or
    falls back to face proportions."""
    x, y, fw, fh = face
    height, width = gray.shape
    y0 = y + int(0.15 * fh)
    roi = gray[y0 : y + int(0.6 * fh), x : x + fw]
    found = _cascade("haarcascade_eye.xml").detectMultiScale(
        roi, scaleFactor=1.05, minNeighbors=3, minSize=(max(6, fw // 10), max(6, fw // 10))
    )
    centre_x = x + fw / 2
    sides: list[tuple[float, float, float] | None] = [None, None]  # (cx, cy, size)
    best = [float("inf"), float("inf")]
    for ex, ey, ew, eh in found:
        cx = x + ex + ew / 2
        cy = y0 + ey + eh / 2
        if not (0.12 * fw <= ew <= 0.4 * fw and y + 0.2 * fh <= cy <= y + 0.55 * fh):
            continue
        side = 0 if cx < centre_x else 1
        expected_x = x + (0.29 if side == 0 else 0.71) * fw
        score = abs(cx - expected_x) / fw + abs(cy - (y + 0.38 * fh)) / fh
        if score < best[side]:
            best[side] = score
            sides[side] = (cx, cy, float(ew))
    found_flags = (sides[0] is not None, sides[1] is not None)
    for side in (0, 1):
        if sides[side] is None:
            other = sides[1 - side]
            if other is not None:
                sides[side] = (2 * centre_x - other[0], other[1], other[2])
            else:
                fx = 0.29 if side == 0 else 0.71
                sides[side] = (x + fx * fw, y + 0.38 * fh, 0.22 * fw)
    boxes: list[Box] = []
    for s in sides:
        assert s is not None
        cx, cy, size = s
        boxes.append(_clip_box((cx - size / 2, cy - size / 2, size, size), width, height))
    return (boxes[0], boxes[1]), found_flags


def _region(img: U8, box: tuple[float, float, float, float]) -> npt.NDArray[np.float32]:
    h, w = img.shape[:2]
    x0, y0, bw, bh = _clip_box(box, w, h)
    return img[y0 : y0 + bh, x0 : x0 + bw].reshape(-1, 3).astype(np.float32)


def _skin_colour(img: U8, face: Box) -> F32:
    x, y, fw, fh = face
    cheeks = np.concatenate(
        [
            _region(img, (x + 0.15 * fw, y + 0.55 * fh, 0.15 * fw, 0.12 * fh)),
            _region(img, (x + 0.70 * fw, y + 0.55 * fh, 0.15 * fw, 0.12 * fh)),
        ]
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


def _feathered_ellipse(
    shape: tuple[int, int], centre: tuple[float, float], axes: tuple[float, float], sigma: float
) -> F32:
    """A filled ellipse blurred by ``sigma``; values too small to change a uint8 pixel are 0."""
    canvas = np.zeros(shape, np.float32)
    shift = 4  # draw with 1/16 px precision
    cv2.ellipse(
        canvas,
        (round(centre[0] * 16), round(centre[1] * 16)),
        (max(1, round(axes[0] * 16)), max(1, round(axes[1] * 16))),
        0.0,
        0.0,
        360.0,
        1.0,
        -1,
        cv2.LINE_AA,
        shift,
    )
    mask = cv2.GaussianBlur(canvas, (0, 0), sigmaX=max(0.5, sigma))
    # Exact zeros where the weight is negligible keep those pixels bit-identical to the picture.
    mask[mask < 1.0 / 512] = 0.0
    return np.clip(mask, 0.0, 1.0).astype(np.float32)


def _lip_line(img: U8, mouth_box: Box) -> tuple[float, bool]:
    """Image row (half-integer) between the lips, and whether teeth already show above it.

    Rows are averaged over the middle half of the mouth. A bright, unreddish band with redder
    (lip) rows above and below it is teeth: the picture's mouth is open, so the split goes under
    the teeth, which stay, and the lower lip drops. Otherwise the split goes through the darkest
    row, the seam of closed lips.
    """
    mx, my, mw, mh = mouth_box
    c0, c1 = mx + mw // 4, mx + mw - mw // 4
    r0, r1 = my + int(0.25 * mh), my + max(int(0.9 * mh), int(0.25 * mh) + 3)
    block = img[r0:r1, c0:c1].astype(np.float32)
    if block.shape[0] < 3 or block.shape[1] < 1:
        return my + mh // 2 + 0.5, False
    rows = block.mean(axis=1)
    lum = _luma(rows)
    redness = rows[:, 0] - rows[:, 1]
    peak = int(np.argmax(lum))
    above, below = redness[:peak], redness[peak + 1 :]
    lip_red = 1.5 * max(float(redness[peak]), 4.0)
    if above.size and below.size and above.max() > lip_red and below.max() > lip_red:
        tail = lum[peak:]
        half = (lum[peak] + tail.min()) / 2
        drop = peak + int(np.argmax(tail < half))
        return r0 + drop - 0.5, True
    margin = max(1, len(lum) // 10)
    seam = margin + int(np.argmin(lum[margin : len(lum) - margin]))
    return r0 + seam + 0.5, False


def _mouth_corners(
    lum: F32, lip_x: float, lip_y: float, half_width: float, fh: int
) -> tuple[tuple[float, float], tuple[float, float]]:
    """(x, y) of the left and right mouth corners, in image pixels.

    A corner is the dark spot where the lips meet, searched near each end of the lip line and
    at or above it (a smile lifts the corners); where no spot stands out, the end of the lip
    line is taken.
    """
    height, width = lum.shape
    corners: list[tuple[float, float]] = []
    for side in (-1.0, 1.0):
        xa, xb = sorted((lip_x + side * 0.7 * half_width, lip_x + side * 1.35 * half_width))
        ya, yb = lip_y - 0.14 * fh, lip_y + 0.04 * fh
        bx, by, bw, bh = _clip_box((xa, ya, xb - xa, yb - ya), width, height)
        window = lum[by : by + bh, bx : bx + bw]
        corner = (lip_x + side * half_width, lip_y)
        if window.size:
            iy, ix = np.unravel_index(int(np.argmin(window)), window.shape)
            if float(np.median(window)) - float(window[iy, ix]) > 25.0:
                # The darkest pixel sits a little inside the corner, where the shadow is deepest.
                corner = (bx + float(ix) + side * 0.1 * half_width, by + float(iy) + 0.5)
        corners.append(corner)
    return corners[0], corners[1]


def _seam_curve(
    lum: F32,
    cols: F32,
    centre: tuple[float, float],
    corners: tuple[tuple[float, float], tuple[float, float]],
    teeth_visible: bool,
) -> F32:
    """Image row of the lip seam for each image column in ``cols``.

    The seam runs from the centre of the lip line to each corner as ``y_c + (y_corner - y_c) *
    |u|**k`` (``u`` the offset over the distance to that corner), flat beyond the corners.
    ``k`` is fitted to the picture: per column the lower edge of the teeth when they show,
    else the darkest row, between the centre and the corners.
    """
    cx, cy = centre
    (lx, ly), (rx, ry) = corners
    u = np.where(cols < cx, (cols - cx) / max(cx - lx, 1.0), (cols - cx) / max(rx - cx, 1.0))
    rise = np.where(cols < cx, ly - cy, ry - cy).astype(np.float32)
    a = np.clip(np.abs(u), 0.0, 1.0).astype(np.float32)
    powers = np.linspace(1.2, 4.0, 29, dtype=np.float32)
    height = lum.shape[0]
    errors = np.zeros(len(powers), np.float32)
    for i, x in enumerate(cols):
        if not 0.15 <= a[i] <= 0.75:
            continue
        candidates = cy + rise[i] * a[i] ** powers
        r0 = int(np.clip(np.floor(candidates.min()) - 2, 0, height - 2))
        r1 = int(np.clip(np.ceil(candidates.max()) + 2, r0 + 2, height - 1))
        column = lum[r0 : r1 + 1, int(x)]
        if teeth_visible:
            # The teeth end where the column turns from bright to darker lip, going down.
            step = column[:-1] - column[1:]
            found = r0 + float(np.argmax(step)) + 0.5
        else:
            found = r0 + float(np.argmin(column)) + 0.5
        errors += np.minimum(np.abs(candidates - found), 2.0) ** 2
    k = float(powers[int(np.argmin(errors))]) if errors.any() else 2.5
    return (cy + rise * a**k).astype(np.float32)


def _mouth_geometry(img: U8, face: Box, mouth_box: Box, skin: F32) -> dict[str, Any]:
    height, width = img.shape[:2]
    _, _, fw, fh = face
    mx, my, mw, mh = mouth_box
    lip_y, teeth_visible = _lip_line(img, mouth_box)
    if teeth_visible:
        # The row at the lower edge of the teeth is half tooth: it stays with the teeth, so the
        # lower lip that drops away starts with clean lip.
        lip_y += 0.5
    luma = _luma(img.reshape(-1, 3).astype(np.float32)).reshape(height, width)
    lum = np.asarray(cv2.GaussianBlur(luma, (0, 0), 0.7), np.float32)
    # Smile-cascade boxes carry a margin around the lips; 0.36 of the box is the lip half-width.
    left, right = _mouth_corners(lum, mx + mw / 2, lip_y, 0.36 * mw, fh)
    lip_x = (left[0] + right[0]) / 2
    crop = _clip_box((lip_x - 0.6 * fw, lip_y - 0.3 * fh, 1.2 * fw, 0.8 * fh), width, height)
    cx0, cy0, cw, ch = crop
    sigma = 0.035 * fw
    # The ellipse is laid out on the unclipped crop, so a face near the border keeps its shape.
    ell_centre = (lip_x - cx0, lip_y + 0.1 * fh - cy0)
    ell_axes = (0.6 * fw - 4 * sigma, 0.4 * fh - 4 * sigma)
    mask = _feathered_ellipse((ch, cw), ell_centre, ell_axes, sigma)

    rows = np.arange(ch, dtype=np.float32)
    cols = np.arange(cw, dtype=np.float32)
    seam = _seam_curve(lum, cols + cx0, (lip_x, lip_y), (left, right), teeth_visible) - cy0
    u = np.where(
        cols < lip_x - cx0,
        (cols - (lip_x - cx0)) / max(lip_x - left[0], 1.0),
        (cols - (lip_x - cx0)) / max(right[0] - lip_x, 1.0),
    )
    dy = rows[:, None] - seam[None, :]
    hold = 0.12 * fh
    fade = 0.45 * fh
    lower = np.where(
        dy <= hold, 1.0, 0.5 * (1.0 + np.cos(np.pi * np.clip((dy - hold) / (fade - hold), 0, 1)))
    )
    lower = np.where(dy > 0, lower, 0.0).astype(np.float32)
    upper = 0.5 * (1.0 + np.cos(np.pi * np.clip(-dy / (0.15 * fh), 0.0, 1.0)))
    upper = np.where(dy <= 0, upper, 0.0).astype(np.float32)
    jaw_blend = np.where(dy > 0, _smoothstep(dy / (0.12 * fh)), 0.0).astype(np.float32)
    grid_y, grid_x = np.meshgrid(rows, cols, indexing="ij")

    # The inside of a mouth is a dark red-brown, lit like the face: scale a generic palette by
    # how bright the skin is, so a dim picture does not get a glowing mouth.
    light = float(np.clip(_luma(skin[None])[0] / 170.0, 0.5, 1.3))
    cavity = np.array([[30, 10, 8], [108, 40, 32], [150, 68, 62]], np.float32) * light
    return {
        "mouth_crop": crop,
        "mouth_mask": mask,
        "mouth_grid_x": grid_x.astype(np.float32),
        "mouth_grid_y": grid_y.astype(np.float32),
        "mouth_u": u.astype(np.float32),
        "mouth_seam": seam,
        "mouth_lower": lower,
        "mouth_upper": upper,
        "mouth_jaw_blend": jaw_blend,
        "lip_y": float(lip_y - cy0),
        "lip_x": float(lip_x - cx0),
        "max_drop": float(0.09 * fh),
        "max_raise": float(0.02 * fh),
        "teeth_height": float(max(1.5, 0.045 * fh)),
        "teeth_hint": 0.0 if teeth_visible else 0.9,
        "cavity_rgb": cavity.astype(np.float32),
        "teeth_rgb": (np.array([226, 218, 204], np.float32) * min(light, 1.1)).astype(np.float32),
    }


def _eye_geometry(img: U8, eyes: tuple[Box, Box]) -> dict[str, Any]:
    height, width = img.shape[:2]
    size = (eyes[0][2] + eyes[1][2]) / 2
    # The Haar eye box spans brow to cheek; the lid covers about 0.84 x 0.44 of its size.
    ax, ay = 0.42 * size, 0.22 * size
    sigma = max(0.7, 0.06 * size)
    cw = min(width, int(np.ceil(2 * (ax + 4 * sigma))))
    ch = min(height, int(np.ceil(2 * (ay + 4 * sigma))))
    crops, centres, lids = [], [], []
    dark = []
    for ex, ey, ew, eh in eyes:
        ecx, ecy = ex + ew / 2, ey + eh / 2
        # Shift, never shrink, a crop at the border: both eyes keep one size so they stack.
        x0 = int(np.clip(round(ecx - cw / 2), 0, width - cw))
        y0 = int(np.clip(round(ecy - ch / 2), 0, height - ch))
        crops.append((x0, y0, cw, ch))
        centres.append((ecx - x0, ecy - y0))
        # Each column of the closed lid takes the colour of the upper lid just above the eye,
        # smoothed sideways: the lid then continues the skin above it without a visible seam.
        band_y0 = int(np.clip(round(ecy - ay - 0.12 * size), 0, height - 1))
        band_y1 = int(np.clip(round(ecy - ay) + 1, band_y0 + 1, height))
        band = img[band_y0:band_y1, x0 : x0 + cw].astype(np.float32)
        column = np.median(band, axis=0)
        column = cv2.GaussianBlur(column[None], (0, 0), sigmaX=max(1.0, 0.08 * size))[0]
        lids.append(column)
        dark.append(_extreme_mean(_region(img, (ex, ey, ew, eh)), 0.08, darkest=True))
    masks = np.stack([_feathered_ellipse((ch, cw), c, (ax, ay), sigma) for c in centres])
    return {
        "eye_crops": np.asarray(crops, np.int32),
        "eye_masks": masks.astype(np.float32),
        "eye_centers": np.asarray(centres, np.float32),
        "eye_axes": np.asarray([(ax, ay), (ax, ay)], np.float32),
        "eyelid_rgb": np.asarray(lids, np.float32),
        "lash_rgb": (0.8 * np.mean(dark, axis=0)).astype(np.float32),
    }


# --------------------------------------------------------------------------------------------
# Cache

_BOX_FIELDS = ("face_box", "mouth_box", "mouth_crop")
_FLOAT_FIELDS = (
    "lip_y",
    "lip_x",
    "max_drop",
    "max_raise",
    "teeth_height",
    "teeth_hint",
)


def _save_cache(avatar: WarpAvatar, path: Path) -> None:
    arrays: dict[str, Any] = {
        f.name: np.asarray(getattr(avatar, f.name)) for f in dataclasses.fields(avatar)
    }
    arrays["_version"] = np.asarray(CACHE_VERSION)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write then rename: a reader never sees half a file, even with two servers starting.
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".npz.tmp")
        with os.fdopen(fd, "wb") as fh:
            np.savez(fh, **arrays)
        os.replace(tmp, path)
    except OSError as exc:
        # A read-only cache directory costs the next start a detection, nothing more.
        logger.warning("could not write avatar cache %s: %s", path, exc)


def _load_cache(path: Path) -> WarpAvatar | None:
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as data:
            if int(data["_version"]) != CACHE_VERSION:
                return None
            values: dict[str, Any] = {}
            for f in dataclasses.fields(WarpAvatar):
                arr = data[f.name]
                if f.name in _BOX_FIELDS:
                    values[f.name] = Box(*(int(v) for v in arr))
                elif f.name == "eye_boxes":
                    values[f.name] = tuple(Box(*(int(v) for v in row)) for row in arr)
                elif f.name in _FLOAT_FIELDS:
                    values[f.name] = float(arr)
                else:
                    values[f.name] = np.ascontiguousarray(arr)
        return WarpAvatar(**values)
    except (OSError, KeyError, ValueError, TypeError, zipfile.BadZipFile) as exc:
        logger.warning("ignoring unreadable avatar cache %s: %s", path, exc)
        return None
