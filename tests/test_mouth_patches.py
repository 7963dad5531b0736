"""Converted mouths reused: the same pictures as drawing them again, within a memory budget,
shared by every call of one avatar."""

from __future__ import annotations

import numpy as np
import pytest

from musetalk_core.i420 import Patch, PatchCache, rgb_to_i420
from musetalk_core.types import AudioChunk
from musetalk_core.warp import WarpRenderer
from musetalk_core.warp_avatar import WarpAvatar, builtin_portrait, prepare_avatar
from musetalk_core.warp_engine import OPENNESS_STEPS, WarpEngine

SR = 48000


@pytest.fixture(scope="module")
def avatar() -> WarpAvatar:
    return prepare_avatar(builtin_portrait())


def _open_eyes_at(r: WarpRenderer, t: float = 0.0) -> float:
    while r.blink_amount(t) > 0.0:
        t += 0.01
    return t


def test_a_reused_mouth_is_the_picture_drawn_again(avatar: WarpAvatar) -> None:
    patches = PatchCache(64 << 20)
    r = WarpRenderer(avatar, patches=patches)
    t = _open_eyes_at(r)
    mouths = [
        {"openness": 0.8, "roundness": 0.0},
        {"openness": 0.4, "roundness": 1.0},
        {"openness": 0.3, "roundness": 0.5, "tucked": 0.7},  # "f": the lip under the teeth
        {"openness": 0.0, "roundness": 0.0, "closed": 1.0},  # sealed lips, no jaw motion
    ]
    for mouth in mouths:
        expected = rgb_to_i420(r.render(t=t, **mouth))
        drawn = r.render_i420(t=t, **mouth)
        reused = r.render_i420(t=t, **mouth)
        assert np.array_equal(drawn, expected) and np.array_equal(reused, expected), mouth
        assert reused is not drawn and reused.flags.writeable  # each frame its own array
    assert (patches.hits, patches.misses, len(patches)) == (4, 4, 4)
    # A blink is drawn whole (its crop may overlap the mouth's), the mouth still exact.
    blink_t = 0.0
    while r.blink_amount(blink_t) < 0.5:
        blink_t += 0.005
    expected = rgb_to_i420(r.render(0.8, 0.0, blink_t))
    assert np.array_equal(r.render_i420(0.8, 0.0, blink_t), expected)
    # A jaw that moves less than 1/256 of its travel is the still picture, not a patch.
    assert r.render_i420(0.001, 0.3, t) is r.still_i420


def test_the_oldest_patches_go_when_the_budget_is_full() -> None:
    def patch(value: int) -> Patch:
        return Patch(0, 0, 8, 8, np.full((12, 8), value, np.uint8))  # 96 bytes

    cache = PatchCache(budget_bytes=300)
    for key in range(5):
        cache.put(key, patch(key))
        assert cache.nbytes <= 300
    assert len(cache) == 3 and cache.nbytes == 288
    assert cache.get(0) is None and cache.get(1) is None
    kept = cache.get(4)
    assert kept is not None and int(kept.planes[0, 0]) == 4
    cache.put(4, patch(9))  # the same key again replaces, it does not count twice
    assert len(cache) == 3 and cache.nbytes == 288
    small = PatchCache(budget_bytes=50)
    small.put("big", patch(1))
    assert len(small) == 0 and small.nbytes == 0  # larger than the whole budget: not kept
    assert (cache.hits, cache.misses) == (1, 2)


async def _speaking_frames(engine: WarpEngine, speech: np.ndarray) -> list[np.ndarray]:
    await engine.push_audio(AudioChunk(speech, SR), 1)
    await engine.end_segment(1)
    frames = engine.frames()
    got = []
    try:
        while len(got) < len(speech) // (SR // 25):
            frame = await anext(frames)
            if frame.speaking:
                got.append(frame.image)
    finally:
        await frames.aclose()
        await engine.aclose()
    return got


async def test_calls_of_one_avatar_reuse_each_others_mouths(avatar: WarpAvatar) -> None:
    """Two engines (two calls) given one cache: the second draws none of the mouths the first
    drew for the same speech, and its frames are the same pictures."""
    rng = np.random.default_rng(5)
    # Speech whose loudness varies from frame to frame: many openings.
    envelope = np.repeat(rng.uniform(0.05, 0.6, 25), SR // 25)
    speech = np.clip(rng.normal(0, 1, envelope.size) * envelope * 32767, -32768, 32767)
    speech = speech.astype(np.int16)
    shared = PatchCache(64 << 20)
    first = await _speaking_frames(
        WarpEngine(avatar, pixel_format="yuv420p", patches=shared), speech
    )
    drawn = shared.misses
    assert drawn >= 5 and len(shared) == drawn
    second = await _speaking_frames(
        WarpEngine(avatar, pixel_format="yuv420p", patches=shared), speech
    )
    assert shared.misses == drawn, "the second call drew a mouth the first had drawn"
    assert shared.hits >= 20
    assert len(first) == len(second) == 25
    assert all(np.array_equal(a, b) for a, b in zip(first, second, strict=True))
    # Openness in steps: a hair's difference in loudness gives the same picture.
    louder = np.clip(speech.astype(np.int32) * 1.002, -32768, 32767).astype(np.int16)
    third = await _speaking_frames(
        WarpEngine(avatar, pixel_format="yuv420p", patches=shared), louder
    )
    same = sum(np.array_equal(a, b) for a, b in zip(first, third, strict=True))
    assert same >= 20, f"{same} of 25 frames the same at +0.2 % loudness ({OPENNESS_STEPS} steps)"
