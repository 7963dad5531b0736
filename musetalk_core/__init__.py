"""Lip-sync engines for avatar-rtc: audio in, paired (video frame, audio slice) out.

The numpy-only seam (:mod:`musetalk_core.types`) imports nothing heavy. The avatar and ``warp``
engine names load OpenCV and are imported on first use, so ``from musetalk_core.types import
...`` stays cheap for packages that only need the data types.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .types import AudioChunk, AvatarFrame, LipSyncEngine

if TYPE_CHECKING:
    from .warp import WarpRenderer, mouth_shape
    from .warp_avatar import (
        AvatarError,
        NoFaceError,
        WarpAvatar,
        builtin_portrait,
        load_portrait,
        prepare_avatar,
    )
    from .warp_engine import WarpEngine

__all__ = [
    "AudioChunk",
    "AvatarError",
    "AvatarFrame",
    "LipSyncEngine",
    "NoFaceError",
    "WarpAvatar",
    "WarpEngine",
    "WarpRenderer",
    "builtin_portrait",
    "load_portrait",
    "mouth_shape",
    "prepare_avatar",
]

_LAZY = {
    "AvatarError": ".warp_avatar",
    "NoFaceError": ".warp_avatar",
    "WarpAvatar": ".warp_avatar",
    "builtin_portrait": ".warp_avatar",
    "load_portrait": ".warp_avatar",
    "prepare_avatar": ".warp_avatar",
    "WarpEngine": ".warp_engine",
    "WarpRenderer": ".warp",
    "mouth_shape": ".warp",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
