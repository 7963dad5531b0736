"""Framing (musetalk_core/framing.py): head and shoulders by default, the whole picture on
request, a video's crop following the head smoothly, framed and whole avatars cached apart."""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np
import pytest

from musetalk_core import landmarks as landmarks_mod
from musetalk_core import warp_avatar as avatar_mod
from musetalk_core.framing import (
    FRAME_SIDE,
    Crop,
    face_fraction,
    face_width,
    frame_pictures,
    head_crops,
)
from musetalk_core.landmarks import find_landmarks
from musetalk_core.musetalk_avatar import prepare_musetalk_avatar
from musetalk_core.types import AudioChunk
from musetalk_core.warp_avatar import WarpAvatar, builtin_portrait, prepare_avatar
from rtc_server.cli import build_parser
from rtc_server.config import ConfigError, EngineSettings, ServerConfig
from rtc_server.engine_factory import load_engine_factory
from rtc_server.options import config_from


@pytest.fixture(scope="module")
def framed() -> WarpAvatar:
    return prepare_avatar(builtin_portrait())


@pytest.fixture(scope="module")
def whole() -> WarpAvatar:
    return prepare_avatar(builtin_portrait(), framing="full")


def _zero_latents(crops: np.ndarray) -> np.ndarray:
    return np.zeros((len(crops), 4, 32, 32), np.float32)


def test_builtin_avatar_face_spans_a_third_to_a_half_of_the_frame(
    framed: WarpAvatar, whole: WarpAvatar
) -> None:
    # Measured with a face mesh found afresh in each picture, not with the framing's numbers.
    before = face_fraction(builtin_portrait())
    after = face_fraction(framed.image)
    print(f"face width: {before:.3f} of the frame whole, {after:.3f} framed")
    assert before < 0.25, "the whole portrait's face is small"
    assert 1 / 3 <= after <= 1 / 2
    # No more pixels to encode than before, sides even (I420).
    assert framed.frame_size == (FRAME_SIDE, FRAME_SIDE) == whole.frame_size
    # The mouth the caller watches is more than twice as large.
    assert framed.mouth_box.w >= 2 * whole.mouth_box.w
    assert framed.mouth_box.h >= 2 * whole.mouth_box.h


def test_head_framing_is_head_and_shoulders(framed: WarpAvatar) -> None:
    marks = find_landmarks(framed.image)
    outline = marks.xy(landmarks_mod.FACE_OVAL)
    centre_x = (outline[:, 0].min() + outline[:, 0].max()) / 2
    top, chin = float(outline[:, 1].min()), float(outline[:, 1].max())
    assert abs(centre_x - FRAME_SIDE / 2) < 0.05 * FRAME_SIDE, "the face is centred"
    assert top > 0.1 * FRAME_SIDE, "room above the forehead for the hair"
    assert chin < 0.75 * FRAME_SIDE, "the neck and shoulders show below the chin"


def test_framing_full_keeps_the_old_picture(whole: WarpAvatar) -> None:
    assert whole.framing == "full"
    assert np.array_equal(whole.image, builtin_portrait())
    assert Crop.from_array(whole.source_crop) == Crop.whole(512, 512)


def test_both_engines_frame_a_picture_alike(framed: WarpAvatar) -> None:
    """MuseTalk's material is made in the same framed picture as the warp engine's avatar (the
    warp engine takes a MuseTalk call over mid-call, and its mouth box is MuseTalk's too)."""
    material = prepare_musetalk_avatar(builtin_portrait(), _zero_latents, encoder_id="zero")
    assert np.array_equal(material.frames[0], framed.image)
    assert np.array_equal(material.source_crops[0], framed.source_crop)
    mx1, my1, mx2, my2 = (int(v) for v in material.face_boxes[0])
    x, y, w, h = framed.mouth_box
    assert mx1 <= x and x + w <= mx2 and my1 <= y and y + h <= my2


async def test_serve_framing_full_serves_the_whole_picture(tmp_path: Path) -> None:
    environ = {"AVATAR_RTC_FRAMING": "full"}
    from_env = config_from(build_parser(environ).parse_args(["serve"]), environ)
    from_flag = config_from(build_parser({}).parse_args(["serve", "--framing", "full"]), {})
    assert from_env.engine.framing == from_flag.engine.framing == "full"
    assert ServerConfig.of().engine.framing == "head"
    with pytest.raises(ConfigError, match="framing"):
        EngineSettings(framing="waist")

    pictures = {}
    for framing in ("full", "head"):
        config = ServerConfig.of(cache_dir=tmp_path, name="warp", framing=framing)
        factory = load_engine_factory(config)
        engine = factory.create()
        try:
            frames = engine.frames()
            frame = await anext(frames)
            await frames.aclose()
        finally:
            await engine.aclose()
        image = frame.image
        if image.ndim == 2:  # I420, as the sender takes it
            image = av.VideoFrame.from_ndarray(image, format="yuv420p").to_ndarray(format="rgb24")
        pictures[framing] = (image, factory.mouth_box)
    old = prepare_avatar(builtin_portrait(), framing="full")
    image, mouth = pictures["full"]
    assert image.shape == (512, 512, 3) and mouth == old.mouth_box
    # Away from the face (which idles), the old picture, to within the I420 round trip.
    away = (slice(300, 512), slice(300, 512))
    error = np.abs(image[away].astype(np.int16) - builtin_portrait()[away].astype(np.int16))
    assert error.mean() < 4
    head, head_mouth = pictures["head"]
    assert head_mouth != mouth and 1 / 3 <= face_fraction(head) <= 1 / 2


