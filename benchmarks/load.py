"""``bench load``: how many calls a server carries smoothly, measured at the server.

Light callers (benchmarks/client.py with ``decode_video=False``) count video frames by RTP
arrival without decoding them and decode only the audio, so many fit beside the server. One
caller first asks the question alone (``baseline_turns`` times): the one-call reply latency and
the speech of the reply alone. Then calls are added one step at a time; at each step every
caller stays silent for ``idle_s`` (server CPU of idle calls), then each asks the question once,
all at the same moment (``simultaneous``) or spread evenly over one turn's length
(``staggered``). A step is smooth when no call failed (a reply within ``reply_timeout_s``),
every caller's video frame interval p99 is at most 60 ms, no reply has an audio hole, and every
reply latency is at most 1.5 times the one-call figure.

The replies come from the spawned server's own models (``providers="offline"``), or from OpenAI's
STT, LLM and TTS played by the vendor stand-in in a process of its own (``"cloud"``): then the
server's CPU is what it costs beside cloud providers, the stand-in's is counted on its own, and
what the stand-in served (requests per route, violations) is in the results.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from benchmarks.analysis import PLAYOUT_DELAY_S, Hole, reply_audio, voiced_span
from benchmarks.client import CallClient, Microphone, OfferRefused
from benchmarks.clip import speech_pcm
from benchmarks.latency import QUESTIONS, spawn_server
from benchmarks.load_lines import step_line
from benchmarks.procstat import cpu_by_thread, usage
from benchmarks.report import progress, summary
from benchmarks.server_cpu import (
    cpu_per_call_by_thread,
    speaking_cpu_by_thread,
    speaking_cpu_pct_per_call,
)
from benchmarks.server_readings import server_metrics, step_readings
from benchmarks.vendor_standin import OPENAI_KEY, StandInProcess, standin_process
from rtc_server.cpu_priority import blas_on_calling_thread
from rtc_server.providers.openai_tts import OPENAI_PCM_RATE

MAX_INTERVAL_P99_MS = 60.0
MAX_LATENCY_RATIO = 1.5
MIN_HOLE_MS = 10.0
"""Shorter waits for a late frame are not counted as holes (a receiver hides them)."""
PAUSE_MARGIN_MS = 100.0
"""A pause counts as a hole when it is this much longer than the longest pause of the reply
alone (the voice varies its pauses by tens of ms from one reading to the next)."""
SAMPLE_S = 0.25
"""How often the server's CPU time is read during the turns."""
TURNS = ("simultaneous", "staggered")
PROVIDERS = ("offline", "local", "cloud")
CLOUD_REPLY = "It is sunny and warm today with a light breeze from the sea."
"""What the stand-in's LLM answers and its TTS says: one clause, so the server asks for its speech
in one request (the stand-in says the whole reply to each)."""
VIDEO_CLOCK_HZ = 90_000
FRAME_MS = 40.0
"""The server's frame interval (25 fps): an RTP gap of two of these is one frame skipped."""


@dataclass
class Settings:
    max_calls: int = 8
    turns: str = "simultaneous"
    workers: int | None = None
    """Passed to the spawned server as ``--workers N`` (only when given)."""
    headroom: bool = False
    """Let the spawned server refuse calls it has no headroom for (the first 503 ends the run,
    kept as ``refused``). Off by default: the bench looks for where calls stop being smooth."""
    url: str | None = None
    server_pid: int | None = None
    """With ``url``: the server's process, for its CPU and memory (else they are not read)."""
    idle_s: float = 5.0
    reply_timeout_s: float = 30.0
    baseline_turns: int = 3
    keep_going: bool = False
    """Go on adding calls after a step that is not smooth (to see how it degrades)."""
    providers: str = "offline"
    """``offline``: the spawned server's own models (Whisper, ``echo``, Piper) answer, in its
    process. ``local``: the same with the local language model in place of ``echo``, in the
    server's model process (its CPU counted with the server's, as ``local-model``).
    ``cloud``: OpenAI's STT, LLM and TTS played by the vendor stand-in in a process of its own
    (benchmarks/vendor_standin.py), so the server's figures are what it costs beside cloud
    providers, and the stand-in's CPU is reported on its own."""
    service_ms: float = 100.0
    """With ``cloud``: the stand-in's simulated service time before each answer."""
    inject_hole_ms: float = 0.0
    """Silence this much of the first caller's received reply at every step, mid-speech: a
    known hole, to check that the measurement and the table catch one."""


