"""Each bench subcommand runs small and writes its JSON document."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from benchmarks.cli import main

SCHEMA = json.loads((Path(__file__).parents[1] / "benchmarks" / "schema.json").read_text())


def _run(tmp_path: Path, *argv: str) -> dict:  # type: ignore[type-arg]
    out = tmp_path / "out.json"
    png = tmp_path / "out.png"
    assert main([*argv, "--json", str(out), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    doc = json.loads(out.read_text())
    jsonschema.validate(doc, SCHEMA)
    assert doc["schema"] == 1 and doc["benchmark"] == argv[0]
    assert {"cpu", "cores", "python"} <= set(doc["machine"])
    assert {"aiortc", "av"} <= set(doc["versions"])
    return doc["results"]  # type: ignore[no-any-return]


def test_bench_encode(tmp_path: Path) -> None:
    results = _run(tmp_path, "encode", "--frames", "30", "--rounds", "1")
    names = [r["codec"] for r in results]
    assert names[:4] == ["h264-ours", "h264-ours-i420", "h264-aiortc-default", "vp8-aiortc-default"]
    assert names[4].startswith("jpeg-q")
    jpeg = results[4]
    # Frames made in I420 (the warp engine's) lose nothing against libswscale's conversion.
    assert results[1]["psnr_db"] >= results[0]["psnr_db"] - 0.1
    assert jpeg["psnr_db"] >= results[0]["psnr_db"] - 0.5  # equal quality, at least
    assert jpeg["bandwidth_vs_h264_ours"] > 1  # per-frame JPEG costs more than video
    for r in results:
        assert 0.5 < r["ssim"] <= 1
        assert r["frames"] == 30 and r["kbps"] > 0 and r["cpu_ms"]["p50"] > 0
        assert 25 < r["psnr_db"] < 99  # decoded frames really compared with the source


def test_bench_encode_compares_the_framings(tmp_path: Path) -> None:
    results = _run(tmp_path, "encode", "--frames", "30", "--rounds", "1", "--framing", "both")
    rows = {(r["framing"], r["codec"]): r for r in results}
    assert set(rows) == {(f, c) for f in ("full", "head") for c in ("h264-ours", "h264-ours-i420")}
    for (framing, _), r in rows.items():
        assert r["size"] == "512x512" and r["frames"] == 30 and r["kbps"] > 0
        assert 25 < r["psnr_db"] < 99
        # Measured by a face mesh in the encoded clip's own frames.
        assert (1 / 3 <= r["face_fraction"] <= 1 / 2) == (framing == "head"), r


def test_bench_engine(tmp_path: Path) -> None:
    r = _run(tmp_path, "engine", "--frames", "20")
    assert r["engine"] == "warp" and r["speaking_ms"]["n"] == 20 and r["idle_ms"]["n"] == 20
    # The first frames of the paragraph are new mouths: drawn, not reused.
    assert r["mouths"]["drawn"] >= 5
    marks = r["landmarks"]
    assert marks["video_frame_ms"] > 0
    assert {"n", "p50"} <= set(marks["picture_ms"]["built-in 512x512"])


def test_gpu_check_script_runs_without_the_media_stack(tmp_path: Path) -> None:
    """benchmarks/gpu_check.sh on CPU with tiny weights, in an interpreter where PyAV, aiortc
    and Piper cannot be imported (as on the bare GPU image): its figures come back."""
    import asyncio
    import os
    import subprocess
    import sys

    from benchmarks.clip import speech_pcm
    from benchmarks.gpu_kit import write_speech_wav

    kit = tmp_path / "kit"
    kit.mkdir()
    pcm = asyncio.run(speech_pcm("The quick brown fox jumps over the lazy dog."))
    write_speech_wav(kit / "speech.wav", pcm)
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import sys\n"
        "for name in ('av', 'aiortc', 'aioice', 'piper'):\n"
        "    sys.modules[name] = None\n"
    )
    out = tmp_path / "out"
    env = os.environ | {
        "KIT": str(kit),
        "OUT": str(out),
        "PYTHON": sys.executable,
        "PYTHONPATH": str(blocker),
        "DEVICE": "cpu",
        "SIZE": "tiny",
        "BATCHES": "1,2",
        "ROUNDS": "1",
        "COMPILE": "0",
    }
    script = Path(__file__).parents[1] / "benchmarks" / "gpu_check.sh"
    done = subprocess.run(
        ["bash", str(script)],
        env=env,
        cwd=script.parents[1],
        capture_output=True,
        text=True,
        timeout=240,
    )
    log = (out / "log.txt").read_text() if (out / "log.txt").exists() else done.stdout
    assert done.returncode == 0, log + done.stderr
    doc = json.loads((out / "musetalk-eager.json").read_text())
    jsonschema.validate(doc, SCHEMA)
    assert doc["versions"]["av"] == doc["versions"]["aiortc"] == "not installed"
    r = doc["results"]
    assert [b["batch"] for b in r["batches"]] == [1, 2] and r["compiled"] is False
    assert r["first_frame_ms"]["n"] >= 1 and r["placement"].startswith("cpu")
    assert not (out / "musetalk-compiled.json").exists()


def test_bench_engine_musetalk_with_tiny_random_weights(tmp_path: Path) -> None:
    r = _run(
        tmp_path,
        "engine",
        "--engine",
        "musetalk",
        "--device",
        "cpu",
        "--batch-sizes",
        "1,2",
        "--rounds",
        "1",
        "--blend-size",
        "640x360",
    )
    assert r["engine"] == "musetalk" and r["weights"] == "random-tiny"
    assert r["placement"] == "cpu float32" and r["gpu_memory"] is None
    assert [b["batch"] for b in r["batches"]] == [1, 2]
    for b in r["batches"]:
        assert b["fps"] > 0 and b["step_ms"]["n"] == 1
        assert all(b["stages_ms"][k] > 0 for k in ("features", "unet", "vae", "blend"))
    assert r["first_frame_ms"]["n"] == 3
    blend = r["blend_ms"]
    assert 0 < blend["crop_ms"] < blend["full_frame_ms"]


def test_bench_vad(tmp_path: Path) -> None:
    r = _run(tmp_path, "vad", "--seconds", "3")
    assert r["chunks"] == 93 and r["cost_ms"]["p50"] > 0


def test_bench_visemes(tmp_path: Path) -> None:
    r = _run(tmp_path, "visemes", "--repeats", "1")
    timing, stream = r["timing"], r["stream"]
    assert timing["voice_has_timing"] and timing["phonemes_per_s"] > 5
    assert timing["plain_cpu_ms_per_s"] > 0 and timing["timed_cpu_ms_per_s"] > 0
    assert stream["with_stream_cpu_ms_per_s"] > stream["scheduler_cpu_ms_per_s"] > 0
    estimate = r["estimate"]
    assert estimate["lip_phonemes"] >= 40 and 0 <= estimate["found"] <= 1
    assert estimate["cpu_ms_per_s"] > 0


def test_bench_call(tmp_path: Path) -> None:
    r = _run(tmp_path, "call", "--says", "1")
    assert r["receiver_fps"] > 20
    assert len(r["lipsync"]) == 1 and r["lipsync"][0]["correlation"] > 0.3


def test_bench_latency(tmp_path: Path) -> None:
    r = _run(tmp_path, "latency", "--turns", "1")
    assert r["turns"] == 1 and r["client_first_audio_ms"]["n"] == 1
    assert r["client_first_speaking_frame_ms"]["n"] == 1
    assert "first_audio_out_ms" in r["server_stages_ms"]


def test_bench_conversation(tmp_path: Path) -> None:
    r = _run(tmp_path, "conversation", "--turns", "1", "--service-delay-ms", "300")
    assert r["standin_violations"] == []
    modes = r["modes"]
    assert set(modes) == {"pipeline", "openai-realtime"}
    assert modes["pipeline"]["service_ms"] == 600 and modes["openai-realtime"]["service_ms"] == 300
    for m in modes.values():
        assert m["turns"] == 1 and m["unanswered"] == 0
        # No reply can come before the services answered and the VAD heard the silence out
        # (its hang-over, counted from its own estimate of the end of speech). The figure
        # counts from when the caller sent its last voiced frame; when the caller sent it late
        # (its loop stalled on a busy machine), the silence after it went out faster by that
        # much, and so could the reply.
        (turn,) = m["raw"]
        assert turn["mic_lag_ms"] is not None and turn["mic_lag_ms"] >= 0
        earliest = m["service_ms"] + 0.8 * r["vad_hangover_ms"]
        assert turn["client_first_audio_ms"] + turn["mic_lag_ms"] > earliest, turn
        assert "first_audio_out_ms" in m["server_stages_ms"]


@pytest.mark.browser
def test_bench_browser(tmp_path: Path) -> None:
    from benchmarks.browser import chromium_missing

    if chromium_missing():
        pytest.skip(chromium_missing() or "")
    r = _run(tmp_path, "browser", "--says", "1")
    # A moving picture, not its speed (25 fps on an idle machine; the bench reports it).
    assert r["codec"] == "video/H264" and r["decoded_fps"] > 10
    assert len(r["av_offset_per_say_ms"]) == 1 and r["connect_to_first_frame_ms"] > 0


def test_bench_load(tmp_path: Path) -> None:
    # One light call against a spawned server, with a known hole put into its reply: the
    # figures are there, the hole is found and the step is not smooth. No speed claim.
    r = _run(
        tmp_path,
        "load",
        "--max-calls",
        "1",
        "--baseline-turns",
        "1",
        "--idle-s",
        "2",
        "--inject-hole-ms",
        "400",
    )
    one = r["one_call"]
    assert one["latency_ms"] > 0 and one["speech_ms"] > 1000 and one["turn_s"] > 1
    assert r["turns"] == "simultaneous" and r["max_calls_tried"] == 1
    step = r["steps"][0]
    assert step["calls"] == 1 and step["failed_calls"] == 0 and step["latency_ms"]["n"] == 1
    (caller,) = step["callers"]
    assert caller["failed"] is None and caller["latency_ms"] > 0
    assert caller["stretch_ms"] is not None
    # Frames counted by RTP arrival, not decoded: 25 fps pacing.
    assert caller["frame_interval_ms"]["n"] > 50
    assert 30 < step["frame_interval_ms"]["p50"] < 50
    assert sum(h["ms"] for h in caller["holes"]) >= 300
    assert step["audio_holes"] >= 1 and not step["smooth"]
    assert any("audio hole" in why for why in step["not_smooth_because"])
    assert r["largest_smooth_calls"] == 0
    assert step["server_cpu_idle_pct_per_call"] > 0
    assert step["server_cpu_speaking_pct_per_call"] > 0
    assert step["server_cpu_turns_pct_per_call"] > 0
    assert step["server_rss_mb"] > 50 and step["client_cpu_pct_per_call"] > 0
    # Where the server's CPU went, by the OS names of its threads: the loop, the encoders on
    # its default executor, the render thread, synthesis and transcription in the turns.
    by_thread = step["server_cpu_by_thread_pct_per_call"]
    turns = by_thread["turns"]
    for part in ("event-loop", "media-encode", "warp-render", "reply-speech", "stt"):
        assert turns.get(part, 0) > 0, (part, by_thread)
    assert by_thread["idle"]["event-loop"] > 0, by_thread
    # While the reply played: its frames drawn and encoded.
    for part in ("event-loop", "media-encode", "warp-render"):
        assert by_thread["speaking"].get(part, 0) > 0, (part, by_thread)
    assert sum(turns.values()) > 0.5 * step["server_cpu_turns_pct_per_call"], by_thread
    # The server's own count of its frames' lateness covers the step (idle and reply):
    # every frame sent, at 4 fps idle and 25 while speaking.
    delay = step["server_video_delay_ms"]
    assert delay["frames"] >= caller["frame_interval_ms"]["n"] and delay["p50"] is not None
    audio = step["server_audio_delay_ms"]  # 50 frames a second, idle or not
    assert audio["frames"] >= 40 * 2 and audio["p50"] is not None


def test_bench_load_cloud_providers(tmp_path: Path) -> None:
    # The server's STT, LLM and TTS are OpenAI's, played by the vendor stand-in in a process of
    # its own: the replies come from it (counted by the stand-in itself), the caller hears its
    # speech, and the stand-in's CPU is read apart from the server's.
    r = _run(tmp_path, "load", "--providers", "cloud", "--max-calls", "1", "--baseline-turns", "1")
    assert r["providers"] == "cloud"
    served = r["stand_in"]
    assert served["violations"] == [] and served["service_ms"] == 100
    # The one call alone, then the step: a transcription, a reply and its speech each.
    for route in ("transcriptions", "chat", "speech"):
        assert served["requests"].get(route, 0) >= 2, served
    one = r["one_call"]
    assert one["clean"] and one["speech_ms"] > 2000  # the stand-in's whole sentence
    (step,) = r["steps"]
    assert step["failed_calls"] == 0 and step["audio_holes"] == 0
    assert step["standin_cpu_pct"] is not None and step["standin_cpu_pct"] > 0
    speaking = step["server_cpu_by_thread_pct_per_call"]["speaking"]
    for part in ("event-loop", "media-encode", "warp-render"):
        assert speaking.get(part, 0) > 0, (part, speaking)


def test_bench_synthesis(tmp_path: Path) -> None:
    # Replies beginning together on the server's pool and on a first-come pool: every reply
    # is counted, torn or not. No speed claim.
    out = tmp_path / "out.json"
    assert main(["synthesis", "--replies", "3", "--rounds", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    jsonschema.validate(doc, SCHEMA)
    runs = doc["results"]["runs"]
    assert [(r["replies"], r["pool"]) for r in runs] == [(3, "deadline"), (3, "first-come")]
    for r in runs:
        assert r["of"] == 3 and 0 <= r["torn"] <= 3 and len(r["replies_ms"]) == 3
        assert r["torn"] == sum(1 for x in r["replies_ms"] if x["gap_ms"] > 0)
        assert all(x["first_audio_ms"] > 0 for x in r["replies_ms"])


def test_bench_prompt(tmp_path: Path) -> None:
    # Every question is asked of the local model and its answer kept; the counts are the
    # answers'. "A reply that says it cannot know" is a word list: checked on its own.
    from benchmarks.prompt_check import HELD_OUT, PLAIN, TUNED, declines, summary

    assert declines("Sorry, I can't know today's weather.")
    assert declines("I have no clock, so I cannot tell the time.")
    assert not declines("The capital of Italy is Rome.")
    out = tmp_path / "out.json"
    assert main(["prompt", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    jsonschema.validate(doc, SCHEMA)
    results = doc["results"]
    answers = results["answers"]
    assert [a["question"] for a in answers] == [*TUNED, *HELD_OUT, *(q for q, _ in PLAIN)]
    assert all(a["answer"] for a in answers)
    assert {k: results[k] for k in summary(answers)} == summary(answers)
    paris = next(a for a in answers if "France" in a["question"])
    assert "paris" in paris["answer"].lower(), paris


def test_bench_stt(tmp_path: Path) -> None:
    # Each voice's clips go through the server's recognizer; the errors are counted word by
    # word against what was said. No accuracy or speed claim: those are the bench's figures.
    from benchmarks.stt_check import QUESTIONS, VOICES, word_errors

    assert word_errors("What is seven times eight?", "What is 7 times 8?") == (0, 5)
    assert word_errors("What colour is the sky?", "What color is this guy") == (2, 5)
    assert word_errors("Where is the Eiffel Tower?", "Where's the Eiffel Tower?") == (2, 5)
    assert word_errors("a b c", "") == (3, 3)
    out = tmp_path / "out.json"
    assert main(["stt", "--questions", "2", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    jsonschema.validate(doc, SCHEMA)
    rows = doc["results"]["rows"]
    assert [r["voice"] for r in rows] == list(VOICES)
    words = sum(word_errors(q, q)[1] for q in QUESTIONS[:2])
    for r in rows:
        assert r["words"] == words and 0 <= r["word_errors"] <= 2 * words
        assert r["wer_pct"] == pytest.approx(100 * r["word_errors"] / words)
        assert r["cpu_ms_per_question"] > 0
        assert len(r["misheard"]) <= 2
        assert all(word_errors(m["said"], m["heard"])[0] for m in r["misheard"])
