"""``bench turn-taking``: when a turn ends and how soon the answer comes, mode by mode.

The modes, side by side in one run: the fixed hang-over; speculation (the reply started at the
pause); the end-of-turn model (a short hang-over for a finished turn, a long one for an
unfinished one); both. Each mode is a server in this process (the same models, the same
avatar); every question goes to every mode in turn, each time in a new call of its own, so the
modes share the machine's state and only one call runs at a time.

- Complete questions: end of the caller's voice -> first reply audio, by packet arrival (as
  ``bench latency``), with the server's stages.
- Questions with a pause in the middle ("I would like to" ... "know more about ..."): a false
  cut-off is a turn that ended at the pause: more than one turn for the question, or a
  transcript without its first or last word.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
from typing import TYPE_CHECKING, Any

import numpy as np

from benchmarks.analysis import first_loud_after, voiced_span
from benchmarks.report import progress, summary, table

if TYPE_CHECKING:
    from benchmarks.client import CallClient, Microphone

# The servers, clients and models load when the bench runs (``avatar-rtc bench --help`` and
# the other benches do not pay for them).

MODES: dict[str, dict[str, Any]] = {
    "fixed hang-over": {"end_of_turn": "off", "speculate": False},
    "speculation": {"end_of_turn": "off", "speculate": True},
    "end-of-turn model": {"end_of_turn": "smart-turn", "speculate": False},
    "both": {"end_of_turn": "smart-turn", "speculate": True},
}
PAUSING = (
    ("I would like to know more about the history of this city.", 4),
    ("Can you tell me how the weather will be tomorrow?", 4),
    ("My favourite place is the old bridge by the river.", 4),
    ("What do you think about the museums of Paris?", 5),
    ("I am looking for a good restaurant near the station.", 4),
    ("The train leaves at nine and arrives in Lyon at noon.", 4),
)
"""(sentence, words before the pause). Held out: nothing was tuned on them. Each is spoken in
one breath with a pause cut in (``benchmarks.clip.speech_with_pause``)."""


def _state(events: list[dict[str, Any]]) -> str | None:
    return next((e["state"] for e in reversed(events) if e.get("type") == "state"), None)


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z']+", text.lower())


def cut_off(thinking: int, transcripts: list[str], sentence: str) -> bool:
    """Whether a question spoken with a pause was answered at its pause: more than one turn
    ended (``thinking`` states), or its one transcript lacks its first or last word."""
    if thinking != 1 or len(transcripts) != 1:
        return True
    words, heard = _words(sentence), _words(transcripts[0])
    return words[0] not in heard or words[-1] not in heard


async def pausing_turn(client: CallClient, mic: Microphone, pcm: np.ndarray) -> dict[str, Any]:
    """Play a question with a pause; wait until the server has answered all it heard."""
    _, voiced_end = voiced_span(pcm, 48_000)
    start = len(client.received.audio)
    first_event = len(client.events)
    handle = mic.play(pcm)
    await client.wait_event(lambda e: e.get("type") == "turn", timeout=60)
    # A cut-off answers twice (the pause, then the rest): wait until the call has been
    # listening, with nothing new, for 2 s after the caller finished.
    deadline = asyncio.get_running_loop().time() + 60
    while asyncio.get_running_loop().time() < deadline:
        seen = len(client.events)
        await asyncio.sleep(2.0)
        if not mic.busy and len(client.events) == seen and _state(client.events) == "listening":
            break
    events = client.events[first_event:]
    client.skip_events()
    speech_end = mic.sent_at(handle, voiced_end)
    first = first_loud_after(client.received.audio[start:], speech_end or 0.0)
    return {
        "transcripts": [e["text"] for e in events if e.get("type") == "transcript"],
        "thinking": sum(1 for e in events if e == {"type": "state", "state": "thinking"}),
        "turns": sum(1 for e in events if e.get("type") == "turn"),
        "first_audio_ms": None
        if first is None or speech_end is None
        else (first - speech_end) * 1000,
    }


async def _measure(rounds: int, pause_ms: int, hangover_ms: int, llm: str) -> dict[str, Any]:
    from benchmarks.call import _server
    from benchmarks.clip import engine_factory, speech_pcm, speech_with_pause
    from benchmarks.latency import QUESTIONS, connect_caller, one_turn
    from rtc_server.app import MANAGER

    factory = engine_factory()
    servers = {}
    callers = {}
    try:
        for name, settings in MODES.items():
            servers[name] = await _server(
                factory, vad_hangover_ms=hangover_ms, piper_deterministic=True, llm=llm, **settings
            )
        # With the local model each mode has a model process of its own: its CPU is the
        # mode's LLM cost, speculations used and discarded included.
        model_cpu = {name: _model_cpu(runner) for name, (_, runner, _) in servers.items()}
        complete = [await speech_pcm(q) for q in QUESTIONS]
        pausing = [await speech_with_pause(q, n, pause_ms) for q, n in PAUSING]
        turns: dict[str, list[dict[str, Any]]] = {name: [] for name in MODES}
        pauses: dict[str, list[dict[str, Any]]] = {name: [] for name in MODES}
        for r in range(rounds):
            # A call of its own for each question and mode: one call at a time on the machine.
            for i, pcm in enumerate(complete):
                for name, (url, _, _) in servers.items():
                    callers[name] = client, mic = await connect_caller(url, record_video=False)
                    turn = await one_turn(client, mic, pcm)
                    turns[name].append({**turn, "question": QUESTIONS[i]})
                    await callers.pop(name)[0].close()
            for (question, _), pcm in zip(PAUSING, pausing, strict=True):
                for name, (url, _, _) in servers.items():
                    callers[name] = client, mic = await connect_caller(url, record_video=False)
                    result = await pausing_turn(client, mic, pcm)
                    pauses[name].append({**result, "question": question})
                    await callers.pop(name)[0].close()
            progress(f"round {r + 1}/{rounds}")
        rows = {}
        for name, (_, runner, _) in servers.items():
            metrics = runner.app[MANAGER].metrics.registry
            discarded = metrics.get_sample_value(
                "avatar_rtc_speculative_replies_total", {"outcome": "discarded"}
            )
            used = metrics.get_sample_value(
                "avatar_rtc_speculative_replies_total", {"outcome": "used"}
            )
            deltas = metrics.get_sample_value("avatar_rtc_discarded_speculation_deltas_total")
            cpu, cpu_before = _model_cpu(runner), model_cpu[name]
            rows[name] = _row(turns[name], pauses[name], used or 0.0, discarded or 0.0)
            rows[name]["discarded_speculation_deltas"] = int(deltas or 0)
            asked = len(turns[name]) + len(pauses[name])
            rows[name]["model_cpu_s_per_question"] = (
                None if cpu is None or cpu_before is None else (cpu - cpu_before) / asked
            )
    finally:
        for client, _ in callers.values():
            await client.close()
        for _, runner, _ in servers.values():
            await runner.cleanup()
    return {"modes": rows, "raw": {"complete": turns, "pausing": pauses}}


def _model_cpu(runner: Any) -> float | None:
    """CPU seconds of the server's local model process so far (None: it has none)."""
    from rtc_server.app import MANAGER

    process = runner.app[MANAGER].model_process
    return None if process is None else float(process.cpu_seconds())


