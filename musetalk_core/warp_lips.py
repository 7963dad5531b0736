"""The warp engine's lip contacts: the mouth crops for "m", "b", "p" (lips sealed) and for "f",
"v" (the lower lip tucked under the upper teeth), one per step of how far the contact has gone.

Both raise the lower lip, and the jaw under it along the jaw's own profile, by remapping the
picture's mouth crop: no new pixels but the pressed lips' shadow and, for a picture that shows
no teeth, the teeth's edge over the tucked lip. :class:`~musetalk_core.warp.WarpRenderer` makes
each step once and blends or warps from it.
"""

from __future__ import annotations

import cv2
import numpy as np
import numpy.typing as npt

from .warp_avatar import WarpAvatar

__all__ = ["LEVELS", "sealed_mouth", "tucked_mouth"]

F32 = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]

LEVELS = 16
"""Steps of a contact (0..1): each step's mouth crop is made once."""
TUCK_CLOSE = 0.5
"""Share of the picture's lip gap the lower lip closes for "f": it stops at the upper teeth."""
TUCK_ROLL = 0.5
"""Share of the lower lip's height that rolls in under the teeth."""
TUCK_TEETH = 0.2
"""Height of the upper teeth's edge showing over the lower lip, in lower-lip heights."""
TUCK_ENAMEL = np.array([222.0, 216.0, 204.0], np.float32)
"""The teeth's edge where the picture shows no teeth to take the colour from."""


def _raised(src: U8, a: WarpAvatar, rows: F32, close: F32, lift: F32) -> F32:
    """``src`` with the lower lip's edge ``close`` higher (per column, anti-aliased) and the
    lip and jaw below it sampled ``lift`` lower: a ``lift`` beyond ``close`` hides the lip's
    top under whatever it meets."""
    dy = rows - a.mouth_seam[None, :]
    covered = np.clip(dy + close[None, :] + 0.5, 0.0, 1.0) * (dy <= 0)
    follow = np.where(dy > 0, np.maximum(a.mouth_lower, (dy <= 1.0)), covered)
    map_y = (a.mouth_grid_y + lift[None, :] * follow).astype(np.float32)
    return np.asarray(
        cv2.remap(src, a.mouth_grid_x, map_y, cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE),
        np.float32,
    )


def sealed_mouth(src: U8, a: WarpAvatar, rows: F32, c: float) -> U8:
    """The mouth crop with its lips brought together by ``c`` of their gap."""
    lift = c * a.mouth_gap
    sealed = _raised(src, a, rows, lift, lift)
    # Pressed lips: a faint shadow where they meet.
    meet = a.mouth_seam[None, :] - lift[None, :]
    line = np.exp(-(((rows - meet) / 0.8) ** 2)) * (c * (a.mouth_gap > 0.5))[None, :]
    sealed *= (1.0 - 0.25 * line)[:, :, None]
    return np.asarray(np.clip(sealed + 0.5, 0, 255), np.uint8)


def tucked_mouth(src: U8, a: WarpAvatar, rows: F32, k: float) -> U8:
    """The mouth crop with the lower lip ``k`` of the way to "f": raised to the upper teeth
    (half the gap closed), its upper part rolled in out of sight, the teeth's edge over it."""
    # The lower lip's height mid-mouth (inner to outer contour), tapering to the corners.
    lip_h = max(2.0, float(a.landmarks[17, 1] - a.landmarks[14, 1]))
    taper = np.clip(1.0 - a.mouth_u**2, 0.0, 1.0) ** 0.75
    close = k * TUCK_CLOSE * a.mouth_gap
    tuck = _raised(src, a, rows, close, close + k * TUCK_ROLL * lip_h * taper)
    # The upper teeth's edge over the lip: a band below where the lips now meet, brightest
    # mid-mouth, with a shadow under it where the lip is pressed in. Where the picture shows
    # its own teeth between the lips, they are that edge.
    meet = a.mouth_seam[None, :] - close[None, :]
    own = np.clip(1.0 - a.mouth_gap / 2.0, 0.0, 1.0)
    band = k * TUCK_TEETH * lip_h * (taper * own)[None, :]
    inside = np.clip(rows - meet + 0.5, 0.0, 1.0) * np.clip(meet + band - rows + 0.5, 0.0, 1.0)
    inside *= np.clip(2.0 * taper, 0.0, 1.0)[None, :] * a.mouth_mask
    # The picture's teeth colour is a guess when it shows none: an enamel white then.
    enamel = a.teeth_rgb if a.teeth_hint == 0.0 else TUCK_ENAMEL
    tuck += inside[:, :, None] * (enamel[None, None, :] - tuck)
    shadow = np.exp(-(((rows - meet - band - 0.7) / 0.9) ** 2)) * k * taper[None, :]
    tuck *= (1.0 - 0.3 * shadow * a.mouth_mask)[:, :, None]
    return np.asarray(np.clip(tuck + 0.5, 0, 255), np.uint8)
