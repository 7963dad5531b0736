"""Avatar preparation for MuseTalk 1.5: face boxes, 256x256 crops, VAE latents, blend masks.

This is our version of upstream's ``Avatar.prepare_material`` (``scripts/realtime_inference.py``),
done once per avatar source and cached on disk:

1. Read the source: one picture, or up to ``max_frames`` frames of a video resampled to ``fps``.
2. Find the face in every frame (the Haar detector of :mod:`musetalk_core.warp_avatar`) and turn it
   into MuseTalk's face box, ``(x1, y1, x2, y2)``.
3. Crop the face box, resize it to 256x256 (Lanczos) and encode the crop twice with the caller's
   VAE: once with its lower half black (the part the UNet repaints) and once whole (the
   reference). Per frame the UNet input is the two latents stacked, ``(8, 32, 32)``.
4. Build the blend mask that pastes a generated face back: over a crop box 1.5x the face box,
   the lower face only, feathered.
5. A video plays as an idle loop: frames then the same frames reversed (ping-pong), and every
   per-frame array follows the same cycle.

Deviations from upstream, all because we ship no landmark or face-parsing weights:

* Face box. Upstream runs from a landmark "upper bound" (the nose-bridge point mirrored above
  the chin) to the chin. The Haar box runs from about the same top (mid-forehead) to just under
  the lower lip, so we extend it down to the chin: ``y2 = y + 1.15 h`` (measured on the bundled
  portrait: Haar box y 67..160, chin at 177, nose bridge at 120, so upstream's top would be
  63). ``bbox_shift`` then moves the top edge by ``2 * bbox_shift`` pixels, as upstream's moves
  the nose-bridge anchor by ``bbox_shift`` and mirrors it; v1.5's ``extra_margin`` extends
  ``y2``; both are clipped to the frame.
* Blend mask. Upstream's comes from BiSeNet face parsing (``parsing_mode="jaw"``: face skin,
  lips and chin, cut to the face box). Ours is the ellipse inscribed in the face box. As
  upstream, only the part below ``upper_boundary_ratio = 0.5`` of the crop box is kept, and it is
  Gaussian-blurred with an odd kernel of about 0.1 x the crop width.
* Boxes near the frame edge. Upstream's PIL crop pads outside the picture implicitly; we clip
  the crop box (and its mask) to the frame.
* Jitter. Haar boxes jump by a few pixels (and by its 10 % scale steps) from frame to frame, so
  the video boxes are smoothed with a centred 5-frame moving average. A frame without a
  detection takes the box of the nearest frame with one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import numpy.typing as npt

from .boxes import Box, Corners
from .warp_avatar import (
    AvatarError,
    NoFaceError,
    as_rgb,
    detect_face,
    image_digest,
    normalise_size,
)

__all__ = [
    "CROP_EXPAND",
    "FACE_SIZE",
    "UPPER_BOUNDARY_RATIO",
    "EncodeFn",
    "MaterialSettings",
    "MuseTalkAvatar",
    "ProgressFn",
    "blend_mask",
    "crop_box",
    "face_crop",
    "masked_crop",
    "musetalk_box",
    "prepare_musetalk_avatar",
]

logger = logging.getLogger(__name__)

U8 = npt.NDArray[np.uint8]
F32 = npt.NDArray[np.float32]
I32 = npt.NDArray[np.int32]

EncodeFn = Callable[[U8], npt.NDArray[Any]]
"""(B, 256, 256, 3) uint8 RGB crops -> (B, 4, 32, 32) scaled VAE latents."""

ProgressFn = Callable[[str, int, int], None]
"""Called as ``(stage, done, total)`` with stage ``"faces"`` or ``"latents"``."""

FACE_SIZE = 256
"""Side of the square face crop the VAE sees."""
LATENT_SHAPE = (8, 32, 32)
"""Per frame: masked-crop latent (4 channels) then reference latent (4 channels)."""
CROP_EXPAND = 1.5
"""Blend crop box side over the face box's longer side (upstream ``expand``)."""
UPPER_BOUNDARY_RATIO = 0.5
"""The blend mask is zero above this fraction of the crop box height."""
CACHE_VERSION = 1
"""Bump whenever the meaning of a cached array changes, so stale caches are ignored."""

_CHIN = 1.15
"""Chin row below the Haar box top, in Haar box heights."""
_SMOOTH = 5
"""Frames in the centred moving average over video face boxes."""