def _row(
    turns: list[dict[str, Any]], pauses: list[dict[str, Any]], used: float, discarded: float
) -> dict[str, Any]:
    stages: dict[str, list[float]] = {}
    for t in turns:
        for k, v in t["server"].items():
            stages.setdefault(k, []).append(v)
    return {
        "first_audio_ms": summary(
            [t["client_first_audio_ms"] for t in turns if t["client_first_audio_ms"] is not None]
        ),
        "stages_ms": {k: statistics.median(v) for k, v in sorted(stages.items())},
        "false_cutoffs": sum(
            cut_off(p["thinking"], p["transcripts"], p["question"]) for p in pauses
        ),
        "pausing_questions": len(pauses),
        "pausing_first_audio_ms": summary(
            [p["first_audio_ms"] for p in pauses if p["first_audio_ms"] is not None]
        ),
        "speculative_replies": {"used": int(used), "discarded": int(discarded)},
    }


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "turn-taking",
        help="fixed hang-over, speculation, end-of-turn model, both: latency and false cut-offs",
    )
    p.add_argument("--rounds", type=int, default=2, help="times every question is asked")
    p.add_argument("--pause-ms", type=int, default=600, help="the pause inside the questions")
    p.add_argument("--hangover-ms", type=int, default=400, help="the fixed hang-over")
    p.add_argument(
        "--llm",
        choices=("echo", "local"),
        default="echo",
        help="the servers' LLM: the deterministic echo, or the local model (a process per "
        "mode, whose CPU per question the table gives)",
    )
    return p


def command(args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    r = asyncio.run(_measure(args.rounds, args.pause_ms, args.hangover_ms, args.llm))
    rows = []
    for name, m in r["modes"].items():
        s = m["stages_ms"]
        rows.append(
            [
                name,
                m["first_audio_ms"].get("p50", float("nan")),
                m["first_audio_ms"].get("p95", float("nan")),
                s.get("vad_end_ms", float("nan")),
                s.get("stt_ms", float("nan")),
                s.get("tts_first_audio_ms", float("nan")),
                f"{m['false_cutoffs']}/{m['pausing_questions']}",
                m["pausing_first_audio_ms"].get("p50", float("nan")),
                f"{m['speculative_replies']['used']}/{m['speculative_replies']['discarded']}",
                m["discarded_speculation_deltas"],
                float("nan")
                if m["model_cpu_s_per_question"] is None
                else m["model_cpu_s_per_question"],
            ]
        )
    headers = [
        "mode",
        "first audio p50 ms",
        "p95",
        "vad_end p50",
        "stt p50",
        "tts_first_audio p50",
        "false cut-offs",
        "pausing: first audio p50",
        "speculation used/discarded",
        "discarded deltas",
        "model CPU s/question",
    ]
    print(table(headers, rows))
    settings = {
        "rounds": args.rounds,
        "pause_ms": args.pause_ms,
        "hangover_ms": args.hangover_ms,
        "llm": args.llm,
    }
    return settings, r
