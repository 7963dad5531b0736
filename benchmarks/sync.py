"""``bench sync``: the A/V offset of a call, exactly, with the ``sync-test`` engine.

The server's engine flashes the frame and beeps the audio on the same media instant once a
second. An aiortc caller records both streams, timed by packet arrival on the sender's RTP
timeline; the offset is each flash's time minus its beep's (positive: video later), less the
delay the in-process server sends its video with on purpose (``MediaSettings.video_send_delay_s``;
a server given by ``--url`` is measured as it arrives).
``--video-delay-ms`` makes the engine put its beeps that much before their flashes, a known
offset the measurement must recover.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from benchmarks.analysis import beep_onsets, flash_onsets, frame_times, paired_offsets_ms
from benchmarks.call import _server, video_sent_late_s
from benchmarks.client import CallClient
from benchmarks.report import progress, summary
from musetalk_core.synctest import SyncTestEngine
from rtc_server.engine_factory import VIDEO_FPS, EngineFactory
from rtc_server.media.clock import AUDIO_RATE

OPUS_DECODER_DELAY_S = 312 / 48_000
"""libopus hands back decoded audio 312 samples after the RTP time it belongs to."""


def sync_test_factory(video_delay_ms: float = 0.0) -> EngineFactory:
    """Per-call sync-test engines whose beeps come ``video_delay_ms`` before their flashes."""
    return EngineFactory(
        "sync-test",
        "bench",
        lambda: SyncTestEngine(
            fps=VIDEO_FPS, sample_rate=AUDIO_RATE, video_delay_ms=video_delay_ms
        ),
    )


async def _measure(
    seconds: float,
    video_delay_ms: float,
    url: str | None,
    sender_reports: str = "media",
    **media: Any,
) -> dict[str, Any]:
    """``media``: more ``MediaSettings`` of the in-process server."""
    runner = None
    late = 0.0
    if url is None:
        factory = sync_test_factory(video_delay_ms)
        url, runner, _ = await _server(factory, sender_reports=sender_reports, **media)
        late = video_sent_late_s(runner)
    elif video_delay_ms:
        raise ValueError("--video-delay-ms works on the in-process server only")
    client = CallClient(url)
    try:
        await client.connect()
        progress(f"recording {seconds:.0f} s of flashes and beeps")
        await asyncio.sleep(seconds)
        video = list(client.received.video)
        audio = list(client.received.audio)
    finally:
        await client.close()
        if runner is not None:
            await runner.cleanup()
    vt = frame_times(video, 90_000, late)
    at = frame_times(audio, 48_000)
    flashes = flash_onsets(vt, [img for _, _, img in video])
    beeps = beep_onsets(at, np.concatenate([p for _, _, p in audio])) - OPUS_DECODER_DELAY_S
    offsets = paired_offsets_ms(flashes, beeps)
    reported = reported_offsets_ms(client, video, audio)
    return {
        # What the sender reports say: the flash's and the beep's media instants as each
        # stream's last report maps them (what a browser's lip-sync lines up).
        "reported_offset_ms": summary(reported.tolist()),
        "report_drift_ms": {k: report_drift_ms(client, k) for k in ("audio", "video")},
        # From a stream's first packet to its first sender report (s): until both have one,
        # a receiver cannot line them up.
        "first_report_s": {k: first_report_s(client, k) for k in ("audio", "video")},
        "injected_video_delay_ms": video_delay_ms,
        # Taken off the arrival times: the server's own send delay (None: not known, --url).
        "video_sent_late_ms": late * 1000 if runner is not None else None,
        "flashes": int(flashes.size),
        "beeps": int(beeps.size),
        "offset_ms": summary(offsets.tolist()),
        "offsets_ms": offsets.tolist(),
    }


def reported_offsets_ms(
    client: CallClient,
    video: list[tuple[float, int, np.ndarray]],
    audio: list[tuple[float, int, np.ndarray]],
) -> np.ndarray:
    """Flash minus beep (ms) on the timeline the sender reports give (NTP seconds)."""
    if not video or not audio:
        return np.zeros(0)
    vt = [client.reported_time("video", client.rtp_of("video", t), 90_000) for _, t, _ in video]
    at = [client.reported_time("audio", client.rtp_of("audio", t), AUDIO_RATE) for _, t, _ in audio]
    if None in vt or None in at:
        return np.zeros(0)
    flashes = flash_onsets(np.asarray(vt), [img for _, _, img in video])
    pcm = np.concatenate([p for _, _, p in audio])
    beeps = beep_onsets(np.asarray(at), pcm) - OPUS_DECODER_DELAY_S
    return paired_offsets_ms(flashes, beeps)


def first_report_s(client: CallClient, kind: str) -> float | None:
    first = client.first_arrival(kind)
    reports = [at for k, at, _, _ in client.sender_reports if k == kind]
    return None if first is None or not reports else reports[0] - first


def report_drift_ms(client: CallClient, kind: str) -> float | None:
    """How far the reports' RTP -> NTP mapping moved over the call (max - min, ms): 0 when
    every report maps media time the same way."""
    rate = AUDIO_RATE if kind == "audio" else 90_000
    reports = [(ntp, ts) for k, _, ntp, ts in client.sender_reports if k == kind]
    if len(reports) < 2:
        return None
    ntp0, ts0 = reports[0]
    moved = [
        (ntp - ntp0) / 2**32 - (((ts - ts0 + 2**31) % 2**32) - 2**31) / rate for ntp, ts in reports
    ]
    return (max(moved) - min(moved)) * 1000


def run(
    seconds: float = 6.0,
    video_delay_ms: float = 0.0,
    url: str | None = None,
    sender_reports: str = "media",
) -> dict[str, Any]:
    """``url``: a running server started with ``--engine sync-test``; ``sender_reports``: the
    in-process server's (``MediaSettings.sender_reports``)."""
    return asyncio.run(_measure(seconds, video_delay_ms, url, sender_reports))
