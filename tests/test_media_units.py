"""Resampling, ICE configuration and the tuned H.264 encoder."""

from __future__ import annotations

import asyncio
import fractions

import aioice.ice
import av
import numpy as np
import pytest
from aiortc import RTCPeerConnection, RTCRtpSender
from aiortc.codecs.h264 import H264Encoder

import rtc_server.aiortc_compat
from rtc_server.aiortc_compat import restrict_host_addresses, set_sender_encoder
from rtc_server.ice import parse_ice_server, rtc_configuration
from rtc_server.media.h264 import TunedH264Encoder, X264Settings
from rtc_server.media.resample import resample_int16


@pytest.mark.parametrize(("src", "dst"), [(22_050, 48_000), (48_000, 16_000), (22_050, 16_000)])
def test_resample_keeps_duration_and_pitch(src: int, dst: int) -> None:
    seconds = 1.5
    t = np.arange(int(src * seconds)) / src
    tone = (8000 * np.sin(2 * np.pi * 440 * t)).astype(np.int16)
    out = resample_int16(tone, src, dst)
    assert out.dtype == np.int16
    assert abs(len(out) - dst * seconds) <= 1
    spectrum = np.abs(np.fft.rfft(out.astype(np.float32)))
    peak_hz = np.argmax(spectrum) * dst / len(out)
    assert abs(peak_hz - 440) < 2


def test_ice_server_urls() -> None:
    stun = parse_ice_server("stun:stun.example.org:3478")
    assert stun.urls == "stun:stun.example.org:3478" and stun.username is None
    turn = parse_ice_server("turn:alice:s%40cret@turn.example.org:3478?transport=udp")
    assert turn.urls == "turn:turn.example.org:3478?transport=udp"
    assert (turn.username, turn.credential) == ("alice", "s@cret")
    with pytest.raises(ValueError, match="stun:host:port"):
        parse_ice_server("http://example.org")


def test_no_ice_servers_means_no_default_stun() -> None:
    # aiortc would otherwise contact a public STUN server on its own.
    assert rtc_configuration([]).iceServers == []


def test_restrict_host_addresses() -> None:
    # Other tests' servers may have restricted the addresses already: restore what they set.
    before = aioice.ice.get_host_addresses
    try:
        restrict_host_addresses(["127.0.0.1", "::1"])
        assert aioice.ice.get_host_addresses(use_ipv4=True, use_ipv6=False) == ["127.0.0.1"]
        assert aioice.ice.get_host_addresses(use_ipv4=True, use_ipv6=True) == ["127.0.0.1", "::1"]
        with pytest.raises(ValueError):
            restrict_host_addresses(["not-an-address"])
        restrict_host_addresses([])
        original = rtc_server.aiortc_compat._original_get_host_addresses
        assert aioice.ice.get_host_addresses is original
    finally:
        aioice.ice.get_host_addresses = before


def _frames(n: int) -> list[av.VideoFrame]:
    rng = np.random.default_rng(1)
    base = rng.integers(0, 255, (256, 256, 3), np.uint8)
    frames = []
    for i in range(n):
        img = base.copy()
        img[100:140, 80 + i : 160 + i] = 30
        frame = av.VideoFrame.from_ndarray(img, format="rgb24")
        frame.pts = i * 3600
        frame.time_base = fractions.Fraction(1, 90_000)
        frames.append(frame)
    return frames


def _sei(encoder: H264Encoder, frames: list[av.VideoFrame]) -> str:
    payloads, _ = encoder.encode(frames[0])
    return b"".join(payloads).decode("latin-1")


def test_tuned_encoder_uses_our_x264_settings() -> None:
    frames = _frames(60)
    tuned_sei = _sei(TunedH264Encoder(), frames)
    default_sei = _sei(H264Encoder(), frames)
    # x264 writes its options into the first frame's SEI.
    assert "subme=7" in default_sei and "ref=3" in default_sei
    # ultrafast: subme 0, one reference frame; one thread; the 10 s keyframe interval kept.
    assert "subme=0" in tuned_sei and "ref=1" in tuned_sei
    assert "threads=1" in tuned_sei and "keyint=250" in tuned_sei
    # Constant quality, capped at the sender's target bitrate (aiortc's default 1 Mbit/s).
    assert "rc=crf" in tuned_sei and "crf=17.0" in tuned_sei
    assert "vbv_maxrate=1000" in tuned_sei and "vbv_bufsize=500" in tuned_sei


