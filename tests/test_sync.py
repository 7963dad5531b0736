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
    measured = {}
    for delay in (0.0, 120.0):
        out = tmp_path / f"sync{delay}.json"
        # 8 s as the documented benchmark runs it: on a loaded machine Chromium's playout
        # shifts for a moment now and then (4 s gave 92 and 141 ms for the 120 injected).
        argv = ["sync", "--browser", "--seconds", "8", "--video-delay-ms", str(delay)]
        assert main([*argv, "--json", str(out)]) == 0
        r = json.loads(out.read_text())["results"]
        assert r["correlation"] > 0.5
        measured[delay] = r["offset_ms"]
    # Chromium adds its own skew to both; the injected delay shows in full.
    assert abs((measured[120.0] - measured[0.0]) - 120) <= 15, measured
    assert abs(measured[0.0]) <= 45, measured
