"""The warp engine: renderer, audio analysis, and the LipSyncEngine contract."""

from __future__ import annotations

import dataclasses

import cv2
import faces
import numpy as np
import pytest

from musetalk_core.types import AudioChunk, AvatarFrame, LipSyncEngine
from musetalk_core.warp import (
    BLINK_INTERVAL,
    BLINK_SECONDS,
    WarpRenderer,
    mouth_opening,
    mouth_shape,
)
from musetalk_core.warp_avatar import WarpAvatar, builtin_portrait, prepare_avatar
from musetalk_core.warp_engine import WarpEngine

SR = 48000
FPS = 25
SPF = SR // FPS


@pytest.fixture(scope="module")
def avatar() -> WarpAvatar:
    return prepare_avatar(builtin_portrait())


def _crop(img: np.ndarray, box: tuple[int, int, int, int]) -> np.ndarray:
    x, y, w, h = box
    return img[y : y + h, x : x + w].astype(np.float32)


def _quiet_time(renderer: WarpRenderer) -> float:
    """A time with no blink in progress."""
    t = 0.0
    while renderer.blink_amount(t) > 0.0:
        t += 0.01
    return t


def _blink_peak(renderer: WarpRenderer) -> float:
    """A time with the eyes shut."""
    t = 0.0
    while renderer.blink_amount(t) < 0.99:
        t += 0.005
    return t


def _pcm(seconds: float, seed: int = 0, level: float = 0.2) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.normal(0, level, int(seconds * SR)) * 32767, -32768, 32767).astype(np.int16)


# --------------------------------------------------------------------------------------------
# Renderer


def test_render_shape_dtype_and_closed_mouth_is_the_picture(avatar: WarpAvatar) -> None:
    r = WarpRenderer(avatar)
    frame = r.render(0.0, 0.0, _quiet_time(r))
    assert frame.shape == (512, 512, 3) and frame.dtype == np.uint8
    assert np.array_equal(frame, avatar.image)
    assert frame is not avatar.image and not np.shares_memory(frame, avatar.image)


def test_render_changes_only_inside_the_feathered_crops(avatar: WarpAvatar) -> None:
    r = WarpRenderer(avatar)
    allowed = np.zeros(avatar.image.shape[:2], bool)
    x, y, w, h = avatar.mouth_crop
    allowed[y : y + h, x : x + w] = avatar.mouth_mask > 0
    for (ex, ey, ew, eh), mask in zip(avatar.eye_crops, avatar.eye_masks, strict=True):
        allowed[ey : ey + eh, ex : ex + ew] |= mask > 0
    t = _blink_peak(r)
    for openness, roundness in [(1.0, 0.0), (0.6, 1.0), (0.3, 0.5)]:
        frame = r.render(openness, roundness, t)
        changed = (frame != avatar.image).any(axis=2)
        assert changed.any()
        assert not (changed & ~allowed).any()


def test_openness_opens_the_mouth(avatar: WarpAvatar) -> None:
    r = WarpRenderer(avatar)
    t = _quiet_time(r)
    shut = _crop(r.render(0.0, 0.0, t), avatar.mouth_box)
    half = _crop(r.render(0.5, 0.0, t), avatar.mouth_box)
    full = _crop(r.render(1.0, 0.0, t), avatar.mouth_box)
    d_half = np.abs(half - shut).mean()
    d_full = np.abs(full - shut).mean()
    assert d_full > 15.0, "a fully open mouth differs clearly from the closed one"
    assert 0.2 * d_full < d_half < d_full
    # An open mouth is darker (the cavity) than the picture's smile.
    assert full.mean() < shut.mean() - 10


