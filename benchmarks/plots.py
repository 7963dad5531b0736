"""``--plot PATH``: one PNG per benchmark run (matplotlib, no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _figure(title: str, panels: int = 1) -> tuple[Any, list[Any]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4), squeeze=False)
    fig.suptitle(title)
    return fig, list(axes[0])


def _histogram(ax: Any, samples: Sequence[float], xlabel: str) -> None:
    ax.hist(list(samples), bins=30, color="#2563eb")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("count")


def _nan(value: float | None) -> float:
    return float("nan") if value is None else value


def plot(bench: str, results: Any, path: Path) -> None:
    """Draw ``results`` of ``bench`` (as the subcommand returns them) into ``path``."""
    import matplotlib.pyplot as plt

    if bench == "latency":
        fig, (dist, timeline) = _figure("Reply latency", 2)
        turns = results["raw"]["turns"]
        client = [t["client_first_audio_ms"] for t in turns]
        _histogram(
            dist, [c for c in client if c is not None], "end of speech -> first reply audio (ms)"
        )
        # One bar per turn: its stages end to end, from the end of the caller's speech.
        stages = [
            "vad_end_ms",
            "stt_ms",
            "llm_first_token_ms",
            "tts_first_audio_ms",
            "engine_first_frame_ms",
        ]
        colours = ["#94a3b8", "#2563eb", "#15803d", "#b45309", "#7c3aed"]
        for i, turn in enumerate(turns):
            left = 0.0
            for stage, colour in zip(stages, colours, strict=True):
                width = turn["server"].get(stage, 0.0)
                timeline.barh(
                    i,
                    width,
                    left=left,
                    color=colour,
                    label=stage.removesuffix("_ms") if i == 0 else None,
                )
                left += width
            if client[i] is not None:
                timeline.plot(client[i], i, "k|", markersize=12)
        timeline.set_xlabel("ms after the end of speech (| = first audio at the caller)")
        timeline.set_ylabel("turn")
        timeline.legend(fontsize="small")
    elif bench == "encode":
        fig, (cpu, kbps) = _figure("Encoding the avatar clip", 2)
        # --framing both: each codec once per framing.
        names = [f"{r['framing']} {r['codec']}" if "framing" in r else r["codec"] for r in results]
        cpu.bar(names, [r["cpu_ms"]["p50"] for r in results], label="p50", color="#2563eb")
        cpu.bar(
            names,
            [r["cpu_ms"]["p95"] - r["cpu_ms"]["p50"] for r in results],
            bottom=[r["cpu_ms"]["p50"] for r in results],
            label="to p95",
            color="#93c5fd",
        )
        cpu.set_ylabel("CPU ms per frame")
        cpu.legend()
        kbps.bar(names, [r["kbps"] for r in results], color="#15803d")
        kbps.set_ylabel("kbps")
        for ax in (cpu, kbps):
            ax.tick_params(axis="x", labelrotation=15)
    elif bench == "sync" and "lipsync" in results:
        fig, (ax,) = _figure("Lip-sync by cross-correlation, per say")
        ax.bar(range(1, len(results["lipsync"]) + 1), [s["offset_ms"] for s in results["lipsync"]])
        ax.set_xlabel("say")
        ax.set_ylabel("offset (ms)")
    elif bench == "sync" and "per_call" in results:
        fig, (ax,) = _figure("A/V offset in Chromium, the first seconds of fresh calls")
        for n, call in enumerate(results["per_call"]):
            seconds = [o["second"] for o in call["seconds"]]
            ax.plot(seconds, [o["offset_ms"] for o in call["seconds"]], "o-", label=f"call {n + 1}")
        ax.set_xlabel("second from the first frame")
        ax.set_ylabel("ms, + = video later")
        ax.legend()
    elif bench == "sync" and "offsets_ms" not in results:
        fig, (ax,) = _figure("A/V offset in Chromium (sync-test engine)")
        ax.bar(["injected", "measured"], [results["injected_video_delay_ms"], results["offset_ms"]])
        ax.set_ylabel("ms, + = video later")
    elif bench == "sync":
        fig, (ax,) = _figure(f"A/V offset, injected {results['injected_video_delay_ms']} ms")
        _histogram(ax, results["offsets_ms"], "flash - beep (ms, + = video later)")
    elif bench == "browser":
        fig, (ax,) = _figure("A/V offset in Chromium, per say")
        offsets = results["av_offset_per_say_ms"]
        ax.bar(range(1, len(offsets) + 1), offsets, color="#2563eb")
        ax.axhline(45, color="#b91c1c", linestyle="--")
        ax.axhline(-45, color="#b91c1c", linestyle="--")
        ax.set_xlabel("say")
        ax.set_ylabel("offset (ms, + = audio later)")
    elif bench == "call":
        fig, (ax,) = _figure(f"Receiver: {results['receiver_fps']:.2f} fps")
        ax.bar(
            ["p50", "p95", "p99", "max"],
            [results["frame_interval_ms"][k] for k in ("p50", "p95", "p99", "max")],
        )
        ax.set_ylabel("frame interval (ms)")
    elif bench == "engine" and results["engine"] == "musetalk":
        fig, (ax,) = _figure(f"MuseTalk on {results['placement']}: frames/s by batch size")
        ax.bar(
            [str(b["batch"]) for b in results["batches"]], [b["fps"] for b in results["batches"]]
        )
        ax.set_xlabel("batch")
        ax.set_ylabel("frames/s (whole step)")
    elif bench == "engine":
        fig, (ax,) = _figure(f"{results['engine']} engine per frame")
        ax.bar(
            ["speaking p50", "speaking p95", "idle p50"],
            [
                results["speaking_ms"]["p50"],
                results["speaking_ms"]["p95"],
                results["idle_ms"]["p50"],
            ],
        )
        ax.set_ylabel("wall ms")
    elif bench == "vad":
        fig, (ax,) = _figure("Silero VAD per 32 ms chunk")
        ax.bar(["p50", "p95", "max"], [results["cost_ms"][k] for k in ("p50", "p95", "max")])
        ax.set_ylabel("ms")
    elif bench == "visemes":
        from benchmarks.visemes import rows

        fig, (ax,) = _figure("Mouth shapes: CPU per second of speech")
        found = rows(results)
        ax.barh([name for name, _, _ in found], [value for _, value, _ in found])
        ax.invert_yaxis()
        ax.set_xlabel("CPU ms per s of speech")
    elif bench == "load":
        fig, (frames, cpu) = _figure(
            f"Load ({results['turns']} turns): {results['largest_smooth_calls']} smooth call(s)", 2
        )
        steps = results["steps"]
        calls = [s["calls"] for s in steps]
        for key, label in (("p99", "worst caller's p99"), ("max", "longest")):
            values = [s["frame_interval_ms"][key] for s in steps]
            frames.plot(calls, [_nan(v) for v in values], "o-", label=label)
        frames.axhline(results["rules"]["frame_interval_p99_ms"], color="#b91c1c", linestyle="--")
        frames.set_xticks(calls)
        frames.set_xlabel("calls")
        frames.set_ylabel("video frame interval (ms)")
        frames.legend()
        for key, label in (
            ("server_cpu_idle_pct_per_call", "idle"),
            ("server_cpu_speaking_pct_per_call", "speaking"),
        ):
            cpu.plot(calls, [_nan(s[key]) for s in steps], "o-", label=label)
        cpu.set_xticks(calls)
        cpu.set_xlabel("calls")
        cpu.set_ylabel("server CPU per call (% of one core)")
        cpu.legend()
    elif bench == "conversation":
        fig, (ax,) = _figure(f"Each service answers after {results['delay_ms']:.0f} ms")
        for mode, m in results["modes"].items():
            got = [t["client_first_audio_ms"] for t in m["raw"]]
            ax.hist([g for g in got if g is not None], bins=20, alpha=0.6, label=mode)
        ax.set_xlabel("end of speech -> first reply audio (ms)")
        ax.set_ylabel("turns")
        ax.legend()
    else:
        raise ValueError(f"no plot for {bench!r}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
