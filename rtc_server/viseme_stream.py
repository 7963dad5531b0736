"""A call's viseme stream: the mouth shapes of the reply, for clients that draw their own avatar.

Opt-in per call, in two forms carrying the same frames: ``viseme`` events on the ``events``
channel (JSON; the offer asks with ``"visemes": true``) and a compact binary message per frame
on a data channel the caller opens with the label ``visemes``. docs/ARCHITECTURE.md
("The viseme stream") is the contract; this is its one implementation.

**One frame per 20 ms audio frame**, stamped with the media time of the audio it shapes: ``t``
(seconds on the call's audio clock, 0 at its first frame) and ``rtp``, the RTP timestamp of
that audio packet, so a client can match frames to what it plays (a browser reads the playing
RTP timestamp from ``RTCRtpReceiver.getSynchronizationSources()``).

**Ahead of the audio.** Speech the TTS has delivered sits in the scheduler's queue, and a run of
speech plays its pieces one instant after another (:meth:`AVScheduler.upcoming`), so its frames
go out :data:`LEAD_S` before their audio leaves; speech that comes later than that (a slow TTS)
goes out when it is placed, still before its audio. A frame sent ahead can turn out wrong: a
barge-in drops the speech it shaped, or speech the queue did not hold yet fills a pause. The
rule that makes this simple for clients: **a later frame for the same ``t`` replaces the
earlier one.** After a barge-in, the frames that replace the dropped speech decay to rest; the
first carries ``cut`` (drop whatever you hold from here on). Every run of speech ends with a
decay to rest over :data:`~musetalk_core.visemes.DECAY_S`, its last frame all zeros with ``end``.
Nothing is sent while the avatar rests.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from aiortc import RTCDataChannel

from musetalk_core.segments import Piece
from musetalk_core.visemes import ARKIT, BLEND_SHAPES, DECAY_S, VISEMES
from musetalk_core.warp import mouth_opening
from rtc_server.media.clock import AUDIO_PTIME, AUDIO_RATE, AUDIO_SAMPLES
from rtc_server.media.scheduler import AVScheduler, Unit

__all__ = [
    "BINARY_FORMAT",
    "LABEL",
    "LEAD_S",
    "VisemeFrame",
    "VisemeStream",
    "decode_binary",
]

LABEL = "visemes"
"""The label of the data channel that carries the binary form."""
LEAD_S = 0.08
"""Frames of queued speech go out at least this long before their audio."""
DECAY_FRAMES = math.ceil(DECAY_S / AUDIO_PTIME)
"""Frames from the last sound (or a cut) to rest."""
SCALE = 1000
"""Weights travel as integers in thousandths (JSON: the same values, three decimals)."""

BINARY_FORMAT = f"<BBBBII{len(BLEND_SHAPES)}H"
"""Little-endian: version (1), flags (bit 0 cut, bit 1 end, bit 2 ``rtp`` known), viseme
(index in ``VISEMES``), weight count (``len(BLEND_SHAPES)``), media time in 48 kHz samples,
RTP timestamp, then each blend shape's weight in thousandths, in ``BLEND_SHAPES`` order."""
VERSION = 1
CUT, END, HAS_RTP = 1, 2, 4


@dataclass(frozen=True, slots=True)
class VisemeFrame:
    """One 20 ms frame of the mouth, as both forms carry it."""

    samples: int
    """Media time: the audio frame's first sample on the call's 48 kHz audio clock."""
    rtp: int | None
    """That sample's RTP timestamp; None while the audio sender has not told it."""
    viseme: str
    """The shape that leads the mix (one of ``VISEMES``)."""
    weights: tuple[int, ...]
    """Each of ``BLEND_SHAPES`` in thousandths (0..1000)."""
    cut: bool = False
    end: bool = False

    @property
    def t(self) -> float:
        return self.samples / AUDIO_RATE

    def event(self) -> dict[str, Any]:
        """The JSON ``viseme`` event: weights that are 0 are left out."""
        out: dict[str, Any] = {"type": "viseme", "t": self.t}
        if self.rtp is not None:
            out["rtp"] = self.rtp
        out["viseme"] = self.viseme
        out["weights"] = {
            k: w / SCALE for k, w in zip(BLEND_SHAPES, self.weights, strict=True) if w
        }
        if self.cut:
            out["cut"] = True
        if self.end:
            out["end"] = True
        return out

    def binary(self) -> bytes:
        flags = (CUT if self.cut else 0) | (END if self.end else 0)
        flags |= HAS_RTP if self.rtp is not None else 0
        viseme = VISEMES.index(self.viseme)
        rtp = self.rtp or 0
        count = len(self.weights)
        return struct.pack(
            BINARY_FORMAT, VERSION, flags, viseme, count, self.samples, rtp, *self.weights
        )