def test_roundness_narrows_the_opening(avatar: WarpAvatar) -> None:
    r = WarpRenderer(avatar)
    t = _quiet_time(r)
    wide = r.render(0.8, 0.0, t)
    round_ = r.render(0.8, 1.0, t)
    assert np.abs(_crop(wide, avatar.mouth_box) - _crop(round_, avatar.mouth_box)).mean() > 2.0
    # The cavity is narrower: fewer dark pixels.

    def dark(img: np.ndarray) -> int:
        return int((_crop(img, avatar.mouth_box).mean(axis=2) < 90).sum())

    assert dark(round_) < dark(wide)

    # Narrower, not just smaller: an "oo" is as deep as an "ah" but much less wide.
    def extent(img: np.ndarray) -> tuple[int, int]:
        cavity = _cavity(img, avatar)
        columns = np.flatnonzero(cavity.any(axis=0))
        return int(columns[-1] - columns[0] + 1), int(cavity[:, _centre_column(avatar)].sum())

    (wide_w, wide_h), (round_w, round_h) = extent(wide), extent(round_)
    assert round_w < 0.8 * wide_w
    assert round_h >= wide_h


def _luma(img: np.ndarray) -> np.ndarray:
    return img.astype(np.float32) @ np.array([0.299, 0.587, 0.114], np.float32)


def _cavity(frame: np.ndarray, avatar: WarpAvatar) -> np.ndarray:
    """Pixels of the mouth box the opening darkened: dark now, light (teeth, lips) before."""
    x, y, w, h = avatar.mouth_box
    dark = np.zeros(frame.shape[:2], bool)
    box = (slice(y, y + h), slice(x, x + w))
    dark[box] = (_luma(frame[box]) < 110) & (_luma(avatar.image[box]) > 130)
    return dark


def _centre_column(avatar: WarpAvatar) -> int:
    return int(round(avatar.lip_x)) + avatar.mouth_crop[0]


def test_mouth_motion_grows_with_openness(avatar: WarpAvatar) -> None:
    r = WarpRenderer(avatar)
    t = _quiet_time(r)
    shut = _crop(r.render(0.0, 0.0, t), avatar.mouth_box)
    diffs = [
        np.abs(_crop(r.render(o, 0.0, t), avatar.mouth_box) - shut).mean()
        for o in np.linspace(0.1, 1.0, 10)
    ]
    assert all(b > a for a, b in zip(diffs, diffs[1:], strict=False)), diffs


def test_open_mouth_is_a_shaded_red_brown_cavity(avatar: WarpAvatar) -> None:
    r = WarpRenderer(avatar)
    frame = r.render(1.0, 0.0, _quiet_time(r))
    cavity = _cavity(frame, avatar)
    pixels = frame[cavity].astype(np.float32)
    assert len(pixels) > 150
    # Not a black slab: no pure black, red-brown on average.
    assert pixels.max(axis=1).min() > 15
    red, green, blue = pixels.mean(axis=0)
    assert red > green + 20 and red > blue + 20
    # Darker at the back and top (under the upper teeth) than towards the floor, inside the
    # opening (its anti-aliased edge rows are part lip, part cavity).
    x = _centre_column(avatar)
    inner = cavity[:, x] & np.roll(cavity[:, x], 1) & np.roll(cavity[:, x], -1)
    column = _luma(frame)[np.flatnonzero(inner), x]
    third = len(column) // 3
    assert third >= 2
    assert column[:third].mean() + 30 < column[-third:].mean()


def test_lower_lip_drops_with_its_own_texture(avatar: WarpAvatar) -> None:
    """The lip under the opening is the picture's lower lip, moved down by the jaw drop."""
    r = WarpRenderer(avatar)
    t = _quiet_time(r)
    x = _centre_column(avatar)
    top = int(np.floor(avatar.mouth_seam[x - avatar.mouth_crop[0]])) + 1 + avatar.mouth_crop[1]
    lip = avatar.image[top : top + 14, x].astype(np.float32)
    # Searched over every drop up to the largest and a little beyond (the framed face's lip
    # drops about 19 px at openness 1).
    reach = int(np.ceil(avatar.max_drop)) + 6
    for openness in (0.5, 1.0):
        frame = r.render(openness, 0.0, t)
        errors = [
            np.abs(frame[top + k : top + k + 14, x].astype(np.float32) - lip).mean()
            for k in range(reach)
        ]
        assert abs(int(np.argmin(errors)) - openness * avatar.max_drop) <= 1.5, errors