def _nal_types(payload: bytes) -> list[int]:
    """NAL unit types in one RTP payload (single NAL, STAP-A or FU-A start)."""
    kind = payload[0] & 0x1F
    if kind == 24:  # STAP-A: 2-byte sizes, then NALs
        types, pos = [], 1
        while pos + 2 < len(payload):
            size = int.from_bytes(payload[pos : pos + 2], "big")
            types.append(payload[pos + 2] & 0x1F)
            pos += 2 + size
        return types
    if kind == 28:  # FU-A: the original type sits in the FU header; count the start only
        return [payload[1] & 0x1F] if payload[1] & 0x80 else []
    return [kind]


def test_tuned_encoder_keyframe_interval_and_timing_hook() -> None:
    seconds: list[float] = []
    encoder = TunedH264Encoder(X264Settings(keyint=10), on_encode=seconds.append)
    idr_frames = []
    for i, frame in enumerate(_frames(30)):
        payloads, timestamp = encoder.encode(frame)
        assert timestamp == frame.pts
        if any(5 in _nal_types(p) for p in payloads):
            idr_frames.append(i)
    assert idr_frames == [0, 10, 20]
    assert len(seconds) == 30 and all(s >= 0 for s in seconds)


async def test_a_preset_encoder_is_kept_by_the_sender() -> None:
    pc = RTCPeerConnection()
    try:
        transceiver = pc.addTransceiver("video", direction="sendonly")
        encoder = TunedH264Encoder()
        set_sender_encoder(transceiver.sender, encoder)
        # aiortc only creates its own encoder when none is set (rtcrtpsender._next_encoded_frame).
        assert transceiver.sender._RTCRtpSender__encoder is encoder  # type: ignore[attr-defined]
        assert isinstance(transceiver.sender, RTCRtpSender)
    finally:
        await pc.close()


async def test_low_latency_audio_replaces_the_receivers_jitter_buffer() -> None:
    from rtc_server.media.inbound import low_latency_audio

    pc = RTCPeerConnection()
    try:
        audio = pc.addTransceiver("audio", direction="recvonly")
        video = pc.addTransceiver("video", direction="recvonly")
        before = audio.receiver._RTCRtpReceiver__jitter_buffer  # type: ignore[attr-defined]
        assert before._prefetch == 4  # aiortc's default, which this undoes
        low_latency_audio(audio, 16_000)
        after = audio.receiver._RTCRtpReceiver__jitter_buffer  # type: ignore[attr-defined]
        assert after is not before and after._prefetch == 1
        # And its frames are decoded on the loop (decode_on_loop's stand-in queue).
        decoding = audio.receiver._RTCRtpReceiver__decoder_queue  # type: ignore[attr-defined]
        assert type(decoding).__name__ == "_DecodeOnLoop"
        with pytest.raises(ValueError):
            low_latency_audio(video, 16_000)
    finally:
        await pc.close()


def test_microphone_downsampling_keeps_duration_and_pitch() -> None:
    from rtc_server.media.inbound import MicDownsampler

    downsample = MicDownsampler(16_000)
    t = np.arange(48_000) / 48_000
    tone = (8000 * np.sin(2 * np.pi * 440 * t)).astype(np.int16)
    stereo = np.repeat(tone, 2).reshape(1, -1)  # interleaved s16, as aiortc decodes Opus
    out = []
    for i in range(0, 48_000, 960):
        frame = av.AudioFrame.from_ndarray(
            stereo[:, 2 * i : 2 * (i + 960)], format="s16", layout="stereo"
        )
        frame.sample_rate = 48_000
        out.append(downsample(frame))
    pcm = np.concatenate(out)
    assert abs(len(pcm) - 16_000) <= 64  # the filter's delay, nothing like a wrong ratio
    spectrum = np.abs(np.fft.rfft(pcm.astype(np.float32)))
    assert abs(np.argmax(spectrum) * 16_000 / len(pcm) - 440) < 3


