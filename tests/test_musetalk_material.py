"""MuseTalk avatar material (crops, latents, masks, cache) and the face blends."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import av
import cv2
import faces
import numpy as np
import pytest
import torch

from musetalk_core import landmarks as lm
from musetalk_core import musetalk_avatar as material_mod
from musetalk_core.blending import blend_crop, blend_crop_torch, blend_full_frame, time_blends
from musetalk_core.framing import Crop
from musetalk_core.landmarks import CHIN, JAW_68, NOSE_MID, FaceLandmarks, find_landmarks
from musetalk_core.musetalk_avatar import MaterialSettings, MuseTalkAvatar, prepare_musetalk_avatar
from musetalk_core.musetalk_geometry import (
    LowerFace,
    blend_mask,
    crop_box,
    face_crop,
    masked_crop,
    musetalk_box,
)
from musetalk_core.warp_avatar import AvatarError, NoFaceError, builtin_portrait


class FakeEncoder:
    """Latents that follow the pixels: channels 0-2 are the crop averaged over 8x8 blocks."""

    def __init__(self) -> None:
        self.calls = 0
        self.crops = 0

    def __call__(self, crops: np.ndarray) -> np.ndarray:
        assert crops.dtype == np.uint8 and crops.shape[1:] == (256, 256, 3)
        self.calls += 1
        self.crops += len(crops)
        out = np.zeros((len(crops), 4, 32, 32), np.float32)
        for i, crop in enumerate(crops):
            small = cv2.resize(crop, (32, 32), interpolation=cv2.INTER_AREA)
            out[i, :3] = small.transpose(2, 0, 1) / 255.0
            out[i, 3] = 1.0
        return out


def _refuse(crops: np.ndarray) -> np.ndarray:
    raise AssertionError("encode ran although the cache should have been used")


def _portrait_crop() -> np.ndarray:
    """The bundled portrait cut to 320x320 around the face (Haar box 177..270 x 67..160)."""
    return np.ascontiguousarray(builtin_portrait()[:320, 60:380])


def _write_video(path: Path, frames: Sequence[np.ndarray], rate: int = 25) -> None:
    h, w = frames[0].shape[:2]
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=rate)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        stream.options = {"qscale": "2"}
        for img in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def _shifted(img: np.ndarray, dx: int) -> np.ndarray:
    matrix = np.array([[1, 0, dx], [0, 1, 0]], np.float32)
    h, w = img.shape[:2]
    return np.asarray(cv2.warpAffine(img, matrix, (w, h), borderMode=cv2.BORDER_REPLICATE))


@pytest.fixture(scope="module")
def still() -> MuseTalkAvatar:
    return prepare_musetalk_avatar(builtin_portrait(), FakeEncoder(), encoder_id="fake")


# --------------------------------------------------------------------------------------------
# Geometry


@pytest.fixture(scope="module")
def marks() -> FaceLandmarks:
    return find_landmarks(builtin_portrait())


def _moved(marks: FaceLandmarks, dx: float, dy: float) -> FaceLandmarks:
    return dataclasses.replace(marks, points=marks.points + np.float32([dx, dy]))


def test_face_box_by_upstreams_rules(marks: FaceLandmarks) -> None:
    jaw = marks.xy(JAW_68)
    chin, nose = float(marks.xy(CHIN)[1]), float(marks.xy(NOSE_MID)[1])
    box = musetalk_box(marks, (512, 512), extra_margin=0)
    assert box == (
        int(np.floor(jaw[:, 0].min())),
        round(2 * nose - chin),
        int(np.ceil(jaw[:, 0].max())),
        round(chin),
    )
    assert musetalk_box(marks, (512, 512))[3] == box[3] + 10
    assert musetalk_box(marks, (512, 512), extra_margin=25)[3] == box[3] + 25


@pytest.mark.parametrize("make", faces.ALL, ids=lambda f: f.__name__)
def test_face_box_and_half_mask_line_on_every_test_face(make: Any) -> None:
    """The box ends at the hand-checked chin (plus the margin); the line the UNet repaints
    below, the middle of the crop, runs between the eyes and the mouth."""
    face: faces.Face = make()
    found = find_landmarks(face.image)
    x1, y1, x2, y2 = musetalk_box(found, face.image.shape[1::-1], extra_margin=0)
    tol = max(5.0, 0.08 * found.eye_distance)
    slack = 0.5 * (x2 - x1) * abs(np.sin(found.roll))  # a turned jaw dips below the chin
    assert face.points["chin"][1] - tol <= y2 <= face.points["chin"][1] + tol + slack
    corners_y = (face.points["mouth_left"][1] + face.points["mouth_right"][1]) / 2
    half = (y1 + y2) / 2
    eyes = found.xy(lm.EYE_LOWER[0] + lm.EYE_LOWER[1])[:, 1].max()
    assert eyes < half < corners_y - 0.25 * (face.points["chin"][1] - corners_y)
    assert x1 < face.points["mouth_left"][0] and face.points["mouth_right"][0] < x2


def test_bbox_shift_moves_the_half_face_line(marks: FaceLandmarks) -> None:
    base = musetalk_box(marks, (512, 512))
    assert musetalk_box(marks, (512, 512), bbox_shift=5)[1] == base[1] + 10
    assert musetalk_box(marks, (512, 512), bbox_shift=-7)[1] == base[1] - 14
    assert musetalk_box(marks, (512, 512), bbox_shift=-40)[1] == 0, "clipped"
    with pytest.raises(AvatarError, match="bbox_shift=60"):
        musetalk_box(marks, (512, 512), bbox_shift=60)


def test_face_box_is_clipped_to_the_frame(marks: FaceLandmarks) -> None:
    x1, y1, x2, y2 = musetalk_box(marks, (512, 512))
    # Chin and margin beyond the bottom edge; the face partly left of, then right of the frame.
    assert musetalk_box(marks, (512, y2 - 4))[3] == y2 - 4
    assert musetalk_box(_moved(marks, -x1 - 6, 0), (512, 512))[0] == 0
    assert musetalk_box(_moved(marks, 512 - x2 + 6, 0), (512, 512))[2] == 512


def test_crop_box_is_the_face_box_times_one_and_a_half() -> None:
    assert crop_box((177, 67, 270, 184)) == (136, 38, 310, 212)
    x1, y1, x2, y2 = crop_box((100, 100, 200, 220))
    assert x2 - x1 == y2 - y1 == 2 * int(120 // 2 * 1.5)
    assert ((x1 + x2) // 2, (y1 + y2) // 2) == (150, 160)


def test_blend_mask_keeps_the_lower_face_feathered() -> None:
    face = (177, 67, 270, 184)
    box, mask = blend_mask(face, (512, 512))
    assert box == crop_box(face) and mask.dtype == np.uint8
    assert mask.shape == (box[3] - box[1], box[2] - box[0])
    half = mask.shape[0] // 2
    kernel = int(0.1 * mask.shape[1] // 2 * 2) + 1
    # Nothing above the upper boundary except what the blur spreads up by half a kernel.
    assert mask[: half - kernel // 2].max() == 0
    cx, cy = (face[0] + face[2]) // 2 - box[0], face[1] + 3 * (face[3] - face[1]) // 4 - box[1]
    assert mask[cy, cx] == 255, "lower face, well inside the ellipse"
    assert 0 < mask[half - 2, cx] < 255, "soft upper edge"
    assert mask[-1].max() == 0 and mask[:, 0].max() == 0 and mask[:, -1].max() == 0
    # Lower corners of the face box lie outside the inscribed ellipse (the jaw).
    assert mask[face[3] - 1 - box[1], face[0] - box[0]] < mask[cy, cx] // 4


def _lower_face_zone(marks: FaceLandmarks, frame_shape: tuple[int, ...], reach: int) -> np.ndarray:
    """The face outline below the nose ridge, grown by ``reach`` px: all a mask may touch."""
    zone = np.zeros(frame_shape[:2], np.uint8)
    outline = marks.xy(lm.FACE_OVAL)
    cv2.fillPoly(zone, [np.round(outline).astype(np.int32)], 255)
    zone[: int(marks.xy(NOSE_MID)[1]) - reach] = 0
    kernel = cv2.getStructuringElement(cv2.MORPH_ELLIPSE, (2 * reach + 1, 2 * reach + 1))
    return cv2.dilate(zone, kernel) > 0


@pytest.mark.parametrize("make", faces.ALL, ids=lambda f: f.__name__)
def test_landmark_mask_is_the_lower_face_less_the_nose(make: Any) -> None:
    face: faces.Face = make()
    marks = find_landmarks(face.image)
    size = face.image.shape[1::-1]
    box = musetalk_box(marks, size)
    crop, mask = blend_mask(box, size, LowerFace.from_landmarks(marks))
    _, ellipse = blend_mask(box, size)
    assert crop == blend_mask(box, size)[0] and mask.shape == ellipse.shape

    def at(x: float, y: float, m: np.ndarray = mask) -> int:
        return int(m[int(round(y)) - crop[1], int(round(x)) - crop[0]])

    # Full weight on the lips and between mouth and chin.
    sx, sy = face.points["seam"]
    cx, cy = face.points["chin"]
    assert at(sx, sy) == 255 and at((sx + cx) / 2, (sy + cy) / 2) == 255
    # The nose tip keeps the picture's own (the ellipse pasted the generated one).
    tx, ty = marks.xy(lm.NOSE_TIP)
    assert at(tx, ty) < 0.6 * at(tx, ty, ellipse)
    # Beyond the jaw line (neck, collar, background beside the chin) the picture stays, where
    # the ellipse pasted the generated face's edge over it.
    jaw = marks.xy(lm.JAW_68)
    low = jaw[np.argsort(jaw[:, 1])[-10:]]  # the lower jaw, round the chin
    outside = low + (low - np.array([sx, sy])) * 0.25
    pasted = [(x, y) for x, y in outside if crop[1] <= y < crop[3] and at(x, y, ellipse) >= 64]
    assert pasted and all(at(x, y) < 0.5 * at(x, y, ellipse) for x, y in pasted)
    # Nothing outside the lower face is touched: there the mask is exactly 0.
    # The region grows by 1.2 % of the crop side, then the blur spreads it by half its kernel.
    side = crop_box(box)[2] - crop_box(box)[0]
    kernel = int(0.1 * side // 2 * 2) + 1
    zone = _lower_face_zone(marks, face.image.shape, kernel // 2 + int(np.ceil(0.012 * side)) + 1)
    full = np.zeros(face.image.shape[:2], np.uint8)
    full[crop[1] : crop[3], crop[0] : crop[2]] = mask
    assert full[~zone].max() == 0


def test_landmark_mask_leaves_the_rest_of_the_frame_bit_identical() -> None:
    face = faces.hopper()
    marks = find_landmarks(face.image)
    size = face.image.shape[1::-1]
    box = musetalk_box(marks, size)
    crop, mask = blend_mask(box, size, LowerFace.from_landmarks(marks))
    generated = np.random.default_rng(5).integers(0, 256, (256, 256, 3), dtype=np.uint8)
    out = blend_crop(face.image, generated, box, crop, mask)
    full = np.zeros(face.image.shape[:2], np.uint8)
    full[crop[1] : crop[3], crop[0] : crop[2]] = mask
    same = np.all(out == face.image, axis=2)
    assert same[full == 0].all()
    assert not same[full == 255].all(), "the lower face did change"


def test_blend_mask_is_clipped_at_the_frame_edge() -> None:
    inner = (230, 210, 330, 340)
    edge = (30, 10, 130, 140)  # the same face 200 px up and left: its crop leaves the frame
    big_box, big = blend_mask(inner, (800, 800))
    box, mask = blend_mask(edge, (400, 300))
    assert box[0] == 0 and box[1] == 0 and box == (0, 0, big_box[2] - 200, big_box[3] - 200)
    assert mask.shape == (box[3], box[2])
    off_x, off_y = 200 - big_box[0], 200 - big_box[1]
    assert np.array_equal(mask, big[off_y:, off_x:])


def test_face_crop_and_masked_crop() -> None:
    img = builtin_portrait()
    crop = face_crop(img, (177, 67, 270, 184))
    assert crop.shape == (256, 256, 3) and crop.dtype == np.uint8
    masked = masked_crop(crop)
    assert (masked[128:] == 0).all() and np.array_equal(masked[:128], crop[:128])
    assert (crop[128:] != 0).any(), "the original is untouched"
    batch = masked_crop(np.stack([crop, crop]))
    assert (batch[:, 128:] == 0).all() and np.array_equal(
        batch[:, :128], np.stack([crop] * 2)[:, :128]
    )


# --------------------------------------------------------------------------------------------
# Preparation


def test_still_picture_material(still: MuseTalkAvatar) -> None:
    assert len(still) == 1 and still.source_frames == 1 and not still.cache_hit
    assert still.frame_size == (512, 512)
    # The material is made in the framed picture (head and shoulders), from its own mesh.
    marks = find_landmarks(still.frames[0])
    box = musetalk_box(marks, (512, 512))
    assert tuple(still.face_boxes[0]) == box
    crop, mask = blend_mask(box, (512, 512), LowerFace.from_landmarks(marks))
    assert tuple(still.crop_boxes[0]) == crop == crop_box(box)
    assert np.array_equal(still.masks[0], mask)
    assert still.latents.shape == (1, 8, 32, 32) and still.latents.dtype == np.float32
    assert still.settings == MaterialSettings(encoder_id="fake")


def test_latents_are_masked_then_reference(still: MuseTalkAvatar) -> None:
    x1, y1, x2, y2 = (int(v) for v in still.face_boxes[0])
    crop = face_crop(still.frames[0], (x1, y1, x2, y2))
    expected = FakeEncoder()(crop[None])[0]
    masked, ref = still.latents[0, :4], still.latents[0, 4:]
    assert np.allclose(ref, expected)
    assert (masked[:3, 16:] == 0).all(), "lower half black"
    assert np.allclose(masked[:3, :16], expected[:3, :16])


def test_encode_batches_and_progress(tmp_path: Path) -> None:
    frames = [_shifted(_portrait_crop(), 2 * k) for k in range(5)]
    path = tmp_path / "clip.mp4"
    _write_video(path, frames)
    enc = FakeEncoder()
    seen: list[tuple[str, int, int]] = []
    avatar = prepare_musetalk_avatar(
        path, enc, encoder_id="fake", batch_size=2, progress=lambda *a: seen.append(a)
    )
    assert avatar.source_frames == 5
    assert enc.calls == 3 and enc.crops == 10, "masked + reference crops, 2 frames per call"
    assert seen[-1] == ("latents", 5, 5) and ("faces", 5, 5) in seen


def test_tiny_diffusers_vae_gives_unet_input_shapes() -> None:
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae: Any = AutoencoderKL(  # type: ignore[no-untyped-call]
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(32, 64, 64, 64),
        layers_per_block=1,
        norm_num_groups=32,
        latent_channels=4,
        sample_size=256,
    )
    vae.eval()

    @torch.no_grad()
    def encode(crops: np.ndarray) -> np.ndarray:
        x = torch.from_numpy(crops).permute(0, 3, 1, 2).float() / 127.5 - 1.0
        latents = vae.encode(x).latent_dist.mode() * 0.18215
        out: np.ndarray = latents.numpy()
        return out

    avatar = prepare_musetalk_avatar(builtin_portrait(), encode, encoder_id="tiny")
    assert avatar.latents.shape == (1, 8, 32, 32) and avatar.latents.dtype == np.float32
    assert np.isfinite(avatar.latents).all()
    assert not np.allclose(avatar.latents[0, :4], avatar.latents[0, 4:]), "masked != reference"


def test_video_plays_as_a_ping_pong_cycle(tmp_path: Path) -> None:
    n = 6
    path = tmp_path / "idle.mp4"
    _write_video(path, [_shifted(_portrait_crop(), 3 * k) for k in range(n)])
    avatar = prepare_musetalk_avatar(path, FakeEncoder(), encoder_id="fake")
    assert avatar.source_frames == n and len(avatar) == 2 * n
    assert avatar.frame_size == (512, 512), "framed head and shoulders"
    for i in range(n):
        j = 2 * n - 1 - i
        assert avatar.frames[i] is avatar.frames[j] and avatar.masks[i] is avatar.masks[j]
        assert np.array_equal(avatar.face_boxes[i], avatar.face_boxes[j])
        assert np.array_equal(avatar.crop_boxes[i], avatar.crop_boxes[j])
        assert np.array_equal(avatar.latents[i], avatar.latents[j])
        assert np.array_equal(avatar.source_crops[i], avatar.source_crops[j])
    assert len(avatar.latents) == len(avatar.face_boxes) == len(avatar.masks) == 2 * n
    # The face moves 3 px a frame to the right; the (smoothed) boxes follow it, where they lie
    # in the video (the framing's crop follows the head too, more slowly).
    crops = [Crop.from_array(c) for c in avatar.source_crops[:n]]
    xs = np.asarray([c.to_source(b[:2])[0] for c, b in zip(crops, avatar.face_boxes, strict=False)])
    assert (np.diff(xs) >= 0).all() and 8 <= xs[-1] - xs[0] <= 22, xs
    assert all(c.x >= 0 and c.x + c.w <= 320 for c in crops)
    assert not np.array_equal(avatar.latents[0], avatar.latents[n - 1])


def test_frames_without_a_face_take_the_nearest_box() -> None:
    face = _portrait_crop()
    blank = np.full_like(face, 128)
    frames = [face, blank, blank, _shifted(face, 4)]
    settings = MaterialSettings(encoder_id="x")
    boxes = [box for box, _ in material_mod._face_geometry(frames, "clip", settings, None)]
    assert len(boxes) == 4
    assert all(b[2] > b[0] and b[3] > b[1] for b in boxes)
    assert boxes[0][0] <= boxes[1][0] <= boxes[2][0] <= boxes[3][0] <= boxes[0][0] + 4


def test_video_is_resampled_to_25_fps_and_capped(tmp_path: Path) -> None:
    levels = [20 * k + 30 for k in range(10)]
    path = tmp_path / "fast.mp4"
    _write_video(path, [np.full((64, 64, 3), v, np.uint8) for v in levels], rate=50)
    frames = material_mod._read_video(path, MaterialSettings(encoder_id="x"))
    assert [round(float(f.mean()) / 10) * 10 for f in frames] == levels[::2]
    capped = material_mod._read_video(path, MaterialSettings(encoder_id="x", max_frames=3))
    assert len(capped) == 3
    every = material_mod._read_video(path, MaterialSettings(encoder_id="x", fps=None))
    assert len(every) == 10
    short = material_mod._read_video(path, MaterialSettings(encoder_id="x", max_seconds=0.1))
    assert len(short) == 2


def test_second_preparation_is_a_cache_hit(tmp_path: Path) -> None:
    enc = FakeEncoder()
    first = prepare_musetalk_avatar(builtin_portrait(), enc, encoder_id="vae-a", cache_dir=tmp_path)
    (path,) = tmp_path.glob("musetalk-avatar-*.npz")
    assert not list(tmp_path.glob("*.tmp")), "written atomically"
    second = prepare_musetalk_avatar(
        builtin_portrait(), _refuse, encoder_id="vae-a", cache_dir=tmp_path
    )
    assert second.cache_hit and not first.cache_hit
    assert second.digest == first.digest and second.settings == first.settings
    assert np.array_equal(second.latents, first.latents)
    assert np.array_equal(second.face_boxes, first.face_boxes)
    assert np.array_equal(second.crop_boxes, first.crop_boxes)
    assert all(np.array_equal(a, b) for a, b in zip(second.masks, first.masks, strict=True))
    assert np.array_equal(second.frames[0], first.frames[0])
    # Another bbox_shift, margin or VAE is another preparation.
    for kwargs in ({"bbox_shift": 2}, {"extra_margin": 0}, {"encoder_id": "vae-b"}):
        args = {"encoder_id": "vae-a", **kwargs}
        before = enc.calls
        again = prepare_musetalk_avatar(builtin_portrait(), enc, cache_dir=tmp_path, **args)  # type: ignore[arg-type]
        assert not again.cache_hit and enc.calls > before, kwargs
    assert len(list(tmp_path.glob("musetalk-avatar-*.npz"))) == 4


def test_video_cache_hit_keeps_the_cycle(tmp_path: Path) -> None:
    path = tmp_path / "idle.mp4"
    _write_video(path, [_shifted(_portrait_crop(), 2 * k) for k in range(3)])
    first = prepare_musetalk_avatar(path, FakeEncoder(), encoder_id="v", cache_dir=tmp_path)
    second = prepare_musetalk_avatar(path, _refuse, encoder_id="v", cache_dir=tmp_path)
    assert second.cache_hit and len(second) == len(first) == 6
    assert second.frames[1] is second.frames[4]
    assert np.array_equal(second.latents, first.latents)


def test_corrupt_cache_is_rebuilt(tmp_path: Path) -> None:
    enc = FakeEncoder()
    prepare_musetalk_avatar(builtin_portrait(), enc, encoder_id="v", cache_dir=tmp_path)
    (path,) = tmp_path.glob("musetalk-avatar-*.npz")
    path.write_bytes(path.read_bytes()[:1000])
    again = prepare_musetalk_avatar(builtin_portrait(), enc, encoder_id="v", cache_dir=tmp_path)
    assert not again.cache_hit and enc.calls == 2
    third = prepare_musetalk_avatar(builtin_portrait(), _refuse, encoder_id="v", cache_dir=tmp_path)
    assert third.cache_hit


def test_no_face_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(NoFaceError, match="no frontal face found in the image"):
        prepare_musetalk_avatar(np.full((300, 400, 3), 128, np.uint8), _refuse, encoder_id="v")
    path = tmp_path / "wall.mp4"
    _write_video(path, [np.full((96, 128, 3), 60 + 20 * k, np.uint8) for k in range(3)])
    with pytest.raises(NoFaceError, match=r"wall\.mp4.*none in any of its 3 frames"):
        prepare_musetalk_avatar(path, _refuse, encoder_id="v")


def test_unreadable_sources(tmp_path: Path) -> None:
    with pytest.raises(AvatarError, match="not found"):
        prepare_musetalk_avatar(tmp_path / "nope.mp4", _refuse, encoder_id="v")
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"not a video" * 100)
    with pytest.raises(AvatarError, match="cannot read"):
        prepare_musetalk_avatar(bad, _refuse, encoder_id="v")
    with pytest.raises(ValueError, match="encode returned shape"):
        prepare_musetalk_avatar(
            builtin_portrait(), lambda c: np.zeros((1, 4, 32, 32), np.float32), encoder_id="v"
        )


# --------------------------------------------------------------------------------------------
# Blending


def _blend_case(
    frame_size: tuple[int, int] = (640, 360), face: tuple[int, int, int, int] = (260, 60, 380, 210)
) -> tuple[
    np.ndarray, np.ndarray, tuple[int, int, int, int], tuple[int, int, int, int], np.ndarray
]:
    rng = np.random.default_rng(1)
    w, h = frame_size
    frame = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    face256 = cv2.GaussianBlur(rng.integers(0, 256, (256, 256, 3), dtype=np.uint8), (9, 9), 3)
    box, mask = blend_mask(face, frame_size)
    return frame, np.asarray(face256, np.uint8), face, box, mask


def _changeable(
    frame_shape: tuple[int, ...],
    face: tuple[int, int, int, int],
    box: tuple[int, int, int, int],
    mask: np.ndarray,
) -> np.ndarray:
    """Pixels a blend may change: inside the face box where the mask is not 0."""
    full = np.zeros(frame_shape[:2], np.uint8)
    full[box[1] : box[3], box[0] : box[2]] = mask
    inside = np.zeros(frame_shape[:2], bool)
    inside[face[1] : face[3], face[0] : face[2]] = True
    result: np.ndarray = inside & (full > 0)
    return result


@pytest.mark.parametrize("face", [(260, 60, 380, 210), (5, 0, 125, 150), (530, 220, 640, 360)])
def test_blend_leaves_pixels_outside_the_mask_unchanged(face: tuple[int, int, int, int]) -> None:
    frame, face256, face, box, mask = _blend_case(face=face)
    original = frame.copy()
    out = blend_crop(frame, face256, face, box, mask)
    assert np.array_equal(frame, original), "input untouched"
    keep = ~_changeable(frame.shape, face, box, mask)
    assert np.array_equal(out[keep], frame[keep])
    # Where the mask is full the face replaces the frame.
    full = np.zeros(frame.shape[:2], np.uint8)
    full[box[1] : box[3], box[0] : box[2]] = mask
    resized = cv2.resize(face256, (face[2] - face[0], face[3] - face[1]))
    solid = full[face[1] : face[3], face[0] : face[2]] == 255
    assert solid.any()
    assert np.array_equal(out[face[1] : face[3], face[0] : face[2]][solid], resized[solid])


def test_full_frame_blend_matches_the_crop_blend() -> None:
    frame, face256, face, box, mask = _blend_case()
    a = blend_crop(frame, face256, face, box, mask).astype(int)
    b = blend_full_frame(frame, face256, face, box, mask).astype(int)
    assert np.abs(a - b).max() <= 1


def test_torch_blend_matches_numpy() -> None:
    cases = [_blend_case(face=f) for f in ((260, 60, 380, 210), (5, 0, 125, 150))]
    frames = torch.from_numpy(np.stack([c[0] for c in cases]))
    faces = torch.from_numpy(np.stack([c[1] for c in cases]))
    out = blend_crop_torch(
        frames,
        faces,
        [c[2] for c in cases],
        [c[3] for c in cases],
        [torch.from_numpy(c[4]) for c in cases],
    )
    assert out.dtype == torch.uint8 and out.shape == frames.shape
    for i, (frame, face256, face, box, mask) in enumerate(cases):
        expected = blend_crop(frame, face256, face, box, mask).astype(int)
        got = out[i].numpy().astype(int)
        # Bilinear resizes differ: OpenCV rounds the uint8 face with fixed-point weights, torch
        # interpolates in float and the blend rounds once.
        assert np.abs(got - expected).max() <= 2
        keep = ~_changeable(frame.shape, face, box, mask)
        assert np.array_equal(got[keep], frame[keep])
    # Float faces and float masks (0..1) give the same frames.
    again = blend_crop_torch(
        frames,
        faces.float(),
        [c[2] for c in cases],
        [c[3] for c in cases],
        [torch.from_numpy(c[4]).float() / 255 for c in cases],
    )
    assert torch.equal(again, out)


def test_blend_rejects_a_mask_of_the_wrong_size() -> None:
    frame, face256, face, box, mask = _blend_case()
    with pytest.raises(ValueError, match="does not fit crop box"):
        blend_crop(frame, face256, face, box, mask[1:])


def test_time_blends_reports_medians() -> None:
    result = time_blends((320, 240), n=2, torch_device="cpu")
    assert set(result) == {"crop_ms", "full_frame_ms", "torch_ms", "face_w", "face_h"}
    assert all(v > 0 for v in result.values())
