"""``avatar-rtc bench``: encode, engine and call benchmarks; tables on stdout, --json for files."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import prompt_check, stt_check, synthesis, turn_taking
from benchmarks.report import table, write_json


def _encode(args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    from benchmarks import encode
    from benchmarks.clip import engine_factory, render_clip_sync

    if args.framing == "both":  # our H.264 on the whole and the framed avatar, side by side
        return encode.framings_command(args.frames, args.rounds)
    clip = render_clip_sync(args.frames, factory=engine_factory(framing=args.framing))
    results = encode.run(clip, rounds=args.rounds)
    print(
        table(
            [
                "codec",
                "frames",
                "CPU ms p50",
                "CPU ms p95",
                "wall ms p50",
                "kbps",
                "PSNR dB",
                "SSIM",
            ],
            [
                [
                    r["codec"],
                    r["frames"],
                    r["cpu_ms"]["p50"],
                    r["cpu_ms"]["p95"],
                    r["wall_ms_p50"],
                    r["kbps"],
                    r["psnr_db"],
                    r["ssim"],
                ]
                for r in results
            ],
        )
    )
    jpeg = results[-1]
    print(
        f"{jpeg['codec']} matches h264-ours' PSNR at {jpeg['bandwidth_vs_h264_ours']:.1f}x "
        "its bandwidth"
    )
    return {"frames": args.frames, "rounds": args.rounds, "framing": args.framing}, results


def _engine(args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    if args.engine == "musetalk":
        return _musetalk(args)
    from benchmarks import engine

    r = engine.run(args.frames, framing=args.framing)
    print(
        table(
            [
                "engine",
                "size",
                "speaking wall ms p50",
                "p95",
                "speaking CPU ms/frame",
                "idle wall ms p50",
                "idle CPU ms/frame",
                "first frame ms",
                "mouths reused / drawn",
            ],
            [
                [
                    r["engine"],
                    "x".join(map(str, r["frame_size"])),
                    r["speaking_ms"]["p50"],
                    r["speaking_ms"]["p95"],
                    r["speaking_cpu_ms_per_frame"],
                    r["idle_ms"]["p50"],
                    r["idle_cpu_ms_per_frame"],
                    r["first_frame_ms"],
                    "-" if r["mouths"] is None else "{reused} / {drawn}".format(**r["mouths"]),
                ]
            ],
        )
    )
    marks = r["landmarks"]
    print(
        table(
            ["face mesh", "ms p50", "ms max"],
            [[f"picture {k}", v["p50"], v["max"]] for k, v in marks["picture_ms"].items()]
            + [["video frame, tracked", marks["video_frame_ms"], marks["video_frame_ms"]]],
        )
    )
    return {"frames": args.frames, "framing": args.framing}, r


def _read_speech(path: Path) -> Any:
    """A mono 16-bit 48 kHz WAV file as int16 samples (what ``--speech-wav`` takes)."""
    import wave

    import numpy as np

    with wave.open(str(path), "rb") as w:
        if (w.getnchannels(), w.getsampwidth(), w.getframerate()) != (1, 2, 48_000):
            raise SystemExit(f"{path}: --speech-wav takes mono 16-bit 48 kHz WAV")
        return np.frombuffer(w.readframes(w.getnframes()), np.int16).copy()


def _musetalk(args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    from benchmarks import musetalk

    sizes = tuple(int(b) for b in args.batch_sizes.split(","))
    w, h = (int(v) for v in args.blend_size.split("x"))
    r = musetalk.run(
        weights_dir=args.weights_dir,
        random=args.random,
        device=args.device,
        batch_sizes=sizes,
        rounds=args.rounds,
        compile_models=args.compile,
        blend_size=(w, h),
        speech=None if args.speech_wav is None else _read_speech(args.speech_wav),
    )
    print(f"MuseTalk ({r['weights']}) on {r['placement']} ({r['device_name']})")
    print(
        table(
            ["batch", "fps", "ms/frame", "CPU ms/frame", "features", "UNet", "VAE", "blend"],
            [
                [
                    b["batch"],
                    b["fps"],
                    b["ms_per_frame"],
                    b["cpu_ms_per_frame"],
                    *(b["stages_ms"][k] for k in ("features", "unet", "vae", "blend")),
                ]
                for b in r["batches"]
            ],
        )
    )
    blend = r["blend_ms"]
    print(
        f"first frame: p50 {r['first_frame_ms']['p50']:.0f} ms; blend on {args.blend_size}: "
        f"crop only {blend['crop_ms']:.2f} ms, full frame {blend['full_frame_ms']:.2f} ms"
        + (f", torch {blend['torch_ms']:.2f} ms" if "torch_ms" in blend else "")
    )
    if r["gpu_memory"]:
        print(f"GPU memory: peak {r['gpu_memory']['peak_allocated_mib']} MiB allocated")
    settings = {
        k: getattr(args, k)
        for k in ("engine", "random", "device", "batch_sizes", "rounds", "compile", "blend_size")
    }
    settings["weights_dir"] = str(args.weights_dir) if args.weights_dir else None
    return settings, r


def _call(args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    from benchmarks import call

    r = call.run(args.says, args.url)
    rows = [
        ["connect -> first frame (ms)", r["connect_to_first_frame_ms"]],
        ["receiver fps", r["receiver_fps"]],
        ["frame interval p50 (ms)", r["frame_interval_ms"]["p50"]],
        ["frame interval p99 (ms)", r["frame_interval_ms"]["p99"]],
        ["frame interval max (ms)", r["frame_interval_ms"]["max"]],
    ]
    if r["lipsync"]:
        rows += [
            ["lip-sync offset p50 (ms)", r["lipsync_offset_ms"]["p50"]],
            ["lip-sync offset p95 (ms)", r["lipsync_offset_ms"]["p95"]],
            ["lip-sync correlation min", min(o["correlation"] for o in r["lipsync"])],
        ]
    print(table(["measure", "value"], rows))
    return {"says": args.says, "url": args.url}, r


def _latency(args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    from benchmarks import latency

    r = latency.run(args.turns, args.calls, args.barge_ins, args.url, args.spawn, args.llm)
    rows = [
        [
            "client: end of speech -> first reply audio",
            r["client_first_audio_ms"].get("p50", float("nan")),
            r["client_first_audio_ms"].get("p95", float("nan")),
            r["client_first_audio_ms"]["n"],
        ]
    ]
    frame = r["client_first_speaking_frame_ms"]
    if frame["n"]:
        rows.append(
            [
                "client: end of speech -> first speaking frame",
                frame["p50"],
                frame["p95"],
                frame["n"],
            ]
        )
    for stage, s in r["server_stages_ms"].items():
        rows.append([f"server: {stage}", s["p50"], s["p95"], s["n"]])
    if r["barge_in_ms"]["n"]:
        rows.append(
            [
                "barge-in: speech onset -> reply silent",
                r["barge_in_ms"]["p50"],
                r["barge_in_ms"]["p95"],
                r["barge_in_ms"]["n"],
            ]
        )
    print(f"{r['calls']} call(s), {r['turns']} turns")
    print(table(["measure (ms)", "p50", "p95", "n"], rows))
    settings = {"turns": args.turns, "calls": args.calls, "barge_ins": args.barge_ins}
    return {**settings, "spawn": args.spawn, "url": args.url, "llm": args.llm}, r


def _conversation(args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    from benchmarks import conversation

    r = conversation.run(args.turns, args.service_delay_ms, args.hangover_ms)
    print(
        f"every service answers after {r['delay_ms']:.0f} ms; "
        "ours = first audio - service - hang-over"
    )
    print(table(conversation.HEADERS, conversation.rows(r)))
    if r["standin_violations"]:
        print("stand-in violations:", *r["standin_violations"], sep="\n  ")
    settings = {"turns": args.turns, "service_delay_ms": args.service_delay_ms}
    return {**settings, "hangover_ms": r["vad_hangover_ms"]}, r


def _vad(args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    from benchmarks import vad

    r = vad.run(args.seconds)
    c = r["cost_ms"]
    print(
        table(
            ["chunks", "chunk ms", "cost ms p50", "p95", "max", "share of real time"],
            [
                [
                    r["chunks"],
                    r["chunk_ms"],
                    c["p50"],
                    c["p95"],
                    c["max"],
                    f"{r['real_time_share'] * 100:.2f} %",
                ]
            ],
        )
    )
    return {"seconds": args.seconds}, r


def _visemes(args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    from benchmarks import visemes

    r = visemes.run(args.repeats)
    print(visemes.table(r))
    return {"repeats": args.repeats}, r


def _browser(args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    from benchmarks import browser_call

    box = tuple(int(v) for v in args.mouth_box.split(",")) if args.mouth_box else None
    if box is not None and len(box) != 4:
        raise SystemExit("--mouth-box is x,y,w,h")
    r = browser_call.run(args.says, args.url, box)
    o = r["av_offset_ms"]
    print(
        table(
            ["measure", "value"],
            [
                ["connect -> first frame shown (ms)", r["connect_to_first_frame_ms"]],
                ["decoded fps while speaking", r["decoded_fps"]],
                ["codec / decoder", f"{r['codec']} / {r['decoder']}"],
                ["A/V offset per say p50 (ms, + = audio later)", o["p50"]],
                ["A/V offset per say p95 (ms)", o["p95"]],
                ["A/V offset per say min (ms)", min(r["av_offset_per_say_ms"])],
                ["A/V offset per say max (ms)", o["max"]],
                ["correlation per say, min", min(r["correlation_per_say"])],
            ],
        )
    )
    return {"says": args.says}, r


def _sync(args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    if args.lipsync:
        # The avatar itself: mouth motion against the audio envelope's change, per say.
        settings, r = _call(argparse.Namespace(says=args.says, url=args.url))
        return {**settings, "lipsync": True}, r
    if args.browser and args.fresh_calls:
        from benchmarks import browser_call

        modes: tuple[str, ...] = ("default",)
        modes += ("sent reports",) if args.compare_sender_reports else ()
        modes += ("audio with the video",) if args.compare_audio_start else ()
        modes += ("video sent at its instant",) if args.compare_video_send_delay else ()
        f = browser_call.run_first_seconds(args.fresh_calls, round(args.seconds), modes)
        print("offset in Chromium at each flash from the first frame (ms, + = video later)")
        print(table(*browser_call.first_seconds_table(f)))
        print(table(*browser_call.first_seconds_summary_table(f)))
        settings = {"seconds": args.seconds, "browser": True, "fresh_calls": args.fresh_calls}
        return {**settings, "servers": list(modes)}, f
    if args.browser:
        from benchmarks import browser_call

        b = browser_call.run_sync(args.seconds, args.video_delay_ms)
        print(
            table(
                ["injected video delay ms", "offset in Chromium ms (+ = video later)", "corr"],
                [[b["injected_video_delay_ms"], b["offset_ms"], b["correlation"]]],
            )
        )
        settings = {"seconds": args.seconds, "video_delay_ms": args.video_delay_ms}
        return {**settings, "browser": True}, b
    from benchmarks import sync

    r = sync.run(args.seconds, args.video_delay_ms, args.url)
    o = r["offset_ms"]
    print(
        table(
            ["injected video delay ms", "flashes", "offset ms p50", "p95", "min", "max", "by SR"],
            [
                [
                    r["injected_video_delay_ms"],
                    r["flashes"],
                    o.get("p50", float("nan")),
                    o.get("p95", float("nan")),
                    min(r["offsets_ms"] or [float("nan")]),
                    o.get("max", float("nan")),
                    r["reported_offset_ms"].get("p50", float("nan")),
                ]
            ],
        )
    )
    return {"seconds": args.seconds, "video_delay_ms": args.video_delay_ms}, r


def _load(args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    from benchmarks import load

    settings = load.Settings(
        max_calls=args.max_calls,
        turns=args.turns,
        workers=args.workers,
        headroom=args.headroom,
        url=args.url,
        server_pid=args.server_pid,
        idle_s=args.idle_s,
        reply_timeout_s=args.reply_timeout_s,
        baseline_turns=args.baseline_turns,
        keep_going=args.keep_going,
        inject_hole_ms=args.inject_hole_ms,
        providers=args.providers,
        service_ms=args.service_ms,
    )
    r = load.run(settings)

    def cell(v: float | None) -> float | str:
        return "-" if v is None else float(v)

    rows = [
        [
            s["calls"],
            s["failed_calls"],
            cell(s["frame_interval_ms"]["p50"]),
            cell(s["frame_interval_ms"]["p99"]),
            cell(s["frame_interval_ms"]["max"]),
            s["audio_holes"],
            cell(s["stretch_ms"].get("max")),
            cell(s["latency_ms"].get("p50")),
            cell(s["latency_ms"].get("max")),
            cell(s["server_cpu_idle_pct_per_call"]),
            cell(s["server_cpu_speaking_pct_per_call"]),
            cell(s["server_rss_mb"]),
            cell(s["client_cpu_pct_per_call"]),
            "yes" if s["smooth"] else "no",
        ]
        for s in r["steps"]
    ]
    one = r["one_call"]
    print(
        f"turns {r['turns']}, workers {r['workers'] or 'default'}, "
        f"providers {r['providers'] or 'of the server at --url'}; "
        f"one call alone: reply "
        f"{one['latency_ms']:.0f} ms, speech {one['speech_ms']:.0f} ms"
    )
    print(
        table(
            [
                "calls",
                "failed",
                "interval p50 ms",
                "p99",
                "max",
                "holes",
                "stretch max ms",
                "reply p50 ms",
                "reply max",
                "srv CPU/call idle %",
                "speaking %",
                "srv RSS MB",
                "client CPU/call %",
                "smooth",
            ],
            rows,
        )
    )
    if not one["clean"]:
        print("the reply alone already had holes: the machine is busy, the reference is off")
    for s in r["steps"]:
        if not s["smooth"]:
            print(f"{s['calls']} call(s) not smooth: {'; '.join(s['not_smooth_because'])}")
    if r.get("refused"):
        x = r["refused"]
        why = f"({x['status']} {x['code']}): {x['message']}"
        print(f"call {x['calls']} refused by the server {why}")
    if "stand_in" in r:
        served = r["stand_in"]
        print(
            f"cloud stand-in ({served['service_ms']:.0f} ms a request) served: "
            + ", ".join(f"{route} {n}" for route, n in sorted(served["requests"].items()))
        )
        if served["violations"]:
            print("stand-in violations:", *served["violations"], sep="\n  ")
    print(f"largest smooth: {r['largest_smooth_calls']} call(s)")
    return {
        "max_calls": args.max_calls,
        "providers": args.providers,
        "service_ms": args.service_ms,
        "turns": args.turns,
        "workers": args.workers,
        "url": args.url,
        "idle_s": args.idle_s,
        "reply_timeout_s": args.reply_timeout_s,
        "baseline_turns": args.baseline_turns,
        "keep_going": args.keep_going,
        "inject_hole_ms": args.inject_hole_ms,
    }, r


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="avatar-rtc bench", description=__doc__)
    sub = parser.add_subparsers(dest="bench", required=True)
    enc = sub.add_parser("encode", help="H.264 (ours vs aiortc's defaults) and VP8 on one clip")
    enc.add_argument("--frames", type=int, default=500, help="20 s: 10 s speaking, then idle")
    enc.add_argument("--rounds", type=int, default=3)
    enc.add_argument("--framing", choices=("head", "full", "both"), default="head")
    eng = sub.add_parser("engine", help="lip-sync engine cost per frame")
    eng.add_argument("--frames", type=int, default=300)
    eng.add_argument("--engine", choices=("warp", "musetalk"), default="warp")
    eng.add_argument("--framing", choices=("head", "full"), default="head", help="warp: the avatar")
    eng.add_argument(
        "--weights-dir", type=Path, default=None, help="musetalk: the weights (else random)"
    )
    eng.add_argument(
        "--random",
        choices=("tiny", "full"),
        default="tiny",
        help="musetalk without --weights-dir: random weights, tiny or the real architecture",
    )
    eng.add_argument("--device", default="auto", help="musetalk: auto, cuda, cuda:N or cpu")
    eng.add_argument("--batch-sizes", default="1,4,8,16", help="musetalk: comma-separated")
    eng.add_argument("--rounds", type=int, default=3, help="musetalk: timed steps per batch")
    eng.add_argument("--compile", action="store_true", help="musetalk: torch.compile")
    eng.add_argument("--blend-size", default="1280x720", help="musetalk: blend benchmark frame")
    eng.add_argument(
        "--speech-wav",
        type=Path,
        default=None,
        help="musetalk: mono 16-bit 48 kHz speech to drive it (default: the Piper voice)",
    )
    cal = sub.add_parser("call", help="a call from an aiortc client: fps, intervals, lip-sync")
    cal.add_argument("--says", type=int, default=5)
    cal.add_argument("--url", default=None, help="a running server (default: in-process)")
    lat = sub.add_parser("latency", help="spoken questions: time to first reply audio")
    lat.add_argument("--turns", type=int, default=10, help="turns per call")
    lat.add_argument("--calls", type=int, default=1, help="calls talking at once")
    lat.add_argument("--barge-ins", type=int, default=0, help="barge-in rounds after the turns")
    lat.add_argument("--url", default=None, help="a running server (default: in-process)")
    lat.add_argument(
        "--spawn",
        action="store_true",
        help="run the server in its own process (no shared event loop with the callers)",
    )
    lat.add_argument(
        "--llm",
        choices=("echo", "local"),
        default="echo",
        help="the started server's LLM: the deterministic echo, or the local model",
    )
    con = sub.add_parser(
        "conversation",
        help="end of speech -> first reply audio: speech-to-speech vs STT -> LLM -> TTS",
    )
    con.add_argument("--turns", type=int, default=10, help="turns per mode")
    con.add_argument(
        "--service-delay-ms", type=float, default=200.0, help="every stand-in service's time"
    )
    con.add_argument(
        "--hangover-ms", type=int, default=None, help="the VAD's hang-over (default: serve's)"
    )
    vad = sub.add_parser("vad", help="Silero VAD cost per 32 ms chunk")
    vad.add_argument("--seconds", type=float, default=30.0)
    vis = sub.add_parser("visemes", help="what phoneme timing, estimates and the stream cost")
    vis.add_argument("--repeats", type=int, default=3, help="times the paragraph is spoken")
    brw = sub.add_parser("browser", help="a call in Chromium: first frame, fps, A/V offset")
    brw.add_argument("--says", type=int, default=5)
    brw.add_argument("--mouth-box", default=None, help="x,y,w,h of the mouth, with --url")
    syn = sub.add_parser("sync", help="exact A/V offset of a call with the sync-test engine")
    syn.add_argument("--seconds", type=float, default=6.0)
    syn.add_argument(
        "--video-delay-ms",
        type=float,
        default=0.0,
        help="make the engine's video this much late, to check the measurement",
    )
    syn.add_argument(
        "--lipsync",
        action="store_true",
        help="measure the avatar's lip-sync by cross-correlation instead (as bench call)",
    )
    syn.add_argument("--says", type=int, default=5, help="with --lipsync")
    syn.add_argument(
        "--fresh-calls",
        type=int,
        default=0,
        help="with --browser: this many new calls, the offset of each of their first --seconds",
    )
    syn.add_argument(
        "--compare-sender-reports",
        action="store_true",
        help="with --fresh-calls: as many calls again with aiortc's own sender reports",
    )
    syn.add_argument(
        "--compare-audio-start",
        action="store_true",
        help="with --fresh-calls: as many calls again with the audio started with the video "
        "(the default starts it 0.6 s later)",
    )
    syn.add_argument(
        "--compare-video-send-delay",
        action="store_true",
        help="with --fresh-calls: as many calls again with each video frame sent at its "
        "instant (the default sends it 25 ms after: MediaSettings.video_send_delay_s)",
    )
    syn.add_argument(
        "--browser",
        action="store_true",
        help="measure in Chromium (what a viewer sees and hears) instead of an aiortc caller",
    )
    lod = sub.add_parser("load", help="add light calls until a step is no longer smooth")
    lod.add_argument("--max-calls", type=int, default=8)
    lod.add_argument(
        "--turns",
        choices=("simultaneous", "staggered"),
        default="simultaneous",
        help="every caller asks at the same moment, or spread over one turn's length",
    )
    lod.add_argument(
        "--workers", type=int, default=None, help="passed to the spawned server's serve"
    )
    lod.add_argument(
        "--server-pid", type=int, default=None, help="with --url: read this process's CPU"
    )
    lod.add_argument(
        "--headroom",
        action="store_true",
        help="let the spawned server refuse calls it has no room for (the first refusal "
        "ends the run and is reported)",
    )
    lod.add_argument("--idle-s", type=float, default=5.0, help="idle window per step")
    lod.add_argument(
        "--reply-timeout-s", type=float, default=30.0, help="no reply by then: a failed call"
    )
    lod.add_argument(
        "--baseline-turns", type=int, default=3, help="turns of one call alone (the reference)"
    )
    lod.add_argument(
        "--keep-going",
        action="store_true",
        help="go on to --max-calls after a step that is not smooth",
    )
    lod.add_argument(
        "--providers",
        choices=("offline", "local", "cloud"),
        default="offline",
        help="the spawned server's own models (offline: the echo LLM; local: the local "
        "language model), or OpenAI STT, LLM and TTS played by a local stand-in in its own "
        "process (the server's cost beside cloud providers)",
    )
    lod.add_argument(
        "--service-ms",
        type=float,
        default=100.0,
        help="with --providers cloud: the stand-in's service time before each answer",
    )
    lod.add_argument(
        "--inject-hole-ms",
        type=float,
        default=0.0,
        help="silence this much of the first caller's reply, to check the hole measurement",
    )
    tt = turn_taking.add_parser(sub)
    sth = synthesis.add_parser(sub)
    pro = prompt_check.add_parser(sub)
    stt = stt_check.add_parser(sub)
    for p in (sth, pro, stt):
        p.add_argument("--json", type=Path, default=None, help="write results here")
    for p in (brw, syn, lod):
        p.add_argument("--url", default=None, help="a running server (default: in-process)")
    for p in (enc, eng, cal, lat, con, vad, vis, brw, syn, lod, tt):
        p.add_argument("--json", type=Path, default=None, help="write results here")
        p.add_argument("--plot", type=Path, default=None, help="draw them into this PNG")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    runner = {
        "encode": _encode,
        "engine": _engine,
        "call": _call,
        "latency": _latency,
        "conversation": _conversation,
        "vad": _vad,
        "visemes": _visemes,
        "browser": _browser,
        "sync": _sync,
        "load": _load,
        "turn-taking": turn_taking.command,
        "synthesis": synthesis.command,
        "prompt": prompt_check.command,
        "stt": stt_check.command,
    }[args.bench]
    settings, results = runner(args)
    if args.json is not None:
        write_json(args.json, args.bench, settings, results)
        print(f"wrote {args.json}")
    if getattr(args, "plot", None) is not None:
        from benchmarks.plots import plot

        plot(args.bench, results, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
