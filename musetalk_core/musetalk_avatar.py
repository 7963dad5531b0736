"""Avatar preparation for MuseTalk 1.5: face boxes, 256x256 crops, VAE latents, blend masks.

This is our version of upstream's ``Avatar.prepare_material`` (``scripts/realtime_inference.py``),
done once per avatar source and cached on disk:

1. Read the source: one picture, or up to ``max_frames`` frames of a video resampled to ``fps``,
   and frame it (:mod:`musetalk_core.framing`; by default head and shoulders at 512x512, the
   crop following a video's head smoothly).
2. Find the face mesh in every frame and turn it into MuseTalk's face box, ``(x1, y1, x2, y2)``.
3. Crop the face box, resize it to 256x256 (Lanczos) and encode the crop twice with the caller's
   VAE: once with its lower half black (the part the UNet repaints) and once whole (the
   reference). Per frame the UNet input is the two latents stacked, ``(8, 32, 32)``.
4. Build the blend mask that pastes a generated face back: over a crop box 1.5x the face box,
   the lower face less the nose, feathered.
5. A video plays as an idle loop: frames then the same frames reversed (ping-pong), and every
   per-frame array follows the same cycle.

The geometry (face box, crop, blend mask) is :mod:`musetalk_core.musetalk_geometry`'s, from the
face mesh of :mod:`musetalk_core.landmarks`. A video's landmarks are tracked from frame to
frame and smoothed with a centred 5-frame moving average, so boxes and masks do not jitter; a
frame without a face takes the landmarks of the nearest frame with one.
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

from .boxes import Corners
from .framing import check_framing, frame_pictures
from .landmarks import FaceLandmarks, find_landmarks, track_landmarks
from .musetalk_geometry import LowerFace, blend_mask, face_crop, masked_crop, musetalk_box
from .types import AvatarError, NoFaceError
from .warp_avatar import as_rgb, image_digest, min_face_size, normalise_size

__all__ = [
    "EncodeFn",
    "MaterialSettings",
    "MuseTalkAvatar",
    "ProgressFn",
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

LATENT_SHAPE = (8, 32, 32)
"""Per frame: masked-crop latent (4 channels) then reference latent (4 channels)."""
CACHE_VERSION = 3
"""Bump whenever the meaning of a cached array changes, so stale caches are ignored."""

_SMOOTH = 5
"""Frames in the centred moving average over video face boxes."""


@dataclass(frozen=True)
class MaterialSettings:
    """What the prepared material depends on besides the source; all of it keys the cache."""

    encoder_id: str
    """Names the VAE weights that made the latents."""
    bbox_shift: int = 0
    """Moves the half-face line down by ``bbox_shift`` pixels (the top edge by twice that)."""
    extra_margin: int = 10
    """Pixels added below the chin (v1.5), so an opening jaw stays inside the box."""
    max_frames: int = 250
    """Most video frames read (the idle loop then has twice as many)."""
    max_seconds: float = 10.0
    """Most seconds of video read."""
    fps: float | None = 25.0
    """Video frames are resampled to this rate (MuseTalk is trained at 25); None keeps all."""
    framing: str = "head"
    """How the source is framed (:data:`musetalk_core.framing.FRAMINGS`)."""


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
    source_crops: F32
    """(L, 6): the region of the source frame each frame shows and the size it was scaled to
    (:meth:`musetalk_core.framing.Crop.as_array`)."""
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
    framing: str = "head",
    batch_size: int = 8,
    progress: bool | ProgressFn = False,
) -> MuseTalkAvatar:
    """Prepare (or load from ``cache_dir``) the MuseTalk material for an avatar source.

    ``source`` is a picture or video file, or a uint8 RGB picture. ``encode`` maps
    (B, 256, 256, 3) uint8 RGB crops to (B, 4, 32, 32) scaled latents; it is called with
    ``2 * batch_size`` crops at a time (masked crops, then the same frames' reference crops) and
    not at all on a cache hit. ``encoder_id`` names its weights and keys the cache with the
    source's content hash and the settings, ``framing`` among them (``head`` and shoulders,
    or the ``full`` picture: :mod:`musetalk_core.framing`). ``progress`` shows a tqdm bar when
    True, or is called as ``(stage, done, total)``.

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
        framing=check_framing(framing),
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
    frames, framed = frame_pictures(
        frames, settings.framing, name, fps=settings.fps, min_face=min_face_size(frames[0])
    )
    report = _reporter(progress)
    geometry = _face_geometry(frames, name, settings, report)
    boxes = [box for box, _ in geometry]
    crops = np.stack([face_crop(f, b) for f, b in zip(frames, boxes, strict=True)])
    latents = _encode(crops, encode, batch_size, report)
    size = (int(frames[0].shape[1]), int(frames[0].shape[0]))
    material = [blend_mask(box, size, lower) for box, lower in geometry]
    unique = _Unique(
        frames=np.stack(frames),
        face_boxes=np.asarray(boxes, np.int32),
        crop_boxes=np.asarray([c for c, _ in material], np.int32),
        masks=[m for _, m in material],
        latents=latents,
        source_crops=np.stack([c.as_array() for c in framed]),
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
    source_crops: F32

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
            source_crops=np.ascontiguousarray(self.source_crops[order]),
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


def _face_geometry(
    frames: list[U8], name: str, settings: MaterialSettings, report: ProgressFn | None
) -> list[tuple[Corners, LowerFace]]:
    """Per frame: MuseTalk's face box and the lower face its mask is drawn from."""
    n = len(frames)

    def progress(done: int) -> None:
        if report is not None:
            report("faces", done, n)

    if n == 1:
        # One picture: the detector's own error says why no face was found.
        found: list[FaceLandmarks | None] = [find_landmarks(frames[0], name)]
        progress(1)
    else:
        found = track_landmarks(frames, name, progress=progress)
    good = [i for i, f in enumerate(found) if f is not None]
    if not good:
        raise NoFaceError(
            f"no frontal face found in {name} (none in any of its {n} frames); use a video "
            "of a frontal face, well lit and looking at the camera"
        )
    if len(good) < n:
        logger.info("no face found in %d of %d frames; using the nearest frame's", n - len(good), n)
    nearest = [found[min(good, key=lambda g: abs(g - i))] for i in range(n)]
    points = np.stack([f.points for f in nearest if f is not None])  # (n, 468, 2)
    if n > 1:
        half = _SMOOTH // 2
        points = np.stack(
            [points[max(0, i - half) : i + half + 1].mean(axis=0) for i in range(n)]
        ).astype(np.float32)
    size = (int(frames[0].shape[1]), int(frames[0].shape[0]))
    out = []
    for f, p in zip(nearest, points, strict=True):
        assert f is not None
        smooth = dataclasses.replace(f, points=p)
        box = musetalk_box(
            smooth, size, bbox_shift=settings.bbox_shift, extra_margin=settings.extra_margin
        )
        out.append((box, LowerFace.from_landmarks(smooth)))
    return out


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
        "source_crops": unique.source_crops,
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
            source_crops = np.asarray(data["source_crops"], np.float32)
        if frames.ndim != 4 or n == 0 or frames.shape[3] != 3:
            raise ValueError(f"frames of shape {frames.shape}")
        for name, arr, shape in (
            ("face_boxes", face_boxes, (n, 4)),
            ("crop_boxes", crop_boxes, (n, 4)),
            ("mask_shapes", shapes, (n, 2)),
            ("latents", latents, (n, *LATENT_SHAPE)),
            ("source_crops", source_crops, (n, 6)),
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
        unique = _Unique(frames, face_boxes, crop_boxes, masks, latents, source_crops)
        return unique.cycle(digest, settings, cache_hit=True)
    except (OSError, KeyError, ValueError, TypeError, EOFError, zipfile.BadZipFile) as exc:
        logger.warning("ignoring unreadable MuseTalk avatar cache %s: %s", path, exc)
        return None
