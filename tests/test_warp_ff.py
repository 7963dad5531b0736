"""The warp engine's "f" and "v": the lower lip drawn up under the upper teeth, measured with
the face mesh on rendered frames of a smiling portrait (teeth showing) and a closed-lip one."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from benchmarks.mouth_sheet import speaking_frames
from musetalk_core import landmarks as lm
from musetalk_core.visemes import viseme_of
from musetalk_core.warp import WarpRenderer
from musetalk_core.warp_avatar import WarpAvatar, builtin_portrait, prepare_avatar
from rtc_server.providers.piper_tts import PiperTTS
from tests import faces


def _lips(image: np.ndarray) -> tuple[float, float, float]:
    """(gap between the lips, the lower lip's height, the lower lip's top y), pixels."""
    m = lm.find_landmarks(image)
    return (
        float(m.xy(14)[1] - m.xy(13)[1]),
        float(m.xy(17)[1] - m.xy(14)[1]),
        float(m.xy(14)[1]),
    )


@pytest.fixture(scope="module", params=["astronaut", "hopper"])
def avatar(request: pytest.FixtureRequest) -> WarpAvatar:
    image = builtin_portrait() if request.param == "astronaut" else faces.hopper().image
    return prepare_avatar(image)


def test_the_lower_lip_tucks_under_the_teeth(avatar: WarpAvatar) -> None:
    r = WarpRenderer(avatar)
    rest, opened = _lips(r.still), _lips(r.render(1.0, 0.0, 0.0))
    tuck, sealed = (
        _lips(r.render(0.0, 0.0, 0.0, tucked=1.0)),
        _lips(r.render(0.0, 0.0, 0.0, closed=1.0)),
    )
    print(f"gap/lower lip/top: rest {rest}, tucked {tuck}, sealed {sealed}, open {opened}")
    # Up: the lower lip's top rises towards the upper teeth, far above an open vowel's.
    assert tuck[2] <= rest[2] - 1.5 and tuck[2] <= opened[2] - 5.0
    # In: less of the lower lip shows.
    assert tuck[1] <= rest[1] - 0.3
    # Not open, and where the picture shows teeth, not sealed either: they rest on the lip.
    assert tuck[0] <= rest[0] + 0.5
    if rest[0] > 3.0:
        assert sealed[0] + 1.0 <= tuck[0] <= rest[0] - 1.0
    assert not r.is_still(0.0, 0.0, tucked=0.5) and r.is_still(0.0, 0.0, tucked=0.001)


def test_an_f_rich_sentence_tucks_the_lip_at_its_f_and_v(avatar: WarpAvatar) -> None:
    text = "Five very fine violins, a fox and a festival of fresh fish."
    tts = PiperTTS.load(deterministic=True)

    async def speak() -> tuple[list, list[np.ndarray]]:  # type: ignore[type-arg]
        chunks = [c async for c in tts.synthesize(text)]
        return chunks, await speaking_frames(avatar, chunks, timed=True)

    chunks, frames = asyncio.run(speak())
    at, mids = 0.0, []
    for c in chunks:
        mids += [at + (s.start + s.end) / 2 for s in c.phonemes if viseme_of(s.phoneme) == "FF"]
        at += c.duration
    rest = _lips(WarpRenderer(avatar).still)

    def raised(shift: int) -> np.ndarray:
        ks = [min(max(int(t * 25) + shift, 0), len(frames) - 1) for t in mids]
        return np.asarray([rest[2] - _lips(frames[k])[2] for k in ks])

    # At the best global shift of at most a frame (40 ms), as the lip-sync criterion allows.
    best = max((raised(s) for s in (-1, 0, 1)), key=lambda r: float(np.mean(r >= 1.0)))
    print(f"{len(mids)} f/v: the lower lip raised by {np.round(best, 1)} px")
    assert len(mids) >= 10
    assert np.mean(best >= 1.0) >= 0.8
