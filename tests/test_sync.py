"""The sync-test engine and the exact A/V offset measurement built on it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from benchmarks.analysis import beep_onsets, flash_onsets, paired_offsets_ms
from benchmarks.cli import main
from musetalk_core.synctest import SyncTestEngine
from musetalk_core.types import AudioChunk, LipSyncEngine


async def _frames(engine: SyncTestEngine, n: int) -> list:  # type: ignore[type-arg]
    stream = engine.frames()
    return [await anext(stream) for _ in range(n)]


@pytest.mark.parametrize("delay_ms", [0.0, 120.0, -33.0])
async def test_flash_and_beep_land_where_they_should(delay_ms: float) -> None:
    engine = SyncTestEngine(period_s=1.0, video_delay_ms=delay_ms)
    assert isinstance(engine, LipSyncEngine)
    frames = await _frames(engine, 75)
    times = np.arange(75) / 25
    flashes = flash_onsets(times, [f.image for f in frames])
    pcm = np.concatenate([f.audio.pcm for f in frames])
    beeps = beep_onsets(times, pcm)
    assert list(flashes) == [1.0, 2.0]  # (frame 0 is bright from the start: no rising edge)
    offsets = paired_offsets_ms(flashes, beeps)
    assert offsets == pytest.approx([delay_ms, delay_ms], abs=1.5)  # 1 ms steps


async def test_speech_plays_over_a_plain_frame() -> None:
    engine = SyncTestEngine()
    await engine.push_audio(AudioChunk(np.full(1920 * 2, 9, np.int16), 48_000), 4)
    frames = await _frames(engine, 3)
    assert [f.speaking for f in frames] == [True, True, False]
    assert (frames[0].audio.pcm == 9).all() and frames[0].image.mean() < 100


@pytest.mark.parametrize("delay_ms", [0.0, 120.0])
def test_bench_sync_recovers_a_known_video_delay(tmp_path: Path, delay_ms: float) -> None:
    import json

    out = tmp_path / "sync.json"
    png = tmp_path / "sync.png"
    argv = ["sync", "--seconds", "4", "--video-delay-ms", str(delay_ms), "--json", str(out)]
    assert main([*argv, "--plot", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    r = json.loads(out.read_text())["results"]
    assert r["flashes"] >= 2
    assert all(abs(o - delay_ms) <= 15 for o in r["offsets_ms"]), r["offsets_ms"]


@pytest.mark.browser
def test_bench_sync_in_chromium_sees_an_injected_delay(tmp_path: Path) -> None:
    import json

    from benchmarks.browser import chromium_missing

    if chromium_missing():
        pytest.skip(chromium_missing() or "")
    heard: dict[float, float] = {}
    wire: dict[float, float] = {}
    for delay in (0.0, 120.0):
        out = tmp_path / f"sync{delay}.json"
        # 8 s, as the documented benchmark runs it.
        argv = ["sync", "--browser", "--seconds", "8", "--video-delay-ms", str(delay)]
        assert main([*argv, "--json", str(out)]) == 0
        r = json.loads(out.read_text())["results"]
        assert r["correlation"] > 0.5
        heard[delay], wire[delay] = r["offset_ms"], r["wire_offset_ms"]
    print(f"heard {heard}, wire {wire}")
    # What the server put on the wire, as Chromium's own stats tell it (the heard offset less
    # its jitter buffers and audio sink), shows the injected delay. Chromium's buffering moves
    # from call to call on a loaded machine, so the heard offsets of two calls differ by more
    # than the delay does: 92, 141 and 60 ms for 120 injected in three make-test runs with a
    # core kept busy, 111-169 with one to three busy cores, where the wire offsets gave
    # 112-144. The exact figure is test_bench_sync_recovers_a_known_video_delay's (an aiortc
    # receiver, within 15 ms).
    assert abs((wire[120.0] - wire[0.0]) - 120) <= 40, (heard, wire)
    assert abs(wire[0.0]) <= 45, (heard, wire)
    # And the viewer sees it: the heard offset moves the same way.
    assert heard[120.0] - heard[0.0] >= 40, (heard, wire)


def _call(server: str, *offsets: float) -> dict:  # type: ignore[type-arg]
    seconds = [{"offset_ms": o} for o in offsets]
    return {"server": server, "first_frame_ms": 450.0, "seconds": seconds}


def test_the_fresh_calls_summary_counts_the_flashes_out_of_sync() -> None:
    from benchmarks.browser_call import first_seconds_summary, first_seconds_summary_table

    f = {
        "servers": ["default", "audio with the video"],
        "per_call": [
            _call("default", -30.0, -31.0, -30.0),
            _call("audio with the video", -61.0, -46.0, -26.0),
            _call("default", -47.0, -20.0, 44.0),
            _call("audio with the video"),  # no flash found
        ],
    }
    default, at_once = first_seconds_summary(f)
    assert default == {
        "server": "default",
        "calls": 2,
        "first_flash_within": 1,
        "flashes_within": 5,
        "flashes": 6,
        "lowest_ms": -47.0,
        "highest_ms": 44.0,
        "bound_ms": 45.0,
    }
    assert (at_once["calls"], at_once["first_flash_within"]) == (2, 0)
    assert (at_once["flashes_within"], at_once["flashes"]) == (1, 3)
    head, rows = first_seconds_summary_table({**f, "summary": [default, at_once]})
    assert head[2] == "flash 1 within +-45 ms"
    assert rows[0][:4] == ["default", 2, "1 / 2", "5 / 6"]


@pytest.mark.browser
def test_bench_sync_measures_the_first_seconds_of_fresh_chromium_calls(tmp_path: Path) -> None:
    """The fresh-call path runs end to end: a new call in Chromium, its flashes found from the
    first frame played and each measured; the summary agrees with the calls. (How close the
    offsets are is a figure of benchmarks/README.md, not asserted: Chromium's first seconds
    vary with the machine's load.)"""
    import json

    from benchmarks.browser import chromium_missing

    if chromium_missing():
        pytest.skip(chromium_missing() or "")
    out = tmp_path / "fresh.json"
    argv = ["sync", "--browser", "--fresh-calls", "1", "--seconds", "5", "--compare-audio-start"]
    assert main([*argv, "--json", str(out)]) == 0
    r = json.loads(out.read_text())["results"]
    assert [c["server"] for c in r["per_call"]] == ["default", "audio with the video"]
    for call in r["per_call"]:
        assert 0 < call["first_frame_ms"] < 10_000
        # A flash a second from 0.45 s after the first frame: 4 or 5 in 5 s (one may be missed
        # on a loaded machine: 9 of 10 in one call of 30 measured).
        assert len(call["seconds"]) >= 3, call
        assert all(o["correlation"] > 0.5 for o in call["seconds"]), call
        assert all(abs(o["offset_ms"]) < 200 for o in call["seconds"]), call
        # Chromium's buffering in each window, and the server's lateness over the call.
        assert all(o["audio_buffer_ms"] > 0 for o in call["seconds"]), call
        sent = call["server_send_delay_ms"]
        assert sent["audio"]["frames"] > 100 and sent["video"]["frames"] > 50, sent
    assert [(s["server"], s["calls"]) for s in r["summary"]] == [
        ("default", 1),
        ("audio with the video", 1),
    ]
    assert sum(s["flashes"] for s in r["summary"]) == sum(len(c["seconds"]) for c in r["per_call"])