def test_microphone_downsampling_is_the_streams_resampler_over_the_whole_call() -> None:
    """The microphone goes through the same resampler as every stream: 20 ms frames give the
    samples of the whole call resampled at once (within rounding), whatever the frame format."""
    from rtc_server.media.inbound import MicDownsampler
    from rtc_server.media.resample import resample_int16

    rng = np.random.default_rng(7)
    left = (rng.standard_normal(48_000) * 4000).astype(np.int16)
    right = (rng.standard_normal(48_000) * 4000).astype(np.int16)
    mono = ((left.astype(np.float64) + right) / 2).round().astype(np.int16)
    for rate in (16_000, 24_000):
        whole = resample_int16(mono, 48_000, rate)
        for layout in ("s16", "fltp"):
            downsample = MicDownsampler(rate)
            out = []
            for i in range(0, 48_000, 960):
                pair = np.stack([left[i : i + 960], right[i : i + 960]])
                if layout == "s16":  # interleaved, as aiortc decodes Opus
                    frame = av.AudioFrame.from_ndarray(
                        pair.T.reshape(1, -1), format="s16", layout="stereo"
                    )
                else:  # planar floats
                    frame = av.AudioFrame.from_ndarray(
                        (pair / 32768).astype(np.float32), format="fltp", layout="stereo"
                    )
                frame.sample_rate = 48_000
                out.append(downsample(frame))
            pcm = np.concatenate(out)
            assert len(whole) - 12 <= len(pcm) <= len(whole)  # only the last few held back
            diff = np.abs(pcm.astype(np.int32) - whole[: len(pcm)])
            assert diff.max() <= 1, (rate, layout)


def test_the_numpy_audio_level_is_aiortcs() -> None:
    from rtc_server.aiortc_compat import AIORTC_AUDIO_LEVEL as original
    from rtc_server.aiortc_compat import audio_level_dbov

    rng = np.random.default_rng(3)
    for scale in (0, 1, 30, 1000, 20000, 32767):
        pcm = (rng.standard_normal(960) * scale).clip(-32768, 32767).astype(np.int16)
        frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
        assert audio_level_dbov(frame) == original(frame), scale


def test_the_fast_ntp_clock_reads_aiortcs_time_and_reaches_its_senders() -> None:
    import inspect

    from aiortc import clock
    from aiortc.rtcrtpsender import RTCRtpSender

    from rtc_server.aiortc_compat import ntp_time_now, use_fast_ntp_clock

    theirs = clock.datetime_to_ntp(clock.current_datetime())
    ours = ntp_time_now()
    assert 0 <= ours - theirs < int(0.05 * 2**32), (ours - theirs) / 2**32
    use_fast_ntp_clock()
    assert clock.current_ntp_time is ntp_time_now
    # The senders look it up in aiortc's clock module at each packet, so the swap reaches them.
    assert "clock.current_ntp_time()" in inspect.getsource(RTCRtpSender._run_rtp)


def test_aiortc_still_takes_a_senders_encoded_frames_as_send_encoded_audio_assumes() -> None:
    """send_encoded_audio replaces one sender's ``_next_encoded_frame(codec)``, which aiortc's
    RTP loop awaits for an ``RTCEncodedFrame(payloads, timestamp, audio_level)``."""
    import inspect

    from aiortc import RTCRtpSender
    from aiortc.rtcrtpsender import RTCEncodedFrame

    from rtc_server.aiortc_compat import send_encoded_audio

    assert inspect.iscoroutinefunction(RTCRtpSender._next_encoded_frame)
    assert list(inspect.signature(RTCRtpSender._next_encoded_frame).parameters) == ["self", "codec"]
    assert "self._next_encoded_frame(codec)" in inspect.getsource(RTCRtpSender._run_rtp)
    frame = RTCEncodedFrame([b"x"], 960, -30)
    assert (frame.payloads, frame.timestamp, frame.audio_level) == ([b"x"], 960, -30)

    class Sender:  # only what the replacement touches
        _enabled = True

    async def source() -> tuple[bytes, int, int]:
        return b"opus", 1920, -42

    sender = Sender()
    send_encoded_audio(sender, source)  # type: ignore[arg-type]
    got = asyncio.run(sender._next_encoded_frame(None))  # type: ignore[attr-defined]
    assert (got.payloads, got.timestamp, got.audio_level) == ([b"opus"], 1920, -42)
    sender._enabled = False
    assert asyncio.run(sender._next_encoded_frame(None)) is None  # type: ignore[attr-defined]


