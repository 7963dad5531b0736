"""The repository documents itself: no tracked file points to documents its users do not have."""

from __future__ import annotations

import subprocess
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


def test_no_tracked_file_points_outside_the_repository() -> None:
    listed = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    found = []
    for name in listed:
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
