"""The line ``bench load`` prints per step: smoothness, the slowest reply's stages, the
server's CPU by thread, and the cloud stand-in's CPU when it plays the providers."""

from __future__ import annotations

from typing import Any


def _threads_line(step: dict[str, Any]) -> str:
    by = step.get("server_cpu_by_thread_pct_per_call") or {}
    idle, speaking, turns = (by.get(k) or {} for k in ("idle", "speaking", "turns"))
    names = sorted(set(idle) | set(speaking) | set(turns), key=lambda n: -turns.get(n, 0.0))
    shown = [
        f"{n} {idle.get(n, 0.0):.1f} / {speaking.get(n, 0.0):.1f} / {turns.get(n, 0.0):.1f}"
        for n in names
    ]
    return (
        "\n      server CPU by thread, % of a core per call idle / per speaking call / per call "
        "over the turns: " + ", ".join(shown)
        if shown
        else ""
    )


def step_line(step: dict[str, Any]) -> str:
    def f(v: float | None, fmt: str = ".0f") -> str:
        return "-" if v is None else format(v, fmt)

    iv = step["frame_interval_ms"]
    return (
        f"{step['calls']} call(s): {step['failed_calls']} failed, frame interval p99 "
        f"{f(iv['p99'])} max {f(iv['max'])} ms (read p99 {f(step['read_interval_ms']['p99'])}, "
        f"sent p99 {f(step['sent_interval_ms']['p99'])}, "
        f"{step['frames_skipped']} skipped; callers' loop lag p99 "
        f"{f(step['client_loop_lag_ms']['p99'])}; server's frames out p99 <= "
        f"{f((step.get('server_video_delay_ms') or {}).get('p99'))} ms late"
        + _gc_part(step.get("server_gc"))
        + "), "
        f"{step['audio_holes']} hole(s), reply max "
        f"{f(step['latency_ms'].get('max'))} ms, server CPU/call idle "
        f"{f(step['server_cpu_idle_pct_per_call'], '.1f')} % speaking "
        f"{f(step['server_cpu_speaking_pct_per_call'], '.1f')} %"
        + (
            ""
            if step.get("standin_cpu_pct") is None
            else f" (cloud stand-in {step['standin_cpu_pct']:.1f} % of a core)"
        )
        + ("" if step["smooth"] else "  <- not smooth: " + "; ".join(step["not_smooth_because"]))
        + _stages_line(step.get("slowest_reply_stages_ms") or {})
        + _threads_line(step)
    )


SHOWN_STAGES = ("vad_end", "stt", "llm_first_token", "tts_first_audio", "engine_first_frame")


def _stages_line(stages: dict[str, float]) -> str:
    shown = [f"{n} {stages[n + '_ms']:.0f}" for n in SHOWN_STAGES if n + "_ms" in stages]
    return f"\n      slowest reply, server's stages (ms): {', '.join(shown)}" if shown else ""


def _gc_part(gc: dict[str, Any] | None) -> str:
    """The server's garbage collections during the step, or nothing when it did not say."""
    if not gc:
        return ""
    longest = "-" if gc["longest_ms"] is None else f"{gc['longest_ms']:g}"
    return f"; its GC ran {gc['collections']} time(s), {gc['full']} full, longest <= {longest} ms"