def test_framed_and_whole_avatars_are_cached_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    head = prepare_avatar(builtin_portrait(), cache_dir=tmp_path)
    full = prepare_avatar(builtin_portrait(), cache_dir=tmp_path, framing="full")
    names = sorted(p.name for p in tmp_path.glob("*.npz"))
    assert len(names) == 2 and "-full-" in names[0] and "-head-" in names[1]

    def no_detection(*args: object, **kwargs: object) -> None:
        raise AssertionError("detection ran although the cache should have been used")

    monkeypatch.setattr(avatar_mod, "find_landmarks", no_detection)
    monkeypatch.setattr(landmarks_mod, "find_landmarks", no_detection)
    again_head = prepare_avatar(builtin_portrait(), cache_dir=tmp_path)
    again_full = prepare_avatar(builtin_portrait(), cache_dir=tmp_path, framing="full")
    assert again_head.framing == "head" and np.array_equal(again_head.image, head.image)
    assert again_full.framing == "full" and np.array_equal(again_full.image, full.image)
    assert not np.array_equal(again_head.image, again_full.image)


def test_musetalk_material_is_cached_per_framing(tmp_path: Path) -> None:
    def refuse(crops: np.ndarray) -> np.ndarray:
        raise AssertionError("encode ran although the cache should have been used")

    picture = builtin_portrait()
    made = {
        f: prepare_musetalk_avatar(
            picture, _zero_latents, encoder_id="z", cache_dir=tmp_path, framing=f
        )
        for f in ("head", "full")
    }
    assert len(list(tmp_path.glob("*.npz"))) == 2
    for framing, first in made.items():
        again = prepare_musetalk_avatar(
            picture, refuse, encoder_id="z", cache_dir=tmp_path, framing=framing
        )
        assert again.cache_hit and again.settings.framing == framing
        assert np.array_equal(again.frames[0], first.frames[0])
        assert np.array_equal(again.source_crops, first.source_crops)
    assert np.array_equal(made["full"].frames[0], picture)
    assert not np.array_equal(made["head"].frames[0], picture)


def test_crop_stays_inside_the_picture_at_its_edge() -> None:
    # The face near the left edge of a wider picture: the crop slides in, keeps its size.
    canvas = np.full((540, 720, 3), 120, np.uint8)
    canvas[28:540, :362] = builtin_portrait()[:512, 150:512]
    (out,), (crop,) = frame_pictures([canvas], "head")
    assert crop.x == 0.0 and crop.y >= 0 and crop.y + crop.h <= 540
    assert out.shape == (FRAME_SIDE, FRAME_SIDE, 3)
    assert 1 / 3 <= face_fraction(out) <= 1 / 2


def test_a_small_picture_is_not_blurred_beyond_three_times() -> None:
    small = np.ascontiguousarray(builtin_portrait()[20:180, 145:305])  # 160x160, the face 95 px
    (out,), (crop,) = frame_pictures([small], "head")
    assert (crop.x, crop.y, crop.w, crop.h) == (0.0, 0.0, 160.0, 160.0)
    assert out.shape == (480, 480, 3) and crop.zoom == 3.0


def test_a_video_crop_follows_the_head_smoothly_without_jitter() -> None:
    """A head swaying 30 px either way over 4 s, its mesh found with 1.5 px of noise a frame:
    the crop keeps one size, follows the sway, and none of the noise shows."""
    base = find_landmarks(builtin_portrait()).points.astype(np.float64) + [100.0, 20.0]
    fps, n = 25.0, 150
    rng = np.random.default_rng(7)
    t = np.arange(n) / fps
    sway = 30.0 * np.sin(2 * np.pi * t / 4.0)
    noise = rng.normal(0.0, 1.5, (n, 2))
    tracks = [
        base + [s, 0.0] + e + rng.normal(0.0, 0.5, base.shape)
        for s, e in zip(sway, noise, strict=True)
    ]
    crops = head_crops(tracks, 720, 540, fps=fps)
    assert len({(c.w, c.h, c.out_w, c.out_h) for c in crops}) == 1, "one size for the clip"
    width = face_width(base)
    assert abs(crops[0].w - width / 0.42) < 0.05 * crops[0].w

    x = np.asarray([c.x for c in crops])
    # It follows: the sway survives the smoothing, within 15 % of its span inside the clip.
    # At the clip's ends, where the idle loop turns round, the crop slows to turn with it.
    assert np.ptp(x) > 0.8 * np.ptp(sway)
    inside = slice(int(2 * 0.3 * fps), n - int(2 * 0.3 * fps))
    offset = np.median(x - sway)
    assert np.abs(x - sway - offset)[inside].max() < 0.15 * np.ptp(sway)
    assert np.corrcoef(x, sway)[0, 1] > 0.98
    assert abs(x[1] - x[0]) < 0.25 and abs(x[-1] - x[-2]) < 0.25
    # No jitter: frame-to-frame acceleration a small fraction of the raw mesh's.
    raw = np.asarray([face_centre_x(p) for p in tracks])
    assert np.std(np.diff(x, 2)) < 0.05 * np.std(np.diff(raw, 2))
    # The most it accelerates is about the sway's own (its turns), noise adds nothing to it.
    assert np.abs(np.diff(x, 2)).max() < 1.5 * np.abs(np.diff(sway, 2)).max()


