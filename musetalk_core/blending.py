"""Paste a generated 256x256 face back into its avatar frame (upstream ``get_image_blending``).

Upstream resizes the face to the face box, pastes it into a copy of the 1.5x crop box and
pastes that crop into the frame through the blend mask, with PIL, on whole frames. Outside the
face box the pasted crop *is* the frame, so only face-box pixels can change; the functions here
touch only that region (face box within the crop box) and leave every other pixel as it was:

* :func:`blend_crop`: numpy integer alpha blend with PIL's rounding, the CPU path.
* :func:`blend_crop_torch`: the same on a batch of tensors on the model's device, so decoded
  faces need not go back to the CPU before blending.
* :func:`blend_full_frame`: the naive whole-frame float version, kept for benchmarks only.

The face is resized with bilinear interpolation (``cv2.INTER_LINEAR``, upstream's
``cv2.resize`` default; ``interpolate(mode="bilinear")`` on tensors). Masks are uint8 0..255
with the shape of the (clipped) crop box, as :func:`musetalk_core.musetalk_geometry.blend_mask`
makes.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import cv2
import numpy as np
import numpy.typing as npt

from .boxes import Corners
from .musetalk_geometry import FACE_SIZE, blend_mask

if TYPE_CHECKING:
    import torch

__all__ = ["blend_crop", "blend_crop_torch", "blend_full_frame", "time_blends"]

U8 = npt.NDArray[np.uint8]


def _region(
    face_box: Corners, crop_box: Corners, mask_shape: tuple[int, ...], frame_shape: tuple[int, ...]
) -> Corners | None:
    """The pixels a blend may change: face box within crop box within the frame."""
    cx1, cy1, cx2, cy2 = crop_box
    if tuple(mask_shape[:2]) != (cy2 - cy1, cx2 - cx1):
        raise ValueError(f"mask of shape {mask_shape[:2]} does not fit crop box {crop_box}")
    fx1, fy1, fx2, fy2 = face_box
    if fx2 <= fx1 or fy2 <= fy1:
        raise ValueError(f"empty face box {face_box}")
    x1, y1 = max(fx1, cx1, 0), max(fy1, cy1, 0)
    x2, y2 = min(fx2, cx2, frame_shape[1]), min(fy2, cy2, frame_shape[0])
    if x2 <= x1 or y2 <= y1:
        return None
    return Corners(x1, y1, x2, y2)


def _resized_face(face256: U8, face_box: Corners) -> U8:
    fx1, fy1, fx2, fy2 = face_box
    resized = cv2.resize(face256, (fx2 - fx1, fy2 - fy1), interpolation=cv2.INTER_LINEAR)
    return np.asarray(resized, np.uint8)


def blend_crop(frame: U8, face256: U8, face_box: Corners, crop_box: Corners, mask: U8) -> U8:
    """A copy of ``frame`` (H, W, 3) with ``face256`` (256, 256, 3) blended into ``face_box``.

    ``mask`` (uint8, the crop box's shape) weights the face against the frame. The result is
    ``(face * m + frame * (255 - m)) / 255`` rounded as PIL's ``paste`` rounds; where
    ``m == 0`` and outside the face box the frame comes back bit for bit.
    """
    out = frame.copy()
    region = _region(face_box, crop_box, mask.shape, frame.shape)
    if region is None:
        return out
    x1, y1, x2, y2 = region
    fx1, fy1, _, _ = face_box
    cx1, cy1, _, _ = crop_box
    face = _resized_face(face256, face_box)[y1 - fy1 : y2 - fy1, x1 - fx1 : x2 - fx1]
    m = mask[y1 - cy1 : y2 - cy1, x1 - cx1 : x2 - cx1, None].astype(np.uint16)
    body = out[y1:y2, x1:x2]
    # uint16 is enough: 255 * 255 + 128 + 255 < 65536. DIV255 as PIL's ImagingPaste rounds it.
    v = body.astype(np.uint16) * (255 - m) + face.astype(np.uint16) * m + 128
    body[...] = (v + (v >> 8)) >> 8
    return out


def blend_full_frame(frame: U8, face256: U8, face_box: Corners, crop_box: Corners, mask: U8) -> U8:
    """:func:`blend_crop` the naive way, like upstream's whole-frame PIL paste.

    Builds a full-frame float copy with the face pasted in and a full-frame float mask, then
    blends every pixel. Same result as :func:`blend_crop` within 1 (rounding); for benchmarks.
    """
    h, w = frame.shape[:2]
    body = frame.astype(np.float32)
    pasted = body.copy()
    full_mask = np.zeros((h, w, 1), np.float32)
    region = _region(face_box, crop_box, mask.shape, frame.shape)
    if region is not None:
        x1, y1, x2, y2 = region
        fx1, fy1, _, _ = face_box
        cx1, cy1, cx2, cy2 = crop_box
        face = _resized_face(face256, face_box)
        pasted[y1:y2, x1:x2] = face[y1 - fy1 : y2 - fy1, x1 - fx1 : x2 - fx1]
        full_mask[cy1:cy2, cx1:cx2, 0] = mask / np.float32(255.0)
    out = body * (1.0 - full_mask) + pasted * full_mask
    return np.asarray(np.clip(np.rint(out), 0, 255), np.uint8)


def blend_crop_torch(
    frames: torch.Tensor,
    faces: torch.Tensor,
    face_boxes: Sequence[Corners],
    crop_boxes: Sequence[Corners],
    masks: Sequence[torch.Tensor],
) -> torch.Tensor:
    """:func:`blend_crop` for a batch, on the tensors' device.

    ``frames`` (B, H, W, 3) uint8, ``faces`` (B, 256, 256, 3) uint8 or float in 0..255 (what
    the VAE decoder gives), per item a face box, a crop box and a mask tensor with the crop
    box's shape (uint8 0..255, or float 0..1). Returns new (B, H, W, 3) uint8 frames.

    Results differ from :func:`blend_crop` by at most 2: OpenCV resizes uint8 with fixed-point
    weights and rounds the resized face to integers, this path interpolates and blends in
    float32 and rounds once (half to even).
    """
    import torch
    import torch.nn.functional as F

    if frames.dtype != torch.uint8 or frames.ndim != 4 or frames.shape[3] != 3:
        raise ValueError(f"frames must be (B, H, W, 3) uint8, got {tuple(frames.shape)}")
    if faces.ndim != 4 or tuple(faces.shape[1:]) != (FACE_SIZE, FACE_SIZE, 3):
        raise ValueError(f"faces must be (B, 256, 256, 3), got {tuple(faces.shape)}")
    batch = frames.shape[0]
    if not (faces.shape[0] == len(face_boxes) == len(crop_boxes) == len(masks) == batch):
        raise ValueError("frames, faces, face_boxes, crop_boxes and masks differ in length")
    out = frames.clone()
    # (B, 3, 256, 256) float once for the whole batch: interpolate wants channels first.
    chw = faces.permute(0, 3, 1, 2).float()
    for i in range(batch):
        mask = masks[i]
        region = _region(face_boxes[i], crop_boxes[i], tuple(mask.shape), tuple(frames.shape[1:]))
        if region is None:
            continue
        x1, y1, x2, y2 = region
        fx1, fy1, fx2, fy2 = face_boxes[i]
        cx1, cy1, _, _ = crop_boxes[i]
        face = F.interpolate(
            chw[i : i + 1], size=(fy2 - fy1, fx2 - fx1), mode="bilinear", align_corners=False
        )[0]
        face = face[:, y1 - fy1 : y2 - fy1, x1 - fx1 : x2 - fx1].permute(1, 2, 0)
        m = mask[y1 - cy1 : y2 - cy1, x1 - cx1 : x2 - cx1]
        weight = m.float() / 255.0 if m.dtype == torch.uint8 else m.float()
        body = out[i, y1:y2, x1:x2].float()
        blended = body + (face.clamp(0.0, 255.0) - body) * weight[..., None]
        out[i, y1:y2, x1:x2] = blended.round().clamp(0.0, 255.0).to(torch.uint8)
    return out


def time_blends(
    frame_size: tuple[int, int] = (1280, 720),
    n: int = 50,
    *,
    torch_device: str | None = None,
    seed: int = 0,
) -> dict[str, float]:
    """Median milliseconds per frame of each blend on a synthetic ``frame_size`` (w, h) frame.

    The face box is a third of the frame height wide, as in a head-and-shoulders shot. Keys:
    ``crop_ms`` (:func:`blend_crop`), ``full_frame_ms`` (:func:`blend_full_frame`) and, with
    ``torch_device``, ``torch_ms`` (:func:`blend_crop_torch`, one frame per call, device
    synchronised, frame already on the device), plus ``face_w`` and ``face_h``.
    """
    width, height = frame_size
    rng = np.random.default_rng(seed)
    frame = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    face256 = rng.integers(0, 256, (FACE_SIZE, FACE_SIZE, 3), dtype=np.uint8)
    fw = height // 3
    fh = round(fw * 1.25)
    x1, y1 = (width - fw) // 2, max(0, height // 2 - fh // 2 - height // 10)
    face_box = Corners(x1, y1, x1 + fw, min(height, y1 + fh))
    crop, mask = blend_mask(face_box, frame_size)

    def median_ms(fn: Callable[[], object]) -> float:
        fn()  # warm-up
        samples = []
        for _ in range(max(1, n)):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1000.0)
        return statistics.median(samples)

    result = {
        "crop_ms": median_ms(lambda: blend_crop(frame, face256, face_box, crop, mask)),
        "full_frame_ms": median_ms(lambda: blend_full_frame(frame, face256, face_box, crop, mask)),
        "face_w": float(face_box[2] - face_box[0]),
        "face_h": float(face_box[3] - face_box[1]),
    }
    if torch_device is not None:
        import torch

        device = torch.device(torch_device)
        frames_t = torch.from_numpy(frame)[None].to(device)
        faces_t = torch.from_numpy(face256)[None].to(device)
        mask_t = torch.from_numpy(mask).to(device)

        def run_torch() -> None:
            blend_crop_torch(frames_t, faces_t, [face_box], [crop], [mask_t])
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        result["torch_ms"] = median_ms(run_torch)
    return result
