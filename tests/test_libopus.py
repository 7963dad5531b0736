"""libopus called directly: the reply's packets as PyAV makes them, the microphone decoded to the
rate the call listens at."""

from __future__ import annotations

import asyncio
import fractions
import logging
from pathlib import Path

import aiohttp
import av
import numpy as np
import pytest
from aiohttp import web
from aiortc import RTCRtpCodecParameters
from aiortc.codecs.g711 import PcmuEncoder
from aiortc.codecs.opus import OpusDecoder
from aiortc.jitterbuffer import JitterFrame

from benchmarks.client import make_offer
from rtc_server.app import create_app
from rtc_server.config import ServerConfig
from rtc_server.engine_factory import EngineFactory
from rtc_server.media import libopus
from rtc_server.media.inbound import MicAudio, MicDecoder, MicDownsampler, ToRate
from rtc_server.media.libopus import OpusError, OpusMonoDecoder, OpusMonoEncoder
from rtc_server.media.opus import BIT_RATE, ReplyOpusEncoder

FRAME = 960
OPUS = RTCRtpCodecParameters(mimeType="audio/opus", clockRate=48000, channels=2)


def _voice(seconds: float) -> np.ndarray:
    """A voiced sound with a moving pitch, syllables and a little breath noise, at 48 kHz."""
    t = np.arange(int(48_000 * seconds)) / 48_000
    pitch = 130 + 40 * np.sin(2 * np.pi * 0.9 * t)
    phase = 2 * np.pi * np.cumsum(pitch) / 48_000
    envelope = 0.3 + 0.7 * np.sin(2 * np.pi * 2.7 * t) ** 2
    wave = sum(np.sin(k * phase) / k for k in range(1, 20))
    noise = np.random.default_rng(0).normal(0, 0.05, len(t))
    return (6000 * envelope * (wave + noise)).astype(np.int16)


def _frames(pcm: np.ndarray) -> list[np.ndarray]:
    return [pcm[i : i + FRAME] for i in range(0, len(pcm) - FRAME + 1, FRAME)]


def _pyav_packets(frames: list[np.ndarray]) -> list[bytes]:
    """What FFmpeg's libopus encoder makes of them, set as the reply encoder was before."""
    codec = av.CodecContext.create("libopus", "w")
    assert isinstance(codec, av.AudioCodecContext)
    codec.bit_rate, codec.format, codec.layout = BIT_RATE, "s16", "mono"
    codec.sample_rate, codec.time_base = 48_000, fractions.Fraction(1, 48_000)
    codec.options = {"application": "voip"}
    packets = []
    for i, pcm in enumerate(frames):
        frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate, frame.pts = 48_000, i * FRAME
        frame.time_base = fractions.Fraction(1, 48_000)
        packets += [bytes(p) for p in codec.encode(frame)]
    return packets


def test_the_reply_encoder_makes_the_packets_ffmpeg_makes() -> None:
    frames = _frames(np.concatenate([_voice(1.5), np.zeros(FRAME * 5, np.int16), _voice(0.5)]))
    ours = OpusMonoEncoder(48_000, BIT_RATE)
    assert [ours.encode(f) for f in frames] == _pyav_packets(frames)
    reply = ReplyOpusEncoder()
    assert [reply.encode_samples(f, i * FRAME).payload for i, f in enumerate(frames)] == (
        _pyav_packets(frames)
    )


def test_the_reply_encoder_takes_only_20_ms_frames() -> None:
    with pytest.raises(ValueError, match="20 ms"):
        ReplyOpusEncoder().encode_samples(np.zeros(480, np.int16), 0)


def _snr_db(reference: np.ndarray, other: np.ndarray) -> float:
    """After the best alignment within 2 ms (the two decoders' delays differ)."""
    ref, oth = reference.astype(np.float64), other.astype(np.float64)
    n = min(len(ref), len(oth)) - 200
    lags = range(-32, 33)
    best = max(lags, key=lambda k: float(np.dot(ref[100 : 100 + n], oth[100 + k : 100 + k + n])))
    err = ref[100 : 100 + n] - oth[100 + best : 100 + best + n]
    return float(10 * np.log10((ref[100 : 100 + n] ** 2).sum() / (err**2).sum()))


