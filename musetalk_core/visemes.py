"""Visemes from phonemes: the 15 mouth shapes of the Oculus/MPEG-4 set, with co-articulation.

A viseme is what a viewer can read of a sound on the lips: "m", "b" and "p" look the same
(closed lips, ``PP``), so do "f" and "v" (lower lip to the upper teeth, ``FF``). This module maps
the phonemes a voice reports (espeak-ng IPA, as Piper writes them; :class:`PhonemeSpan`) to
those shapes and blends them over time the way speakers do:

* **Anticipation.** Every shape is reached :data:`ANTICIPATION_S` before its sound's own span:
  the lips close for "m" before the "m" is heard.
* **Dominance** (Cohen and Massaro's model). Each phoneme pulls the mouth towards its shape
  with a strength that is full inside its (anticipated) span and falls off exponentially
  outside it (:data:`SPREAD_S`); the mouth at any instant is the dominance-weighted mix of the
  shapes near it. Lips that must close or touch the teeth (``PP``, ``FF``) dominate strongly,
  tongue consonants (``DD``, ``kk``, ``nn``) weakly, so "t" between two vowels hardly moves
  the lips while "m" always closes them.
* **Rest.** Pauses, punctuation and the ends of speech are ``sil``; past the last phoneme the
  mouth decays to ``sil`` over :data:`DECAY_S`, also when speech is cut short.

Symbols without a shape of their own are transparent: stress marks lend their time to the next
phoneme, length marks to the previous one, "h" and the glottal stop take their neighbours'
shapes, a word gap is split between the words it separates.

:data:`ARKIT` gives each viseme as weights of Apple's ARKit face blend shapes
(:data:`BLEND_SHAPES`), for clients that draw their own avatar; :data:`MOUTH` as the few
parameters the warp engine draws with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .types import PhonemeSpan

__all__ = [
    "ANTICIPATION_S",
    "ARKIT",
    "BLEND_SHAPES",
    "DECAY_S",
    "MOUTH",
    "MOUTH_PARAMS",
    "SPREAD_S",
    "VISEMES",
    "VisemeTimeline",
    "viseme_of",
]

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]

VISEMES = ("sil", "PP", "FF", "TH", "DD", "kk", "CH", "SS", "nn", "RR", "aa", "E", "ih", "oh", "ou")
"""The Oculus/MPEG-4 set, in its usual order (index 0 is rest)."""
SIL = 0

ANTICIPATION_S = 0.025
"""How far ahead of its sound a shape starts to pull (the time constant of its rise)."""
SPREAD_S = 0.012
"""How fast a phoneme's pull falls off after its span (exponential time constant)."""
DECAY_S = 0.12
"""Past the last phoneme the mouth relaxes to rest over this long."""
_REACH_S = 0.4
"""Phonemes farther than this from an instant are left out of its mix (their pull < 1e-7)."""
_CONTACT = 0.3
"""Share of ``PP`` (or ``FF``) in the mix from which the lips start to seal (or tuck)."""
# The three constants were set on four sentences of the bundled voice ("My mother bought a big
# blue map for five pounds." and three more like it); tests/test_visemes.py holds others out.

_SHAPES: dict[str, str] = {}
for _viseme, _symbols in {
    "PP": "pbmɱʙɓ",
    "FF": "fvⱱʋ",
    "TH": "θð",
    "DD": "tdɾɖʈɗɽɺ",
    "kk": "kgɡŋxɣqɢɠçχʁʀʟ",
    "CH": "ʃʒɕʑʂʐʝ",
    "SS": "szʦ",
    "nn": "nlɲɳɴɫɬɮɭʎ",
    "RR": "ɹrɻɚɝ˞",
    "aa": "aɑɐæʌɶä",
    "E": "eɛəɜɘœɞε",
    "ih": "iɪjɨᵻyʏɥ",
    "oh": "oɔɒɵø",
    "ou": "uʊwɯʉʍɰ",
}.items():
    for _s in _symbols:
        _SHAPES[_s] = _viseme

