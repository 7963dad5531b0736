"""The ``warp`` lip-sync engine: animates the mouth of a still portrait from the audio, on CPU.

Two layers here, each usable on its own, and the engine over them:

- :func:`mouth_shape` reads one frame's audio slice into (openness, roundness)
  (:func:`mouth_opening`: the openness alone);
- :class:`WarpRenderer` draws one frame for a mouth shape and a time: the jaw drops and the
  lips part inside the mouth crop, eyes blink now and then. Pure and synchronous;
- :class:`~musetalk_core.warp_engine.WarpEngine` implements
  :class:`~musetalk_core.types.LipSyncEngine`: it slices queued audio into frames, renders each
  in a worker thread and yields (image, audio) pairs.

Frame k always shows the sound of its own audio slice k: there is no smoothing across frames,
so the mouth cannot lag the voice.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import cv2
import numpy as np
import numpy.typing as npt

from .boxes import Box
from .i420 import I420Canvas, PatchCache
from .warp_avatar import WarpAvatar
from .warp_lips import LEVELS, sealed_mouth, tucked_mouth

__all__ = ["PIXEL_FORMATS", "SHUT", "WarpRenderer", "mouth_opening", "mouth_shape"]

F32 = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]

PIXEL_FORMATS = ("rgb24", "yuv420p")
"""What :class:`WarpEngine` yields: (H, W, 3) RGB, or (H * 3 // 2, W) I420 (musetalk_core.i420),
which an H.264 encoder takes as it is."""

# Openness: RMS of a slice, full scale 1.0, through a compressive power curve.
OPEN_FLOOR_RMS = 0.004
"""Below this the mouth stays shut: room tone, dither, the tail of a fade."""
OPEN_FULL_RMS = 0.3
"""At this level the mouth is fully open. Piper normalises each sentence to full scale, which
puts its loud vowels at 0.15-0.3 RMS (openness 0.6-1.0) and its median speech frame near 0.05."""
OPEN_GAMMA = 0.7
"""< 1 so quiet consonants still move the lips while loud vowels do not all saturate."""

# Roundness: share of the voiced energy in the second-formant band. Rounded vowels ("oo", "oh")
# keep F2 below ~1 kHz, spread ones ("ee", "ay") push it to 2 kHz and beyond.
_LOW_BAND = (150.0, 900.0)
_HIGH_BAND = (900.0, 3500.0)
ROUND_HIGH_SHARE = (0.02, 0.08)
"""High-band energy share mapped to roundness 1 and 0 respectively. A weak cue: on the Piper
"joe" voice rounded sentences measure 0.04-0.06 (median per loud frame), spread ones 0.06-0.14."""

# Rounding scales with openness, so a quiet frame hardly moves whatever its roundness: motion
# that does not follow loudness is noise to viewers and to the lip-sync metric (mouth motion
# against envelope change) alike.
LENS_NARROWING = 0.5
"""How much narrower the lip opening gets at roundness 1: its half-width over 1 + this."""
CONTENT_NARROWING = 0.3
"""How much the lips themselves are pulled towards the centre at roundness 1, openness 1."""
ROUND_LIFT = 1.5
"""How much more the upper lip lifts at roundness 1 (relative)."""
ROUND_JAW = 0.25
"""How much less the jaw drops at roundness 1 (relative)."""
SHUT = 1.0 / 256
"""Openness, closing and tucking below this move the lips by < 0.05 px: the picture at rest."""
_ROUND_LEVELS = 16
"""Roundness is quantised to this many steps so each step's warp fields are built once."""

BLINK_SECONDS = 0.15
BLINK_INTERVAL = (2.5, 6.0)
"""Seconds between blink starts, drawn uniformly from a seeded generator."""


def _float_samples(pcm: npt.NDArray[np.generic]) -> npt.NDArray[np.float32]:
    x = np.asarray(pcm)
    if x.dtype == np.int16:
        return x.astype(np.float32) / np.float32(32768.0)
    return x.astype(np.float32, copy=False)


def _opening(samples: npt.NDArray[np.float32]) -> float:
    rms = float(np.sqrt(np.mean(np.square(samples, dtype=np.float32))))
    level = (rms - OPEN_FLOOR_RMS) / (OPEN_FULL_RMS - OPEN_FLOOR_RMS)
    return 0.0 if level <= 0.0 else float(min(1.0, level) ** OPEN_GAMMA)


def mouth_opening(pcm: npt.NDArray[np.generic]) -> float:
    """The openness of :func:`mouth_shape` alone (0..1), without the spectrum roundness needs:
    for a mouth whose shape comes from the phonemes, only how far it opens from the audio."""
    samples = _float_samples(pcm)
    return _opening(samples) if samples.size else 0.0


def mouth_shape(pcm: npt.NDArray[np.generic], sample_rate: int) -> tuple[float, float]:
    """(openness, roundness), each 0..1, for one frame's slice of mono audio.

    ``pcm`` is int16, or float with full scale 1.0. Openness follows the slice's RMS through a
    compressive curve (silence 0, normal TTS speech about 0.6-1.0); roundness is high when the
    voiced energy sits below ~1 kHz, as in "oo", and 0 for silence, "ee" and hiss.
    """
    samples = _float_samples(pcm)
    if samples.size == 0:
        return 0.0, 0.0
    openness = _opening(samples)
    if openness <= 0.0:
        return 0.0, 0.0

    power = np.abs(np.fft.rfft(samples * _window(len(samples)))) ** 2
    freqs = np.fft.rfftfreq(len(samples), 1.0 / sample_rate)
    low = float(power[(freqs >= _LOW_BAND[0]) & (freqs < _LOW_BAND[1])].sum())
    high = float(power[(freqs >= _HIGH_BAND[0]) & (freqs < _HIGH_BAND[1])].sum())
    if low + high <= 0.0:
        return openness, 0.0
    share = high / (low + high)
    lo, hi = ROUND_HIGH_SHARE
    roundness = float(np.clip((hi - share) / (hi - lo), 0.0, 1.0))
    return openness, roundness


_windows: dict[int, F32] = {}


def _window(n: int) -> F32:
    w = _windows.get(n)
    if w is None:
        w = _windows[n] = np.hanning(n).astype(np.float32)
    return w


@dataclass(frozen=True)
class _MouthFields:
    """Warp fields and cavity shading for one roundness level, in mouth-crop coordinates."""

    squeeze: F32 | None
    """Horizontal backward-map offset per unit openness (None at roundness 0)."""
    disp: F32
    """Pixels of vertical displacement per unit openness; + moves content down."""
    top_raise: F32
    """Per column: how far the upper lip rises per unit openness (top of the opening)."""
    bottom_drop: F32
    """Per column: how far the lower lip drops per unit openness (bottom of the opening)."""
    cols: slice
    """The columns the opening can reach."""
    light: F32
    """Per column of ``cols``: how much light reaches the floor of the mouth (dark at the sides)."""
    tongue: F32
    """Per column of ``cols``: how much of the tongue shows."""
    teeth: F32
    """Per column of ``cols``: opacity of the painted teeth hint."""
    teeth_shade: F32
    """Per column of ``cols``: brightness of the teeth hint (gaps between teeth, dim sides)."""


@dataclass
class _Blinks:
    rng: np.random.Generator
    starts: list[float] = field(default_factory=list)

    def amount(self, t: float) -> float:
        """How closed the eyes are at ``t``: 0 open .. 1 shut."""
        if not self.starts:
            self.starts.append(float(self.rng.uniform(0.5, 2.5)))
        while self.starts[-1] <= t:
            self.starts.append(self.starts[-1] + float(self.rng.uniform(*BLINK_INTERVAL)))
        i = bisect.bisect_right(self.starts, t) - 1
        if i < 0:
            return 0.0
        dt = t - self.starts[i]
        if dt >= BLINK_SECONDS:
            return 0.0
        # A sine hump sampled every 40 ms always lands one frame at >= 0.9 of full closure,
        # whatever the phase; the power < 1 snaps the lid shut faster than a plain sine.
        return float(math.sin(math.pi * dt / BLINK_SECONDS) ** 0.6)


class WarpRenderer:
    """Draws frames of a prepared avatar: mouth opening and roundness, blinks.

    Only the mouth and eye crops are written to; with ``sway_px`` > 0 the whole frame also
    drifts slowly by up to that many pixels (off by default: it makes every pixel change, which
    costs encoder bits and adds noise to mouth-motion measurements). Not thread-safe: use one
    renderer per thread.
    """

    def __init__(
        self,
        avatar: WarpAvatar,
        *,
        seed: int = 0,
        sway_px: float = 0.0,
        patches: PatchCache | None = None,
    ) -> None:
        """``patches``: converted mouths to reuse in :meth:`render_i420`; the renderers of one
        avatar may share them (its mouth does not depend on ``seed``)."""
        self.avatar = avatar
        self.patches = patches
        self.sway_px = float(sway_px)
        self._base = avatar.image
        self._still = avatar.image.copy()
        self._still.flags.writeable = False
        self._blinks = _Blinks(np.random.default_rng(seed))
        self._fields: dict[int, _MouthFields] = {}
        self._contacts: dict[tuple[str, int], U8] = {}
        self._canvas: I420Canvas | None = None
        """The base picture in I420, made on the first I420 render."""

        x, y, w, h = avatar.mouth_crop
        self._mouth_at = (slice(y, y + h), slice(x, x + w))
        # remap reads from its own contiguous copy; slices of the full image would be strided.
        self._mouth_src = np.ascontiguousarray(avatar.image[y : y + h, x : x + w])
        self._mouth_weight = np.ascontiguousarray(avatar.mouth_mask, np.float32)
        self._bg_weight = np.ascontiguousarray(1.0 - avatar.mouth_mask, np.float32)
        rows = np.arange(h, dtype=np.float32)
        self._rows = rows[:, None]
        self._map_y = np.empty((h, w), np.float32)
        self._map_x = np.empty((h, w), np.float32)
        # Rows at or above the seam belong to the upper lip, the rest to the lower one.
        first_lower = np.floor(avatar.mouth_seam) + 1.0
        is_lower = rows[:, None] >= first_lower[None, :]
        big = np.float32(4 * h)
        self._src_lo = np.where(is_lower, first_lower[None, :], -big).astype(np.float32)
        self._src_hi = np.where(is_lower, big, first_lower[None, :] - 1.0).astype(np.float32)

        self._eye_at = [
            (slice(int(ey), int(ey + eh)), slice(int(ex), int(ex + ew)))
            for ex, ey, ew, eh in avatar.eye_crops
        ]
        self._changed = [_box(at) for at in (self._mouth_at, *self._eye_at)]
        """Everything :meth:`render` writes to when the avatar does not sway: the mouth first."""
        eh, ew = avatar.eye_masks.shape[1:]
        self._eye_rows = np.arange(eh, dtype=np.float32)[:, None]
        self._eye_cols = np.broadcast_to(np.arange(ew, dtype=np.float32), (eh, ew)).copy()
        self._eye_src = [np.ascontiguousarray(avatar.image[at]) for at in self._eye_at]

    @property
    def frame_size(self) -> tuple[int, int]:
        """(width, height) of every frame."""
        return self.avatar.frame_size

    def blink_amount(self, t: float) -> float:
        """Eyelid closure at time ``t`` seconds: 0 open, 1 shut. Deterministic per seed."""
        return self._blinks.amount(t)

    @property
    def still(self) -> U8:
        """The avatar at rest (mouth shut, eyes open): one shared, read-only array."""
        return self._still

    def is_still(
        self, openness: float, t: float, *, closed: float = 0.0, tucked: float = 0.0
    ) -> bool:
        """Does :meth:`render` at (``openness``, ``t``, ``closed``, ``tucked``) give
        :attr:`still`?"""
        return (
            openness < SHUT
            and closed < SHUT
            and tucked < SHUT
            and self.sway_px <= 0.0
            and self._blinks.amount(t) <= 0.0
        )

    @property
    def still_i420(self) -> U8:
        """:attr:`still` in I420: one shared, read-only array."""
        return self._i420().base

    def render_i420(
        self,
        openness: float,
        roundness: float,
        t: float,
        *,
        closed: float = 0.0,
        tucked: float = 0.0,
    ) -> U8:
        """:meth:`render` in I420 (musetalk_core.i420), converting only the mouth and eye crops
        the render changed; the avatar at rest is always the same :attr:`still_i420`. With
        ``patches``, a mouth drawn before for the same (openness, roundness, contact) is reused
        as converted then."""
        if self.is_still(openness, t, closed=closed, tucked=tucked):
            return self.still_i420
        canvas = self._i420()
        if self.sway_px > 0.0 or self._blinks.amount(t) > 0.0:
            whole = self.render(openness, roundness, t, closed=closed, tucked=tucked)
            return canvas.convert(whole, None if self.sway_px > 0.0 else self._changed)
        # Only the mouth differs from the still picture (the eye crops may overlap the mouth's,
        # so a blink is drawn whole, above).
        o, level, contact = self._mouth(openness, roundness, closed, tucked)
        if o < SHUT and contact[1] == 0:
            return self.still_i420
        key = (o, level, contact)
        patch = None if self.patches is None else self.patches.get(key)
        if patch is None:
            rgb = self._base.copy()
            self._paint_mouth(rgb, o, level, contact)
            patch = canvas.patch(rgb, self._changed[0])
            if patch is None:
                return self.still_i420  # a mouth crop outside the picture
            if self.patches is not None:
                self.patches.put(key, patch)
        out = canvas.base.copy()
        canvas.paste(out, patch)
        return out

    def _i420(self) -> I420Canvas:
        if self._canvas is None:
            self._canvas = I420Canvas(self._base)
        return self._canvas

    def render(
        self,
        openness: float,
        roundness: float,
        t: float,
        *,
        closed: float = 0.0,
        tucked: float = 0.0,
    ) -> U8:
        """A uint8 RGB frame with the mouth at (openness, roundness) at time ``t`` seconds.

        ``closed`` (0..1) seals lips that the picture shows apart (a smile with teeth): the
        lower lip rises over the teeth to meet the upper one, the jaw with it, as for "m", "b"
        and "p". A picture with closed lips is sealed already. ``tucked`` (0..1) draws "f" and
        "v": the lower lip drawn up and in under the upper teeth, which show over it.

        A new array, except for the avatar at rest, which is always the same :attr:`still`
        (read-only): consumers can tell an unchanged picture by identity.
        """
        if self.is_still(openness, t, closed=closed, tucked=tucked):
            return self._still
        out = self._base.copy()
        self._paint_mouth(out, *self._mouth(openness, roundness, closed, tucked))
        blink = self._blinks.amount(t)
        if blink > 0.0:
            self._draw_lids(out, blink)
        if self.sway_px > 0.0:
            out = self._sway(out, t)
        return out

    def _mouth(
        self, openness: float, roundness: float, closed: float, tucked: float
    ) -> tuple[float, int, tuple[str, int]]:
        """What the mouth's pixels depend on: the openness (clipped), the roundness level and
        the lip contact (``"sealed"`` or ``"tucked"`` and its step; step 0: none)."""
        o = min(1.0, max(0.0, float(openness)))
        c = min(1.0, max(0.0, float(closed)))
        k = min(1.0, max(0.0, float(tucked)))
        level = round(min(1.0, max(0.0, float(roundness))) * _ROUND_LEVELS)
        kind, amount = ("tucked", k) if k > c else ("sealed", c)
        return o, level, (kind, round(amount * LEVELS))

    def _paint_mouth(self, out: U8, o: float, level: int, contact: tuple[str, int]) -> None:
        kind, step = contact
        src = self._mouth_src if step == 0 else self._contact(kind, step)
        # Below SHUT the jaw moves by < 0.05 px: skip the work and keep the pixels exact. All
        # mouth motion, rounding included, scales with openness, so a shut mouth is the picture.
        if o >= SHUT:
            self._draw_mouth(out, o, level, src)
        elif src is not self._mouth_src:
            self._blend_mouth(out, src)

    def _mouth_fields(self, level: int) -> _MouthFields:
        cached = self._fields.get(level)
        if cached is not None:
            return cached
        a = self.avatar
        r = level / _ROUND_LEVELS
        u = a.mouth_u * (1.0 + LENS_NARROWING * r)
        # The opening tapers to the corners. The nearer the power is to 0.5 the blunter its
        # ends: spread lips (0.75) keep pointed corners, rounded ones (0.6) get an oval.
        profile = (np.clip(1.0 - u * u, 0.0, 1.0) ** (0.75 - 0.15 * r)).astype(np.float32)
        # Deeper down the whole jaw moves, so the profile widens from the lip taper to a broad
        # bump; right at the seam it is the taper, which gives the opening its corners.
        broad = 0.5 * (1.0 + np.cos(np.pi * np.clip(np.abs(a.mouth_u) / 1.8, 0.0, 1.0)))
        blend = a.mouth_jaw_blend
        lower = ((1.0 - blend) * profile + blend * broad) * a.mouth_lower
        # Rounded lips push forward: the upper lip lifts more and the jaw drops less, so the
        # opening is centred on the lip line, an oval rather than a bowl.
        lift = (1.0 + ROUND_LIFT * r) * a.max_raise
        drop = (1.0 - ROUND_JAW * r) * a.max_drop
        upper = profile[None, :] * a.mouth_upper
        disp = (drop * lower - lift * upper) * a.mouth_mask
        squeeze = None
        if level > 0:
            # The whole mouth purses, corners included: a bump wider than the jaw profile.
            pull = 0.5 * (1.0 + np.cos(np.pi * np.clip(np.abs(a.mouth_u) / 2.4, 0.0, 1.0)))
            pull = pull[None, :] * a.mouth_mask
            squeeze = CONTENT_NARROWING * r * pull * (a.mouth_grid_x - a.lip_x)
        h, w = disp.shape
        at = np.arange(w)
        first_lower = np.clip(np.floor(a.mouth_seam).astype(np.int64) + 1, 0, h - 1)
        bottom_drop = disp[first_lower, at]
        top_raise = lift * profile * a.mouth_mask[np.maximum(first_lower - 1, 0), at]
        open_cols = np.flatnonzero(profile > 0.0)
        cols = slice(int(open_cols[0]), int(open_cols[-1]) + 1) if open_cols.size else slice(0, 0)
        pc = profile[cols]
        fields = _MouthFields(
            squeeze=None if squeeze is None else squeeze.astype(np.float32),
            disp=disp.astype(np.float32),
            top_raise=top_raise.astype(np.float32),
            bottom_drop=bottom_drop.astype(np.float32),
            cols=cols,
            light=np.clip(1.6 * pc, 0.0, 1.0).astype(np.float32),
            tongue=np.clip(1.4 * pc - 0.4, 0.0, 1.0).astype(np.float32),
            teeth=(a.teeth_hint * np.clip(2.0 * pc, 0.0, 1.0)).astype(np.float32),
            teeth_shade=_teeth_shade(a.mouth_u, profile)[cols],
        )
        self._fields[level] = fields
        return fields

    def _contact(self, kind: str, step: int) -> U8:
        """The mouth crop of a lip contact (``"sealed"`` or ``"tucked"``) at ``step`` of
        :data:`~musetalk_core.warp_lips.LEVELS`, made once."""
        cached = self._contacts.get((kind, step))
        if cached is None:
            make = sealed_mouth if kind == "sealed" else tucked_mouth
            cached = make(self._mouth_src, self.avatar, self._rows, step / LEVELS)
            self._contacts[(kind, step)] = cached
        return cached

    def _draw_mouth(self, out: U8, openness: float, level: int, src: U8) -> None:
        a = self.avatar
        f = self._mouth_fields(level)
        o = openness
        map_y = self._map_y
        np.multiply(f.disp, -o, out=map_y)
        map_y += a.mouth_grid_y
        # Each lip samples only its own side of the seam: the pixel rows the opening uncovers
        # are painted over below, and the one at its soft edge must not pick up the other lip.
        np.clip(map_y, self._src_lo, self._src_hi, out=map_y)
        map_x = a.mouth_grid_x
        if f.squeeze is not None:
            map_x = self._map_x
            np.multiply(f.squeeze, o, out=map_x)
            map_x += a.mouth_grid_x
        warped = np.asarray(
            cv2.remap(src, map_x, map_y, cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE),
            np.uint8,
        )
        cols = f.cols
        if cols.stop > cols.start:
            seam = a.mouth_seam[cols]
            top = seam - o * f.top_raise[cols]
            bottom = seam + o * f.bottom_drop[cols]
            # Only the rows the opening and its lip shadow can reach are painted, in float.
            r0 = max(0, int(top.min()) - 2)
            r1 = min(warped.shape[0], int(bottom.max()) + 5)
            if r1 > r0:
                block = warped[r0:r1, cols]
                px = block.astype(np.float32)
                self._paint_opening(px, self._rows[r0:r1], top, bottom, f, o)
                np.clip(px + 0.5, 0.0, 255.0, out=px)
                block[...] = px
        self._blend_mouth(out, warped)

    def _blend_mouth(self, out: U8, crop: U8) -> None:
        """Lay a mouth crop over ``out`` through the feathered mask, in one pass: uint8 in and
        out, each pixel rounded once (outside the mask the picture stays exact)."""
        region = out[self._mouth_at]
        region[...] = cv2.blendLinear(crop, region, self._mouth_weight, self._bg_weight)

    def _paint_opening(
        self, px: F32, rows: F32, top: F32, bottom: F32, f: _MouthFields, o: float
    ) -> None:
        """Paint the mouth cavity between ``top`` and ``bottom`` (per column) into ``px``."""
        a = self.avatar
        dark, lit, tongue_rgb = a.cavity_rgb
        gap = bottom - top
        # Pixel coverage of the opening, box-filtered over a little more than a pixel: soft,
        # anti-aliased lips, and an opening thinner than that only shades the seam.
        cover = np.minimum(rows + 0.7, bottom) - np.maximum(rows - 0.7, top)
        cover = np.clip(cover * (1 / 1.4), 0.0, 1.0)
        depth = np.clip((rows - top) / np.maximum(gap, 0.5), 0.0, 1.0)
        # The back and top of the cavity are in the shadow of the upper teeth and lip; light
        # reaches its floor, less so at the sides and in a narrow opening.
        light = _smoothstep_f((depth - 0.2) * 1.25) * (f.light * min(1.0, 0.4 + o))
        fill = dark + light[:, :, None] * (lit - dark)
        if o > 0.3:
            # The tongue: a hump rising from the floor of the mouth, highest in the middle, lit
            # on top and shading into the lower lip's shadow.
            rise = depth - (1.0 - 0.5 * f.tongue)
            tongue = _smoothstep_f(rise * 3.5) * min(1.0, (o - 0.3) * 2.0)
            tongue_rgb = tongue_rgb * (1.0 - 0.3 * np.clip(rise * 2.5, 0.0, 1.0))[:, :, None]
            fill += tongue[:, :, None] * (tongue_rgb - fill)
        if a.teeth_hint > 0.0:
            # Upper teeth under the upper lip: as tall as the opening allows, a soft lower edge,
            # a thin shadow where the lip meets them.
            reach = top + np.minimum(a.teeth_height, 0.45 * gap)
            teeth = np.clip(reach - rows + 0.5, 0.0, 1.0) * f.teeth
            under_lip = 0.75 + 0.25 * np.clip(rows - top, 0.0, 1.0)
            teeth_rgb = a.teeth_rgb * (under_lip * f.teeth_shade)[:, :, None]
            fill += teeth[:, :, None] * (teeth_rgb - fill)
        # The lower lip curls into the mouth: a soft contact shadow along its inner edge.
        below = rows - bottom
        shadow = np.clip(1.0 - below * 0.5, 0.0, 1.0) * np.clip(below * 2.0 + 1.0, 0.0, 1.0)
        px *= (1.0 - (0.22 * min(1.0, 3.0 * o)) * shadow * f.light)[:, :, None]
        px += cover[:, :, None] * (fill - px)

    def _draw_lids(self, out: U8, blink: float) -> None:
        a = self.avatar
        rows = self._eye_rows
        for i, at in enumerate(self._eye_at):
            top = a.eye_upper[i]
            # The upper lid slides down over the eye until its edge meets the lower lid: the
            # picture's own lid, lashes and crease move down with it, in the eye opening only.
            shift = blink * (a.eye_lower[i] - top)
            edge = top + shift
            map_y = np.maximum(rows - shift[None, :], 0.0).astype(np.float32)
            lid_px = np.asarray(
                cv2.remap(self._eye_src[i], self._eye_cols, map_y, cv2.INTER_LINEAR), np.float32
            )
            region_mask = a.eye_masks[i]
            lid = region_mask * np.clip(edge[None, :] - rows + 0.5, 0.0, 1.0)
            lash_width = max(0.8, 0.25 * float(a.eye_axes[i][1]))
            lash = region_mask * np.exp(-(((rows - edge[None, :]) / lash_width) ** 2))
            lash *= 0.4 * min(1.0, 2.0 * blink)
            # The closing lid darkens towards its edge, where it folds over the eyeball.
            fold = np.clip((rows - top) / np.maximum(edge - top, 1.0)[None, :], 0.0, 1.0)
            lid_px *= (1.0 - 0.12 * fold)[:, :, None]
            region = out[at]
            px = region.astype(np.float32)
            px += lid[:, :, None] * (lid_px - px)
            px += lash[:, :, None] * (a.lash_rgb - px)
            region[...] = (px + 0.5).astype(np.uint8)

    def _sway(self, frame: U8, t: float) -> U8:
        # Two incommensurate slow periods so the drift never looks like a loop.
        dx = self.sway_px * math.sin(2 * math.pi * t / 7.3)
        dy = 0.6 * self.sway_px * math.sin(2 * math.pi * t / 5.1 + 1.3)
        m = np.array([[1.0, 0.0, dx], [0.0, 1.0, dy]], np.float32)
        w, h = self.frame_size
        shifted = cv2.warpAffine(
            frame, m, (w, h), flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE
        )
        return np.asarray(shifted, np.uint8)


def _box(at: tuple[slice, slice]) -> Box:
    """The rectangle of a (rows, columns) pair of slices."""
    rows, cols = at
    return Box(
        int(cols.start), int(rows.start), int(cols.stop - cols.start), int(rows.stop - rows.start)
    )


def _teeth_shade(u: F32, profile: F32) -> F32:
    """Per column brightness of painted upper teeth: darker towards the corners, where the
    cheeks shade them, with faint gaps between incisors, laterals and canines."""
    # Gap positions as fractions of the mouth half-width, symmetric about the centre.
    gaps = np.array([0.0, 0.24, 0.46, 0.66], np.float32)
    px_per_u = 1.0 / np.maximum(np.abs(np.gradient(u)), 1e-3)
    dist = np.min(np.abs(np.abs(u)[:, None] - gaps[None, :]), axis=1) * px_per_u
    seams = 1.0 - 0.15 * np.exp(-(dist**2))
    return np.asarray((0.6 + 0.4 * np.sqrt(profile)) * seams, np.float32)


def _smoothstep_f(v: F32) -> F32:
    v = np.clip(v, 0.0, 1.0)
    out: F32 = v * v * (3.0 - 2.0 * v)
    return out
