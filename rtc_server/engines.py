"""Choosing and preparing the lip-sync engine once per process; one engine instance per call."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

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


def load_engine_factory(config: ServerConfig) -> EngineFactory:
    """Prepare the avatar (face and mouth found, cached) and return a per-call engine maker.

    Raises ``musetalk_core.avatar.AvatarError`` with a readable message for a bad portrait.
    """
    if config.engine == "sync-test":
        from musetalk_core.synctest import SyncTestEngine

        logger.info("lip-sync engine: sync-test (asked for: flash and beep once a second)")
        return EngineFactory(
            "sync-test",
            "asked for: a flash and a beep on the same instant, once a second",
            lambda: SyncTestEngine(fps=VIDEO_FPS, sample_rate=AUDIO_RATE),
        )
    from musetalk_core.avatar import builtin_portrait, load_portrait, prepare_avatar
    from musetalk_core.warp import WarpEngine

    image = builtin_portrait() if config.avatar is None else load_portrait(config.avatar)
    avatar = prepare_avatar(image, cache_dir=config.cache_dir / "avatars")
    reason = (
        "engine 'warp' requested"
        if config.engine == "warp"
        else "auto: MuseTalk is not available in this build, using the CPU 'warp' renderer"
    )
    logger.info("lip-sync engine: warp (%s)", reason)

    def create() -> LipSyncEngine:
        return WarpEngine(avatar, fps=VIDEO_FPS, sample_rate=AUDIO_RATE)

    return EngineFactory("warp", reason, create, mouth_box=avatar.mouth_box)