_REST = set('^$.,;:!?"()-_↓')
"""Sentence edges and punctuation: the mouth rests."""
_STRESS = set("ˈˌ")
"""Give their time to the next phoneme."""
_LENGTH = set("ːˑ̧̩̯̪̃ʰʲˤ")
"""Give their time to the previous one (length, and diacritics Piper writes as symbols)."""
_TRANSPARENT = set("hɦʔħʕʜʢʡ ")
"""No shape of their own: the neighbours' shapes spread over them."""

_DOMINANCE = {
    "sil": 0.6,
    "PP": 1.0,
    "FF": 1.0,
    "TH": 0.7,
    "DD": 0.35,
    "kk": 0.3,
    "CH": 0.8,
    "SS": 0.6,
    "nn": 0.35,
    "RR": 0.6,
    "aa": 0.7,
    "E": 0.6,
    "ih": 0.6,
    "oh": 0.8,
    "ou": 0.9,
}

BLEND_SHAPES = (
    "jawOpen",
    "mouthClose",
    "mouthFunnel",
    "mouthPucker",
    "mouthStretchLeft",
    "mouthStretchRight",
    "mouthSmileLeft",
    "mouthSmileRight",
    "mouthRollLower",
    "mouthRollUpper",
    "mouthPressLeft",
    "mouthPressRight",
    "mouthLowerDownLeft",
    "mouthLowerDownRight",
    "mouthUpperUpLeft",
    "mouthUpperUpRight",
    "tongueOut",
)
"""The ARKit blend shapes a viseme moves (Apple's names; the others stay 0)."""


def _arkit(**w: float) -> list[float]:
    both = {"Stretch", "Smile", "Press", "LowerDown", "UpperUp"}
    out = dict.fromkeys(BLEND_SHAPES, 0.0)
    for k, v in w.items():
        if k.removeprefix("mouth") in both:
            out[f"{k}Left"] = out[f"{k}Right"] = v
        else:
            out[k] = v
    return [out[k] for k in BLEND_SHAPES]


ARKIT: F32 = np.array(
    [
        _arkit(),  # sil
        _arkit(mouthClose=0.6, mouthPress=0.5, mouthRollLower=0.2, mouthRollUpper=0.2),  # PP
        _arkit(jawOpen=0.08, mouthRollLower=0.7, mouthUpperUp=0.25),  # FF
        _arkit(jawOpen=0.15, tongueOut=0.4, mouthLowerDown=0.1),  # TH
        _arkit(jawOpen=0.2, mouthStretch=0.15),  # DD
        _arkit(jawOpen=0.25, mouthStretch=0.1),  # kk
        _arkit(jawOpen=0.15, mouthFunnel=0.5, mouthPucker=0.3),  # CH
        _arkit(jawOpen=0.08, mouthStretch=0.35, mouthSmile=0.15),  # SS
        _arkit(jawOpen=0.18, mouthStretch=0.1),  # nn
        _arkit(jawOpen=0.15, mouthFunnel=0.3, mouthPucker=0.3),  # RR
        _arkit(jawOpen=0.65, mouthLowerDown=0.3),  # aa
        _arkit(jawOpen=0.4, mouthStretch=0.3, mouthLowerDown=0.2),  # E
        _arkit(jawOpen=0.25, mouthStretch=0.45, mouthSmile=0.3),  # ih
        _arkit(jawOpen=0.45, mouthFunnel=0.6, mouthPucker=0.3),  # oh
        _arkit(jawOpen=0.2, mouthFunnel=0.4, mouthPucker=0.8),  # ou
    ],
    np.float32,
)
"""(15, len(BLEND_SHAPES)): each viseme as ARKit blend-shape weights in [0, 1]."""

