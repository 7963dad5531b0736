"""The two box conventions of the engines, as two types a checker keeps apart.

:class:`Box` is ``(x, y, w, h)``: OpenCV's, which the face detector and the warp engine use.
:class:`Corners` is ``(x1, y1, x2, y2)`` with ``x2``/``y2`` exclusive: upstream MuseTalk's,
which its face box, blend crop and cached material use. Both are in full-frame pixels and
unpack as plain tuples; :meth:`Box.corners` and :meth:`Corners.box` convert.
"""

from __future__ import annotations

from typing import NamedTuple


class Box(NamedTuple):
    x: int
    y: int
    w: int
    h: int

    def corners(self) -> Corners:
        return Corners(self.x, self.y, self.x + self.w, self.y + self.h)


class Corners(NamedTuple):
    x1: int
    y1: int
    x2: int
    y2: int

    def box(self) -> Box:
        return Box(self.x1, self.y1, self.x2 - self.x1, self.y2 - self.y1)