def test_mouth_corners_stay_put(avatar: WarpAvatar) -> None:
    r = WarpRenderer(avatar)
    frame = r.render(1.0, 0.0, _quiet_time(r)).astype(np.float32)
    image = avatar.image.astype(np.float32)
    x0, y0 = avatar.mouth_crop[:2]
    for side in (-1, 1):
        column = int(np.argmin(np.abs(avatar.mouth_u - side)))
        x, y = x0 + column, y0 + int(round(avatar.mouth_seam[column]))
        xs = slice(x, x + 4) if side > 0 else slice(x - 3, x + 1)
        corner = (slice(y - 3, y + 4), xs)
        assert np.abs(frame[corner] - image[corner]).mean() < 5.0
    centre = (slice(y0 + int(avatar.lip_y), y0 + int(avatar.lip_y) + 6), _centre_column(avatar))
    assert np.abs(frame[centre] - image[centre]).mean() > 40.0


def test_teeth_hint_shows_under_the_upper_lip(avatar: WarpAvatar) -> None:
    """A picture with closed lips gets painted upper teeth at the top of the opening."""
    closed_lips = dataclasses.replace(avatar, teeth_hint=0.9)
    t = _quiet_time(WarpRenderer(avatar))
    plain = _luma(WarpRenderer(avatar).render(1.0, 0.0, t))
    hinted = _luma(WarpRenderer(closed_lips).render(1.0, 0.0, t))
    x = _centre_column(avatar)
    seam = avatar.mouth_crop[1] + int(avatar.lip_y)
    assert hinted[seam + 1 : seam + 3, x].min() > 150 > plain[seam + 1 : seam + 3, x].max()
    # The floor of the mouth is left alone.
    assert hinted[seam + 7, x] == pytest.approx(plain[seam + 7, x], abs=1)


def test_blinks_are_seeded_spaced_and_short(avatar: WarpAvatar) -> None:
    a, b, c = (
        WarpRenderer(avatar, seed=1),
        WarpRenderer(avatar, seed=1),
        WarpRenderer(avatar, seed=2),
    )
    times = np.arange(0.0, 60.0, 0.005)
    amounts = np.array([a.blink_amount(t) for t in times])
    assert np.array_equal(amounts, [b.blink_amount(t) for t in times])
    assert not np.array_equal(amounts, [c.blink_amount(t) for t in times])
    closed = amounts > 0
    starts = times[1:][closed[1:] & ~closed[:-1]]
    gaps = np.diff(starts)
    assert 8 <= len(starts) <= 25
    assert (gaps >= BLINK_INTERVAL[0] - 0.01).all() and (gaps <= BLINK_INTERVAL[1] + 0.01).all()
    lengths = [(closed[(times >= s) & (times < s + 1.0)]).sum() * 0.005 for s in starts]
    assert all(abs(n - BLINK_SECONDS) < 0.02 for n in lengths)
    # Sampled at 25 fps, every blink shows at least one nearly shut frame.
    frame_times = np.arange(0.0, 60.0, 1 / FPS)
    for s in starts:
        near = [a.blink_amount(t) for t in frame_times if s - 0.01 <= t < s + BLINK_SECONDS]
        assert max(near) > 0.85


def test_blink_touches_the_eyes_not_the_mouth(avatar: WarpAvatar) -> None:
    r = WarpRenderer(avatar)
    frame = r.render(0.0, 0.0, _blink_peak(r))
    for box in avatar.eye_boxes:
        assert np.abs(_crop(frame, box) - _crop(avatar.image, box)).mean() > 5.0
    assert np.array_equal(_crop(frame, avatar.mouth_box), _crop(avatar.image, avatar.mouth_box))


