"""Avatar preparation: detection on real pictures, errors, loading, the .npz cache."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import av
import cv2
import faces
import numpy as np
import pytest

from musetalk_core import warp_avatar as avatar_mod
from musetalk_core.boxes import Box, Corners
from musetalk_core.framing import Crop
from musetalk_core.warp_avatar import (
    AvatarError,
    NoFaceError,
    WarpAvatar,
    builtin_portrait,
    load_portrait,
    prepare_avatar,
)


def _centre(box: tuple[int, int, int, int]) -> tuple[float, float]:
    x, y, w, h = box
    return x + w / 2, y + h / 2


def _inside(point: tuple[float, float], box: tuple[int, int, int, int]) -> bool:
    x, y, w, h = box
    return x <= point[0] <= x + w and y <= point[1] <= y + h


@pytest.fixture(scope="module")
def astronaut() -> WarpAvatar:
    return prepare_avatar(builtin_portrait())


def _in_source(avatar: WarpAvatar, point: tuple[float, float]) -> tuple[float, float]:
    """A point of the framed avatar where it lies in the picture the avatar was made from."""
    x, y = Crop.from_array(avatar.source_crop).to_source(point)
    return float(x), float(y)


def test_builtin_portrait_is_rgb_512() -> None:
    img = builtin_portrait()
    assert img.shape == (512, 512, 3)
    assert img.dtype == np.uint8


def test_astronaut_face_mouth_and_eyes_found(astronaut: WarpAvatar) -> None:
    face = astronaut.face_box
    fx, fy, fw, fh = face
    mouth = _centre(astronaut.mouth_box)
    left, right = (_centre(b) for b in astronaut.eye_boxes)
    assert _inside(mouth, face) and _inside(left, face) and _inside(right, face)
    assert mouth[1] > fy + fh / 2, "mouth in the lower half of the face"
    assert left[1] < fy + fh / 2 and right[1] < fy + fh / 2, "eyes in the upper half"
    assert left[0] < fx + fw / 2 < right[0]
    # Where the features are in the built-in picture (measured by eye on a zoomed crop): mouth
    # corners at x 203..245, lips y 139..154; eye centres near (204, 100) and (247, 102). The
    # avatar is framed, so what it found is carried back into that picture.
    mouth, left, right = (_in_source(astronaut, p) for p in (mouth, left, right))
    assert abs(mouth[0] - 224) < 8 and abs(mouth[1] - 146) < 8
    assert abs(left[0] - 204) < 6 and abs(left[1] - 100) < 6
    assert abs(right[0] - 247) < 6 and abs(right[1] - 102) < 6
    # The lip line sits between upper teeth and lower lip (row ~148).
    lip = _in_source(astronaut, (0.0, astronaut.lip_y + astronaut.mouth_crop[1]))
    assert 140 < lip[1] < 154


@pytest.fixture(scope="module")
def astronaut_whole() -> WarpAvatar:
    return prepare_avatar(builtin_portrait(), framing="full")


def test_lip_seam_follows_the_smile(astronaut_whole: WarpAvatar) -> None:
    """The line where the lips part runs under the teeth and up to the raised mouth corners.

    On the whole picture, where its points were measured to the pixel; the framed avatar's lip
    line is checked against the same points by test_lip_line_and_corners_on_every_test_face.
    """
    astronaut = astronaut_whole
    x0, y0 = astronaut.mouth_crop[:2]
    seam = astronaut.mouth_seam + y0
    u = astronaut.mouth_u
    left, right = int(np.argmin(np.abs(u + 1))), int(np.argmin(np.abs(u - 1)))
    centre = int(np.argmin(np.abs(u)))
    # Measured by eye: corners near (203, 140) and (244, 141), teeth end at row ~148 mid-mouth.
    assert abs(left + x0 - 203) <= 4 and abs(right + x0 - 244) <= 4
    assert abs(seam[centre] - 148.5) <= 1.0
    assert 138 <= seam[left] <= 144 and 138 <= seam[right] <= 144
    # Smooth: rising monotonically from the centre to each corner, flat beyond.
    middle = int(np.flatnonzero(u >= 0)[0])
    assert (np.diff(seam[left:middle]) >= 0).all()
    assert (np.diff(seam[middle : right + 1]) <= 0).all()
    for beyond, end in ((seam[:left], seam[left]), (seam[right + 1 :], seam[right])):
        assert np.ptp(beyond) == 0.0 and abs(beyond[0] - end) < 0.5


def test_detection_follows_the_face_when_moved_and_scaled(astronaut: WarpAvatar) -> None:
    scale, dx, dy = 0.75, 150, 40
    small = cv2.resize(builtin_portrait(), None, fx=scale, fy=scale, interpolation=cv2.INTER_AREA)
    canvas = np.full((480, 700, 3), 200, np.uint8)
    canvas[dy : dy + small.shape[0], dx : dx + small.shape[1]] = small
    moved = prepare_avatar(canvas)
    # Both are framed: compared where their features lie in the pictures they were made from.
    mx, my = _in_source(moved, _centre(moved.mouth_box))
    ox, oy = _in_source(astronaut, _centre(astronaut.mouth_box))
    assert abs(mx - (ox * scale + dx)) < 6 and abs(my - (oy * scale + dy)) < 6
    for new, old in zip(moved.eye_boxes, astronaut.eye_boxes, strict=True):
        nx, ny = _in_source(moved, _centre(new))
        ex, ey = _in_source(astronaut, _centre(old))
        assert abs(nx - (ex * scale + dx)) < 5 and abs(ny - (ey * scale + dy)) < 5


def test_crops_lie_inside_the_image_and_masks_are_feathered(astronaut: WarpAvatar) -> None:
    h, w = astronaut.image.shape[:2]
    x, y, cw, ch = astronaut.mouth_crop
    assert 0 <= x and 0 <= y and x + cw <= w and y + ch <= h
    mask = astronaut.mouth_mask
    assert mask.dtype == np.float32 and mask.shape == (ch, cw)
    assert mask.max() == pytest.approx(1.0, abs=1e-3)
    assert mask[0].max() == mask[-1].max() == mask[:, 0].max() == mask[:, -1].max() == 0.0
    assert 0 < ((mask > 0) & (mask < 1)).sum(), "soft edge"
    for (ex, ey, ew, eh), eye_mask in zip(astronaut.eye_crops, astronaut.eye_masks, strict=True):
        assert 0 <= ex and 0 <= ey and ex + ew <= w and ey + eh <= h
        assert eye_mask.shape == (eh, ew) and eye_mask[0].max() == 0.0


@pytest.mark.parametrize(
    "image",
    [
        np.full((360, 480, 3), 128, np.uint8),
        np.random.default_rng(0).integers(0, 256, (400, 400, 3), dtype=np.uint8),
    ],
    ids=["blank", "noise"],
)
def test_no_face_raises_a_clear_error(image: np.ndarray) -> None:
    with pytest.raises(NoFaceError, match="no frontal face found in cat.png") as info:
        prepare_avatar(image, source="cat.png")
    assert "frontal portrait" in str(info.value)
    assert isinstance(info.value, AvatarError) and isinstance(info.value, ValueError)


def test_prepare_rejects_non_images() -> None:
    with pytest.raises(AvatarError, match="uint8"):
        prepare_avatar(np.zeros((64, 64, 3), np.float32))
    with pytest.raises(AvatarError, match="shape"):
        prepare_avatar(np.zeros((64, 64, 2), np.uint8))


def test_cache_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = prepare_avatar(builtin_portrait(), cache_dir=tmp_path)
    files = list(tmp_path.glob("*.npz"))
    assert len(files) == 1 and len(files[0].stem.rsplit("-", 1)[-1]) == 64  # sha256 hex

    def no_detection(*args: object, **kwargs: object) -> None:
        raise AssertionError("detection ran although the cache should have been used")

    monkeypatch.setattr(avatar_mod, "find_landmarks", no_detection)
    second = prepare_avatar(builtin_portrait(), cache_dir=tmp_path)
    for f in dataclasses.fields(WarpAvatar):
        a, b = getattr(first, f.name), getattr(second, f.name)
        if isinstance(a, np.ndarray):
            assert a.dtype == b.dtype and np.array_equal(a, b), f.name
        else:
            assert a == b and type(a) is type(b), f.name


def test_unreadable_cache_is_rebuilt(tmp_path: Path) -> None:
    first = prepare_avatar(builtin_portrait(), cache_dir=tmp_path)
    (path,) = tmp_path.glob("*.npz")
    path.write_bytes(b"not a zip file")
    again = prepare_avatar(builtin_portrait(), cache_dir=tmp_path)
    assert again.mouth_box == first.mouth_box
    assert np.load(path)["image"].shape == (512, 512, 3)


def test_load_portrait_missing_file(tmp_path: Path) -> None:
    with pytest.raises(AvatarError, match="not found"):
        load_portrait(tmp_path / "nope.png")


def test_load_portrait_unreadable_file(tmp_path: Path) -> None:
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"\x89PNG but not really" + bytes(range(256)))
    with pytest.raises(AvatarError, match="cannot read"):
        load_portrait(bad)


def test_load_portrait_image_is_rgb_with_even_sides(tmp_path: Path) -> None:
    img = np.zeros((201, 301, 3), np.uint8)
    img[..., 0] = 255  # red in RGB
    path = tmp_path / "odd.png"
    cv2.imwrite(str(path), cv2.cvtColor(img, cv2.COLOR_RGB2BGR))
    loaded = load_portrait(path)
    assert loaded.shape == (200, 300, 3) and loaded.dtype == np.uint8
    assert (loaded[..., 0] == 255).all() and (loaded[..., 1:] == 0).all()


def test_load_portrait_scales_large_images(tmp_path: Path) -> None:
    path = tmp_path / "big.jpg"
    cv2.imwrite(str(path), np.full((1000, 1500, 3), 90, np.uint8))
    loaded = load_portrait(path)
    assert max(loaded.shape[:2]) <= 720
    assert loaded.shape[0] % 2 == 0 and loaded.shape[1] % 2 == 0
    assert loaded.shape[1] / loaded.shape[0] == pytest.approx(1.5, rel=0.01)


def test_load_portrait_video_first_frame(tmp_path: Path) -> None:
    path = tmp_path / "clip.mp4"
    portrait = builtin_portrait()[:256, :320]
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=25)
        stream.width, stream.height, stream.pix_fmt = 320, 256, "yuv420p"
        for k in range(3):
            frame = av.VideoFrame.from_ndarray(
                portrait if k == 0 else 255 - portrait, format="rgb24"
            )
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    loaded = load_portrait(path)
    assert loaded.shape == (256, 320, 3)
    assert np.abs(loaded.astype(int) - portrait.astype(int)).mean() < 12


def test_prepare_astronaut_from_file_matches_builtin(tmp_path: Path, astronaut: WarpAvatar) -> None:
    path = tmp_path / "astronaut.png"
    cv2.imwrite(str(path), cv2.cvtColor(builtin_portrait(), cv2.COLOR_RGB2BGR))
    again = prepare_avatar(load_portrait(path))
    assert again.mouth_box == astronaut.mouth_box
    assert again.frame_size == (512, 512)


@pytest.fixture(scope="module", params=faces.ALL, ids=lambda f: f.__name__)
def face(request: pytest.FixtureRequest) -> tuple[faces.Face, WarpAvatar]:
    made: faces.Face = request.param()
    avatar = prepare_avatar(made.image, source=made.name)
    return faces.framed(made, avatar.source_crop), avatar


def _tolerance(avatar: WarpAvatar) -> float:
    """As tests/test_landmarks.py: 8 % of the eye distance, at least 5 px."""
    (lx, ly), (rx, ry) = (_centre(b) for b in avatar.eye_boxes)
    return max(5.0, 0.08 * float(np.hypot(rx - lx, ry - ly)))


def test_lip_line_and_corners_on_every_test_face(face: tuple[faces.Face, WarpAvatar]) -> None:
    """Closed lips part at their seam; lips apart over teeth part under the teeth."""
    made, avatar = face
    x0, y0 = avatar.mouth_crop[:2]
    u = avatar.mouth_u
    left, right = int(np.argmin(np.abs(u + 1))), int(np.argmin(np.abs(u - 1)))
    tol = _tolerance(avatar)
    assert abs(left + x0 - made.points["mouth_left"][0]) <= tol
    assert abs(right + x0 - made.points["mouth_right"][0]) <= tol
    sx, sy = made.points["seam"]
    seam_there = float(np.interp(sx - x0, np.arange(len(avatar.mouth_seam)), avatar.mouth_seam))
    assert abs(seam_there + y0 - sy) <= tol
    # Flat beyond the corners.
    assert np.ptp(avatar.mouth_seam[:left]) == 0.0 and np.ptp(avatar.mouth_seam[right + 1 :]) == 0.0
    # The built-in portrait shows its teeth, Grace Hopper's lips are closed.
    assert avatar.teeth_hint == (0.0 if made.name in ("astronaut", "dark") else 0.9)


def test_eyelids_follow_the_eye_contours(face: tuple[faces.Face, WarpAvatar]) -> None:
    _, avatar = face
    for i, ew in enumerate(avatar.eye_crops[:, 2]):
        top, bottom = avatar.eye_upper[i], avatar.eye_lower[i]
        assert top.shape == bottom.shape == (ew,) and (bottom >= top).all()
        open_cols = np.flatnonzero(bottom - top > 1.0)
        assert open_cols.size > 0.4 * ew / 1.3, "an eye about as wide as the crop allows"
        # The mask covers the opening, not the brow above it or the cheek below.
        mask = avatar.eye_masks[i]
        c = int(open_cols[len(open_cols) // 2])
        mid = int(round((top[c] + bottom[c]) / 2))
        assert mask[mid, c] > 0.9
        # Its feathered edge reaches a sixth of the eye's width at most (the brow sits half of
        # it above the eye).
        reach = int(np.ceil(2 + 2 * avatar.eye_axes[i][0] / 6))
        assert mask[: max(0, int(top[c]) - reach), c].max(initial=0.0) == 0.0
        assert mask[int(bottom[c]) + reach + 1 :, c].max(initial=0.0) == 0.0


def test_the_two_box_conventions_convert_both_ways() -> None:
    box = Box(10, 20, 30, 40)
    assert box.corners() == Corners(10, 20, 40, 60) and box.corners().box() == box
    x, y, w, h = box  # still unpacks as the tuple it is
    assert (x, y, w, h) == (10, 20, 30, 40)