@dataclass(frozen=True)
class MaterialSettings:
    """What the prepared material depends on besides the source; all of it keys the cache."""

    encoder_id: str
    """Names the VAE weights that made the latents."""
    bbox_shift: int = 0
    """Moves the top edge of the face box by ``2 * bbox_shift`` pixels (positive: down)."""
    extra_margin: int = 10
    """Pixels added below the chin (v1.5), so an opening jaw stays inside the box."""
    max_frames: int = 250
    """Most video frames read (the idle loop then has twice as many)."""
    max_seconds: float = 10.0
    """Most seconds of video read."""
    fps: float | None = 25.0
    """Video frames are resampled to this rate (MuseTalk is trained at 25); None keeps all."""


@dataclass(frozen=True, eq=False)
class MuseTalkAvatar:
    """Everything the MuseTalk engine needs per output frame, in idle-loop order.

    Index ``i`` of every sequence is cycle frame ``i``; play frame ``k`` as ``k % len(avatar)``.
    Boxes are :data:`Corners`. Arrays are shared, not copied, between a frame and its mirror in
    the ping-pong cycle, so treat them as read-only.
    """

    frames: tuple[U8, ...]
    """uint8 RGB (H, W, 3) frames with even sides, all the same size."""
    face_boxes: I32
    """(L, 4): the region the generated 256x256 face is resized to and pasted over."""
    crop_boxes: I32
    """(L, 4): the blend region, 1.5x the face box, clipped to the frame."""
    masks: tuple[U8, ...]
    """uint8 blend weights (0..255) with the shape of each frame's crop box."""
    latents: F32
    """(L, 8, 32, 32) float32 UNet input: masked-crop latent then reference latent."""
    digest: str
    """SHA-256 of the source (file bytes, or pixels for an in-memory picture)."""
    settings: MaterialSettings
    source_frames: int
    """Distinct frames read from the source (the cycle has twice as many for a video)."""
    cache_hit: bool = False
    """True when this was loaded from the cache rather than prepared."""

    def __len__(self) -> int:
        return len(self.frames)

    @property
    def frame_size(self) -> tuple[int, int]:
        """(width, height) of every frame."""
        return int(self.frames[0].shape[1]), int(self.frames[0].shape[0])


# --------------------------------------------------------------------------------------------
# Geometry


def musetalk_box(
    face: Box, frame_size: tuple[int, int], *, bbox_shift: int = 0, extra_margin: int = 10
) -> Corners:
    """MuseTalk's face box from a Haar face box ``(x, y, w, h)``.

    The Haar box is extended down to the chin, its top moved by ``2 * bbox_shift`` and its
    bottom by ``extra_margin``, and the result clipped to ``frame_size`` ``(width, height)``.
    Raises :class:`AvatarError` when ``bbox_shift`` moves the top below the chin.
    """
    x, y, w, h = face
    width, height = frame_size
    chin = min(height, y + round(_CHIN * h))
    top = max(0, y + 2 * bbox_shift)
    if top >= chin - 1:
        raise AvatarError(
            f"bbox_shift={bbox_shift} moves the top of the face box (row {top}) below the chin "
            f"(row {chin}); use a smaller value"
        )
    x1, x2 = max(0, x), min(width, x + w)
    return Corners(x1, top, x2, min(height, chin + extra_margin))


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


def blend_mask(
    face: Corners,
    frame_size: tuple[int, int],
    *,
    expand: float = CROP_EXPAND,
    upper_boundary_ratio: float = UPPER_BOUNDARY_RATIO,
) -> tuple[Corners, U8]:
    """The blend crop box (clipped to the frame) and its uint8 mask (upstream
    ``get_image_prepare_material``, with an ellipse in place of face parsing).

    The mask is laid out on the unclipped crop box, so a face at the frame edge keeps the
    mask it would have in the middle, and then cut to the clipped box.
    """
    full = crop_box(face, expand)
    cx1, cy1, cx2, cy2 = full
    side_w, side_h = cx2 - cx1, cy2 - cy1
    mask = np.zeros((side_h, side_w), np.uint8)
    x1, y1, x2, y2 = face
    # The ellipse inscribed in the face box, sampled at pixel centres.
    a, b = max(x2 - x1, 1) / 2, max(y2 - y1, 1) / 2
    ex, ey = (x1 + x2) / 2, (y1 + y2) / 2
    fx1, fy1 = max(x1, cx1), max(y1, cy1)
    fx2, fy2 = min(x2, cx2), min(y2, cy2)
    if fx2 > fx1 and fy2 > fy1:
        cols = (np.arange(fx1, fx2, dtype=np.float32) + 0.5 - ex) / a
        rows = (np.arange(fy1, fy2, dtype=np.float32) + 0.5 - ey) / b
        inside = rows[:, None] ** 2 + cols[None, :] ** 2 <= 1.0
        mask[fy1 - cy1 : fy2 - cy1, fx1 - cx1 : fx2 - cx1][inside] = 255
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


