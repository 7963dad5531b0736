"""Face landmarks (musetalk_core.landmarks) against hand-checked points on four faces."""

from __future__ import annotations

import numpy as np
import pytest
from faces import ALL, Face

from musetalk_core import landmarks as lm
from musetalk_core.types import NoFaceError


def _tolerance(found: lm.FaceLandmarks) -> float:
    """A few pixels: 8 % of the distance between the eyes, at least 5 px."""
    return max(5.0, 0.08 * found.eye_distance)


@pytest.fixture(scope="module", params=ALL, ids=lambda f: f.__name__)
def face(request: pytest.FixtureRequest) -> Face:
    made: Face = request.param()
    return made


def test_mesh_points_sit_on_the_hand_checked_points(face: Face) -> None:
    found = lm.find_landmarks(face.image, face.name)
    assert found.points.shape == (468, 2) and found.points.dtype == np.float32
    mesh = {
        "mouth_left": found.xy(lm.MOUTH_CORNERS[0]),
        "mouth_right": found.xy(lm.MOUTH_CORNERS[1]),
        "seam": found.xy(14),  # the top of the lower lip, mid-mouth
        "lip_bottom": found.xy(17),
        "chin": found.xy(lm.CHIN),
    }
    tol = _tolerance(found)
    errors = {k: float(np.hypot(*(mesh[k] - np.array(p)))) for k, p in face.points.items()}
    assert max(errors.values()) <= tol, (face.name, tol, errors)


def test_face_box_runs_from_forehead_to_chin(face: Face) -> None:
    found = lm.find_landmarks(face.image, face.name)
    x, y, w, h = found.box
    chin_x, chin_y = face.points["chin"]
    tol = _tolerance(found)
    # A turned head's jaw reaches below its chin on the lower side.
    slack = 0.5 * w * abs(np.sin(found.roll))
    assert chin_y - tol <= y + h <= chin_y + tol + slack
    assert x < face.points["mouth_left"][0] and x + w > face.points["mouth_right"][0]
    assert x < chin_x < x + w
    # The face outline is a little taller than wide; the mouth sits in its lower third.
    assert 0.9 * w <= h <= 1.4 * w
    assert y + 0.6 * h < face.points["seam"][1] < y + 0.9 * h


def test_roll_follows_a_turned_head() -> None:
    upright = lm.find_landmarks(ALL[1]().image)
    turned = lm.find_landmarks(ALL[3]().image)
    # tilted() turns the picture 12 degrees counter-clockwise.
    assert abs(np.degrees(turned.roll - upright.roll) + 12.0) < 3.0


def test_tracking_a_video_keeps_the_face_and_steadies_points() -> None:
    base = ALL[0]().image
    frames = [np.roll(base, shift=(dy, dx), axis=(0, 1)) for dy, dx in ((0, 0), (2, 3), (4, 6))]
    tracked = lm.track_landmarks(frames)
    assert all(t is not None for t in tracked)
    first = lm.find_landmarks(base)
    for (dy, dx), t in zip(((0, 0), (2, 3), (4, 6)), tracked, strict=True):
        assert t is not None
        moved = t.xy(lm.MOUTH_CORNERS) - np.array([dx, dy])
        assert np.abs(moved - first.xy(lm.MOUTH_CORNERS)).max() < 2.0


def test_track_gives_none_where_no_face_is_found() -> None:
    base = ALL[0]().image
    blank = np.full_like(base, 128)
    tracked = lm.track_landmarks([base, blank, base])
    assert tracked[0] is not None and tracked[1] is None and tracked[2] is not None


@pytest.mark.parametrize(
    "image",
    [
        np.full((240, 320, 3), 128, np.uint8),
        np.random.default_rng(3).integers(0, 256, (300, 300, 3), dtype=np.uint8),
    ],
    ids=["grey", "noise"],
)
def test_no_face_is_a_clear_error(image: np.ndarray) -> None:
    with pytest.raises(NoFaceError, match=r"no frontal face found in portrait\.png"):
        lm.find_landmarks(image, "portrait.png")


def test_small_faces_are_ignored_below_the_minimum() -> None:
    face = ALL[2]()  # about 65 px wide
    lm.find_landmarks(face.image, min_face=40)
    with pytest.raises(NoFaceError, match="at least 120 px"):
        lm.find_landmarks(face.image, min_face=120)


def test_a_face_turned_away_is_refused() -> None:
    face = ALL[1]()
    found = lm.find_landmarks(face.image)
    # Squash the image-right half of the face to a third: the nose is now near that cheek.
    img = face.image.copy()
    nose_x = int(found.xy(lm.NOSE_TIP)[0])
    right = img[:, nose_x:]
    import cv2

    squashed = cv2.resize(right, (max(1, right.shape[1] // 4), right.shape[0]))
    img[:, nose_x : nose_x + squashed.shape[1]] = squashed
    img[:, nose_x + squashed.shape[1] :] = squashed[:, -1:]
    with pytest.raises(NoFaceError, match="turned"):
        lm.find_landmarks(img)