def test_an_untested_aiortc_or_aioice_is_refused_with_what_to_install() -> None:
    from rtc_server.aiortc_compat import TESTED, check_versions

    check_versions()  # what is installed here is what was tested
    with pytest.raises(ImportError, match=r"tested with aiortc 1\.16\.\*; 1\.17\.0 is installed"):
        check_versions(lambda package: "1.17.0" if package == "aiortc" else "0.13.0")
    with pytest.raises(ImportError, match=r"pip install 'aioice==0\.13\.\*'"):
        check_versions(lambda package: "1.16.2" if package == "aiortc" else "0.14.1")
    assert set(TESTED) == {"aiortc", "aioice"}


def test_aiortc_still_decodes_through_the_queue_decode_on_loop_replaces() -> None:
    """decode_on_loop swaps a receiver's decoder queue before receive() starts the thread:
    aiortc must still pass that attribute to its thread, put (codec, frame) into it on the
    loop, and put None into it to stop."""
    import inspect

    from aiortc import rtcrtpreceiver

    receive = inspect.getsource(rtcrtpreceiver.RTCRtpReceiver.receive)
    assert "self.__decoder_queue," in receive and "target=decoder_worker" in receive
    handle = inspect.getsource(rtcrtpreceiver.RTCRtpReceiver._handle_rtp_packet)
    assert "self.__decoder_queue.put((codec, encoded_frame))" in handle
    stop = inspect.getsource(rtcrtpreceiver.RTCRtpReceiver._RTCRtpReceiver__stop_decoder)  # type: ignore[attr-defined]
    assert "self.__decoder_queue.put(None)" in stop and ".join()" in stop
    worker = inspect.getsource(rtcrtpreceiver.decoder_worker)
    assert "input_q.get()" in worker and "output_q.put(None)" in worker


async def test_decode_on_loop_decodes_as_frames_are_put_and_lets_the_thread_end() -> None:
    import threading

    from aiortc import RTCRtpCodecParameters
    from aiortc.codecs.opus import OpusDecoder
    from aiortc.jitterbuffer import JitterFrame

    from rtc_server.aiortc_compat import _DecodeOnLoop
    from rtc_server.media.opus import ReplyOpusEncoder

    class Receiver:  # what the stand-in reads of aiortc's receiver: its track's queue
        class _track:  # noqa: N801
            _queue: asyncio.Queue[object] = asyncio.Queue()

    out = Receiver._track._queue
    decoder = OpusDecoder()  # aiortc's, as its decoder thread would run it
    stand_in = _DecodeOnLoop(Receiver, lambda _, frame: decoder.decode(frame))  # type: ignore[arg-type]
    codec = RTCRtpCodecParameters(mimeType="audio/opus", clockRate=48000, channels=2)
    encoder = ReplyOpusEncoder()
    tone = (8000 * np.sin(np.arange(960) * 2 * np.pi * 440 / 48_000)).astype(np.int16)
    for i in range(3):
        payload = encoder.encode_samples(tone, i * 960).payload
        stand_in.put((codec, JitterFrame(payload, i * 960)))
    frames = [out.get_nowait() for _ in range(3)]  # decoded at once, on this thread
    assert all(isinstance(f, av.AudioFrame) and f.samples == 960 for f in frames)
    assert np.abs(frames[-1].to_ndarray()).max() > 1000  # type: ignore[union-attr]
    waiting = threading.Thread(target=stand_in.get)  # as aiortc's decoder thread waits
    waiting.start()
    stand_in.put(None)
    waiting.join(timeout=5)
    assert not waiting.is_alive()
