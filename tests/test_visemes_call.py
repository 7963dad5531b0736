"""The warp engine's lips, measured on the received video of a real call, at the voice's own
phoneme times: sealed for "m", "b", "p", open for open vowels."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import cv2
import numpy as np
import pytest

from benchmarks.analysis import frame_times
from benchmarks.client import CallClient
from musetalk_core import landmarks as lm
from musetalk_core.warp_avatar import builtin_portrait, load_portrait
from rtc_server.config import ServerConfig
from rtc_server.engine_factory import load_engine_factory
from rtc_server.media.resample import resample_int16
from tests import faces
from tests.conftest import LiveServer, start_server
from tests.waiting import wait_for_video

# Held out of the viseme constants' tuning (musetalk_core/visemes.py), as tests/test_visemes.py.
SENTENCE = (
    "Abby and Pam moved five big boxes of maps above the van and Bob brought maple buns "
    "and plum jam from the market."
)
BILABIAL = set("pbm")
OPEN_VOWELS = set("aɑæʌ")


def _where(received: np.ndarray, reference: np.ndarray) -> int:
    """Where ``reference`` starts in ``received`` (samples): envelopes cross-correlated, then
    refined on the waveform."""

    def envelope(x: np.ndarray) -> np.ndarray:
        n = len(x) // 48
        return np.abs(x[: n * 48].astype(np.float32)).reshape(n, 48).mean(axis=1)

    a, b = envelope(received), envelope(reference)
    coarse = int(np.argmax(np.correlate(a - a.mean(), b - b.mean(), mode="valid"))) * 48
    ref = reference.astype(np.float32)
    lags = range(max(0, coarse - 96), min(len(received) - len(ref), coarse + 96) + 1)
    return max(lags, key=lambda lag: float(received[lag : lag + len(ref)].astype(np.float32) @ ref))


@pytest.fixture(params=["astronaut", "hopper"])
async def server_and_portrait(
    request: pytest.FixtureRequest, cache_dir: Path, tmp_path: Path
) -> AsyncIterator[tuple[LiveServer, np.ndarray]]:
    """A live server with the smiling built-in portrait (lips apart over the teeth), or with
    Grace Hopper's photograph (lips closed)."""
    if request.param == "astronaut":
        portrait, avatar = builtin_portrait(), None
    else:
        avatar = tmp_path / "hopper.png"
        cv2.imwrite(str(avatar), cv2.cvtColor(faces.hopper().image, cv2.COLOR_RGB2BGR))
        portrait = load_portrait(avatar)
    factory = load_engine_factory(ServerConfig.of(cache_dir=cache_dir, avatar=avatar))
    server, runner = await start_server(factory, cache_dir)
    try:
        yield server, portrait
    finally:
        await runner.cleanup()


async def test_received_lips_close_for_bilabials_and_open_for_open_vowels(
    server_and_portrait: tuple[LiveServer, np.ndarray],
) -> None:
    live_server, picture = server_and_portrait
    client = CallClient(live_server.url)
    try:
        await client.connect()
        await client.wait_channel_open()
        await wait_for_video(client, 5)
        await client.wait_state("listening", timeout=5)
        start, audio_start = len(client.received.video), len(client.received.audio)
        await client.say(SENTENCE)
        await client.wait_state("speaking", timeout=10)
        await client.wait_state("listening", timeout=30)
        video = client.received.video[start:]
        audio = client.received.audio[audio_start:]
    finally:
        await client.close()

    # The reply as the server's voice speaks it, with its phonemes on the reference's clock.
    tts = live_server.manager.providers.tts  # type: ignore[union-attr]
    chunks = [c async for c in tts.synthesize(SENTENCE)]
    assert all(c.phonemes for c in chunks), "the bundled voice reports phoneme timing"
    reference = np.concatenate([resample_int16(c.pcm, c.sample_rate, 48_000) for c in chunks])
    mids: list[tuple[str, float]] = []
    at = 0.0
    for c in chunks:
        mids += [(s.phoneme, at + (s.start + s.end) / 2) for s in c.phonemes]
        at += c.duration

    # Where the reference sits in the received audio (by RTP time), then on the received
    # video, both streams timed by their RTP clocks anchored on arrival (as the lip-sync
    # measurement of tests/test_call.py). That anchoring is good to about a frame, so the
    # figures are taken at the best global shift between -40 and +40 ms (10 ms steps): the
    # +-40 ms the lip-sync criterion allows.
    first_pts = audio[0][1]
    pcm = np.zeros(audio[-1][1] + len(audio[-1][2]) - first_pts, np.int16)
    for _, pts, frame in audio:
        pcm[pts - first_pts : pts - first_pts + len(frame)] = frame
    loud = int(np.flatnonzero(np.abs(reference.astype(np.int32)) > 328)[0])
    lag = _where(pcm, reference[loud:]) - loud  # the received sample of reference sample 0
    audio_t0 = frame_times(audio, 48_000)[0]
    vt = frame_times(video, 90_000, live_server.video_sent_late_s)

    def frame_at(ref_seconds: float, shift_ms: int) -> int:
        t = audio_t0 + lag / 48_000 + ref_seconds + shift_ms / 1000
        k = int(np.searchsorted(vt, t, side="right")) - 1  # the frame showing that instant
        return min(max(k, 0), len(video) - 1)

    gaps: dict[int, float] = {}

    def gap(image: np.ndarray) -> float:
        found = lm.find_landmarks(image)
        return float(found.xy(14)[1] - found.xy(13)[1])

    # The caller sees the portrait framed (head and shoulders, musetalk_core/framing.py): gaps
    # are measured in the frames and given in the portrait's own pixels, where the limits
    # below were set, through the ratio of the two faces' sizes (eye distance).
    zoom = lm.find_landmarks(video[0][2]).eye_distance / lm.find_landmarks(picture).eye_distance

    def gap_of(k: int) -> float:
        if k not in gaps:
            gaps[k] = gap(video[k][2]) / zoom
        return gaps[k]

    rest = gap(picture)

    def measure(shift_ms: int) -> tuple[list[float], list[float]]:
        closed = [gap_of(frame_at(t, shift_ms)) for p, t in mids if p in BILABIAL]
        opened = [gap_of(frame_at(t, shift_ms)) for p, t in mids if p in OPEN_VOWELS]
        return closed, opened

    def score(m: tuple[list[float], list[float]]) -> int:
        return sum(g < 2.5 for g in m[0]) + sum(g >= 3.5 for g in m[1])

    shifts = range(-40, 41, 10)
    shift, (closed, opened) = max(((s, measure(s)) for s in shifts), key=lambda x: score(x[1]))
    sealed = int(sum(g < 2.5 for g in closed))
    apart = int(sum(g >= 3.5 for g in opened))
    print(
        f"rest gap {rest:.1f} px, framed x{zoom:.2f}, shift {shift:+d} ms: sealed at "
        f"{sealed}/{len(closed)} "
        f"bilabials, open at {apart}/{len(opened)} open vowels"
    )
    assert len(closed) >= 18 and len(opened) >= 12
    # Sealed: the mesh finds the inner lips within 2.5 px of each other (the built-in portrait
    # smiles with them 6 px apart, Grace Hopper's are closed). Open: 3.5 px apart at least.
    assert np.mean(np.asarray(closed) < 2.5) >= 0.9, closed
    assert np.mean(np.asarray(opened) >= 3.5) >= 0.9, opened
