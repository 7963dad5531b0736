"""``bench load``'s measurements on made-up input: holes, pauses, failed calls, CPU per call.

The end-to-end run against a spawned server is ``test_bench_load`` in test_benchmarks_cli.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from benchmarks.analysis import Hole, reply_audio
from benchmarks.load import (
    PAUSE_MARGIN_MS,
    Answer,
    Reference,
    Settings,
    _measure,
    holes,
    skipped_frames,
    summarize_step,
)
from benchmarks.load_lines import step_line
from benchmarks.procstat import usage
from benchmarks.server_cpu import (
    cpu_per_call_by_thread,
    speaking_cpu_by_thread,
    speaking_cpu_pct_per_call,
)
from benchmarks.server_readings import (
    delay_summary,
    gc_pauses,
    server_delay_buckets,
    server_late_counts,
)
from benchmarks.vendor_standin import standin_process
from rtc_server.engine_factory import EngineFactory
from tests.conftest import start_server

LOUD = (np.sin(np.arange(960) / 5) * 8000).astype(np.int16)
QUIET = np.zeros(960, np.int16)


def _reply(n: int = 50, t0: float = 10.0) -> list[tuple[float, int, np.ndarray]]:
    """``n`` loud 20 ms frames arriving on time after a second of silence."""
    lead = [(t0 + i * 0.02, i * 960, QUIET) for i in range(50)]
    return lead + [(t0 + 1 + i * 0.02, (50 + i) * 960, LOUD) for i in range(n)]


def test_a_clean_reply_has_no_hole() -> None:
    r = reply_audio(_reply(), after=10.5)
    assert r is not None and r.holes == [] and r.pauses == []
    assert r.first_loud == 11.0 and abs(r.speech_ms - 1000) < 1


def test_nothing_loud_after_the_question_is_no_reply() -> None:
    assert reply_audio(_reply(), after=20.0) is None


def test_missing_late_and_silent_frames_are_found() -> None:
    frames = _reply()
    del frames[70:75]  # 5 frames never came: 100 ms, 400 ms into the speech
    frames = [
        (a + 0.3, ts, p) if 80 * 960 <= ts < 83 * 960 else (a, ts, p) for a, ts, p in frames
    ]  # 3 frames 300 ms late: the receiver (80 ms ahead) waits 220 ms, then plays on
    frames = [(a, ts, QUIET) if 60 * 960 <= ts < 65 * 960 else (a, ts, p) for a, ts, p in frames]
    r = reply_audio(frames, after=10.5)
    assert r is not None
    missing, late = r.holes
    assert missing == Hole(400.0, 100.0, "missing")
    assert (late.at_ms, late.kind) == (600.0, "late") and abs(late.ms - 220) < 1
    assert r.pauses == [Hole(200.0, 100.0, "pause")]
    assert abs(r.speech_ms - 1220) < 1  # heard 220 ms longer


def _ref() -> Reference:
    return Reference(
        latency_ms=800.0, speech_ms=2000.0, longest_pause_ms=200.0, turn_s=5.0, clean=True
    )


def test_only_pauses_longer_than_the_reply_alone_are_holes() -> None:
    short = Hole(100.0, 200.0 + PAUSE_MARGIN_MS, "pause")
    long = Hole(900.0, 200.0 + PAUSE_MARGIN_MS + 20, "pause")
    late = Hole(50.0, 40.0, "late")
    hidden = Hole(500.0, 5.0, "late")
    answer = Answer(0.0, holes=[late, hidden], pauses=[short, long])
    assert holes(answer, _ref()) == [late, long]


def _answer(latency: float | None, failed: str | None = None) -> Answer:
    return Answer(0.0, latency_ms=latency, speech_ms=None if failed else 2050.0, failed=failed)


def _step(answers: list[Answer], interval_ms: float = 40.0) -> dict:  # type: ignore[type-arg]
    intervals = [np.full(100, interval_ms) for _ in answers]
    return summarize_step(len(answers), answers, intervals, _ref(), {"server_rss_mb": None})


def test_a_smooth_step() -> None:
    step = _step([_answer(900.0), _answer(1100.0)])
    assert step["smooth"] and step["failed_calls"] == 0 and step["audio_holes"] == 0
    assert step["frame_interval_ms"] == {"p50": 40.0, "p99": 40.0, "max": 40.0}
    assert step["latency_ms"]["n"] == 2 and step["stretch_ms"]["max"] == 50.0


def test_a_caller_without_a_reply_is_a_failed_call_not_a_dropped_one() -> None:
    step = _step([_answer(900.0), _answer(None, "no reply within 30 s")])
    assert step["failed_calls"] == 1 and not step["smooth"]
    assert step["not_smooth_because"] == ["1 call(s) failed"]
    assert len(step["callers"]) == 2 and step["callers"][1]["failed"] == "no reply within 30 s"


def test_slow_replies_and_uneven_frames_are_not_smooth() -> None:
    step = _step([_answer(1300.0)], interval_ms=70.0)
    assert step["not_smooth_because"] == [
        "frame interval p99 over 60 ms",
        "reply latency over 1200 ms",
    ]


CPU_FIGURES = ("server_cpu_idle_pct_per_call", "server_cpu_speaking_pct_per_call")


def test_the_slowest_replys_server_stages_are_kept_and_shown() -> None:
    quick = _answer(600.0)
    quick.stages = {"stt_ms": 20.0, "tts_first_audio_ms": 40.0}
    slow = _answer(1300.0)
    slow.stages = {"vad_end_ms": 380.0, "stt_ms": 450.0, "tts_first_audio_ms": 210.0}
    step = _step([quick, slow, _answer(None, "no reply within 30 s")])
    assert step["slowest_reply_stages_ms"] == slow.stages
    assert [c["stages_ms"] for c in step["callers"]] == [quick.stages, slow.stages, {}]
    step.update(dict.fromkeys(CPU_FIGURES, 10.0))
    assert "stages (ms): vad_end 380, stt 450, tts_first_audio 210\n" in step_line(step) + "\n"
    assert _step([_answer(None, "no reply")])["slowest_reply_stages_ms"] == {}


def test_frames_the_server_skipped_are_told_from_frames_that_arrived_late() -> None:
    """Arrival intervals mix in the network and the caller's machine; RTP intervals are the
    server's alone: a late frame is a long arrival interval on a 40 ms RTP step, a skipped
    one an 80 ms RTP step."""
    arrived = np.full(100, 40.0)
    arrived[10], arrived[11] = 90.0, 0.0  # one frame 50 ms late, the next on time
    sent_on_time = np.full(100, 40.0)
    sent_skipping = np.full(100, 40.0)
    sent_skipping[20] = 80.0  # one instant skipped
    sent_skipping[30] = 120.0  # two in a row
    assert skipped_frames(sent_on_time) == 0
    assert skipped_frames(sent_skipping) == 3
    late = {"held": 2, "dropped": 3}
    step = summarize_step(
        2,
        [_answer(900.0), _answer(900.0)],
        [arrived, np.full(100, 40.0)],
        _ref(),
        {"server_rss_mb": None},
        [sent_on_time, sent_skipping],
        late,
        [0.5] * 99 + [30.0],
    )
    assert step["frame_interval_ms"]["max"] == 90.0
    assert step["sent_interval_ms"] == {
        "p99": float(np.percentile(sent_skipping, 99)),
        "max": 120.0,
    }
    assert [c["frames_skipped"] for c in step["callers"]] == [0, 3]
    assert step["frames_skipped"] == 3 and step["server_frames_late"] == late
    assert step["client_loop_lag_ms"]["max"] == 30.0


def test_speaking_cpu_per_call_takes_off_the_idle_callers() -> None:
    # Two calls: one speaks from t=1 to t=3 while the server burns 0.5 core; idle calls cost
    # 0.1 core each. The speaking call: 0.5 - 0.1 (the other, idle) = 40 % of a core.
    samples = [(t / 4, 0.5 * t / 4) for t in range(17)]
    pct = speaking_cpu_pct_per_call(samples, [(1.0, 3.0)], 0.1, 2)
    assert pct is not None and abs(pct - 40.0) < 1e-6
    assert speaking_cpu_pct_per_call(samples, [], 0.1, 2) is None


def test_each_threads_cpu_per_speaking_call_and_per_call() -> None:
    # The same two calls, the 0.5 core split between the loop (0.3: 0.1 of it the idle calls')
    # and the render thread (0.2, only while the call speaks); synthesis ran before it spoke.
    samples = []
    for i in range(17):
        t = i / 4
        speaking = min(max(t - 1.0, 0.0), 2.0)
        cpu = {"event-loop": 0.2 * t + 0.1 * speaking, "warp-render": 0.2 * speaking}
        samples.append((t, {**cpu, "reply-speech": 0.4 if t > 0.5 else 0.0}))
    idle = cpu_per_call_by_thread(samples[0][1], samples[4][1], 1.0, 2)
    assert idle == {"event-loop": 10.0, "reply-speech": 20.0}
    by = speaking_cpu_by_thread(samples, [(1.0, 3.0)], {"event-loop": 10.0}, 2)
    assert by is not None
    assert abs(by["event-loop"] - 20.0) < 1e-6 and abs(by["warp-render"] - 20.0) < 1e-6
    assert set(by) == {"event-loop", "warp-render"}  # nothing else ran while it spoke
    assert cpu_per_call_by_thread(None, samples[4][1], 1.0, 2) is None


def test_usage_counts_the_children() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        u = usage(os.getpid())
        assert u.processes >= 2 and u.cpu_s > 0 and u.rss_bytes > 10 * 2**20
    finally:
        child.kill()
        child.wait()


def test_the_schema_holds_a_load_document_and_catches_a_missing_figure() -> None:
    schema = json.loads((Path(__file__).parents[1] / "benchmarks" / "schema.json").read_text())
    step = _step([_answer(900.0), _answer(None, "no reply within 30 s")])
    step.update(
        server_cpu_idle_pct_per_call=30.0,
        server_cpu_speaking_pct_per_call=45.0,
        server_cpu_turns_pct_per_call=40.0,
        client_cpu_pct_per_call=11.0,
    )
    one = {"latency_ms": 800.0, "speech_ms": 2000.0, "longest_pause_ms": 200.0, "turn_s": 5.0}
    one["clean"] = True
    results = {
        "largest_smooth_calls": 0,
        "max_calls_tried": 1,
        "turns": "staggered",
        "workers": None,
        "one_call": {**one, "turns": []},
        "rules": {},
        "steps": [step],
    }
    doc = {
        "schema": 1,
        "benchmark": "load",
        "date": "2026-12-01T00:00:00Z",
        "machine": {"cpu": "x", "cores": 2, "python": "3.11"},
        "versions": {"aiortc": "1", "av": "1", "numpy": "1"},
        "settings": {},
        "results": json.loads(json.dumps(results)),
    }
    jsonschema.validate(doc, schema)
    del doc["results"]["steps"][0]["callers"][0]["holes"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, schema)


METRICS_OF_TWO_WORKERS = """\
# HELP avatar_rtc_video_frames_late_total Frame instants the media path missed.
avatar_rtc_video_frames_late_total{reason="held"} 2.0
avatar_rtc_video_frames_late_total{reason="dropped"} 1.0
avatar_rtc_video_frames_late_total{reason="held"} 3.0
avatar_rtc_frame_send_delay_seconds_bucket{kind="video",le="0.01"} 90.0
avatar_rtc_frame_send_delay_seconds_bucket{kind="video",le="0.04"} 99.0
avatar_rtc_frame_send_delay_seconds_bucket{kind="video",le="+Inf"} 100.0
avatar_rtc_frame_send_delay_seconds_bucket{kind="audio",le="0.01"} 7.0
avatar_rtc_frame_send_delay_seconds_bucket{kind="audio",le="0.04"} 7.0
avatar_rtc_frame_send_delay_seconds_bucket{kind="audio",le="+Inf"} 7.0
avatar_rtc_frame_send_delay_seconds_bucket{kind="video",le="0.01"} 90.0
avatar_rtc_frame_send_delay_seconds_bucket{kind="video",le="0.04"} 99.0
avatar_rtc_frame_send_delay_seconds_bucket{kind="video",le="+Inf"} 100.0
"""


def test_the_servers_own_counts_are_read_from_every_workers_metrics() -> None:
    assert server_late_counts(METRICS_OF_TWO_WORKERS) == {"held": 5, "dropped": 1}
    assert server_late_counts(None) is None
    buckets = server_delay_buckets(METRICS_OF_TWO_WORKERS)
    assert buckets == {0.01: 180.0, 0.04: 198.0, float("inf"): 200.0}
    before = {0.01: 100.0, 0.04: 100.0, float("inf"): 100.0}
    # Of the 100 frames since: 80 under 10 ms, 18 more under 40, 2 later than every bound.
    assert delay_summary(before, buckets) == {"frames": 100, "p50": 10.0, "p99": None}
    assert delay_summary({}, buckets) == {"frames": 200, "p50": 10.0, "p99": 40.0}
    assert delay_summary(None, buckets) is None


def _gc_metrics(young: tuple[float, float, float], full: tuple[float, float, float]) -> str:
    """One worker's avatar_rtc_gc_pause_seconds buckets (<= 10 ms, <= 160 ms, all), by
    generation 0 and 2."""
    lines = []
    for gen, counts in (("0", young), ("2", full)):
        for bound, count in zip(("0.01", "0.16", "+Inf"), counts, strict=True):
            lines.append(
                f'avatar_rtc_gc_pause_seconds_bucket{{generation="{gen}",le="{bound}"}} {count}'
            )
    return "\n".join(lines) + "\n"


def test_the_servers_collector_pauses_over_a_step_are_counted_from_every_worker() -> None:
    before = _gc_metrics((50, 50, 50), (1, 1, 1)) + _gc_metrics((40, 40, 40), (0, 0, 0))
    # Since: worker 1 ran 10 young collections and a full one of 10-160 ms, worker 2 five.
    after = _gc_metrics((60, 60, 60), (1, 2, 2)) + _gc_metrics((45, 45, 45), (0, 0, 0))
    assert gc_pauses(before, after) == {"collections": 16, "full": 1, "longest_ms": 160.0}
    # A pause past the last bound has no bound to report.
    later = _gc_metrics((60, 60, 60), (1, 2, 3)) + _gc_metrics((45, 45, 45), (0, 0, 0))
    assert gc_pauses(after, later) == {"collections": 1, "full": 1, "longest_ms": None}
    assert gc_pauses(after, after) == {"collections": 0, "full": 0, "longest_ms": 0.0}
    assert gc_pauses(None, after) is None
    assert gc_pauses(METRICS_OF_TWO_WORKERS, METRICS_OF_TWO_WORKERS) is None, "not reported: no 0"
    step = {**_step([_answer(600.0)]), **dict.fromkeys(CPU_FIGURES, 10.0)}
    step["server_gc"] = gc_pauses(before, after)
    assert "its GC ran 16 time(s), 1 full, longest <= 160 ms" in step_line(step)


async def test_providers_are_refused_for_a_server_the_bench_did_not_spawn() -> None:
    # The stand-in is wired into the server the bench starts; a running server's providers
    # are its own, and claiming otherwise would mislabel every figure.
    with pytest.raises(ValueError, match="not on one at --url"):
        await _measure(Settings(url="http://127.0.0.1:9", providers="cloud"))
    with pytest.raises(ValueError, match="providers is one of"):
        await _measure(Settings(providers="gpu"))


async def test_a_call_the_server_refuses_ends_the_run_and_is_reported(
    engine_factory: EngineFactory, cache_dir: Path
) -> None:
    # Admission on, with a budget no second call fits in: the first call is always taken.
    server, runner = await start_server(engine_factory, cache_dir, headroom=True, cpu_limit=0.01)
    try:
        settings = Settings(url=server.url, max_calls=3, baseline_turns=1, idle_s=1.0)
        r = await _measure(settings)
    finally:
        await runner.cleanup()
    assert r["refused"]["calls"] == 2 and r["refused"]["status"] == 503, r["refused"]
    assert r["refused"]["code"] == "at_capacity" and "no room" in r["refused"]["message"]
    assert [step["calls"] for step in r["steps"]] == [1]
    assert r["max_calls_tried"] == 1
    assert not server.manager.sessions, "the refused caller and the others were closed"
    schema = json.loads((Path(__file__).parents[1] / "benchmarks" / "schema.json").read_text())
    load = {"$schema": schema["$schema"], "$defs": schema["$defs"], "$ref": "#/$defs/load"}
    jsonschema.validate(json.loads(json.dumps(r, default=float)), load)


async def test_a_stand_in_that_dies_is_reported_not_hidden() -> None:
    # Killed mid-run, the stand-in prints no summary: the run's record says so (a violation),
    # instead of an empty count that would read as "nothing went wrong".
    speech = np.zeros(2400, np.int16)
    async with standin_process(transcript="hi", reply="Hello.", speech=speech, delay_s=0) as s:
        os.kill(s.pid, 9)
    assert s.served["requests"] == {}
    assert "without its summary" in s.served["violations"][0]
    async with standin_process(transcript="hi", reply="Hello.", speech=speech, delay_s=0) as s:
        pass
    assert s.served == {"requests": {}, "violations": [], "hangups": 0}