MOUTH_PARAMS = ("open", "round", "spread", "closed", "teeth_on_lip")
MOUTH: F32 = np.array(
    [
        # open round spread closed teeth_on_lip
        [0.0, 0.0, 0.0, 0.0, 0.0],  # sil: at rest, lips as in the picture
        [0.0, 0.0, 0.0, 1.0, 0.0],  # PP: lips pressed shut
        [0.08, 0.0, 0.1, 0.0, 1.0],  # FF: lower lip under the upper teeth
        [0.25, 0.0, 0.1, 0.0, 0.0],  # TH
        [0.3, 0.0, 0.2, 0.0, 0.0],  # DD
        [0.35, 0.0, 0.1, 0.0, 0.0],  # kk
        [0.25, 0.6, 0.0, 0.0, 0.0],  # CH
        [0.12, 0.0, 0.6, 0.0, 0.0],  # SS
        [0.25, 0.0, 0.2, 0.0, 0.0],  # nn
        [0.25, 0.5, 0.0, 0.0, 0.0],  # RR
        [1.0, 0.0, 0.1, 0.0, 0.0],  # aa
        [0.6, 0.0, 0.5, 0.0, 0.0],  # E
        [0.35, 0.0, 0.8, 0.0, 0.0],  # ih
        [0.7, 0.8, 0.0, 0.0, 0.0],  # oh
        [0.3, 1.0, 0.0, 0.0, 0.0],  # ou
    ],
    np.float32,
)
"""(15, len(MOUTH_PARAMS)): what the warp engine draws for each viseme."""


def viseme_of(phoneme: str) -> str | None:
    """The viseme of one phoneme symbol; None for a symbol that has no shape of its own
    (stress and length marks, "h", a word gap); "sil" for pauses and punctuation."""
    if phoneme in _REST:
        return "sil"
    if phoneme in _STRESS or phoneme in _LENGTH or phoneme in _TRANSPARENT:
        return None
    shape = _SHAPES.get(phoneme)
    if shape is not None:
        return shape
    if phoneme.isdigit() or phoneme in "'#":
        return None
    return "sil"


@dataclass(frozen=True)
class _Target:
    start: float
    end: float
    viseme: int


def _targets(spans: Sequence[PhonemeSpan], offset: float) -> list[_Target]:
    """Spans as shaped intervals: transparent symbols' time given to their neighbours."""
    shaped: list[list[float | int]] = []  # [start, end, viseme]
    pending_start: float | None = None  # a stress mark's start, for the next phoneme
    gap: tuple[float, float] | None = None  # a transparent stretch waiting for its right side
    for span in spans:
        start, end = span.start + offset, span.end + offset
        p = span.phoneme
        v = viseme_of(p)
        if p in _STRESS:
            pending_start = start if pending_start is None else pending_start
            continue
        if p in _LENGTH:
            if shaped:
                shaped[-1][1] = end
            continue
        if v is None:  # transparent
            gap = (gap[0], end) if gap is not None else (start, end)
            continue
        if gap is not None:
            mid = (gap[0] + gap[1]) / 2
            if shaped:
                shaped[-1][1] = mid
                start = min(start, mid)
            else:
                start = gap[0]
            gap = None
        if pending_start is not None:
            start = min(start, pending_start)
            pending_start = None
        shaped.append([start, end, VISEMES.index(v)])
    if gap is not None and shaped:
        shaped[-1][1] = gap[1]
    return [_Target(float(s), float(e), int(v)) for s, e, v in shaped]


