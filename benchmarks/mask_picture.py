"""Draw MuseTalk's two blend masks side by side: the ellipse in the face box we used before
landmarks, and the lower face from the face mesh (``docs/musetalk-mask.png``).

    python -m benchmarks.mask_picture [--out docs/musetalk-mask.png]

Faces: the built-in portrait and matplotlib's sample photograph of Grace Hopper (both public
domain). Each row shows the face box (white), the half-mask line (dashed), and the mask as a
red tint whose strength is the blend weight: left the ellipse, right the landmark mask.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import cv2
import numpy as np
import numpy.typing as npt

from benchmarks.portraits import grace_hopper
from musetalk_core.landmarks import find_landmarks
from musetalk_core.musetalk_geometry import LowerFace, blend_mask, musetalk_box
from musetalk_core.warp_avatar import builtin_portrait

U8 = npt.NDArray[np.uint8]


def _hopper() -> U8:
    picture = grace_hopper()
    if picture is None:
        raise SystemExit("matplotlib's sample grace_hopper.jpg is missing")
    return picture


def _panel(image: U8, box: tuple[int, int, int, int], crop: tuple[int, ...], mask: U8) -> U8:
    out = image.astype(np.float32)
    x1, y1, x2, y2 = crop
    weight = (mask.astype(np.float32) / 255.0)[:, :, None] * 0.6
    red = np.array([255.0, 40.0, 40.0], np.float32)
    out[y1:y2, x1:x2] += weight * (red - out[y1:y2, x1:x2])
    panel = np.ascontiguousarray(out.clip(0, 255).astype(np.uint8))
    bx1, by1, bx2, by2 = box
    cv2.rectangle(panel, (bx1, by1), (bx2 - 1, by2 - 1), (255, 255, 255), 1)
    half = (by1 + by2) // 2
    for x in range(bx1, bx2, 6):
        cv2.line(panel, (x, half), (min(x + 3, bx2 - 1), half), (255, 255, 255), 1)
    side = int(1.15 * max(x2 - x1, y2 - y1))
    cx, cy = (x1 + x2) // 2, (y1 + y2) // 2
    h, w = image.shape[:2]
    top, left = max(0, cy - side // 2), max(0, cx - side // 2)
    view = panel[top : min(h, top + side), left : min(w, left + side)]
    return np.asarray(cv2.resize(view, (320, 320), interpolation=cv2.INTER_AREA), np.uint8)


def render() -> U8:
    rows = []
    for image in (builtin_portrait(), _hopper()):
        marks = find_landmarks(image)
        size = (image.shape[1], image.shape[0])
        box = musetalk_box(marks, size)
        crop, ellipse = blend_mask(box, size)
        _, jaw = blend_mask(box, size, LowerFace.from_landmarks(marks))
        panels = [_panel(image, box, crop, ellipse), _panel(image, box, crop, jaw)]
        rows.append(np.concatenate(panels, axis=1))
    return np.concatenate(rows, axis=0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/musetalk-mask.png"))
    args = parser.parse_args(argv)
    picture = render()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    cv2.imwrite(str(args.out), cv2.cvtColor(picture, cv2.COLOR_RGB2BGR))
    print(f"wrote {args.out} ({picture.shape[1]}x{picture.shape[0]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
