"""The repository documents itself: no tracked file points to documents its users do not have."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Spelled in pieces so that this file does not match itself.
OUTSIDE = (
    "../" + "shared",
    "ARCHITECTURE" + " §",
    "STACK" + ".md",
    "FIELD" + ".md",
    "STYLE" + ".md",
)


def _tracked() -> list[str]:
    return subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()


def test_no_tracked_file_points_outside_the_repository() -> None:
    found = []
    for name in _tracked():
        path = ROOT / name
        if not path.is_file() or path.suffix in {".png", ".jpg", ".onnx", ".pth", ".bin"}:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            found += [f"{name}:{number}: {word}" for word in OUTSIDE if word in line]
    assert not found, "\n".join(found)


def test_the_wheel_carries_the_pages_inside_the_package(tmp_path: Path) -> None:
    """``static/`` and ``templates/`` sit at the top of the checkout; a wheel installs them as
    ``rtc_server/static`` and ``rtc_server/templates``, where ``rtc_server.pages`` finds them."""
    source = tmp_path / "source"  # the tracked files alone: no build/ left in the checkout
    for name in _tracked():
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(source),
            "--no-deps",
            "--no-build-isolation",
            "--quiet",
            "--wheel-dir",
            str(tmp_path / "dist"),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "dist").glob("avatar_rtc-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder in ("static", "templates"):
        expected = {f"rtc_server/{folder}/{p.name}" for p in (ROOT / folder).iterdir()}
        assert expected and expected <= names, sorted(expected - names)
    assert not any(n.startswith(("static/", "templates/")) for n in names)
    assert "rtc_server/media/viseme_estimator.npz" in names  # the estimator's weights


def test_the_http_stack_floor_is_past_its_known_smuggling_fixes() -> None:
    """The server parses requests from anyone: aiohttp below 3.12.14 has request smuggling
    bugs fixed since (GHSA-8495-4g3g-x7pr in 3.10.11, GHSA-9548-qrrj-x5pj in 3.12.14)."""
    import tomllib
    from importlib.metadata import version

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (aiohttp,) = [d for d in project["dependencies"] if d.startswith("aiohttp")]
    floor = tuple(int(p) for p in aiohttp.split(">=", 1)[1].split(",")[0].split("."))
    assert floor >= (3, 12, 14), aiohttp
    installed = tuple(int(p) for p in version("aiohttp").split(".")[:3])
    assert installed >= floor
