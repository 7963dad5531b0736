"""Avatar preparation for the CPU ``warp`` engine: find the face once, precompute the rest.

Everything expensive happens here, once per picture: the face mesh (:mod:`musetalk_core.landmarks`),
and from it (:mod:`musetalk_core.warp_geometry`) the crop boxes the renderer touches, feathered
blend masks, remap grids and displacement profiles, the eyelid contours and the colours it
paints with. The result, a :class:`WarpAvatar`, is a bag of numpy arrays that
:mod:`musetalk_core.warp` combines per frame with a handful of cheap operations. It can be cached
as ``.npz`` keyed by the SHA-256 of the picture and the framing, so a second start with the same
picture skips detection.

Before any of it the picture is framed (:mod:`musetalk_core.framing`): by default head and
shoulders, scaled to 512x512, so the face the renderer animates is the one the caller sees.
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

from . import warp_geometry as geometry
from .boxes import Box
from .framing import check_framing, frame_pictures
from .landmarks import find_landmarks
from .types import AvatarError, NoFaceError

__all__ = [
    "AvatarError",
    "NoFaceError",
    "WarpAvatar",
    "as_rgb",
    "builtin_portrait",
    "image_digest",
    "load_portrait",
    "min_face_size",
    "normalise_size",
    "prepare_avatar",
]

logger = logging.getLogger(__name__)

F32 = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]

MAX_SIDE = 720
"""Longest side of a prepared portrait: larger pictures cost encode time and bandwidth only."""

CACHE_VERSION = 5
"""Bump whenever the meaning of a cached array changes, so stale caches are ignored."""

_MIN_FACE_FRACTION = 1 / 12
"""Smallest face searched for, as a fraction of the shorter image side."""


@dataclass(frozen=True, eq=False)
class WarpAvatar:
    """Everything the warp renderer needs, precomputed from one portrait.

    Boxes are ``(x, y, w, h)`` in full-image pixels. Arrays named ``mouth_*`` are in the
    coordinates of :attr:`mouth_crop`, arrays named ``eye_*`` in those of each :attr:`eye_crops`
    row (both eye crops have the same size so they stack).
    """

    image: U8
    """The base portrait, uint8 RGB (H, W, 3) with even sides: the source picture framed."""
    framing: str
    """How the source picture was framed (:data:`musetalk_core.framing.FRAMINGS`)."""
    source_crop: F32
    """(6,) the region of the (normalised) source picture :attr:`image` shows, ``x, y, w, h``
    in its pixels, and the size it was scaled to (:meth:`musetalk_core.framing.Crop.as_array`)."""
    landmarks: F32
    """(468, 2) the face mesh the rest was built from, in image pixels."""
    face_box: Box
    mouth_box: Box
    """The mouth as found in the picture; benchmarks measure mouth motion inside it."""
    eye_boxes: tuple[Box, Box]
    """(left-in-image, right-in-image) eye boxes."""

    mouth_crop: Box
    """The only region the mouth animation writes to."""
    mouth_mask: F32
    """Feathered blend weight over the lower face, 0 on the crop border."""
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
    mouth_gap: F32
    """Per column: pixels between the picture's inner lip contours (0 where the lips meet);
    the lower lip rises by this much to seal the lips."""
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
    """(2, h, w) the eye openings, feathered: the only pixels a blink paints."""
    eye_centers: F32
    """(2, 2) eye centre (x, y) in crop coordinates."""
    eye_axes: F32
    """(2, 2) half-width of the eye and half-height of its opening."""
    eye_upper: F32
    """(2, w) crop row of the upper lid's edge in each crop column (flat beyond the corners)."""
    eye_lower: F32
    """(2, w) crop row of the lower lid's edge, where a closing upper lid comes to rest."""
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
    framing: str = "head",
) -> WarpAvatar:
    """Frame ``image``, find the face mesh in it and precompute what the renderer needs.

    ``image`` is uint8 RGB (grey and RGBA are converted); it is scaled like
    :func:`load_portrait` does, then framed by ``framing`` (:mod:`musetalk_core.framing`:
    ``head`` and shoulders at 512x512, or the ``full`` picture). With ``cache_dir`` the result
    is stored as ``warp-avatar-v<N>-<framing>-<sha256>.npz`` and loaded from there next time.
    ``source`` names the picture in error messages. Raises :class:`NoFaceError` when no
    frontal face is found, ValueError for an unknown ``framing``.
    """
    check_framing(framing)
    rgb = as_rgb(image)
    digest = image_digest(rgb)
    cache_path = None
    if cache_dir is not None:
        cache_path = Path(cache_dir) / f"warp-avatar-v{CACHE_VERSION}-{framing}-{digest}.npz"
        cached = _load_cache(cache_path, framing)
        if cached is not None:
            logger.info("avatar loaded from cache %s", cache_path)
            return cached
    picture = normalise_size(rgb)
    name = source or "the image"
    (framed,), (crop,) = frame_pictures([picture], framing, name, min_face=min_face_size(picture))
    avatar = _build(framed, name, framing=framing, source_crop=crop.as_array())
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


def min_face_size(img: U8) -> int:
    """Smallest face searched for in ``img``, in pixels (both engines frame by this rule)."""
    return max(24, int(min(img.shape[:2]) * _MIN_FACE_FRACTION))


def _build(img: U8, source: str, *, framing: str, source_crop: F32) -> WarpAvatar:
    height, width = img.shape[:2]
    marks = find_landmarks(img, source, min_face=min_face_size(img))
    face = geometry.face_box(marks, width, height)
    mouth_box = geometry.mouth_box(marks, width, height)
    skin = geometry.skin_colour(img, marks, face.w)
    mouth = geometry.mouth_geometry(img, marks, face, skin)
    eye = geometry.eye_geometry(img, marks)
    logger.info(
        "avatar face %s, mouth %s, eyes %s (face mesh, score %.2f)",
        face,
        mouth_box,
        eye["eye_boxes"],
        marks.score,
    )
    return WarpAvatar(
        image=img,
        framing=framing,
        source_crop=source_crop,
        landmarks=marks.points,
        face_box=face,
        mouth_box=mouth_box,
        skin_rgb=skin,
        **mouth,
        **eye,
    )


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


def _load_cache(path: Path, framing: str) -> WarpAvatar | None:
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as data:
            if int(data["_version"]) != CACHE_VERSION or str(data["framing"]) != framing:
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
                elif f.name == "framing":
                    values[f.name] = str(arr)
                else:
                    values[f.name] = np.ascontiguousarray(arr)
        return WarpAvatar(**values)
    except (OSError, KeyError, ValueError, TypeError, zipfile.BadZipFile) as exc:
        logger.warning("ignoring unreadable avatar cache %s: %s", path, exc)
        return None