def test_sway_is_switchable_and_small(avatar: WarpAvatar) -> None:
    still = WarpRenderer(avatar)
    swaying = WarpRenderer(avatar, sway_px=0.8)
    t = _quiet_time(still)
    corner = (slice(0, 60), slice(0, 60))
    assert np.array_equal(still.render(0.0, 0.0, t)[corner], avatar.image[corner])
    moved = [swaying.render(0.0, 0.0, t + k)[corner] for k in (0.0, 1.0, 2.0)]
    assert not np.array_equal(moved[0], moved[1])
    # Sub-pixel drift: the picture stays close to the original everywhere.
    assert np.abs(moved[0].astype(int) - avatar.image[corner].astype(int)).mean() < 10


# --------------------------------------------------------------------------------------------
# Audio analysis


def test_mouth_shape_silence_and_levels() -> None:
    assert mouth_shape(np.zeros(SPF, np.int16), SR) == (0.0, 0.0)
    assert mouth_shape(np.zeros(0, np.int16), SR) == (0.0, 0.0)
    t = np.arange(SPF) / SR
    levels = [0.01, 0.05, 0.1, 0.2, 0.4]
    opens = [mouth_shape(np.sin(2 * np.pi * 200 * t) * a * np.sqrt(2), SR)[0] for a in levels]
    assert opens == sorted(opens) and opens[0] > 0.0
    assert opens[-1] == 1.0
    # Normal TTS vowels (RMS 0.15-0.3 of full scale) open the mouth most of the way.
    assert 0.5 < opens[3] < 1.0


def test_mouth_shape_int16_and_float_agree() -> None:
    x = np.random.default_rng(3).normal(0, 0.1, SPF).astype(np.float32)
    as_int = (x * 32768).astype(np.int16)
    a, b = mouth_shape(x, SR), mouth_shape(as_int, SR)
    assert a == pytest.approx(b, abs=0.01)


def test_the_opening_alone_is_the_shapes_opening() -> None:
    # What the phoneme-driven mouth takes from the audio, without the spectrum.
    rng = np.random.default_rng(4)
    slices = [np.zeros(SPF, np.int16), np.zeros(0, np.int16)]
    slices += [(rng.normal(0, a, SPF) * 32768).astype(np.int16) for a in (0.005, 0.05, 0.3)]
    slices += [rng.normal(0, 0.1, SPF).astype(np.float32)]
    for pcm in slices:
        assert mouth_opening(pcm) == mouth_shape(pcm, SR)[0]
    assert mouth_opening(slices[3]) > 0.0


def test_mouth_shape_roundness_follows_spectrum() -> None:
    t = np.arange(SPF) / SR
    # "oo": harmonics of 120 Hz with all energy under 900 Hz.
    oo = np.sum([np.sin(2 * np.pi * 120 * k * t) / k for k in range(1, 7)], axis=0) * 0.1
    # "ee"/hiss: broadband noise, most energy above 1 kHz.
    ee = np.random.default_rng(0).normal(0, 0.1, SPF)
    assert mouth_shape(oo, SR)[1] > 0.8
    assert mouth_shape(ee, SR)[1] == 0.0


# --------------------------------------------------------------------------------------------
# Engine


async def _take(engine: WarpEngine, n: int) -> list[AvatarFrame]:
    frames = engine.frames()
    out = [await anext(frames) for _ in range(n)]
    await frames.aclose()
    return out


async def test_engine_is_a_lipsync_engine(avatar: WarpAvatar) -> None:
    engine = WarpEngine(avatar)
    try:
        assert isinstance(engine, LipSyncEngine)
        assert engine.fps == 25 and engine.sample_rate == 48000
        assert engine.frame_size == (512, 512)
        assert 0.0 < engine.latency < 0.2
    finally:
        await engine.aclose()