def decode_binary(message: bytes) -> VisemeFrame:
    """The frame of one binary message (what a client does; tests and the docs use it)."""
    version, flags, viseme, count, samples, rtp, *weights = struct.unpack(BINARY_FORMAT, message)
    if version != VERSION or count != len(BLEND_SHAPES):
        raise ValueError(f"not a version {VERSION} viseme frame")
    return VisemeFrame(
        samples,
        rtp if flags & HAS_RTP else None,
        VISEMES[viseme],
        tuple(weights),
        cut=bool(flags & CUT),
        end=bool(flags & END),
    )


_Key = tuple[object, ...]
"""What a frame shows, to tell a changed plan: ("speech", segment, piece, frame) or
("decay", the speech frame it decays from, frames since)."""


class VisemeStream:
    """Plans the frames of one call from its scheduler and sends the ones that changed.

    Driven by the scheduler: :meth:`on_unit` for every instant the tracks take (the media
    actually played), :meth:`on_queued` when speech comes, :meth:`on_clear` after a barge-in.
    Costs nothing while no form is on.
    """

    def __init__(self, scheduler: AVScheduler) -> None:
        self._scheduler = scheduler
        fps = scheduler.fps
        self._per_unit = max(1, round(1 / (fps * AUDIO_PTIME)))
        self._unit_s = 1 / fps
        self._lead_units = math.ceil(LEAD_S * fps)
        self.json: Callable[[dict[str, Any]], None] | None = None
        """Where JSON events go (the events channel's send), when the caller asked for them."""
        self._binary: RTCDataChannel | None = None
        self.rtp_origin: int | None = None
        """The audio sender's RTP timestamp of media time 0 (aiortc_compat tells it)."""
        self._state: tuple[_Key | None, int] = (None, DECAY_FRAMES)
        """After the last instant played: its last speech frame, and the frames since."""
        self._sent: dict[int, _Key] = {}
        """What went out for each audio frame not yet played."""
        self._mixes: dict[_Key, tuple[float, ...]] = {}
        """The viseme mix of each speech frame planned and not yet played."""
        self.frames_sent = 0

    @property
    def active(self) -> bool:
        return self.json is not None or self._binary is not None

    def attach(self, channel: RTCDataChannel) -> bool:
        """Take ``channel`` if it is the binary channel (the caller opening it is the opt-in)."""
        if channel.label != LABEL:
            return False
        self._binary = channel
        return True

    def set_rtp_origin(self, origin: int) -> None:
        self.rtp_origin = origin

    # -- the scheduler's side ------------------------------------------------------------------

    def on_unit(self, index: int, unit: Unit) -> None:
        """Instant ``index`` is being played: send what it shows if that changed, and what lies
        ahead of it."""
        if not self.active:
            return
        pieces: dict[int, Piece] = {}
        if unit.speaking:
            pcm = unit.audio.pcm
            pieces[index] = Piece(unit.segment_id, unit.index, pcm, unit.timeline, unit.time)
        through = index + self._lead_units
        pieces.update(self._scheduler.upcoming(through + 1))
        self._plan(index, through, pieces)
        # What instant ``index`` left the mouth at:
        keys = self._keys(pieces.get(index))
        last, since = self._state
        for key in keys:
            last, since = (key, 0) if key is not None else (last, since + 1)
        self._state = (last, since)
        played = (index + 1) * self._per_unit
        for frame in [a for a in self._sent if a < played]:
            del self._sent[frame]
        live = set(self._sent.values())
        if last is not None:
            live.add(last)
        for key in [k for k in self._mixes if k not in live]:
            del self._mixes[key]

    def on_queued(self) -> None:
        """Speech was queued: send its frames that lie within the lead."""
        if self.active:
            self._replan(cut=False)

    def on_clear(self) -> None:
        """A barge-in dropped the queued speech: what was sent ahead of it decays instead."""
        if self.active:
            cut = self._state[1] == 0 or any(k[0] == "speech" for k in self._sent.values())
            self._replan(cut=cut)

    def _replan(self, *, cut: bool) -> None:
        first = self._scheduler.next_unit
        through = first + self._lead_units - 1
        self._plan(first, through, dict(self._scheduler.upcoming(through + 1)), cut=cut)

    # -- planning --------------------------------------------------------------------------------

    def _plan(
        self, first_unit: int, through: int, pieces: dict[int, Piece], *, cut: bool = False
    ) -> None:
        """Send the frames of instants ``first_unit`` to ``through`` that differ from what
        went out: ``pieces`` (by instant) where there is speech, a decay to rest after it
        (to its end, past ``through`` if need be, unless speech queued there goes on)."""
        last, since = self._state
        unit = first_unit
        while unit <= through or (last is not None and since < DECAY_FRAMES and unit not in pieces):
            piece = pieces.get(unit)
            for f, key in enumerate(self._keys(piece)):
                frame = unit * self._per_unit + f
                if key is not None:
                    assert piece is not None
                    last, since = key, 0
                    if self._sent.get(frame) != key:
                        self._send(frame, self._mix(piece, f, key), key)
                elif last is not None and since < DECAY_FRAMES:
                    since += 1
                    decay: _Key = ("decay", last, since)
                    if self._sent.get(frame) != decay or cut:
                        mix = _decayed(self._mixes[last], since)
                        self._send(frame, mix, decay, cut=cut, end=since == DECAY_FRAMES)
                    cut = False
            unit += 1

    def _keys(self, piece: Piece | None) -> list[_Key | None]:
        if piece is None:
            return [None] * self._per_unit
        return [("speech", piece.segment_id, piece.index, f) for f in range(self._per_unit)]

    def _mix(self, piece: Piece, f: int, key: _Key) -> tuple[float, ...]:
        """The viseme mix of audio frame ``f`` of ``piece``: from its phonemes where it has
        them, else open by loudness (speech from a voice that gives no timing). The frames of
        a piece are worked out together, once."""
        mix = self._mixes.get(key)
        if mix is not None:
            return mix
        n = self._per_unit
        if piece.timeline is not None and len(piece.timeline):
            start = piece.time - self._unit_s / 2
            middles = start + (np.arange(n, dtype=np.float64) + 0.5) * AUDIO_PTIME
            mixes = np.atleast_2d(piece.timeline.weights(middles))
        else:
            mixes = np.zeros((n, len(VISEMES)), np.float32)
            for g in range(n):
                opening = mouth_opening(piece.pcm[g * AUDIO_SAMPLES : (g + 1) * AUDIO_SAMPLES])
                mixes[g, 0], mixes[g, VISEMES.index("aa")] = 1.0 - opening, opening
        for g, key_g in enumerate(self._keys(piece)):
            assert key_g is not None
            self._mixes[key_g] = tuple(float(v) for v in mixes[g])
        return self._mixes[key]

    def _send(
        self, frame: int, mix: tuple[float, ...], key: _Key, *, cut: bool = False, end: bool = False
    ) -> None:
        self._sent[frame] = key
        weights = np.clip(np.asarray(mix, np.float32) @ ARKIT, 0.0, 1.0)
        samples = frame * AUDIO_SAMPLES
        rtp = None if self.rtp_origin is None else (self.rtp_origin + samples) & 0xFFFFFFFF
        out = VisemeFrame(
            samples,
            rtp,
            VISEMES[int(np.argmax(mix))],
            tuple(int(round(float(w) * SCALE)) for w in weights),
            cut=cut,
            end=end,
        )
        self.frames_sent += 1
        if self.json is not None:
            self.json(out.event())
        channel = self._binary
        if channel is not None and channel.readyState == "open":
            channel.send(out.binary())


def _decayed(mix: tuple[float, ...], since: int) -> tuple[float, ...]:
    """``mix`` ``since`` frames into its decay: towards rest, reached at DECAY_FRAMES."""
    keep = 0.5 * (1 + math.cos(math.pi * min(1.0, since / DECAY_FRAMES)))
    out = [keep * v for v in mix]
    out[0] += 1.0 - keep
    return tuple(out)