# --------------------------------------------------------------------------------------------
# Preparation


def prepare_musetalk_avatar(
    source: str | os.PathLike[str] | np.ndarray[Any, Any],
    encode: EncodeFn,
    *,
    encoder_id: str,
    cache_dir: str | os.PathLike[str] | None = None,
    bbox_shift: int = 0,
    extra_margin: int = 10,
    max_frames: int = 250,
    max_seconds: float = 10.0,
    fps: float | None = 25.0,
    batch_size: int = 8,
    progress: bool | ProgressFn = False,
) -> MuseTalkAvatar:
    """Prepare (or load from ``cache_dir``) the MuseTalk material for an avatar source.

    ``source`` is a picture or video file, or a uint8 RGB picture. ``encode`` maps
    (B, 256, 256, 3) uint8 RGB crops to (B, 4, 32, 32) scaled latents; it is called with
    ``2 * batch_size`` crops at a time (masked crops, then the same frames' reference crops) and
    not at all on a cache hit. ``encoder_id`` names its weights and keys the cache with the
    source's content hash and the settings. ``progress`` shows a tqdm bar when True, or is
    called as ``(stage, done, total)``.

    Raises :class:`AvatarError` when the source cannot be read and :class:`NoFaceError` when
    no frame shows a frontal face.
    """
    if max_frames < 1 or batch_size < 1:
        raise ValueError("max_frames and batch_size must be at least 1")
    settings = MaterialSettings(
        encoder_id=encoder_id,
        bbox_shift=bbox_shift,
        extra_margin=extra_margin,
        max_frames=max_frames,
        max_seconds=max_seconds,
        fps=fps,
    )
    picture: U8 | None = None
    path: Path | None = None
    if isinstance(source, np.ndarray):
        picture = as_rgb(source)
        digest = image_digest(picture)
        name = "the image"
    else:
        path = Path(source)
        if not path.is_file():
            raise AvatarError(f"avatar file not found: {path}")
        digest = _file_digest(path)
        name = path.name

    cache_path = None
    if cache_dir is not None:
        key = _key(digest, settings)
        cache_path = Path(cache_dir) / f"musetalk-avatar-v{CACHE_VERSION}-{key}.npz"
        cached = _load_cache(cache_path, digest, settings)
        if cached is not None:
            logger.info("MuseTalk avatar loaded from cache %s", cache_path)
            return cached

    if picture is not None:
        frames = [normalise_size(picture)]
    else:
        assert path is not None
        frames = _read_source(path, settings)
    report = _reporter(progress)
    boxes = _face_boxes(frames, name, settings, report)
    crops = np.stack([face_crop(f, b) for f, b in zip(frames, boxes, strict=True)])
    latents = _encode(crops, encode, batch_size, report)
    size = (int(frames[0].shape[1]), int(frames[0].shape[0]))
    material = [blend_mask(b, size) for b in boxes]
    unique = _Unique(
        frames=np.stack(frames),
        face_boxes=np.asarray(boxes, np.int32),
        crop_boxes=np.asarray([c for c, _ in material], np.int32),
        masks=[m for _, m in material],
        latents=latents,
    )
    logger.info(
        "MuseTalk avatar prepared from %s: %d frame(s) %dx%d, face box %s",
        name,
        len(frames),
        size[0],
        size[1],
        boxes[0],
    )
    if cache_path is not None:
        _save_cache(unique, cache_path, digest, settings)
    return unique.cycle(digest, settings, cache_hit=False)


@dataclass
class _Unique:
    """Per distinct source frame, before the ping-pong cycle is laid out."""

    frames: U8
    face_boxes: I32
    crop_boxes: I32
    masks: list[U8]
    latents: F32

    def cycle(self, digest: str, settings: MaterialSettings, *, cache_hit: bool) -> MuseTalkAvatar:
        n = len(self.frames)
        # Upstream's idle loop: forwards then backwards; a still picture is its own loop.
        order = list(range(n)) + list(range(n - 1, -1, -1)) if n > 1 else [0]
        views = list(self.frames)  # one view per frame, shared by both its cycle slots
        return MuseTalkAvatar(
            frames=tuple(views[i] for i in order),
            face_boxes=np.ascontiguousarray(self.face_boxes[order]),
            crop_boxes=np.ascontiguousarray(self.crop_boxes[order]),
            masks=tuple(self.masks[i] for i in order),
            latents=np.ascontiguousarray(self.latents[order]),
            digest=digest,
            settings=settings,
            source_frames=n,
            cache_hit=cache_hit,
        )


