"""Measurements on received media: frame rate, intervals, lip-sync offset by cross-correlation.

Received frames are placed on one timeline per stream from their RTP timestamps, anchored at the
median of (arrival - RTP time): that is the sender's timeline as the network delivered it, with
per-packet jitter removed. Lip-sync is measured as per-frame mouth
*motion* against the *change* of the audio envelope (both rates of change).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

VIDEO_CLOCK = 90_000
AUDIO_CLOCK = 48_000

Frame = tuple[float, int, np.ndarray]
"""A received frame as the test client keeps it: arrival (s), RTP timestamp, image or PCM."""


def stream_times(arrivals: Sequence[float], rtp: Sequence[int], clock_rate: int) -> np.ndarray:
    """Arrival-anchored media times (s) of frames, from their RTP timestamps (wrap-safe)."""
    ts = np.asarray(rtp, dtype=np.int64)
    unwrapped = np.concatenate([[0], np.cumsum(((np.diff(ts) + 2**31) % 2**32) - 2**31)])
    media = unwrapped / clock_rate
    offset = float(np.median(np.asarray(arrivals) - media))
    return media + offset


def frame_times(frames: Sequence[Frame], clock_rate: int, sent_late_s: float = 0.0) -> np.ndarray:
    """:func:`stream_times` of received frames, less ``sent_late_s``: how long after its
    instant the sender sends each frame on purpose (for our server's video,
    ``MediaSettings.video_send_delay_s``; a browser lines the streams up by the sender reports,
    which that delay does not move, once its lip-sync has settled)."""
    arrivals = [a for a, _, _ in frames]
    return stream_times(arrivals, [t for _, t, _ in frames], clock_rate) - sent_late_s


def mouth_motion(images: Sequence[np.ndarray], box: tuple[int, int, int, int]) -> np.ndarray:
    """Mean absolute difference of the mouth box between consecutive frames (first is 0)."""
    x, y, w, h = box
    crops = [img[y : y + h, x : x + w].astype(np.float32).mean(axis=2) for img in images]
    motion = [0.0] + [float(np.abs(b - a).mean()) for a, b in zip(crops, crops[1:], strict=False)]
    return np.asarray(motion)


@dataclass(frozen=True, slots=True)
class SyncResult:
    offset_ms: float
    """Best lag: positive when video comes after the audio it shows."""
    correlation: float
    """Pearson correlation at the best lag."""


def av_offset(
    video_times: np.ndarray,
    motion: np.ndarray,
    audio_times: np.ndarray,
    audio_pcm: np.ndarray,
    *,
    sample_rate: int = 48_000,
    frame_s: float = 0.040,
    max_lag_ms: int = 200,
    step_ms: int = 5,
) -> SyncResult:
    """Cross-correlate mouth motion with the envelope change at lags of ±max_lag_ms.

    ``audio_times`` holds the time of the first sample of each equal-length block of
    ``audio_pcm`` (one block per received audio frame).
    """
    block = len(audio_pcm) // len(audio_times)
    sample_times = np.repeat(audio_times, block) + np.tile(
        np.arange(block) / sample_rate, len(audio_times)
    )
    power = np.cumsum(np.concatenate([[0.0], audio_pcm.astype(np.float64) ** 2]))

    def envelope(starts: np.ndarray) -> np.ndarray:
        lo = np.searchsorted(sample_times, starts)
        hi = np.searchsorted(sample_times, starts + frame_s)
        n = np.maximum(hi - lo, 1)
        rms: np.ndarray = np.sqrt((power[hi] - power[lo]) / n)
        return rms

    best = SyncResult(0.0, -1.0)
    for lag_ms in range(-max_lag_ms, max_lag_ms + 1, step_ms):
        # Video frame i shows the audio that played lag earlier: audio window at t_i - lag.
        env = envelope(video_times - lag_ms / 1000)
        change = np.abs(np.diff(env, prepend=env[0]))
        if change.std() == 0 or motion.std() == 0:
            continue
        corr = float(np.corrcoef(motion, change)[0, 1])
        if corr > best.correlation:
            best = SyncResult(float(lag_ms), corr)
    return best


def lip_sync(
    video: Sequence[Frame],
    audio: Sequence[Frame],
    mouth_box: tuple[int, int, int, int],
    *,
    video_sent_late_s: float,
) -> SyncResult:
    """How the mouth in ``video`` follows ``audio`` (48 kHz mono), both as received: each
    stream on its arrival-anchored RTP timeline (the video's less ``video_sent_late_s``, the
    server's ``MediaSettings.video_send_delay_s``), mouth motion against the audio's envelope
    change (:func:`av_offset`)."""
    vt = frame_times(video, VIDEO_CLOCK, video_sent_late_s)
    at = frame_times(audio, AUDIO_CLOCK)
    pcm = np.concatenate([p for _, _, p in audio])
    return av_offset(vt, mouth_motion([img for _, _, img in video], mouth_box), at, pcm)


def pcm_by_rtp_time(audio: Sequence[Frame]) -> np.ndarray:
    """Received audio frames laid out sample for sample by their RTP time, from the first
    frame's to the last one's end: a packet lost on the way leaves its samples silent."""
    start, end = audio[0][1], audio[-1][1] + len(audio[-1][2])
    pcm = np.zeros(end - start, np.int16)
    for _, pts, frame in audio:
        pcm[pts - start : pts - start + len(frame)] = frame
    return pcm


def frame_intervals_ms(times: Sequence[float]) -> np.ndarray:
    return np.diff(np.asarray(times)) * 1000


def voiced_span(pcm: np.ndarray, sample_rate: int, level: float = 0.01) -> tuple[int, int]:
    """First and one-past-last sample of the 10 ms windows louder than ``level`` (RMS, 0..1)."""
    win = sample_rate // 100
    frames = pcm[: len(pcm) // win * win].astype(np.float32).reshape(-1, win) / 32768
    loud = np.flatnonzero(np.sqrt((frames**2).mean(axis=1)) > level)
    if loud.size == 0:
        return 0, 0
    return int(loud[0] * win), int((loud[-1] + 1) * win)


def loud_frames(frames: Sequence[np.ndarray], level: float = 0.01) -> np.ndarray:
    """Per received audio frame: is its RMS above ``level``?"""
    return np.asarray(
        [np.sqrt(np.mean((f.astype(np.float32) / 32768) ** 2)) > level for f in frames]
    )


def first_loud_after(frames: Sequence[tuple[float, int, np.ndarray]], t: float) -> float | None:
    """Arrival time of the first loud audio frame that arrived after ``t``."""
    loud = loud_frames([pcm for _, _, pcm in frames])
    for (arrival, _, _), is_loud in zip(frames, loud, strict=True):
        if is_loud and arrival > t:
            return arrival
    return None


def fell_silent_at(
    frames: Sequence[tuple[float, int, np.ndarray]], t: float, quiet_s: float = 0.3
) -> float | None:
    """Arrival of the last loud frame after ``t`` that ``quiet_s`` of silence follows.

    The end of the reply a barge-in cut off; the caller's interruption is answered later, so
    the first such silence is the one that counts.
    """
    loud = loud_frames([pcm for _, _, pcm in frames])
    arrivals = np.asarray([a for a, _, _ in frames])
    needed = int(quiet_s / 0.020 * 0.8)
    for i in np.flatnonzero(arrivals >= t):
        window = (arrivals > arrivals[i]) & (arrivals <= arrivals[i] + quiet_s)
        if not loud[window].any() and window.sum() >= needed:
            return float(arrivals[i])
    return None


def flash_onsets(times: np.ndarray, images: Sequence[np.ndarray]) -> np.ndarray:
    """Times of frames that turn bright (mean level crossing mid-grey from below)."""
    level = np.asarray([float(img.mean()) for img in images])
    bright = level > 128
    rising = np.flatnonzero(bright[1:] & ~bright[:-1]) + 1
    return np.asarray(times)[rising]


def beep_onsets(
    block_times: np.ndarray, pcm: np.ndarray, sample_rate: int = 48_000, hz: float = 1000.0
) -> np.ndarray:
    """Times where a ``hz`` tone starts, to the millisecond.

    ``block_times`` is the time of the first sample of each equal block of ``pcm`` (one block
    per received audio frame). The tone's level is read in 1 ms steps over 4 ms windows.
    """
    block = len(pcm) // len(block_times)
    x = pcm[: block * len(block_times)].astype(np.float64)
    t = np.arange(len(x)) / sample_rate
    ref = np.exp(-2j * np.pi * hz * t)
    step, win = sample_rate // 1000, 4 * sample_rate // 1000
    prod = x * ref
    csum = np.concatenate([[0], np.cumsum(prod)])
    starts = np.arange(0, len(x) - win, step)
    level = np.abs(csum[starts + win] - csum[starts]) / win
    on = level > 0.25 * level.max()
    rising = np.flatnonzero(on[1:] & ~on[:-1]) + 1
    # A window first reads 25 % of the tone when 1 ms of its 4 ms holds it: the tone began
    # 3 ms after the window did.
    sample_index = starts[rising] + win - win // 4
    blocks = sample_index // block
    return np.asarray(block_times)[blocks] + (sample_index % block) / sample_rate


def paired_offsets_ms(flashes: np.ndarray, beeps: np.ndarray, max_ms: float = 400) -> np.ndarray:
    """For each flash, flash minus the nearest beep, in ms (positive: video later)."""
    out = []
    for f in flashes:
        if beeps.size == 0:
            break
        nearest = beeps[np.argmin(np.abs(beeps - f))]
        if abs(f - nearest) * 1000 <= max_ms:
            out.append((f - nearest) * 1000)
    return np.asarray(out)


AUDIO_FRAME_SAMPLES = 960
"""Samples in one 20 ms Opus frame at 48 kHz (the RTP timestamp step of audio)."""
PLAYOUT_DELAY_S = 0.080
"""The playout delay of the modelled receiver: it plays the reply's first frame this long after
it arrived, and each later frame at its RTP time from there."""


@dataclass(frozen=True, slots=True)
class Hole:
    at_ms: float
    """Where it starts, from the first loud frame of the reply (media time)."""
    ms: float
    kind: str
    """``missing`` (no packet for those instants), ``late`` (they came after their playout
    time), ``mixed`` (both), or ``pause`` (a quiet stretch longer than the reply alone has)."""


@dataclass(frozen=True, slots=True)
class ReplyAudio:
    first_loud: float
    """Arrival of the reply's first loud frame (s)."""
    speech_ms: float
    """How long the speech took to hear, first loud frame to the end of the last: its RTP
    span plus the waits for late frames."""
    holes: list[Hole]
    """Waits inside the speech (between its first and last loud frame) with nothing to play:
    missing frames (20 ms each) and frames that came after their playout time (the wait until
    they came; the receiver plays on from there, later)."""
    pauses: list[Hole]
    """Quiet stretches inside the speech (frames that came in time but are below ``level``):
    the voice's own pauses, and any gap the sender filled with silence."""


def reply_audio(
    frames: Sequence[tuple[float, int, np.ndarray]],
    after: float,
    *,
    level: float = 0.01,
    playout_delay_s: float = PLAYOUT_DELAY_S,
) -> ReplyAudio | None:
    """The reply in ``frames`` (arrival s, RTP timestamp, mono pcm) that arrived after ``after``.

    A receiver is modelled that plays the first loud frame ``playout_delay_s`` after it
    arrived and every later frame at its RTP time from there; a frame that comes after its
    playout time makes it wait (a hole of that length) and play on from then, later (as a
    jitter buffer that rebuffers). A sender that had no speech in time sends silence instead
    (the RTP timeline has no gap): that shows as a pause longer than the same reply's pauses
    alone, which the caller compares. None: no loud frame arrived after ``after``.
    """
    later = sorted((f for f in frames if f[0] > after), key=lambda f: f[1])
    if not later:
        return None
    loud = loud_frames([pcm for _, _, pcm in later], level)
    if not loud.any():
        return None
    index = np.flatnonzero(loud)
    first, last = later[index[0]], later[index[-1]]
    by_ts = {
        ts: (arrival, bool(is_loud))
        for (arrival, ts, _), is_loud in zip(later, loud, strict=True)
        if first[1] <= ts <= last[1]
    }
    frame_ms = AUDIO_FRAME_SAMPLES / 48
    # Playout time minus RTP time (s); it grows by each wait.
    offset = first[0] + playout_delay_s - first[1] / 48_000
    waited = 0.0
    kinds: list[tuple[str, float] | None] = []
    for ts in range(first[1], last[1] + 1, AUDIO_FRAME_SAMPLES):
        got = by_ts.get(ts)
        if got is None:
            kinds.append(("missing", frame_ms))
            continue
        wait = got[0] - (ts / 48_000 + offset)
        if wait > 0.0005:  # (float rounding aside)
            offset += wait
            waited += wait
            kinds.append(("late", wait * 1000))
        else:
            kinds.append(None if got[1] else ("quiet", frame_ms))
    holes = _runs(kinds, {"missing", "late"})
    pauses = [Hole(h.at_ms, h.ms, "pause") for h in _runs(kinds, {"quiet"})]
    speech_ms = (last[1] - first[1]) / 48 + frame_ms + waited * 1000
    return ReplyAudio(first[0], speech_ms, holes, pauses)


def _runs(kinds: Sequence[tuple[str, float] | None], wanted: set[str]) -> list[Hole]:
    """Runs of consecutive 20 ms instants whose kind is in ``wanted``; (kind, ms) each."""
    frame_ms = AUDIO_FRAME_SAMPLES / 48
    runs: list[Hole] = []
    previous: str | None = None
    for i, item in enumerate(kinds):
        kind, ms = item if item is not None else (None, 0.0)
        if kind in wanted and previous in wanted:
            h = runs[-1]
            runs[-1] = Hole(h.at_ms, h.ms + ms, h.kind if h.kind == kind else "mixed")
        elif kind in wanted:
            runs.append(Hole(i * frame_ms, ms, str(kind)))
        previous = kind
    return runs
