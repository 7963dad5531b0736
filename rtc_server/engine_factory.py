"""Choosing and preparing the lip-sync engine once per process; one engine instance per call."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from musetalk_core.types import LipSyncEngine
from rtc_server.config import ServerConfig
from rtc_server.media.clock import AUDIO_RATE

logger = logging.getLogger(__name__)

VIDEO_FPS = 25


@dataclass(frozen=True, slots=True)
class EngineFactory:
    name: str
    """The engine chosen, e.g. "warp"."""
    reason: str
    """Why it was chosen (logged, shown by ``doctor``)."""
    create: Callable[[], LipSyncEngine]
    mouth_box: tuple[int, int, int, int] | None = None
    """(x, y, w, h) of the avatar's mouth in the frame, where the engine knows it."""
    notice: str | None = None
    """A problem every call should hear about (an ``error`` event), e.g. a fallback."""
    close: Callable[[], None] | None = None
    """Releases what the engine holds for the process (MuseTalk's worker thread)."""
    fallback: Callable[[], LipSyncEngine] | None = None
    """Makes the engine that takes a call over when this one fails mid-call (MuseTalk: warp)."""
    start: Callable[[], Awaitable[None]] | None = None
    """Run once on the server's event loop before the first call (a media worker connects to
    the MuseTalk engine process)."""


def load_engine_factory(config: ServerConfig) -> EngineFactory:
    """Prepare the avatar (face and mouth found, cached) and return a per-call engine maker.

    Raises ``musetalk_core.warp_avatar.AvatarError`` with a readable message for a bad portrait.
    """
    if config.engine.name == "sync-test":
        from musetalk_core.synctest import SyncTestEngine

        logger.info("lip-sync engine: sync-test (asked for: flash and beep once a second)")
        return EngineFactory(
            "sync-test",
            "asked for: a flash and a beep on the same instant, once a second",
            lambda: SyncTestEngine(fps=VIDEO_FPS, sample_rate=AUDIO_RATE),
        )
    from musetalk_core.i420 import PatchCache, i420_fits
    from musetalk_core.warp_avatar import builtin_portrait, load_portrait, prepare_avatar
    from musetalk_core.warp_engine import MOUTH_PATCHES_BYTES, WarpEngine

    image = (
        builtin_portrait() if config.engine.avatar is None else load_portrait(config.engine.avatar)
    )
    avatar = prepare_avatar(
        image, cache_dir=config.server.cache_dir / "avatars", framing=config.engine.framing
    )

    # I420 frames where the size allows: the sender encodes them without converting them.
    pixels = "yuv420p" if i420_fits(avatar.frame_size) else "rgb24"

    # Every call's engine reuses the mouths any of them drew (musetalk_core/warp_engine.py).
    patches = PatchCache(MOUTH_PATCHES_BYTES) if pixels == "yuv420p" else None

    def warp() -> LipSyncEngine:
        return WarpEngine(
            avatar, fps=VIDEO_FPS, sample_rate=AUDIO_RATE, pixel_format=pixels, patches=patches
        )

    notice = None
    if config.engine.name == "warp":
        reason = "engine 'warp' requested"
    else:
        if config.engine.musetalk_engine_socket is not None:
            # The front chose MuseTalk and runs it: this worker loads no model (nor torch).
            return _remote_musetalk(
                config.engine.musetalk_engine_socket,
                "the front's MuseTalk engine process",
                avatar.mouth_box,
                warp,
            )
        use, reason = musetalk_choice(config)
        if use:
            try:
                return _load_musetalk(
                    config,
                    reason,
                    avatar.mouth_box,
                    warp,
                )
            except Exception as exc:  # weights, import, out of memory: never a crash
                logger.exception("MuseTalk failed to load")
                reason = f"MuseTalk failed to load ({exc}); using the CPU 'warp' renderer"
                notice = reason
    logger.info("lip-sync engine: warp (%s)", reason)

    return EngineFactory("warp", reason, warp, mouth_box=avatar.mouth_box, notice=notice)


