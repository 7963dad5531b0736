"""``bench conversation``: what our side adds to a reply, speech-to-speech against the pipeline.

Two servers in this process, one per conversation mode, each with its cloud services played by
a local stand-in that answers after the same fixed simulated service time:

* ``openai-realtime``: the Realtime stand-in (:mod:`benchmarks.realtime_standin`): one hop,
  ``response.create`` to the first audio delta;
* ``pipeline``: OpenAI STT, LLM and TTS, all three on the vendor stand-in
  (:mod:`benchmarks.vendor_standin`), each waiting the same time before it answers: the first
  token and the first byte of speech after the turn ends; the transcription starts early, when
  the caller falls silent, so only what of it outlasts the hang-over waits.

Both reply with the same audio (a tone, loud from its first sample), so the first loud frame
the caller receives is the first reply audio in both. One caller per server asks the same
Piper-spoken questions, the two calls taking turns, so a busy machine weighs on both alike.
Figures per mode, by packet arrival at the caller: end of voiced speech to the first reply
audio; the service time in it (hops x delay); the VAD's hang-over (silence it waits for before
it ends a turn: fixed here, the end-of-turn model and speculative replies off, so both modes
wait the same and the rest can be told apart; ``bench turn-taking`` measures those); and what
is left, our side: VAD decision, uploads, sentence splitting,
resampling, the lip-sync engine's start, encoding, packetization and the loopback network.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import numpy as np

from benchmarks.call import _server
from benchmarks.clip import speech_pcm
from benchmarks.latency import QUESTIONS, connect_caller, one_turn, stage_table
from benchmarks.realtime_standin import KEY, RATE, RealtimeStandIn
from benchmarks.report import progress, summary
from benchmarks.vendor_standin import OPENAI_KEY, VendorServer, tone
from rtc_server.config import ConversationSettings

MODES = ("pipeline", "openai-realtime")
REPLY_TEXT = "Paris is the capital of France."
REPLY_SECONDS = 1.0


def service_time_ms(mode: str, delay_ms: float, hangover_ms: float) -> float:
    """The stand-ins' time on the path from the end of the turn to the first reply audio."""
    if mode == "openai-realtime":
        return delay_ms  # response.create -> the first audio delta
    # The first token, the first byte of speech, and what of the early transcription outlasts
    # the hang-over.
    return 2 * delay_ms + max(0.0, delay_ms - hangover_ms)


def _reply_pcm() -> np.ndarray:
    return np.frombuffer(tone(REPLY_SECONDS, RATE), "<i2").astype(np.int16)


async def _measure(turns: int, delay_ms: float, hangover_ms: int) -> dict[str, Any]:
    delay_s = delay_ms / 1000
    async with contextlib.AsyncExitStack() as stack:
        vendor = await stack.enter_async_context(
            VendorServer(
                reply_deltas=[f"{w} " for w in REPLY_TEXT.split()],
                transcript=QUESTIONS[1],
                speech_seconds=REPLY_SECONDS,
                delay_s=delay_s,
            )
        )
        realtime = await stack.enter_async_context(
            RealtimeStandIn(_reply_pcm(), REPLY_TEXT, heard=QUESTIONS[1], delay_s=delay_s)
        )
        factory = None  # loaded by the first server, shared with the second
        urls: dict[str, str] = {}
        for mode, settings in (
            (
                "pipeline",
                {
                    "stt": "openai",
                    "llm": "openai",
                    "tts": "openai",
                    "openai_api_key": OPENAI_KEY,
                    "openai_base_url": vendor.openai_base,
                },
            ),
            (
                "openai-realtime",
                {
                    "mode": "openai-realtime",
                    "openai_api_key": KEY,
                    "openai_base_url": realtime.base_url,
                },
            ),
        ):
            url, runner, factory = await _server(
                factory,
                vad_hangover_ms=hangover_ms,
                end_of_turn="off",
                speculate=False,
                **settings,
            )
            stack.push_async_callback(runner.cleanup)
            urls[mode] = url
        callers = {}
        for mode, url in urls.items():
            client, mic = await connect_caller(url, record_video=False)
            stack.push_async_callback(client.close)
            callers[mode] = (client, mic)
        pcms = [await speech_pcm(q) for q in QUESTIONS]
        results: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
        started = time.monotonic()
        for i in range(turns):
            for mode in MODES:
                client, mic = callers[mode]
                results[mode].append(await one_turn(client, mic, pcms[i % len(pcms)]))
                progress(f"{mode}: turn {i + 1}/{turns}")
                await asyncio.sleep(0.5)
        elapsed = time.monotonic() - started
        failures = vendor.violations + realtime.violations
    modes = {}
    for mode in MODES:
        got = [r["client_first_audio_ms"] for r in results[mode]]
        answered = [ms for ms in got if ms is not None]
        service_ms = service_time_ms(mode, delay_ms, hangover_ms)
        vad = [r["server"].get("vad_end_ms") for r in results[mode]]
        modes[mode] = {
            "turns": len(got),
            "unanswered": len(got) - len(answered),
            "first_audio_ms": summary(answered),
            "service_ms": service_ms,
            "ours_ms": summary([ms - service_ms - hangover_ms for ms in answered]),
            "vad_decision_ms": summary([v - hangover_ms for v in vad if v is not None]),
            "mic_lag_ms": summary(
                [r["mic_lag_ms"] for r in results[mode] if r["mic_lag_ms"] is not None]
            ),
            "server_stages_ms": stage_table(results[mode]),
            "raw": results[mode],
        }
    return {
        "delay_ms": delay_ms,
        "vad_hangover_ms": hangover_ms,
        "modes": modes,
        "standin_violations": failures,
        "elapsed_s": elapsed,
    }


def run(turns: int, delay_ms: float, hangover_ms: int | None = None) -> dict[str, Any]:
    if hangover_ms is None:
        hangover_ms = ConversationSettings().vad_hangover_ms
    return asyncio.run(_measure(turns, delay_ms, hangover_ms))


def rows(r: dict[str, Any]) -> list[list[Any]]:
    """The table ``bench conversation`` prints: one row per mode."""
    out = []
    for mode, m in r["modes"].items():
        first, ours = m["first_audio_ms"], m["ours_ms"]
        out.append(
            [
                mode,
                f"{m['turns'] - m['unanswered']}/{m['turns']}",
                first.get("p50", float("nan")),
                first.get("p95", float("nan")),
                m["service_ms"],
                r["vad_hangover_ms"],
                ours.get("p50", float("nan")),
                ours.get("p95", float("nan")),
                m["vad_decision_ms"].get("p50", float("nan")),
            ]
        )
    return out


HEADERS = [
    "mode",
    "answered",
    "first audio p50 (ms)",
    "p95",
    "service (ms)",
    "hang-over (ms)",
    "ours p50 (ms)",
    "ours p95",
    "VAD past hang-over p50",
]
