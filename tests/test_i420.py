"""I420 straight from the warp engine: libswscale's colours, only the changed crops converted."""

from __future__ import annotations

import fractions

import av
import numpy as np
import pytest

from musetalk_core.boxes import Box
from musetalk_core.i420 import I420Canvas, i420_fits, i420_planes, rgb_to_i420
from musetalk_core.types import AudioChunk
from musetalk_core.warp import WarpRenderer
from musetalk_core.warp_avatar import WarpAvatar, builtin_portrait, prepare_avatar
from musetalk_core.warp_engine import WarpEngine
from rtc_server.media.h264 import TunedH264Encoder

SR = 48000


@pytest.fixture(scope="module")
def avatar() -> WarpAvatar:
    return prepare_avatar(builtin_portrait())


def _swscale(rgb: np.ndarray) -> np.ndarray:
    """What aiortc's encoder would have made of the RGB frame (libswscale's default)."""
    frame = av.VideoFrame.from_ndarray(rgb, format="rgb24").reformat(format="yuv420p")
    return frame.to_ndarray().astype(np.int16)


def test_the_colours_are_libswscales(avatar: WarpAvatar) -> None:
    rgb = avatar.image
    h = rgb.shape[0]
    ours = rgb_to_i420(rgb).astype(np.int16)
    theirs = _swscale(rgb)
    assert ours.shape == theirs.shape == (h * 3 // 2, rgb.shape[1])
    luma, chroma = np.abs(ours[:h] - theirs[:h]), np.abs(ours[h:] - theirs[h:])
    assert luma.max() <= 1 and luma.mean() < 0.05
    assert chroma.mean() < 0.5 and chroma.max() <= 10

    # Back to RGB the way a decoder does, as close to the source as libswscale's own.
    def back(i420: np.ndarray) -> np.ndarray:
        f = av.VideoFrame.from_ndarray(i420.astype(np.uint8), format="yuv420p")
        return f.to_ndarray(format="rgb24").astype(np.int16)

    assert np.abs(back(ours) - rgb).mean() <= np.abs(back(theirs) - rgb).mean() + 0.05


def test_planes_are_views_in_pyavs_layout() -> None:
    rng = np.random.default_rng(1)
    rgb = rng.integers(0, 256, (8, 12, 3)).astype(np.uint8)
    i420 = rgb_to_i420(rgb)
    y, u, v = i420_planes(i420, 12, 8)
    assert y.shape == (8, 12) and u.shape == v.shape == (4, 6)
    assert np.shares_memory(y, i420) and np.shares_memory(v, i420)
    frame = av.VideoFrame.from_ndarray(i420, format="yuv420p")
    assert (frame.width, frame.height) == (12, 8)
    assert np.array_equal(frame.to_ndarray(), i420)
    for plane, ours in zip(frame.planes, (y, u, v), strict=True):
        rows = np.frombuffer(bytes(plane), np.uint8).reshape(-1, plane.line_size)
        assert np.array_equal(rows[:, : ours.shape[1]], ours)


def test_odd_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="even sides"):
        rgb_to_i420(np.zeros((5, 8, 3), np.uint8))
    with pytest.raises(ValueError, match="even sides"):
        rgb_to_i420(np.zeros((8, 8), np.uint8))


def test_converting_the_changed_crops_is_converting_the_whole_picture() -> None:
    rng = np.random.default_rng(2)
    base = rng.integers(0, 256, (64, 80, 3)).astype(np.uint8)
    canvas = I420Canvas(base)
    changed = base.copy()
    boxes = [Box(7, 9, 13, 11), Box(60, 50, 25, 20), Box(0, 0, 1, 1)]  # odd edges, one clipped
    for b in boxes:
        changed[b.y : b.y + b.h, b.x : b.x + b.w] = rng.integers(0, 256, (b.h, b.w, 3))[
            : max(0, min(b.h, 64 - b.y)), : max(0, min(b.w, 80 - b.x))
        ]
    assert np.array_equal(canvas.convert(changed, boxes), rgb_to_i420(changed))
    assert np.array_equal(canvas.convert(changed, None), rgb_to_i420(changed))
    assert np.array_equal(canvas.convert(base, []), canvas.base)
    with pytest.raises(ValueError):
        canvas.base[0, 0] = 1  # shared by every frame that does not change: read-only


