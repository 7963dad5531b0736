"""The viseme stream on the scheduler's clock: frames ahead of their audio, replaced where the
plan changed, a decay to rest after speech and after a barge-in, JSON and binary alike."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from benchmarks.client import make_offer
from musetalk_core.types import AudioChunk, PhonemeSpan
from musetalk_core.visemes import ARKIT, BLEND_SHAPES, VISEMES, VisemeTimeline
from rtc_server.media.clock import ManualClock
from rtc_server.media.scheduler import AVScheduler
from rtc_server.viseme_stream import DECAY_FRAMES, LEAD_S, VisemeStream, decode_binary
from signaling.errors import SignalingError
from signaling.messages import parse_offer
from signaling.offer_rules import PeerRule
from tests.fakes import CountingEngine

RATE = 48_000
UNIT = 1 / 25
ORIGIN = 4_294_966_000  # close to 2**32: the RTP times wrap during the test
PHONEMES = (
    ("_", 0.0, 0.1),
    ("m", 0.1, 0.2),
    ("a", 0.2, 0.4),
    ("p", 0.4, 0.45),
    ("a", 0.45, 0.55),
    ("_", 0.55, 0.6),
)


def _chunk(seconds: float = 0.6, phonemes: bool = True) -> AudioChunk:
    n = round(seconds * RATE)
    pcm = (np.sin(np.arange(n) * 0.05) * 8000).astype(np.int16)
    spans = tuple(PhonemeSpan(p, a, b) for p, a, b in PHONEMES if b <= seconds + 1e-9)
    return AudioChunk(pcm, RATE, spans if phonemes else ())


class Channel:
    label = "visemes"
    readyState = "open"

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, data: bytes) -> None:
        self.sent.append(data)


class Call:
    """A scheduler on a hand-moved clock, its viseme stream, and what the stream sent when."""

    def __init__(self) -> None:
        self.clock = ManualClock()
        self.scheduler = AVScheduler(CountingEngine(), self.clock, on_unit=self._on_unit)
        self.stream = VisemeStream(self.scheduler)
        self.scheduler.on_clear = self.stream.on_clear
        self.scheduler.on_queued = self.stream.on_queued
        self.stream.rtp_origin = ORIGIN
        self.sent: list[tuple[int, dict[str, Any]]] = []
        """(the last instant played when it went out, event)."""
        self.stream.json = lambda e: self.sent.append((self.scheduler.next_unit - 1, e))
        self.channel = Channel()
        assert self.stream.attach(self.channel)  # type: ignore[arg-type]
        self.played = -1

    def _on_unit(self, index: int, unit: Any) -> None:
        self.stream.on_unit(index, unit)

    def play(self, through: int) -> None:
        """The audio track asks for every instant up to ``through``, each at its time."""
        while self.played < through:
            self.played += 1
            self.clock.advance(self.played * UNIT - self.clock.now())
            self.scheduler.unit(self.played, "audio")

    def latest(self) -> dict[float, dict[str, Any]]:
        """The frame a client holds for each ``t``: the later of two sent for it."""
        return {e["t"]: e for _, e in self.sent}


def _frame_unit(event: dict[str, Any]) -> int:
    return round(event["t"] / UNIT - 0.25)  # the 20 ms frames at 0 and 20 ms of instant k


async def test_frames_go_out_ahead_of_their_audio_with_their_rtp_time() -> None:
    call = Call()
    await call.scheduler.push_audio(_chunk(), 0)
    await call.scheduler.end_segment(0)
    call.play(30)
    speech = [(played, e) for played, e in call.sent if "weights" in e and e["viseme"] != "sil"]
    assert speech, call.sent
    lead_units = round(LEAD_S / UNIT)
    placed = 1  # the counting engine's latency, one instant
    for played, event in call.sent:
        unit = _frame_unit(event)
        assert played < unit, f"{event} went out as its audio did"
        if unit >= placed + lead_units:
            assert unit - played >= lead_units, event
        samples = round(event["t"] * RATE)
        assert samples % 960 == 0 and event["rtp"] == (ORIGIN + samples) % 2**32
    # Each frame went out once (nothing changed the plan), one per 20 ms from the speech on.
    times = [e["t"] for _, e in call.sent]
    assert len(times) == len(set(times))
    assert np.allclose(np.diff(times), 0.02)
    assert times[0] == pytest.approx(placed * UNIT)


async def test_frames_shape_the_phonemes_they_play() -> None:
    call = Call()
    await call.scheduler.push_audio(_chunk(), 0)
    await call.scheduler.end_segment(0)
    call.play(30)
    frames = call.latest()
    timeline = VisemeTimeline()
    timeline.add([PhonemeSpan(p, a, b) for p, a, b in PHONEMES], 0.0)
    start = UNIT  # the speech plays from instant 1
    for t, event in frames.items():
        expected = np.clip(timeline.weights(t - start + 0.01) @ ARKIT, 0, 1)
        if t - start > 0.6 - 1e-9:
            continue  # the decay after the speech is the stream's own
        got = np.array([event["weights"].get(k, 0.0) for k in BLEND_SHAPES])
        assert np.abs(got - expected).max() <= 0.0006, (t, event)
    at_m, at_a = frames[round(start + 0.14, 2)], frames[round(start + 0.3, 2)]
    assert at_m["viseme"] == "PP" and at_m["weights"]["mouthClose"] >= 0.5
    assert at_a["viseme"] == "aa" and at_a["weights"]["jawOpen"] >= 0.5


async def test_speech_ends_in_a_decay_to_rest_then_nothing() -> None:
    call = Call()
    await call.scheduler.push_audio(_chunk(), 0)
    await call.scheduler.end_segment(0)
    call.play(40)
    events = [e for _, e in call.sent]
    last_speech = max(i for i, e in enumerate(events) if e["t"] < UNIT + 0.6)
    decay = events[last_speech + 1 :]
    assert len(decay) == DECAY_FRAMES
    assert decay[-1]["end"] and decay[-1]["weights"] == {} and decay[-1]["viseme"] == "sil"
    assert not any(e.get("end") for e in events[:-1])
    sums = [sum(e["weights"].values()) for e in events[last_speech:]]
    assert all(a >= b for a, b in zip(sums, sums[1:], strict=False))
    count = len(call.sent)
    call.play(80)
    assert len(call.sent) == count, "a resting avatar sends nothing"


async def test_barge_in_cuts_the_frames_sent_ahead_and_decays() -> None:
    call = Call()
    await call.scheduler.push_audio(_chunk(0.6), 0)
    await call.scheduler.push_audio(_chunk(0.6), 0)
    call.play(8)
    before = len(call.sent)
    ahead = [e for _, e in call.sent if _frame_unit(e) > 8]
    assert ahead, "frames of speech still to play had gone out"
    call.scheduler.clear()
    after = [e for _, e in call.sent[before:]]
    assert len(after) == DECAY_FRAMES
    assert after[0]["cut"] and after[0]["t"] == pytest.approx(9 * UNIT)
    assert after[-1]["end"] and after[-1]["weights"] == {}
    assert not any(e.get("cut") for e in after[1:])
    held = call.latest()
    for t, event in held.items():
        if t >= 9 * UNIT:
            assert event in after, "every frame sent ahead was replaced by the decay"
    call.play(40)
    assert len(call.sent) == before + DECAY_FRAMES


async def test_speech_that_fills_a_pause_replaces_its_decay() -> None:
    call = Call()
    await call.scheduler.push_audio(_chunk(0.2), 0)  # 5 instants; the TTS is slow
    call.play(5)
    decayed = [e for _, e in call.sent if e["viseme"] == "sil" or e.get("end")]
    assert decayed, "past the queued speech the plan was a decay"
    await call.scheduler.push_audio(_chunk(0.4), 0)  # in time: plays on at instant 6
    call.play(40)
    held = call.latest()
    speech_end = UNIT + 0.6
    for t, event in held.items():
        if t < speech_end - 0.1:
            assert not event.get("end"), f"a stale rest at {t}"
    speaking = [t for t, e in held.items() if e["weights"] and t < speech_end]
    assert max(speaking) >= speech_end - 0.2


async def test_binary_frames_carry_what_the_json_events_do() -> None:
    call = Call()
    await call.scheduler.push_audio(_chunk(), 0)
    await call.scheduler.end_segment(0)
    call.play(12)
    call.scheduler.clear()
    call.play(30)
    events = [e for _, e in call.sent]
    frames = [decode_binary(m) for m in call.channel.sent]
    assert len(frames) == len(events) > 0
    assert len(call.channel.sent[0]) == 12 + 2 * len(BLEND_SHAPES)
    for frame, event in zip(frames, events, strict=True):
        assert frame.event() == event
        assert frame.t == event["t"] and frame.rtp == event["rtp"]
        assert frame.viseme == event["viseme"] in VISEMES
        weights = [event["weights"].get(k, 0.0) for k in BLEND_SHAPES]
        assert [w / 1000 for w in frame.weights] == weights
    with pytest.raises(ValueError, match="viseme frame"):
        decode_binary(b"\x02" + call.channel.sent[0][1:])


async def test_speech_without_phonemes_opens_by_loudness() -> None:
    call = Call()
    await call.scheduler.push_audio(_chunk(phonemes=False), 0)
    await call.scheduler.end_segment(0)
    call.play(30)
    opened = [e["weights"].get("jawOpen", 0.0) for _, e in call.sent if not e.get("end")]
    assert max(opened) >= 0.4
    assert {e["viseme"] for _, e in call.sent} <= {"aa", "sil"}


async def test_nothing_is_planned_for_a_call_that_did_not_ask() -> None:
    clock = ManualClock()
    scheduler = AVScheduler(CountingEngine(), clock)
    stream = VisemeStream(scheduler)
    scheduler.on_unit = stream.on_unit  # type: ignore[attr-defined]
    scheduler.on_queued = stream.on_queued
    await scheduler.push_audio(_chunk(), 0)
    for k in range(20):
        clock.advance(UNIT)
        scheduler.unit(k, "audio")
    assert stream.frames_sent == 0 and not stream.active


async def test_offer_asks_for_visemes_with_a_boolean() -> None:
    offer, local = await make_offer(), PeerRule(local=True)
    assert parse_offer({"sdp": offer, "type": "offer", "visemes": True}, peers=local).visemes
    assert not parse_offer({"sdp": offer, "type": "offer"}, peers=local).visemes
    with pytest.raises(SignalingError) as caught:
        parse_offer({"sdp": offer, "type": "offer", "visemes": "yes"}, peers=local)
    assert caught.value.code == "bad_offer" and "visemes" in caught.value.message
