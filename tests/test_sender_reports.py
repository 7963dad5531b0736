"""The RTCP sender reports of a call map both tracks' RTP time to the call's clock.

A browser lines audio and video up by these reports. aiortc stamps each with the time its last
packet left, so a frame sent late (a slow encode, a busy loop) shifts its stream on the
receiver; ours carry the media instant itself. Measured with the ``sync-test`` engine (a flash
and a beep on the same media instant every second) by an aiortc caller that places each
received frame where the sender's last report says it belongs.
"""

from __future__ import annotations

import pytest

from benchmarks import sync
from rtc_server.config import ConfigError, ServerConfig


def test_sender_reports_put_the_flash_and_its_beep_on_one_instant() -> None:
    r = sync.run(6.0)
    reported = r["reported_offset_ms"]
    print("by sender reports:", reported, "drift:", r["report_drift_ms"])
    assert reported["n"] >= 3
    # One instant, to the beep detector's millisecond, however late either went out.
    assert abs(reported["p50"]) <= 2.0 and abs(reported["max"]) <= 2.0
    # Every report maps RTP time the same way: the mapping does not move during the call.
    assert r["report_drift_ms"]["audio"] < 0.1 and r["report_drift_ms"]["video"] < 0.1
    # The first report follows a stream's first packet at once (aiortc's loop: 0.5-1.5 s on),
    # so a receiver lines the streams up from the start. 0.4 s leaves room for a busy machine.
    print("first report after the first packet:", r["first_report_s"])
    assert 0 <= r["first_report_s"]["audio"] < 0.4 and 0 <= r["first_report_s"]["video"] < 0.4


def test_aiortcs_own_reports_are_kept_for_comparison_only() -> None:
    assert ServerConfig.of().media.sender_reports == "media"
    ServerConfig.of(sender_reports="sent")
    with pytest.raises(ConfigError, match="sender_reports"):
        ServerConfig.of(sender_reports="wall")


def test_the_video_send_delay_moves_the_wire_not_the_reports() -> None:
    import asyncio

    import numpy as np

    assert ServerConfig.of().media.video_send_delay_s == 0.025
    r = asyncio.run(sync._measure(6.0, 0.0, None))
    # bench sync takes the server's own delay off the arrival times; put it back.
    assert r["video_sent_late_ms"] == 25.0
    by_arrival = np.asarray(r["offsets_ms"]) + r["video_sent_late_ms"]
    print("by arrival:", by_arrival, "by sender reports:", r["reported_offset_ms"])
    # Each frame leaves 25 ms after its instant: by arrival the flash comes that much after
    # its beep (+ the few ms the wire adds either way without the delay).
    assert len(by_arrival) >= 3 and 15 <= float(np.median(by_arrival)) <= 40, by_arrival
    # The reports still put both on one instant: a browser's lip-sync is not moved.
    assert abs(r["reported_offset_ms"]["p50"]) <= 2.0, r["reported_offset_ms"]
    with pytest.raises(ConfigError, match="video_send_delay_s"):
        ServerConfig.of(video_send_delay_s=0.5)
