"""The viseme stream of a real call: ahead of the audio, on its RTP clock, shaping the very
phonemes the caller hears, JSON and binary alike, and a decay to rest on barge-in."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np

from benchmarks.client import CallClient
from musetalk_core.types import PhonemeSpan
from musetalk_core.visemes import ARKIT, BLEND_SHAPES, VisemeTimeline
from rtc_server.media.resample import resample_int16
from rtc_server.viseme_stream import DECAY_FRAMES, decode_binary
from tests.conftest import LiveServer
from tests.test_visemes_call import _where
from tests.waiting import wait_for_video

SENTENCE = "Bob and Pam bought five maps of the valley from a man in a blue van."
LONG = (
    "My brave friend Maggie plans to move her maple boxes above the big barn, and then "
    "she will bring a bowl of plum jam to every member of the village by the pond."
)


def _weights(event: dict[str, Any]) -> np.ndarray:
    return np.array([event["weights"].get(k, 0.0) for k in BLEND_SHAPES])


def _held(events: list[tuple[float, dict[str, Any]]]) -> dict[int, dict[str, Any]]:
    """What a client holds per RTP time: the later frame where two share it."""
    return {e["rtp"]: e for _, e in events}


async def _call(live_server: LiveServer) -> CallClient:
    client = CallClient(live_server.url, visemes=True)
    await client.connect()
    await client.wait_channel_open()
    await wait_for_video(client, 5)
    await client.wait_state("listening", timeout=5)
    return client


async def test_viseme_frames_lead_their_audio_and_shape_its_phonemes(
    live_server: LiveServer,
) -> None:
    client = await _call(live_server)
    try:
        audio_start = len(client.received.audio)
        await client.say(SENTENCE)
        await client.wait_state("speaking", timeout=10)
        await client.wait_state("listening", timeout=30)
        await asyncio.sleep(0.3)  # the decay after the speech
        audio = client.received.audio[audio_start:]
        events, binary = list(client.viseme_events), list(client.viseme_binary)
    finally:
        await client.close()
    assert len(events) >= 100, "a sentence of about 4 s: 50 frames a second"

    # The two forms carry the same frames, in the same order.
    assert [decode_binary(m).event() for _, m in binary] == [e for _, e in events]

    # Every frame arrived no later than the audio packet it shapes (same RTP time).
    late, missing = [], 0
    for arrived, event in events:
        heard = client.audio_arrival(event["rtp"])
        if heard is None:
            missing += 1
        elif arrived > heard:
            late.append((event["t"], round((arrived - heard) * 1000, 1)))
    assert missing <= len(events) // 50, f"{missing} frames' audio packets never came"
    assert not late, f"frames that came after their audio (t, ms late): {late[:10]}"

    # The frames shape the phonemes of the audio at their RTP time: the reply located in the
    # received audio by its waveform (the server's voice is deterministic in tests).
    tts = live_server.manager.providers.tts  # type: ignore[union-attr]
    chunks = [c async for c in tts.synthesize(SENTENCE)]
    reference = np.concatenate([resample_int16(c.pcm, c.sample_rate, 48_000) for c in chunks])
    spans: list[PhonemeSpan] = []
    at = 0.0
    for c in chunks:
        spans += [PhonemeSpan(s.phoneme, s.start + at, s.end + at) for s in c.phonemes]
        at += c.duration
    timeline = VisemeTimeline()
    timeline.add(spans, 0.0)
    first_pts = audio[0][1]
    pcm = np.zeros(audio[-1][1] + len(audio[-1][2]) - first_pts, np.int16)
    for _, pts, frame in audio:
        pcm[pts - first_pts : pts - first_pts + len(frame)] = frame
    loud = int(np.flatnonzero(np.abs(reference.astype(np.int32)) > 328)[0])
    lag = _where(pcm, reference[loud:]) - loud
    rtp0 = (client.audio_rtp(first_pts) + lag) & 0xFFFFFFFF  # reference sample 0

    held = _held(events)
    speech = {
        rtp: e
        for rtp, e in held.items()
        if 0.15 < ((rtp - rtp0) & 0xFFFFFFFF) / 48_000 < at - 0.05  # inside the reply
    }
    assert len(speech) >= 100

    def error(shift_ms: float) -> np.ndarray:
        out = []
        for rtp, event in speech.items():
            seconds = ((rtp - rtp0) & 0xFFFFFFFF) / 48_000 + 0.01 + shift_ms / 1000
            expected = np.clip(timeline.weights(seconds) @ ARKIT, 0.0, 1.0)
            out.append(np.abs(_weights(event) - expected).max())
        return np.asarray(out)

    # The received audio is the decoder's: Opus delays it 6.5 ms behind its RTP time, so the
    # best match is that much off the waveform's lag; a frame's worth (20 ms) would be wrong.
    errors = {s / 2: error(s / 2) for s in range(-60, 61)}
    best = min(errors, key=lambda s: float(errors[s].mean()))
    coarse = {s: round(float(errors[s].mean()), 4) for s in (-20.0, -10.0, 0.0, 10.0, 20.0)}
    print(f"frames {len(events)}: best match {best:+.1f} ms, mean weight error {coarse}")
    assert abs(best) < 10, (best, coarse)
    # At the best time the frames are the phonemes' weights, to the quantization, but where the
    # trimmed start changes the fade-in.
    assert np.mean(errors[best] <= 0.005) >= 0.95, coarse
    visemes = {e["viseme"] for e in speech.values()}
    assert {"PP", "FF", "aa"} <= visemes, visemes

    # After the speech: a decay to rest, ended.
    ordered = [held[r] for r in sorted(held, key=lambda r: (r - rtp0) & 0xFFFFFFFF)]
    assert ordered[-1].get("end") and ordered[-1]["weights"] == {}


async def test_barge_in_ends_the_viseme_stream_with_a_decay(live_server: LiveServer) -> None:
    client = await _call(live_server)
    try:
        await client.say(LONG)
        await client.wait_state("speaking", timeout=10)
        await asyncio.sleep(1.0)
        client.channel.send(json.dumps({"type": "interrupt"}))
        await client.wait_state("listening", timeout=5)
        await asyncio.sleep(0.5)
        events = [e for _, e in client.viseme_events]
        binary = [decode_binary(m) for _, m in client.viseme_binary]
    finally:
        await client.close()

    cuts = [i for i, e in enumerate(events) if e.get("cut")]
    assert len(cuts) == 1, [e for e in events if e.get("cut")]
    after = events[cuts[0] :]
    assert len(after) == DECAY_FRAMES, after
    sums = [sum(e["weights"].values()) for e in after]
    assert all(a >= b for a, b in zip(sums, sums[1:], strict=False)), sums
    assert after[-1].get("end") and after[-1]["weights"] == {}
    assert [round(e["t"] - after[0]["t"], 2) for e in after] == [
        round(0.02 * k, 2) for k in range(DECAY_FRAMES)
    ]
    # Frames sent ahead of the cut are replaced: from the cut on, a client holds the decay.
    held = _held([(0.0, e) for e in events])
    cut_t = after[0]["t"]
    assert all(e in after for e in held.values() if e["t"] >= cut_t)
    assert [f.event() for f in binary] == events
