"""The benchmarks' callers encode their microphone and decode the server's audio themselves, on
the loop: cheaper, so many fit on one machine beside the server, and heard the same."""

from __future__ import annotations

import numpy as np
from aiortc import RTCRtpCodecParameters
from aiortc.codecs import get_decoder, get_encoder
from aiortc.jitterbuffer import JitterFrame
from av import AudioFrame

from benchmarks.client import CallClient, DecodedAudio, Microphone, ReplyAudioDecoder
from benchmarks.clip import speech_pcm
from rtc_server.media.opus import ReplyOpusEncoder
from tests.conftest import LiveServer

OPUS = RTCRtpCodecParameters(mimeType="audio/opus", clockRate=48_000, channels=2, payloadType=111)
PCMU = RTCRtpCodecParameters(mimeType="audio/PCMU", clockRate=8_000, payloadType=0)
QUESTION = "What is the capital of Italy?"


def _voice() -> np.ndarray:
    t = np.arange(48_000) / 48_000
    tone = np.sin(2 * np.pi * 220 * t) * 6000 * (1 + np.sin(2 * np.pi * 3 * t))
    noise = np.random.default_rng(0).normal(0, 500, len(t))
    return (tone + noise).astype(np.int16)


def test_the_servers_opus_decodes_to_what_aiortcs_decoder_gives() -> None:
    voice = _voice()
    encoder = ReplyOpusEncoder()
    packets = [encoder.encode_samples(voice[i : i + 960], i).payload for i in range(0, 48_000, 960)]
    ours, theirs = ReplyAudioDecoder(), get_decoder(OPUS)
    for i, packet in enumerate(packets):
        (decoded,) = ours(OPUS, JitterFrame(packet, i * 960))
        (frame,) = theirs.decode(JitterFrame(packet, i * 960))
        first_channel = frame.to_ndarray().reshape(-1, 2)[:, 0]
        assert decoded.pts == i * 960 and decoded.samples.dtype == np.int16
        np.testing.assert_array_equal(decoded.samples, first_channel)


def test_other_codecs_are_decoded_by_aiortc_one_channel() -> None:
    encoder = get_encoder(PCMU)
    decoder = ReplyAudioDecoder()
    voice = _voice()
    payloads: list[bytes] = []
    for i in range(0, 4800, 960):  # aiortc's resampler to 8 kHz holds the first frame back
        frame = AudioFrame.from_ndarray(
            voice[i : i + 960].reshape(1, -1), format="s16", layout="mono"
        )
        frame.sample_rate, frame.pts = 48_000, i
        payloads, timestamp = encoder.encode(frame)
    frames = decoder(PCMU, JitterFrame(payloads[0], timestamp))
    assert [type(f) for f in frames] == [DecodedAudio]
    assert frames[0].samples.dtype == np.int16 and frames[0].samples.ndim == 1
    assert np.abs(frames[0].samples.astype(float)).max() > 1000  # the voice, not silence


async def test_a_microphone_sent_encoded_is_heard_and_the_reply_recorded(
    live_server: LiveServer,
) -> None:
    mic = Microphone()

    async def never_read() -> None:
        raise AssertionError("aiortc read the track: the microphone was not sent encoded")

    mic.recv = never_read  # type: ignore[method-assign]
    client = CallClient(live_server.url, microphone=mic, record_video=False)
    try:
        await client.connect()
        await client.wait_channel_open()
        await client.wait_state("listening", timeout=10)
        start = len(client.received.audio)
        handle = mic.play(await speech_pcm(QUESTION))
        transcript = await client.wait_event(lambda e: e.get("type") == "transcript", 15)
        assert {"capital", "italy"} <= set(transcript["text"].lower().strip("?.").split())
        await client.wait_event(lambda e: e.get("type") == "turn", 30)
        await client.wait_state("listening", 10)
        reply = client.received.audio[start:]
    finally:
        await client.close()
    assert mic.sent_at(handle, 0) is not None
    # The reply, recorded as before: mono 20 ms frames at 48 kHz, one RTP step apart, loud.
    assert {len(pcm) for _, _, pcm in reply} == {960}
    steps = np.diff([pts for _, pts, _ in reply])
    assert (steps == 960).mean() > 0.95
    assert max(np.abs(pcm.astype(np.int32)).max() for _, _, pcm in reply) > 3000
