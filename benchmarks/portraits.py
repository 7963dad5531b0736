"""Public-domain portraits shipped by packages, for benchmarks and tests (beside the built-in
one, :func:`musetalk_core.warp_avatar.builtin_portrait`)."""

from __future__ import annotations

import cv2
import numpy as np
import numpy.typing as npt

U8 = npt.NDArray[np.uint8]


def grace_hopper() -> U8 | None:
    """matplotlib's sample photograph of Grace Hopper (US Navy, public domain), uint8 RGB
    512x600; None where matplotlib or its sample data is missing."""
    try:
        import matplotlib.cbook as cbook

        path = cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)
    except (ImportError, OSError, ValueError):
        return None
    bgr = cv2.imread(str(path), cv2.IMREAD_COLOR)
    if bgr is None:
        return None
    return np.ascontiguousarray(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB), dtype=np.uint8)