def test_the_renderer_in_i420_is_its_rgb_render_converted(avatar: WarpAvatar) -> None:
    r = WarpRenderer(avatar)
    t = 0.0
    while r.blink_amount(t) < 0.5:  # mouth open and eyes half shut: every crop changes
        t += 0.005
    for openness, roundness in [(0.8, 0.0), (0.4, 1.0), (0.05, 0.5)]:
        expected = rgb_to_i420(r.render(openness, roundness, t))
        assert np.array_equal(r.render_i420(openness, roundness, t), expected)
    still_t = 0.0
    while r.blink_amount(still_t) > 0.0:
        still_t += 0.01
    assert r.render_i420(0.0, 0.0, still_t) is r.still_i420
    assert np.array_equal(r.still_i420, rgb_to_i420(avatar.image))
    swaying = WarpRenderer(avatar, sway_px=2.0)
    assert np.array_equal(
        swaying.render_i420(0.5, 0.0, 1.3), rgb_to_i420(swaying.render(0.5, 0.0, 1.3))
    )


async def test_the_engine_yields_i420_that_the_encoder_takes_as_it_is(avatar: WarpAvatar) -> None:
    with pytest.raises(ValueError, match="pixel_format"):
        WarpEngine(avatar, pixel_format="bgr24")
    # PyAV reads an I420 array's height as rows // 6 * 4: such pictures stay RGB (framed
    # avatars are 512x512; a whole picture keeps its own size).
    odd = prepare_avatar(builtin_portrait()[:510], framing="full")
    assert odd.frame_size == (512, 510) and not i420_fits(odd.frame_size)
    with pytest.raises(ValueError, match="multiple of 4"):
        WarpEngine(odd, pixel_format="yuv420p")
    engine = WarpEngine(avatar, pixel_format="yuv420p")
    rng = np.random.default_rng(3)
    speech = np.clip(rng.normal(0, 0.2, SR // 5) * 32767, -32768, 32767).astype(np.int16)
    try:
        await engine.push_audio(AudioChunk(speech, SR), 1)
        await engine.end_segment(1)
        frames = engine.frames()
        got = [await anext(frames) for _ in range(10)]
        await frames.aclose()
    finally:
        await engine.aclose()
    speaking = [f for f in got if f.speaking]
    idle = [f for f in got if not f.speaking]
    assert len(speaking) == 5 and idle
    for f in got:
        assert f.image.shape == (768, 512) and f.image.dtype == np.uint8
    # The mouth relaxes over two idle frames after speech; then the still picture, one array.
    rest = idle[2:]
    assert len(rest) >= 2 and all(f.image is rest[0].image for f in rest)
    encoder = TunedH264Encoder()
    for i, f in enumerate(speaking):
        frame = av.VideoFrame.from_ndarray(f.image, format="yuv420p")
        frame.pts, frame.time_base = i * 3600, fractions.Fraction(1, 90_000)
        payloads, timestamp = encoder.encode(frame, force_keyframe=i == 0)
        assert payloads and timestamp == i * 3600
    assert encoder.codec is not None and encoder.codec.pix_fmt == "yuv420p"


def test_an_i420_frame_decodes_to_the_picture_it_was_made_from(avatar: WarpAvatar) -> None:
    r = WarpRenderer(avatar)
    picture = r.render_i420(0.7, 0.3, 0.0)
    codec = av.CodecContext.create("libx264", "w")
    codec.width, codec.height, codec.pix_fmt = 512, 512, "yuv420p"
    codec.time_base = fractions.Fraction(1, 25)
    codec.options = {"preset": "ultrafast", "tune": "zerolatency", "crf": "17"}
    frame = av.VideoFrame.from_ndarray(picture, format="yuv420p")
    frame.pts = 0
    packets = [*codec.encode(frame), *codec.encode(None)]
    decoder = av.CodecContext.create("h264", "r")
    decoded = [f for p in packets for f in decoder.decode(p)]
    assert len(decoded) == 1
    back = decoded[0].to_ndarray(format="rgb24").astype(np.int16)
    source = r.render(0.7, 0.3, 0.0).astype(np.int16)
    assert np.abs(back - source).mean() < 3.0  # CRF 17 plus 4:2:0 chroma