@pytest.mark.parametrize("rate", [16_000, 24_000])
def test_the_microphone_is_decoded_at_the_calls_rate(rate: int) -> None:
    encoder = OpusMonoEncoder(48_000, BIT_RATE)
    packets = [encoder.encode(f) for f in _frames(_voice(2.0))]
    decode = MicDecoder(rate)
    heard = [decode(OPUS, JitterFrame(p, i * FRAME)) for i, p in enumerate(packets)]
    assert all(len(h) == 1 and isinstance(h[0], MicAudio) for h in heard)
    assert all(h[0].rate == rate and len(h[0].samples) == rate // 50 for h in heard)
    assert all(h[0].samples.dtype == np.int16 for h in heard)
    ours = np.concatenate([h[0].samples for h in heard])
    # What the browser's stereo 48 kHz frames gave once mixed and resampled: the same voice.
    stereo, downsample = OpusDecoder(), MicDownsampler(rate)
    before = np.concatenate(
        [
            downsample(frame)
            for i, p in enumerate(packets)
            for frame in stereo.decode(JitterFrame(p, i * FRAME))
            if isinstance(frame, av.AudioFrame)
        ]
    )
    assert _snr_db(before, ours) > 30  # 46-47 dB measured


def test_a_packet_libopus_cannot_read_is_skipped_and_the_next_decodes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    encoder = OpusMonoEncoder(48_000, BIT_RATE)
    good = [encoder.encode(f) for f in _frames(_voice(0.2))]
    decode = MicDecoder(16_000)
    assert len(decode(OPUS, JitterFrame(good[0], 0))) == 1
    with caplog.at_level(logging.WARNING):
        assert decode(OPUS, JitterFrame(b"\xff" * 3, FRAME)) == []
    assert "could not be decoded" in caplog.text
    assert len(decode(OPUS, JitterFrame(good[1], 2 * FRAME))[0].samples) == 320


def test_other_codecs_go_through_aiortcs_decoder() -> None:
    pcmu = RTCRtpCodecParameters(mimeType="audio/PCMU", clockRate=8000, channels=1)
    encoder, decode, heard = PcmuEncoder(), MicDecoder(16_000), []
    for i, pcm in enumerate(_frames(_voice(0.2))):
        frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate, frame.pts = 48_000, i * FRAME
        frame.time_base = fractions.Fraction(1, 48_000)
        payloads, timestamp = encoder.encode(frame)
        for payload in payloads:
            heard += decode(pcmu, JitterFrame(payload, timestamp))
    # G.711 at 8 kHz brought up to 16 kHz: 320 samples a frame once the filter is primed.
    assert len(heard) >= 8 and all(h.rate == 16_000 for h in heard)
    assert all(len(h.samples) == 320 for h in heard[1:])
    assert np.abs(np.concatenate([h.samples for h in heard])).max() > 2000


def test_decoders_refuse_what_libopus_cannot_do() -> None:
    with pytest.raises(ValueError, match="decodes at"):
        OpusMonoDecoder(44_100)
    decoder = OpusMonoDecoder(16_000)
    decoder.close()
    with pytest.raises(OpusError, match="closed"):
        decoder.decode(b"\x00")


def test_audio_decoded_at_another_rate_is_brought_to_the_one_asked() -> None:
    to_vad = ToRate(16_000)
    same = MicAudio(np.arange(320, dtype=np.int16), 16_000)
    assert to_vad(same) is same.samples  # decoded at the VAD's rate: passed as it is
    # A speech-to-speech call decodes at 24 kHz: its VAD hears the stream at 16, no sample
    # gained or lost over the frames (the resampler's ~10-sample delay aside).
    to_vad = ToRate(16_000)
    frames = [MicAudio(f[::2].copy(), 24_000) for f in _frames(_voice(1.0))]
    out = np.concatenate([to_vad(f) for f in frames])
    assert 16_000 - 20 <= len(out) <= 16_000 and out.dtype == np.int16


async def test_without_libopus_the_server_says_so_instead_of_taking_calls(
    monkeypatch: pytest.MonkeyPatch, engine_factory: EngineFactory, cache_dir: Path
) -> None:
    def missing() -> None:
        raise OpusError("libopus not found: neither PyAV's wheel nor the system has it")

    monkeypatch.setattr(libopus, "library", missing)
    cfg = ServerConfig.of(
        cache_dir=cache_dir, ice_addresses=("127.0.0.1",), headroom=False, llm="echo"
    )
    runner = web.AppRunner(create_app(cfg, engine_loader=lambda: engine_factory))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(100):  # the load fails in the background, at once
                async with http.get(url + "/readyz") as resp:
                    ready = (resp.status, await resp.json())
                if ready[1].get("error", {}).get("code") != "not_ready":
                    break
                await asyncio.sleep(0.1)
            async with http.get(url + "/healthz") as resp:
                assert resp.status == 200  # the process is up and says what is wrong
            async with http.post(
                url + "/offer", json={"sdp": await make_offer(), "type": "offer"}
            ) as resp:
                offer = (resp.status, await resp.json())
    finally:
        await runner.cleanup()
    for status, body in (ready, offer):
        assert status == 503 and body["error"]["code"] == "load_failed", body
        assert "libopus not found" in body["error"]["message"]