class VisemeTimeline:
    """The visemes of one stretch of speech on its own clock (seconds), built as the speech
    arrives: :meth:`add` each chunk's phonemes at the time its audio starts.

    :meth:`weights` gives, for any instant, the mix of the 15 visemes (summing to 1).
    :meth:`cut` ends the speech at an instant (barge-in, a vanished stream): the mouth then
    relaxes to rest from there.
    """

    def __init__(self) -> None:
        self._starts: list[float] = []
        self._ends: list[float] = []
        self._visemes: list[int] = []
        self._end: float | None = None
        self._cache: tuple[F64, F64, F64, npt.NDArray[np.int64]] | None = None

    def __len__(self) -> int:
        return len(self._visemes)

    @property
    def end(self) -> float:
        """When the speech ends: the last phoneme's end, or the cut."""
        last = self._ends[-1] if self._ends else 0.0
        return last if self._end is None else min(self._end, last)

    def add(self, spans: Sequence[PhonemeSpan], at: float) -> None:
        """Append the phonemes of a chunk whose audio starts at ``at`` seconds."""
        for t in _targets(spans, at):
            self._starts.append(t.start)
            self._ends.append(t.end)
            self._visemes.append(t.viseme)

    def cut(self, at: float) -> None:
        """Speech stops at ``at``: nothing after it is shaped, the mouth relaxes from there."""
        self._end = at if self._end is None else min(self._end, at)

    def weights(self, t: float | Sequence[float] | F64) -> F32:
        """(15,) viseme weights at ``t``, or (n, 15) for n instants; they sum to 1."""
        times = np.atleast_1d(np.asarray(t, np.float64))
        out = np.zeros((len(times), len(VISEMES)), np.float64)
        if self._visemes:
            all_starts, all_ends, all_dom, all_v = self._arrays()
            # Only the phonemes near the instants asked for: beyond _REACH_S a pull is < 1e-7.
            lo = int(np.searchsorted(all_ends, times.min() - _REACH_S))
            hi = int(np.searchsorted(all_starts, times.max() + _REACH_S, side="right"))
            lo, hi = min(lo, len(all_v) - 1), max(hi, lo + 1)
            starts, ends, dom, visemes = (
                all_starts[lo:hi],
                all_ends[lo:hi],
                all_dom[lo:hi],
                all_v[lo:hi],
            )
            before = np.clip(starts[None, :] - times[:, None], 0.0, None)
            after = np.clip(times[:, None] - ends[None, :], 0.0, None)
            # A shape pulls long before its sound (anticipation), briefly after it.
            pull = dom[None, :] * np.exp(-before / ANTICIPATION_S - after / SPREAD_S)
            # Nothing pulls once the speech has ended; rest takes over as it decays.
            end = self.end
            pull = np.where(starts[None, :] < end, pull, 0.0)
            onehot = np.zeros((len(visemes), len(VISEMES)))
            onehot[np.arange(len(visemes)), visemes] = 1.0
            mix = pull @ onehot
            total = pull.sum(axis=1, keepdims=True)
            mix = np.divide(mix, total, out=np.zeros_like(mix), where=total > 0)
            # The speech fades in before the first shape and out after the end.
            first = float(all_starts[0])
            fade_in = np.clip((times - (first - DECAY_S)) / DECAY_S, 0.0, 1.0)
            fade_out = np.clip(1.0 - (times - end) / DECAY_S, 0.0, 1.0)
            amount = np.minimum(fade_in, fade_out)[:, None]
            out = amount * mix
        out[:, SIL] = np.clip(out[:, SIL] + 1.0 - out.sum(axis=1), 0.0, 1.0)
        result = out.astype(np.float32)
        return result[0] if np.ndim(t) == 0 else result

    def _arrays(self) -> tuple[F64, F64, F64, npt.NDArray[np.int64]]:
        if self._cache is None or len(self._cache[3]) != len(self._visemes):
            visemes = np.asarray(self._visemes, np.int64)
            dom = np.array([_DOMINANCE[VISEMES[v]] for v in self._visemes], np.float64)
            # Spans come in time order; ends kept non-decreasing for the window search.
            ends = np.maximum.accumulate(np.asarray(self._ends, np.float64))
            self._cache = (np.asarray(self._starts, np.float64), ends, dom, visemes)
        return self._cache

    def arkit(self, t: float | Sequence[float] | F64) -> F32:
        """ARKit blend-shape weights (:data:`BLEND_SHAPES`) at ``t``."""
        return np.asarray(self.weights(t) @ ARKIT, np.float32)

    def mouth(self, t: float | Sequence[float] | F64) -> F32:
        """The warp engine's mouth parameters (:data:`MOUTH_PARAMS`) at ``t``.

        The mix of the shapes, with the two contacts a viewer reads as constraints rather than
        averages: once ``PP`` leads the mix the lips seal (``closed`` 1, nothing open), once
        ``FF`` does the lower lip tucks under the teeth, whatever vowel pulls beside them.
        """
        w = self.weights(t)
        params = np.asarray(w @ MOUTH, np.float64)
        closed = _smoothstep((w[..., 1] - _CONTACT) / 0.25)
        tucked = _smoothstep((w[..., 2] - _CONTACT) / 0.25)
        params[..., 3] = np.maximum(params[..., 3], closed)
        params[..., 4] = np.maximum(params[..., 4], tucked)
        params[..., 0] *= (1.0 - closed) * (1.0 - 0.9 * tucked)
        return params.astype(np.float32)


def _smoothstep(v: F64 | F32) -> F64:
    x = np.clip(np.asarray(v, np.float64), 0.0, 1.0)
    return np.asarray(x * x * (3.0 - 2.0 * x), np.float64)