def weights_dir(config: ServerConfig) -> Path:
    from musetalk_core.weights import DEFAULT_WEIGHTS_DIR

    return (
        config.engine.weights_dir if config.engine.weights_dir is not None else DEFAULT_WEIGHTS_DIR
    )


def musetalk_choice(config: ServerConfig) -> tuple[bool, str]:
    """Whether to load MuseTalk, and why (``auto`` needs CUDA, the weights and the libraries)."""
    import importlib.util

    folder = weights_dir(config)
    missing = [m for m in ("torch", "diffusers", "transformers") if not importlib.util.find_spec(m)]
    if config.engine.name == "musetalk":
        if missing:
            libs = ", ".join(missing)
            return False, f"MuseTalk asked for, but {libs} not installed; using 'warp'"
        return True, f"engine 'musetalk' requested (weights in {folder})"
    if missing:
        return False, f"auto: {', '.join(missing)} not installed, using the CPU 'warp' renderer"
    from musetalk_core.weights import WeightsError, check_layout

    try:
        check_layout(folder)
    except WeightsError as exc:
        return False, f"auto: {exc}; using the CPU 'warp' renderer"
    import torch

    if config.engine.musetalk_device == "cpu" or not torch.cuda.is_available():
        return False, (
            "auto: no CUDA device (MuseTalk on CPU is about 0.3 fps), using the CPU 'warp' renderer"
        )
    return True, f"auto: CUDA and MuseTalk weights in {folder}"


def _load_musetalk(
    config: ServerConfig,
    reason: str,
    mouth_box: tuple[int, int, int, int],
    fallback: Callable[[], LipSyncEngine],
) -> EngineFactory:
    from musetalk_core.engine import MuseTalkEngine
    from musetalk_core.loading import load_musetalk

    loaded = load_musetalk(
        weights_dir(config),
        config.engine.avatar if config.engine.avatar is not None else _builtin_source(),
        cache_dir=config.server.cache_dir / "musetalk-avatars",
        device=config.engine.musetalk_device,
        compile_models=config.engine.musetalk_compile,
        framing=config.engine.framing,
    )
    placement = loaded.placement
    runtime = loaded.runtime(
        fps=VIDEO_FPS, sample_rate=AUDIO_RATE, max_batch=config.engine.musetalk_batch
    )
    warm_ms = runtime.warm_up()
    logger.info("lip-sync engine: musetalk on %s (%s); warm-up %.0f ms", placement, reason, warm_ms)

    def create() -> LipSyncEngine:
        return MuseTalkEngine(runtime)

    return EngineFactory(
        "musetalk",
        f"{reason}; {placement}",
        create,
        mouth_box=mouth_box,
        close=runtime.close,
        fallback=fallback,
    )


ENGINE_CONNECT_S = 120.0
"""How long a media worker waits at start-up for the engine process (its models load first)."""


def _remote_musetalk(
    socket: Path,
    reason: str,
    mouth_box: tuple[int, int, int, int],
    fallback: Callable[[], LipSyncEngine],
) -> EngineFactory:
    """MuseTalk rendered in the engine process at ``socket``; a call placed while it is away
    (not started yet, restarting) gets the CPU engine."""
    from musetalk_core.engine import MuseTalkEngine
    from musetalk_core.engine_client import EngineConnection

    connection = EngineConnection(socket)

    async def start() -> None:
        if not await connection.start(ENGINE_CONNECT_S):
            logger.error("no MuseTalk engine process at %s yet; calls use 'warp'", socket)

    def create() -> LipSyncEngine:
        client = connection.usable
        return MuseTalkEngine(client) if client is not None else fallback()

    return EngineFactory(
        "musetalk",
        f"{reason}; rendered in the engine process at {socket}",
        create,
        mouth_box=mouth_box,
        close=connection.close,
        fallback=fallback,
        start=start,
    )


def _builtin_source() -> np.ndarray:
    from musetalk_core.warp_avatar import builtin_portrait

    return builtin_portrait()