def _reporter(progress: bool | ProgressFn) -> ProgressFn | None:
    if callable(progress):
        return progress
    if not progress:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm comes with diffusers

        def log(stage: str, done: int, total: int) -> None:
            logger.info("avatar %s: %d/%d", stage, done, total)

        return log
    bars: dict[str, Any] = {}

    def bar(stage: str, done: int, total: int) -> None:
        b = bars.get(stage)
        if b is None:
            b = bars[stage] = tqdm(total=total, desc=f"avatar {stage}", unit="frame")
        b.update(done - b.n)
        if done >= total:
            b.close()

    return bar


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _key(digest: str, settings: MaterialSettings) -> str:
    blob = json.dumps(
        {"v": CACHE_VERSION, "source": digest, **dataclasses.asdict(settings)}, sort_keys=True
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def _read_source(path: Path, settings: MaterialSettings) -> list[U8]:
    if cv2.haveImageReader(str(path)):
        bgr = cv2.imread(str(path), cv2.IMREAD_COLOR)
        if bgr is not None:
            return [normalise_size(np.asarray(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB), np.uint8))]
    frames = _read_video(path, settings)
    if not frames:
        raise AvatarError(
            f"cannot read {path} as an image or a video; use a PNG/JPEG portrait or a video file"
        )
    return frames


def _read_video(path: Path, settings: MaterialSettings) -> list[U8]:
    """Frames of a video as normalised uint8 RGB, resampled to ``settings.fps`` (nearest frame
    in time) and capped at ``max_frames`` and ``max_seconds``."""
    import av

    fps = settings.fps
    limit = settings.max_frames
    if fps is not None:
        limit = min(limit, max(1, int(settings.max_seconds * fps + 1e-9)))
    out: list[U8] = []
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                return []
            stream = container.streams.video[0]
            rate = float(stream.average_rate) if stream.average_rate else (fps or 25.0)
            src_step = 1.0 / rate
            step = 1.0 / fps if fps is not None else 0.0
            prev: _Decoded | None = None
            t0: float | None = None
            k = 0
            for i, frame in enumerate(container.decode(stream)):
                t = float(frame.time) if frame.time is not None else i * src_step
                t0 = t if t0 is None else t0
                cur = _Decoded(t - t0, frame)
                if fps is None:
                    if cur.t > settings.max_seconds:
                        break
                    out.append(cur.rgb())
                else:
                    while k < limit and k * step <= cur.t + 1e-6:
                        target = k * step
                        near_prev = prev is not None and target - prev.t < cur.t - target
                        out.append(prev.rgb() if near_prev and prev is not None else cur.rgb())
                        k += 1
                    prev = cur
                if len(out) >= limit:
                    break
            else:
                # The stream ended: the last frame covers its own duration.
                while fps is not None and prev is not None and k < limit:
                    if k * step >= prev.t + src_step / 2:
                        break
                    out.append(prev.rgb())
                    k += 1
    except (av.error.FFmpegError, OSError, ValueError, IndexError) as exc:
        if not out:
            logger.debug("cannot decode %s as video: %s", path, exc)
            return []
        logger.warning("video %s ends early after %d frames: %s", path, len(out), exc)
    return out[:limit]


class _Decoded:
    """A decoded video frame and its time, converted to normalised RGB once, when first used."""

    def __init__(self, t: float, frame: Any) -> None:
        self.t = t
        self._frame = frame
        self._rgb: U8 | None = None

    def rgb(self) -> U8:
        if self._rgb is None:
            self._rgb = normalise_size(np.asarray(self._frame.to_ndarray(format="rgb24"), np.uint8))
        return self._rgb


def _face_boxes(
    frames: list[U8], name: str, settings: MaterialSettings, report: ProgressFn | None
) -> list[Corners]:
    n = len(frames)
    found: list[Box | None] = []
    error: NoFaceError | None = None
    for i, frame in enumerate(frames):
        try:
            found.append(detect_face(frame, name))
        except NoFaceError as exc:
            if n == 1:
                raise
            found.append(None)
            error = exc
        if report is not None:
            report("faces", i + 1, n)
    good = [i for i, b in enumerate(found) if b is not None]
    if not good:
        assert error is not None
        raise NoFaceError(f"{error} (none in any of its {n} frames)")
    if len(good) < n:
        logger.info("no face found in %d of %d frames; using the nearest frame's", n - len(good), n)
    filled = np.array(
        [found[min(good, key=lambda g: abs(g - i))] for i in range(n)], np.float64
    )  # (n, 4) x, y, w, h
    if n > 1:
        half = _SMOOTH // 2
        filled = np.array(
            [filled[max(0, i - half) : i + half + 1].mean(axis=0) for i in range(n)], np.float64
        )
    size = (int(frames[0].shape[1]), int(frames[0].shape[0]))
    return [
        musetalk_box(
            Box(round(x), round(y), round(w), round(h)),
            size,
            bbox_shift=settings.bbox_shift,
            extra_margin=settings.extra_margin,
        )
        for x, y, w, h in filled
    ]