def face_centre_x(points: np.ndarray) -> float:
    xs = points[list(landmarks_mod.FACE_OVAL), 0]
    return float((xs.min() + xs.max()) / 2)


async def test_the_warp_engine_speaks_in_the_framed_picture(framed: WarpAvatar) -> None:
    """Speech moves the framed mouth, and nothing far from the face."""
    from musetalk_core.warp_engine import WarpEngine

    engine = WarpEngine(framed, fps=25, sample_rate=16_000)
    rng = np.random.default_rng(1)
    tone = np.sin(2 * np.pi * 4 * np.arange(16_000) / 16_000)  # 4 Hz syllables
    speech = (rng.normal(0, 0.25, 16_000) * np.abs(tone) * 32767).astype(np.int16)
    try:
        await engine.push_audio(AudioChunk(speech, 16_000), 1)
        await engine.end_segment(1)
        frames = engine.frames()
        images = [(await anext(frames)).image for _ in range(25)]
        await frames.aclose()
    finally:
        await engine.aclose()
    stack = np.stack(images).astype(np.float32)
    x, y, w, h = framed.mouth_box
    mouth = stack[:, y : y + h, x : x + w].std(axis=0).mean()
    corner = stack[:, -100:, -100:].std(axis=0).mean()
    assert mouth > 5.0 and corner < 0.5, (mouth, corner)


def test_prepare_avatar_takes_the_framing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import cv2

    from rtc_server.cli import main

    portrait = tmp_path / "me.png"
    cv2.imwrite(str(portrait), cv2.cvtColor(builtin_portrait(), cv2.COLOR_RGB2BGR))
    out = tmp_path / "cache"
    base = ["prepare-avatar", str(portrait), "--engine", "warp", "--out", str(out)]
    assert main(base, {}) == 0
    assert main([*base, "--framing", "full"], {}) == 0
    said = capsys.readouterr().out.splitlines()
    assert len(said) == 2 and said[0] != said[1], "two mouths: framed, then whole"
    assert sorted(p.name.split("-")[3] for p in out.glob("*.npz")) == ["full", "head"]


def test_a_video_avatar_keeps_its_head_in_frame(tmp_path: Path) -> None:
    """A video panning the head 40 px across in 2 s: MuseTalk's material, framed, keeps the
    face near the same place while the crop travels smoothly with it."""
    import cv2

    n, fps = 50, 25
    sway = 20.0 * np.sin(np.pi * (np.arange(n) / (n - 1) - 0.5))  # -20 .. +20 px, eased
    portrait = builtin_portrait()
    path = tmp_path / "pan.mp4"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = 640, 512, "yuv420p"
        stream.options = {"qscale": "2"}
        for dx in sway:
            m = np.float32([[1, 0, 64 + dx], [0, 1, 0]])
            img = cv2.warpAffine(portrait, m, (640, 512), borderMode=cv2.BORDER_REPLICATE)
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    material = prepare_musetalk_avatar(path, _zero_latents, encoder_id="zero")
    assert material.source_frames == n and material.frame_size == (FRAME_SIDE, FRAME_SIDE)
    crops = [Crop.from_array(c) for c in material.source_crops[:n]]
    x = np.asarray([c.x for c in crops])
    assert all(0 <= c.x and c.x + c.w <= 640 and 0 <= c.y and c.y + c.h <= 512 for c in crops)
    assert len({c.w for c in crops}) == 1
    # The crop travels with the head ...
    assert np.ptp(x) > 0.8 * np.ptp(sway)
    assert np.abs(np.diff(x, 2)).max() < 0.5, "smoothly: no frame-to-frame jumps"
    # ... so the face, in the framed frames, moves a fraction of what it would with a fixed
    # crop (the pan times the zoom).
    face_x = (material.face_boxes[:n, 0] + material.face_boxes[:n, 2]) / 2
    print(f"crop moved {np.ptp(x):.1f} px, the face in the frame {np.ptp(face_x):.1f} px")
    assert np.ptp(face_x) < 0.3 * np.ptp(sway) * crops[0].zoom, (np.ptp(face_x), crops[0].zoom)
