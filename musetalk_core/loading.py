"""The one way to load MuseTalk: weights onto their device, an avatar's material, the runtime.

The server (``rtc_server.engine_factory``), ``avatar-rtc prepare-avatar`` and ``avatar-rtc
bench engine --engine musetalk`` all go through :func:`load_musetalk`, so a change to how the
release is loaded, compiled or keyed in the cache is made once.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .models import MuseTalkModels, Placement, load_models, resolve_placement
from .musetalk_avatar import MuseTalkAvatar, ProgressFn, prepare_musetalk_avatar
from .runtime import MuseTalkRuntime
from .weights import weights_id


@dataclass(frozen=True, slots=True)
class LoadedMuseTalk:
    """A release on its device and one avatar's material: what a runtime is made of."""

    models: MuseTalkModels
    material: MuseTalkAvatar
    placement: Placement
    load_ms: float
    """Time to load the weights (not the avatar material, which may be a cache hit)."""

    def runtime(
        self, *, fps: int = 25, sample_rate: int = 48_000, max_batch: int = 16, first_batch: int = 2
    ) -> MuseTalkRuntime:
        """The shared inference runtime every call's ``MuseTalkEngine`` feeds."""
        return MuseTalkRuntime(
            self.models,
            self.material,
            fps=fps,
            sample_rate=sample_rate,
            max_batch=max_batch,
            first_batch=first_batch,
        )


def load_musetalk(
    weights_dir: str | os.PathLike[str],
    source: str | os.PathLike[str] | np.ndarray[Any, Any],
    *,
    cache_dir: str | os.PathLike[str],
    device: str = "auto",
    compile_models: bool = False,
    encoder_id: str | None = None,
    bbox_shift: int = 0,
    extra_margin: int = 10,
    framing: str = "head",
    progress: bool | ProgressFn = False,
) -> LoadedMuseTalk:
    """Load the release in ``weights_dir`` and prepare (or take from ``cache_dir``) the
    material of the avatar ``source`` (a picture or video file, or an RGB picture).

    ``encoder_id`` keys the material cache (default: the weights' own id, so new weights
    never reuse material encoded by old ones); ``framing`` is :mod:`musetalk_core.framing`'s
    (``head`` or ``full``). Raises ``WeightsError`` for a broken release, ``AvatarError`` /
    ``NoFaceError`` for a source without a usable face.
    """
    placement = resolve_placement(device)
    started = time.perf_counter()
    models = load_models(weights_dir, placement)
    load_ms = (time.perf_counter() - started) * 1000
    if compile_models:
        from .inference import compile_models as compile_all

        compile_all(models)
    material = prepare_musetalk_avatar(
        source,
        models.encode_crops,
        encoder_id=encoder_id or weights_id(Path(weights_dir)),
        cache_dir=cache_dir,
        bbox_shift=bbox_shift,
        extra_margin=extra_margin,
        framing=framing,
        progress=progress,
    )
    return LoadedMuseTalk(models, material, placement, load_ms)