def _encode(crops: U8, encode: EncodeFn, batch_size: int, report: ProgressFn | None) -> F32:
    n = len(crops)
    latents = np.empty((n, *LATENT_SHAPE), np.float32)
    half = LATENT_SHAPE[0] // 2
    for start in range(0, n, batch_size):
        ref = crops[start : start + batch_size]
        b = len(ref)
        out = np.asarray(encode(np.concatenate([masked_crop(ref), ref])), np.float32)
        if out.shape != (2 * b, half, *LATENT_SHAPE[1:]):
            raise ValueError(
                f"encode returned shape {out.shape} for {2 * b} crops; "
                f"expected {(2 * b, half, *LATENT_SHAPE[1:])}"
            )
        latents[start : start + b, :half] = out[:b]
        latents[start : start + b, half:] = out[b:]
        if report is not None:
            report("latents", start + b, n)
    return latents


# --------------------------------------------------------------------------------------------
# Cache


def _save_cache(unique: _Unique, path: Path, digest: str, settings: MaterialSettings) -> None:
    shapes = np.asarray([m.shape for m in unique.masks], np.int32)
    arrays: dict[str, Any] = {
        "_version": np.asarray(CACHE_VERSION),
        "_digest": np.asarray(digest),
        "_settings": np.asarray(json.dumps(dataclasses.asdict(settings), sort_keys=True)),
        "frames": unique.frames,
        "face_boxes": unique.face_boxes,
        "crop_boxes": unique.crop_boxes,
        "mask_shapes": shapes,
        "mask_data": np.concatenate([m.ravel() for m in unique.masks]),
        "latents": unique.latents,
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write then rename: a reader never sees half a file, even with two servers starting.
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".npz.tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                np.savez(fh, **arrays)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        # A read-only cache directory costs the next start a preparation, nothing more.
        logger.warning("could not write MuseTalk avatar cache %s: %s", path, exc)


def _load_cache(path: Path, digest: str, settings: MaterialSettings) -> MuseTalkAvatar | None:
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as data:
            if int(data["_version"]) != CACHE_VERSION or str(data["_digest"]) != digest:
                return None
            if json.loads(str(data["_settings"])) != dataclasses.asdict(settings):
                return None
            frames = np.asarray(data["frames"], np.uint8)
            n = len(frames)
            face_boxes = np.asarray(data["face_boxes"], np.int32)
            crop_boxes = np.asarray(data["crop_boxes"], np.int32)
            shapes = np.asarray(data["mask_shapes"], np.int64)
            mask_data = np.asarray(data["mask_data"], np.uint8)
            latents = np.asarray(data["latents"], np.float32)
        if frames.ndim != 4 or n == 0 or frames.shape[3] != 3:
            raise ValueError(f"frames of shape {frames.shape}")
        for name, arr, shape in (
            ("face_boxes", face_boxes, (n, 4)),
            ("crop_boxes", crop_boxes, (n, 4)),
            ("mask_shapes", shapes, (n, 2)),
            ("latents", latents, (n, *LATENT_SHAPE)),
        ):
            if arr.shape != shape:
                raise ValueError(f"{name} of shape {arr.shape}, expected {shape}")
        sizes = shapes.prod(axis=1)
        if int(sizes.sum()) != mask_data.size:
            raise ValueError("mask data does not match the mask shapes")
        widths = crop_boxes[:, 2] - crop_boxes[:, 0]
        heights = crop_boxes[:, 3] - crop_boxes[:, 1]
        if not (np.array_equal(shapes[:, 0], heights) and np.array_equal(shapes[:, 1], widths)):
            raise ValueError("mask shapes do not match the crop boxes")
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        masks = [
            mask_data[offsets[i] : offsets[i + 1]].reshape(int(shapes[i, 0]), int(shapes[i, 1]))
            for i in range(n)
        ]
        unique = _Unique(frames, face_boxes, crop_boxes, masks, latents)
        return unique.cycle(digest, settings, cache_hit=True)
    except (OSError, KeyError, ValueError, TypeError, EOFError, zipfile.BadZipFile) as exc:
        logger.warning("ignoring unreadable MuseTalk avatar cache %s: %s", path, exc)
        return None