async def test_idle_frames_when_nothing_is_queued(avatar: WarpAvatar) -> None:
    engine = WarpEngine(avatar)
    for frame in await _take(engine, 5):
        assert not frame.speaking and frame.segment_id == -1
        assert frame.image.shape == (512, 512, 3) and frame.image.dtype == np.uint8
        assert frame.audio.sample_rate == SR and frame.audio.pcm.dtype == np.int16
        assert len(frame.audio.pcm) == SPF and not frame.audio.pcm.any()
    await engine.aclose()


async def test_wrong_audio_is_rejected(avatar: WarpAvatar) -> None:
    engine = WarpEngine(avatar)
    with pytest.raises(ValueError, match="16000 Hz"):
        await engine.push_audio(AudioChunk(np.zeros(160, np.int16), 16000), 1)
    with pytest.raises(ValueError, match="int16"):
        await engine.push_audio(AudioChunk(np.zeros(160, np.float32), SR), 1)
    await engine.aclose()
    with pytest.raises(ValueError, match="multiple"):
        WarpEngine(avatar, fps=7)


async def test_audio_is_conserved(avatar: WarpAvatar) -> None:
    """Speaking frames carry exactly the pushed audio, each segment padded to whole frames."""
    rng = np.random.default_rng(5)
    engine = WarpEngine(avatar)
    frames = engine.frames()
    expected: dict[int, np.ndarray] = {}
    got: dict[int, list[np.ndarray]] = {1: [], 2: []}
    idle = 0
    for seg, seconds in [(1, 1.37), (2, 0.51)]:
        pcm = _pcm(seconds, seed=seg)
        expected[seg] = np.concatenate([pcm, np.zeros(-len(pcm) % SPF, np.int16)])
        pos = 0
        while pos < len(pcm):
            n = int(rng.integers(1, 5000))
            await engine.push_audio(AudioChunk(pcm[pos : pos + n], SR), seg)
            pos += n
            # Pull now and then, so frames interleave with pushes and idle gaps.
            if rng.random() < 0.5:
                frame = await anext(frames)
                if frame.speaking:
                    got[frame.segment_id].append(frame.audio.pcm)
                else:
                    idle += 1
        await engine.end_segment(seg)
    for _ in range(80):
        frame = await anext(frames)
        assert len(frame.audio.pcm) == SPF
        if frame.speaking:
            got[frame.segment_id].append(frame.audio.pcm)
        else:
            assert not frame.audio.pcm.any()
    for seg in (1, 2):
        assert np.array_equal(np.concatenate(got[seg]), expected[seg])
    await frames.aclose()
    await engine.aclose()


async def test_partial_frame_never_blocks(avatar: WarpAvatar) -> None:
    engine = WarpEngine(avatar)
    frames = engine.frames()
    pcm = _pcm(SPF * 1.5 / SR)
    await engine.push_audio(AudioChunk(pcm[:1000], SR), 7)
    assert not (await anext(frames)).speaking  # 1000 of 1920 samples: idle, no waiting
    await engine.push_audio(AudioChunk(pcm[1000:], SR), 7)
    first = await anext(frames)
    assert first.speaking and first.segment_id == 7
    assert np.array_equal(first.audio.pcm, pcm[:SPF])
    assert not (await anext(frames)).speaking  # 960 left, segment still open
    await engine.end_segment(7)
    last = await anext(frames)
    assert last.speaking and np.array_equal(last.audio.pcm[: len(pcm) - SPF], pcm[SPF:])
    assert not last.audio.pcm[len(pcm) - SPF :].any()
    assert not (await anext(frames)).speaking
    await frames.aclose()
    await engine.aclose()