@dataclass
class Answer:
    """One caller's question and what came back."""

    delay_s: float
    asked_at: float = 0.0
    done_at: float = 0.0
    failed: str | None = None
    latency_ms: float | None = None
    speech: tuple[float, float] | None = None
    """(first loud arrival, last loud end) of the reply, s."""
    speech_ms: float | None = None
    holes: list[Hole] = field(default_factory=list)
    """Missing or late audio inside the speech."""
    pauses: list[Hole] = field(default_factory=list)
    stages: dict[str, float] = field(default_factory=dict)
    """The server's own times for the turn (its ``turn`` event's metrics, ms)."""


def _mute_middle(frames: list[tuple[float, int, np.ndarray]], after: float, ms: float) -> None:
    """Zero ``ms`` of the loud part of ``frames`` after ``after``, around its middle."""
    loud = [i for i, (a, _, p) in enumerate(frames) if a > after and np.abs(p).max() > 327]
    if not loud:
        return
    middle = (loud[0] + loud[-1]) // 2
    count = max(1, round(ms / 20))
    for i in range(middle - count // 2, min(len(frames), middle - count // 2 + count)):
        arrival, ts, pcm = frames[i]
        frames[i] = (arrival, ts, np.zeros_like(pcm))


async def _ask(
    client: CallClient,
    mic: Microphone,
    pcm: np.ndarray,
    answer: Answer,
    timeout: float,
    inject_hole_ms: float = 0.0,
) -> Answer:
    await asyncio.sleep(answer.delay_s)
    _, voiced_end = voiced_span(pcm, 48_000)
    start = len(client.received.audio)
    answer.asked_at = time.monotonic()
    handle = mic.play(pcm)
    deadline = answer.asked_at + timeout
    try:
        turn = await client.wait_event(lambda e: e.get("type") == "turn", timeout=timeout)
        answer.stages = dict(turn.get("metrics") or {})
        await client.wait_state("listening", timeout=max(0.1, deadline - time.monotonic()))
    except TimeoutError:
        answer.failed = f"no reply within {timeout:g} s"
    answer.done_at = time.monotonic()
    await asyncio.sleep(0.3)  # the last packets of the reply
    end = mic.sent_at(handle, voiced_end)
    frames = list(client.received.audio[start:])
    if end is None:
        answer.failed = answer.failed or "the question was not sent"
        return answer
    if inject_hole_ms:
        _mute_middle(frames, end, inject_hole_ms)
    reply = reply_audio(frames, end)
    if reply is None:
        answer.failed = answer.failed or "no reply audio"
        return answer
    answer.latency_ms = (reply.first_loud - end) * 1000
    answer.speech = (reply.first_loud, reply.first_loud + reply.speech_ms / 1000)
    answer.speech_ms = reply.speech_ms
    answer.holes = reply.holes
    answer.pauses = reply.pauses
    return answer


async def _settle(client: CallClient, timeout: float = 60.0) -> None:
    """After a failed ask: let the late reply finish, so the next step starts clean."""
    with contextlib.suppress(TimeoutError):
        await client.wait_event(lambda e: e.get("type") == "turn", timeout=timeout)
        await client.wait_state("listening", timeout=timeout)
    client.skip_events()


async def connect_light_caller(url: str) -> tuple[CallClient, Microphone]:
    mic = Microphone()
    # Timed by the kernel's receive time: the callers share this process's loop and the
    # machine's cores with the server; when it lags they read packets late, which is not the
    # server's doing (what the loop saw is kept too: ``read_interval_ms``).
    client = CallClient(
        url, microphone=mic, record_video=False, decode_video=False, kernel_arrivals=True
    )
    try:
        await client.connect()
        await client.wait_channel_open()
        await client.wait_state("listening", timeout=30)
    except BaseException:
        await client.close()
        raise
    return client, mic


LAG_TICK_S = 0.01


async def _watch_loop_lag(out: list[float]) -> None:
    """How late this process's own event loop wakes from a 10 ms sleep (ms): when the callers'
    loop is late, arrival intervals grow whatever the server does."""
    while True:
        due = time.monotonic() + LAG_TICK_S
        await asyncio.sleep(LAG_TICK_S)
        out.append(max(0.0, time.monotonic() - due) * 1000)


async def _sample(
    pid: int,
    out: list[tuple[float, float]],
    rss: list[int],
    by_thread: list[tuple[float, dict[str, float]]],
) -> None:
    while True:
        u = usage(pid)
        now = time.monotonic()
        out.append((now, u.cpu_s))
        by_thread.append((now, cpu_by_thread(pid)))
        rss.append(u.rss_bytes)
        await asyncio.sleep(SAMPLE_S)


@dataclass
class Reference:
    """The question asked by one caller alone."""

    latency_ms: float
    speech_ms: float
    longest_pause_ms: float
    """The longest quiet stretch inside the reply alone (the voice's own pause)."""
    turn_s: float
    """Question start to the reply's end."""
    clean: bool
    """The reply alone had no hole (else the machine was busy and the reference is off)."""


async def _baseline(
    client: CallClient, mic: Microphone, pcm: np.ndarray, s: Settings
) -> tuple[Reference, list[dict[str, Any]]]:
    answers = []
    for i in range(s.baseline_turns):
        a = await _ask(client, mic, pcm, Answer(0.0), s.reply_timeout_s)
        if a.failed or a.latency_ms is None or a.speech_ms is None:
            raise RuntimeError(f"the one-call reference turn failed: {a.failed}")
        answers.append(a)
        progress(f"one call alone: turn {i + 1}/{s.baseline_turns}, {a.latency_ms:.0f} ms")
        await asyncio.sleep(0.5)
    # The speech of the reply alone: the cleanest reading (holes and late speech only ever
    # lengthen a reply), fewest holes first, then the shortest.
    best = min(answers, key=lambda a: (len(holes(a, None)), a.speech_ms or 0.0))
    ref = Reference(
        latency_ms=statistics.median(a.latency_ms or 0.0 for a in answers),
        speech_ms=best.speech_ms or 0.0,
        longest_pause_ms=max((h.ms for h in best.pauses), default=0.0),
        turn_s=statistics.median(a.done_at - a.asked_at for a in answers),
        clean=not holes(best, None),
    )
    return ref, [_answer_json(a, None) for a in answers]


def holes(a: Answer, ref: Reference | None) -> list[Hole]:
    """The reply's holes: missing or late audio, and pauses the reply alone does not have."""
    waits = [h for h in a.holes if h.ms >= MIN_HOLE_MS]
    if ref is None:
        return waits
    limit = ref.longest_pause_ms + PAUSE_MARGIN_MS
    return sorted([*waits, *(p for p in a.pauses if p.ms > limit)], key=lambda h: h.at_ms)


def _answer_json(a: Answer, ref: Reference | None) -> dict[str, Any]:
    return {
        "delay_s": a.delay_s,
        "failed": a.failed,
        "latency_ms": a.latency_ms,
        "speech_ms": a.speech_ms,
        "stretch_ms": (None if ref is None or a.speech_ms is None else a.speech_ms - ref.speech_ms),
        "holes": [asdict(h) for h in holes(a, ref)],
        "longest_pause_ms": max((h.ms for h in a.pauses), default=None),
        "stages_ms": a.stages,
    }


def _slowest_stages(answers: list[Answer]) -> dict[str, float]:
    """The server's stages of the step's slowest reply: where its latency went."""
    timed = [a for a in answers if a.latency_ms is not None]
    return max(timed, key=lambda a: a.latency_ms or 0.0).stages if timed else {}


def skipped_frames(sent_ms: np.ndarray) -> int:
    """Frame instants the server sent nothing for, from the RTP intervals of its frames."""
    gaps = np.round(np.asarray(sent_ms, np.float64) / FRAME_MS) - 1
    return int(gaps[gaps > 0].sum())


def summarize_step(
    calls: int,
    answers: list[Answer],
    intervals: list[np.ndarray],
    ref: Reference,
    cpu: dict[str, Any],
    sent: list[np.ndarray] | None = None,
    server_late: dict[str, int] | None = None,
    client_lags_ms: list[float] | None = None,
    server_delays_ms: dict[str, dict[str, float | int | None] | None] | None = None,
    read: list[np.ndarray] | None = None,
    server_gc: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One row of the table: per-call figures, the step's worst, and whether it was smooth.

    ``intervals`` are the frames' arrival intervals (by the kernel's receive time: what a
    viewer receives, the server and the network); ``read`` the same frames' intervals as the
    callers' event loop read them (the arrival plus this process's own lag); ``sent`` their RTP
    intervals, which only the server decides (a frame it skipped is a gap of two frames
    whenever it arrives). ``server_late``:
    the server's own count of instants it held or dropped during the step; ``client_lags_ms``
    how late the callers' own event loop woke during the turns; ``server_delays_ms`` how long
    after their instants the server's frames left, by its own histogram, per track ("video",
    "audio"; :func:`delay_summary`); ``server_gc`` its garbage collections
    (:func:`~benchmarks.server_readings.gc_pauses`).
    """
    sent = sent if sent is not None else [np.zeros(0) for _ in intervals]
    read = read if read is not None else [np.zeros(0) for _ in intervals]
    lag = summary(client_lags_ms or [])
    read_p99s = [summary(r.tolist())["p99"] for r in read if len(r)]
    read_maxes = [float(r.max()) for r in read if len(r)]
    callers = []
    for a, iv, sv in zip(answers, intervals, sent, strict=True):
        row = _answer_json(a, ref)
        row["frame_interval_ms"] = summary(iv.tolist())
        row["sent_interval_ms"] = summary(sv.tolist())
        row["frames_skipped"] = skipped_frames(sv)
        callers.append(row)
    sent_rows = [c for c in callers if c["sent_interval_ms"]["n"]]
    latencies = [a.latency_ms for a in answers if a.latency_ms is not None]
    stretches = [c["stretch_ms"] for c in callers if c["stretch_ms"] is not None]
    # A caller that got no frames has no interval: it counts as infinitely late.
    p99s = [c["frame_interval_ms"].get("p99", float("inf")) for c in callers]
    p50s = [c["frame_interval_ms"]["p50"] for c in callers if c["frame_interval_ms"]["n"]]
    failed = sum(1 for a in answers if a.failed)
    hole_count = sum(len(c["holes"]) for c in callers)
    limit = MAX_LATENCY_RATIO * ref.latency_ms
    why = []
    if failed:
        why.append(f"{failed} call(s) failed")
    if max(p99s, default=float("inf")) > MAX_INTERVAL_P99_MS:
        why.append(f"frame interval p99 over {MAX_INTERVAL_P99_MS:g} ms")
    if hole_count:
        why.append(f"{hole_count} audio hole(s)")
    if any(x > limit for x in latencies):
        why.append(f"reply latency over {limit:.0f} ms")
    return {
        "calls": calls,
        "failed_calls": failed,
        "frame_interval_ms": {
            "p50": statistics.median(p50s) if p50s else None,
            "p99": max(p99s) if all(np.isfinite(p99s)) else None,
            "max": max(c["frame_interval_ms"].get("max", 0.0) for c in callers) if p50s else None,
        },
        "sent_interval_ms": {
            k: max((c["sent_interval_ms"][k] for c in sent_rows), default=None)
            for k in ("p99", "max")
        },
        "read_interval_ms": {
            "p99": max(read_p99s, default=None),
            "max": max(read_maxes, default=None),
        },
        "frames_skipped": sum(c["frames_skipped"] for c in callers),
        "server_frames_late": server_late,
        "server_video_delay_ms": (server_delays_ms or {}).get("video"),
        "server_audio_delay_ms": (server_delays_ms or {}).get("audio"),
        "server_gc": server_gc,
        "client_loop_lag_ms": {"p99": lag.get("p99"), "max": lag.get("max")},
        "audio_holes": hole_count,
        "stretch_ms": summary(stretches),
        "latency_ms": summary(latencies),
        "slowest_reply_stages_ms": _slowest_stages(answers),
        **cpu,
        "smooth": not why,
        "not_smooth_because": why,
        "callers": callers,
    }


async def _step(
    callers: list[tuple[CallClient, Microphone]],
    pcm: np.ndarray,
    ref: Reference,
    s: Settings,
    url: str,
    pid: int | None,
    standin_pid: int | None = None,
) -> dict[str, Any]:
    n = len(callers)
    for client, _ in callers:
        client.received.audio.clear()
        client.received.video.clear()
        client.received.video_read.clear()
    started = time.monotonic()
    client_cpu = time.process_time()
    metrics_before = await server_metrics(url)
    idle0 = usage(pid) if pid else None
    threads0 = cpu_by_thread(pid) if pid else None
    standin0 = usage(standin_pid) if standin_pid else None
    await asyncio.sleep(s.idle_s)
    idle1 = usage(pid) if pid else None
    threads1 = cpu_by_thread(pid) if pid else None
    idle_end = time.monotonic()
    samples: list[tuple[float, float]] = []
    rss: list[int] = []
    thread_samples: list[tuple[float, dict[str, float]]] = []
    sampler = asyncio.ensure_future(_sample(pid, samples, rss, thread_samples)) if pid else None
    lags: list[float] = []
    lag_watch = asyncio.ensure_future(_watch_loop_lag(lags))
    spread = ref.turn_s if s.turns == "staggered" else 0.0
    asks = [
        _ask(c, m, pcm, Answer(i * spread / n), s.reply_timeout_s, 0 if i else s.inject_hole_ms)
        for i, (c, m) in enumerate(callers)
    ]
    answers = await asyncio.gather(*asks)
    threads2 = cpu_by_thread(pid) if pid else None
    turns_end = time.monotonic()
    for watcher in (sampler, lag_watch):
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
    ended = time.monotonic()
    client_pct = (time.process_time() - client_cpu) / (ended - started) / n * 100
    # Smoothness is judged while the reply plays: an idle avatar whose picture does not change
    # is sent at 4 fps on purpose (rtc_server/media/tracks.py). A reply that was not heard is
    # judged over the whole step.
    intervals, sent, read = [], [], []
    for (c, _), a in zip(callers, answers, strict=True):
        lo, hi = a.speech if a.speech is not None else (started, ended)
        frames = [
            (t, rtp, seen)
            for (t, rtp, _), seen in zip(c.received.video, c.received.video_read, strict=True)
            if lo <= t <= hi
        ]
        intervals.append(np.diff([t for t, _, _ in frames]) * 1000)
        sent.append(np.diff(np.array([r for _, r, _ in frames], np.int64)) * 1000 / VIDEO_CLOCK_HZ)
        read.append(np.diff([seen for _, _, seen in frames]) * 1000)
    metrics_after = await server_metrics(url)
    server = step_readings(metrics_before, metrics_after)
    idle_by_thread = cpu_per_call_by_thread(threads0, threads1, idle_end - started, n)
    speech_spans = [a.speech for a in answers if a.speech is not None]
    cpu: dict[str, Any] = {
        "server_cpu_by_thread_pct_per_call": {
            "idle": idle_by_thread,
            "speaking": speaking_cpu_by_thread(thread_samples, speech_spans, idle_by_thread, n),
            "turns": cpu_per_call_by_thread(threads1, threads2, turns_end - idle_end, n),
        },
        "server_cpu_idle_pct_per_call": None,
        "server_cpu_speaking_pct_per_call": None,
        "server_cpu_turns_pct_per_call": None,
        "server_rss_mb": None,
        "server_processes": None,
        "client_cpu_pct_per_call": client_pct,
        "standin_cpu_pct": None,
    }
    if standin0 is not None and standin_pid:
        standin_s = usage(standin_pid).cpu_s - standin0.cpu_s
        cpu["standin_cpu_pct"] = standin_s / (time.monotonic() - started) * 100

    if idle0 is not None and idle1 is not None and len(samples) > 1:
        idle_cores = (idle1.cpu_s - idle0.cpu_s) / (idle_end - started) / n
        turn_cores = (samples[-1][1] - samples[0][1]) / (samples[-1][0] - samples[0][0]) / n
        cpu["server_cpu_idle_pct_per_call"] = idle_cores * 100
        cpu["server_cpu_speaking_pct_per_call"] = speaking_cpu_pct_per_call(
            samples, speech_spans, idle_cores, n
        )
        cpu["server_cpu_turns_pct_per_call"] = turn_cores * 100
        cpu["server_rss_mb"] = max([idle1.rss_bytes, *rss]) / 2**20
        cpu["server_processes"] = idle1.processes
    for (client, _), a in zip(callers, answers, strict=True):
        if a.failed:
            await _settle(client)
    return summarize_step(
        n,
        answers,
        intervals,
        ref,
        cpu,
        sent,
        server["late"],
        lags,
        server["delays"],
        read,
        server["gc"],
    )


async def _measure(s: Settings) -> dict[str, Any]:
    if s.turns not in TURNS:
        raise ValueError(f"turns is one of {TURNS}, not {s.turns!r}")
    # The callers' BLAS without its spinning pool too, as in the server: CPU it would burn
    # beside the server is CPU the server does not get.
    blas_on_calling_thread()
    if s.providers not in PROVIDERS:
        raise ValueError(f"providers is one of {PROVIDERS}, not {s.providers!r}")
    if s.url is not None and s.providers != "offline":
        raise ValueError("providers are set on the server the bench spawns, not on one at --url")
    async with contextlib.AsyncExitStack() as stack:
        standin = None
        if s.providers == "cloud":  # on the server the bench spawns (checked above)
            standin = await stack.enter_async_context(
                standin_process(
                    transcript=QUESTIONS[1],
                    reply=CLOUD_REPLY,
                    speech=await speech_pcm(CLOUD_REPLY, OPENAI_PCM_RATE),
                    delay_s=s.service_ms / 1000,
                )
            )
        r = await _measure_with(s, standin)
    if standin is not None:
        r["stand_in"] = {"service_ms": s.service_ms, **standin.served}
    return r


async def _measure_with(s: Settings, standin: StandInProcess | None) -> dict[str, Any]:
    process = None
    url, pid = s.url, s.server_pid
    if url is None:
        # The same sentence always gives the same reply audio: stretch and holes are measured
        # against the reply alone.
        extra = ["--max-sessions", str(max(8, s.max_calls)), "--piper-deterministic"]
        if not s.headroom:
            extra.append("--no-headroom")
        if s.providers == "local":
            extra += ["--llm", "local"]
        if s.workers is not None:
            extra += ["--workers", str(s.workers)]
        env = None
        if standin is not None:
            extra += ["--stt", "openai", "--llm", "openai", "--tts", "openai"]
            env = {"OPENAI_API_KEY": OPENAI_KEY, "OPENAI_BASE_URL": standin.openai_base}
        url, process = await spawn_server(*extra, env=env)
        pid = process.pid
    pcm = await speech_pcm(QUESTIONS[1])
    callers: list[tuple[CallClient, Microphone]] = []
    steps: list[dict[str, Any]] = []
    largest = 0
    refused: dict[str, Any] | None = None
    try:
        callers.append(await connect_light_caller(url))
        ref, baseline = await _baseline(*callers[0], pcm, s)
        for n in range(1, s.max_calls + 1):
            if n > 1:
                try:
                    callers.append(await connect_light_caller(url))
                except OfferRefused as exc:
                    # The server's admission said no (with --headroom): where it stops
                    # taking calls is a result, and no more are tried.
                    refused = {
                        "calls": n,
                        "status": exc.status,
                        "code": exc.code,
                        "message": exc.message,
                    }
                    print(f"  call {n} refused ({exc.status} {exc.code}): {exc.message}")
                    break
            await asyncio.sleep(1.0)
            step = await _step(callers, pcm, ref, s, url, pid, standin.pid if standin else None)
            steps.append(step)
            print("  " + step_line(step), flush=True)
            if step["smooth"] and largest == n - 1:
                largest = n
            elif not s.keep_going:
                break
    finally:
        for client, _ in callers:
            await client.close()
        if process is not None:
            process.terminate()
            await process.wait()
    return {
        "largest_smooth_calls": largest,
        "max_calls_tried": len(steps),
        "refused": refused,
        "turns": s.turns,
        "providers": s.providers if s.url is None else None,
        "workers": s.workers,
        "headroom": s.headroom,
        "one_call": {**asdict(ref), "turns": baseline},
        "rules": {
            "frame_interval_p99_ms": MAX_INTERVAL_P99_MS,
            "latency_ratio": MAX_LATENCY_RATIO,
            "audio_holes": 0,
            "pause_margin_ms": PAUSE_MARGIN_MS,
            "min_hole_ms": MIN_HOLE_MS,
            "playout_delay_ms": PLAYOUT_DELAY_S * 1000,
        },
        "steps": steps,
    }


def run(settings: Settings) -> dict[str, Any]:
    return asyncio.run(_measure(settings))