async def test_new_segment_ends_the_previous_one(avatar: WarpAvatar) -> None:
    engine = WarpEngine(avatar)
    await engine.push_audio(AudioChunk(_pcm(0.05, seed=1), SR), 1)
    await engine.push_audio(AudioChunk(_pcm(0.04, seed=2), SR), 2)
    a, b, c = await _take(engine, 3)
    assert (a.segment_id, b.segment_id, c.segment_id) == (1, 1, 2)
    assert not b.audio.pcm[SPF // 2 :].any()  # 0.01 s of segment 1, then padding
    await engine.aclose()


async def test_clear_makes_the_next_frame_idle(avatar: WarpAvatar) -> None:
    engine = WarpEngine(avatar)
    frames = engine.frames()
    await engine.push_audio(AudioChunk(_pcm(2.0), SR), 3)
    assert (await anext(frames)).speaking
    engine.clear()
    after = [await anext(frames) for _ in range(3)]
    assert not any(f.speaking for f in after)
    assert engine.queued_seconds == 0.0
    await engine.push_audio(AudioChunk(_pcm(0.04), SR), 4)
    assert (await anext(frames)).segment_id == 4
    await frames.aclose()
    await engine.aclose()


async def test_aclose_ends_frames(avatar: WarpAvatar) -> None:
    engine = WarpEngine(avatar)
    frames = engine.frames()
    await anext(frames)
    await engine.aclose()
    with pytest.raises(StopAsyncIteration):
        await anext(frames)
    with pytest.raises(RuntimeError):
        await engine.push_audio(AudioChunk(_pcm(0.04), SR), 1)


# --------------------------------------------------------------------------------------------
# Lip sync: the product's acceptance measure on synthetic speech


def _speech_like(seconds: float, seed: int) -> np.ndarray:
    """Syllable bursts at 3-6 Hz (voiced harmonics plus some hiss) in phrases with pauses."""
    rng = np.random.default_rng(seed)
    out = np.zeros(int(seconds * SR), np.float32)
    t = 0.3
    while t < seconds - 1.0:
        for _ in range(int(rng.integers(2, 7))):
            n = int(rng.uniform(1 / 6, 1 / 3) * SR)
            i0 = int(t * SR)
            if i0 + n > len(out):
                break
            tt = np.arange(n) / SR
            f0 = rng.uniform(90, 180)
            voiced = sum(
                rng.uniform(0.2, 1.0) / k * np.sin(2 * np.pi * f0 * k * tt + rng.uniform(0, 6))
                for k in range(1, 15)
            )
            hiss = rng.normal(0, 1, n) * rng.uniform(0.0, 0.4)
            burst = voiced + hiss
            burst *= rng.uniform(0.05, 0.35) / np.sqrt(np.mean(burst**2))
            out[i0 : i0 + n] += burst * np.sin(np.pi * np.arange(n) / n) ** 2
            t += n / SR
        t += rng.uniform(0.25, 0.7)
    return np.clip(out * 32767, -32768, 32767).astype(np.int16)


def _lag_correlations(motion: np.ndarray, change: np.ndarray, max_lag: int) -> dict[int, float]:
    """Pearson r of motion[k + lag] against change[k]."""
    out = {}
    for lag in range(-max_lag, max_lag + 1):
        a = motion[max(lag, 0) : len(motion) + min(lag, 0)]
        b = change[max(-lag, 0) : len(change) - max(lag, 0)]
        out[lag] = float(np.corrcoef(a, b)[0, 1])
    return out


async def test_mouth_motion_follows_the_audio_envelope(avatar: WarpAvatar) -> None:
    pcm = _speech_like(8.0, seed=11)
    engine = WarpEngine(avatar)
    await engine.push_audio(AudioChunk(pcm, SR), 1)
    await engine.end_segment(1)
    frames = []
    async for frame in engine.frames():
        if not frame.speaking:
            break
        frames.append(frame)
    await engine.aclose()
    assert len(frames) == 200
    mouths = [_crop(f.image, avatar.mouth_box) for f in frames]
    motion = np.array([np.abs(mouths[k] - mouths[k - 1]).mean() for k in range(1, len(mouths))])
    rms = np.array([np.sqrt(np.mean((f.audio.pcm / 32768.0) ** 2)) for f in frames])
    change = np.abs(np.diff(rms))
    corr = _lag_correlations(motion, change, max_lag=4)
    best = max(corr, key=lambda lag: corr[lag])
    assert abs(best) <= 1, corr
    assert corr[best] >= 0.5, corr


@pytest.fixture(scope="module", params=faces.ALL, ids=lambda f: f.__name__)
def face_avatar(request: pytest.FixtureRequest) -> WarpAvatar:
    made: faces.Face = request.param()
    return prepare_avatar(made.image, source=made.name)


def test_the_opening_sits_between_the_detected_lips(face_avatar: WarpAvatar) -> None:
    """On every test face the mouth opens along the mesh's lip line, between its corners."""
    a = face_avatar
    r = WarpRenderer(a)
    o = 0.6
    frame = r.render(o, 0.0, _quiet_time(r))
    # The cavity: much darker than the skin, and darker than the picture was there (a moving
    # jaw also shifts skin texture about, which only changes shading).
    skin = float(_luma(a.skin_rgb[None])[0])
    now = _luma(frame)
    darker = (now < 0.6 * skin) & (_luma(a.image) - now > 25)
    # Only the opening itself: the largest dark region (a skin fold may darken a little).
    _, labels, stats, _ = cv2.connectedComponentsWithStats(darker.astype(np.uint8), connectivity=8)
    largest = 1 + int(np.argmax(stats[1:, cv2.CC_STAT_AREA]))
    darker = labels == largest
    pts = a.landmarks
    (lx, _), (rx, _) = pts[61], pts[291]
    x0, y0 = a.mouth_crop[:2]
    cols = np.flatnonzero(darker.any(axis=0))
    assert cols.size and lx - 2 <= cols.min() and cols.max() <= rx + 2
    # Mid-mouth the dark opening starts at the seam (the upper lip lifts a little) and ends
    # above the dropped lower lip (a dark lip counts as dark too).
    c = int(round(a.lip_x)) + x0
    rows = np.flatnonzero(darker[:, c])
    assert rows.size >= 2
    seam = a.mouth_seam[c - x0] + y0
    upper_lip_top, lower_lip_bottom = pts[0][1], pts[17][1]
    assert upper_lip_top <= rows.min() and abs(rows.min() - seam) <= 2 + o * a.max_raise * 1.5
    assert seam + o * a.max_drop - 2 <= rows.max() <= lower_lip_bottom + o * a.max_drop


def _redness(px: np.ndarray) -> float:
    """Mean red minus green: about 20 for these warm-lit teeth, 40-60 for lips."""
    f = px.astype(np.float32).reshape(-1, 3)
    return float((f[:, 0] - f[:, 1]).mean())


def _teeth_rows(a: WarpAvatar) -> tuple[slice, slice]:
    """Image rows and columns of the picture's gap between the lips, mid-mouth (the teeth)."""
    pts = a.landmarks
    top, bottom = pts[13][1], pts[14][1]
    (lx, _), (rx, _) = pts[61], pts[291]
    x0, x1 = int(lx + 0.35 * (rx - lx)), int(lx + 0.65 * (rx - lx))
    return slice(int(np.ceil(top)) + 1, int(np.floor(bottom))), slice(x0, x1)


def test_closed_seals_lips_the_picture_shows_apart(avatar: WarpAvatar) -> None:
    r = WarpRenderer(avatar)
    t = _quiet_time(r)
    assert not r.is_still(0.0, t, closed=1.0)
    rows, cols = _teeth_rows(avatar)
    teeth = _redness(avatar.image[rows, cols])
    sealed = r.render(0.0, 0.0, t, closed=1.0)
    covered = _redness(sealed[rows, cols])
    # The built-in portrait smiles with its teeth (white: as red as green); sealed, the red
    # lower lip covers them.
    assert teeth < 25 and covered > teeth + 25, (teeth, covered)
    half = _redness(r.render(0.0, 0.0, t, closed=0.5)[rows, cols])
    assert teeth < half < covered
    # Only the mouth crop changes.
    x, y, w, h = avatar.mouth_crop
    outside = np.ones(sealed.shape[:2], bool)
    outside[y : y + h, x : x + w] = False
    assert np.array_equal(sealed[outside], avatar.image[outside])
    assert np.array_equal(r.render_i420(0.0, 0.0, t, closed=1.0).shape, r.still_i420.shape)


def test_closed_leaves_closed_lips_as_they_are() -> None:
    a = prepare_avatar(faces.hopper().image)
    r = WarpRenderer(a)
    t = _quiet_time(r)
    assert not a.mouth_gap.any()
    assert np.array_equal(r.render(0.0, 0.0, t, closed=1.0), a.image)


async def test_speech_with_phonemes_seals_for_bilabials_and_opens_for_vowels(
    avatar: WarpAvatar,
) -> None:
    from musetalk_core.types import PhonemeSpan

    # "a m a p a": loud throughout, so loudness alone would keep the mouth open.
    spans = tuple(
        PhonemeSpan(p, 0.16 * i, 0.16 * (i + 1)) for i, p in enumerate(["a", "m", "a", "p", "a"])
    )
    pcm = _pcm(0.8, seed=4, level=0.25)
    engine = WarpEngine(avatar)
    await engine.push_audio(AudioChunk(pcm, SR, spans), 1)
    await engine.end_segment(1)
    frames = []
    async for frame in engine.frames():
        if not frame.speaking:
            break
        frames.append(frame.image)
    await engine.aclose()
    assert len(frames) == 20
    rows, cols = _teeth_rows(avatar)
    teeth = _redness(avatar.image[rows, cols])

    def at(seconds: float) -> np.ndarray:
        return frames[int(seconds * FPS)]

    for mid in (0.24, 0.56):  # the middles of "m" and "p": sealed, lip over the teeth
        assert _redness(at(mid)[rows, cols]) > teeth + 25, mid
    for mid in (0.08, 0.40, 0.72):  # the vowels: open, a dark cavity below the teeth
        assert (_cavity(at(mid), avatar)).sum() > 100, mid


async def test_a_cut_relaxes_the_mouth_to_rest_over_a_few_frames(avatar: WarpAvatar) -> None:
    """Barge-in mid-vowel: the next idle frames close the mouth over about 120 ms instead of
    snapping shut; then the still picture."""
    from musetalk_core.types import PhonemeSpan

    engine = WarpEngine(avatar)
    frames = engine.frames()
    pcm = _pcm(2.0, seed=5, level=0.25)
    await engine.push_audio(AudioChunk(pcm, SR, (PhonemeSpan("a", 0.0, 2.0),)), 1)
    speaking = [await anext(frames) for _ in range(10)]
    assert all(f.speaking for f in speaking)
    engine.clear()
    after = [await anext(frames) for _ in range(5)]
    await frames.aclose()
    await engine.aclose()
    assert not any(f.speaking for f in after)

    def moved(image: np.ndarray) -> float:
        return float(
            np.abs(_crop(image, avatar.mouth_box) - _crop(avatar.image, avatar.mouth_box)).mean()
        )

    last = moved(speaking[-1].image)
    decay = [moved(f.image) for f in after]
    assert last > 5.0
    assert last > decay[0] > decay[1] > 0.0, (last, decay)
    assert decay[2:] == [0.0, 0.0, 0.0], decay
    assert after[3].image is after[4].image, "at rest: the one shared still picture"
