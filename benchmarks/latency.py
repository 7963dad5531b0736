"""``bench latency``: spoken questions into a call, time to the first reply audio; barge-in.

Each caller is an in-process aiortc client whose microphone plays Piper-spoken questions in
real time. Client figures are taken by packet arrival: the end of the caller's voiced audio
(when that 20 ms frame went out) to the first loud reply frame that arrived.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import sys
import time
from collections.abc import Mapping
from typing import IO, Any

import aiohttp
import numpy as np

from benchmarks.analysis import fell_silent_at, first_loud_after, mouth_motion, voiced_span
from benchmarks.call import _server
from benchmarks.client import CallClient, Microphone
from benchmarks.clip import speech_pcm
from benchmarks.report import progress, summary

QUESTIONS = (
    "Hello.",
    "What is the capital of France?",
    "Can you tell me how the weather will be tomorrow morning?",
    "I would like to know more about the history of this city and its old bridges.",
)
LONG_QUESTION = (
    "Please tell me everything you know about the history of the city of Paris, its bridges, "
    "its museums and its famous tower."
)
INTERRUPTION = "Stop, wait a moment please."


async def connect_caller(url: str, *, record_video: bool = True) -> tuple[CallClient, Microphone]:
    """A connected caller with a microphone, after half a second of room tone."""
    mic = Microphone()
    client = CallClient(url, microphone=mic, record_video=record_video)
    await client.connect()
    await client.wait_channel_open()
    await client.wait_state("listening", timeout=10)
    await asyncio.sleep(0.5)
    return client, mic


SPEAKING_MOTION = 2.0
"""Mean level change in the mouth box that counts as the mouth moving (idle is below 0.5)."""


def first_moving_frame_after(
    frames: list[tuple[float, int, np.ndarray]], box: tuple[int, int, int, int], t: float
) -> float | None:
    """Arrival of the first video frame after ``t`` whose mouth moved against the previous."""
    later = [f for f in frames if f[0] > t]
    if len(later) < 2:
        return None
    motion = mouth_motion([img for _, _, img in later], box)
    moving = np.flatnonzero(motion > SPEAKING_MOTION)
    return float(later[moving[0]][0]) if moving.size else None


async def one_turn(
    client: CallClient,
    mic: Microphone,
    pcm: np.ndarray,
    mouth_box: tuple[int, int, int, int] | None = None,
) -> dict[str, Any]:
    """One spoken question and its answer: client figures by packet arrival, the server's own."""
    _, voiced_end = voiced_span(pcm, 48_000)
    start = len(client.received.audio)
    video_start = len(client.received.video)
    handle = mic.play(pcm)
    turn = await client.wait_event(lambda e: e.get("type") == "turn", timeout=60)
    await client.wait_state("listening", timeout=30)
    speech_end = mic.sent_at(handle, voiced_end)
    lag = mic.lag_at(handle, voiced_end)
    first = first_loud_after(client.received.audio[start:], speech_end or 0.0)
    client_ms = None if first is None or speech_end is None else (first - speech_end) * 1000
    frame_ms = None
    if mouth_box is not None and speech_end is not None:
        video = client.received.video[video_start:]
        moving = first_moving_frame_after(video, mouth_box, speech_end)
        frame_ms = None if moving is None else (moving - speech_end) * 1000
        client.received.video.clear()  # the images are big; this turn is done with
    return {
        "client_first_audio_ms": client_ms,
        "client_first_speaking_frame_ms": frame_ms,
        # The caller's own lateness sending the last voiced frame: the figures above count from
        # when it was sent, and the frames due after it went out that much closer together.
        "mic_lag_ms": None if lag is None else lag * 1000,
        "server": turn["metrics"],
    }


async def _turns(
    url: str,
    turns: int,
    pcms: list[np.ndarray],
    offset: int,
    mouth_box: tuple[int, int, int, int] | None,
) -> list[dict[str, Any]]:
    # Video is converted (costly) only when the first speaking frame can be found.
    client, mic = await connect_caller(url, record_video=mouth_box is not None)
    results = []
    try:
        for i in range(turns):
            pcm = pcms[(i + offset) % len(pcms)]
            results.append(await one_turn(client, mic, pcm, mouth_box))
            progress(f"caller {offset + 1}: turn {i + 1}/{turns}")
            await asyncio.sleep(0.5)
    finally:
        await client.close()
    return results


async def _barge_ins(url: str, count: int) -> list[float]:
    client, mic = await connect_caller(url, record_video=False)
    long_pcm = await speech_pcm(LONG_QUESTION)
    stop_pcm = await speech_pcm(INTERRUPTION)
    onset, _ = voiced_span(stop_pcm, 48_000)
    cuts = []
    try:
        for _ in range(count):
            mic.play(long_pcm)
            await client.wait_event(lambda e: e == {"type": "state", "state": "speaking"}, 60)
            await asyncio.sleep(1.0)
            start = len(client.received.audio)
            handle = mic.play(stop_pcm)
            await client.wait_event(lambda e: e == {"type": "state", "state": "listening"}, 30)
            await asyncio.sleep(0.6)
            speech_onset = mic.sent_at(handle, onset) or 0.0
            stop = fell_silent_at(client.received.audio[start:], speech_onset)
            if stop is not None:
                cuts.append((stop - speech_onset) * 1000)
            progress(f"barge-in {len(cuts)}/{count}")
            # Let the answer to the interruption play out before the next round.
            await client.wait_event(lambda e: e.get("type") == "turn", 60)
            await client.wait_event(lambda e: e.get("type") == "turn", 60)
            await client.wait_state("listening", 30)
    finally:
        await client.close()
    return cuts


def stage_table(results: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    names = sorted({k for r in results for k in r["server"]})
    return {n: summary([r["server"][n] for r in results if n in r["server"]]) for n in names}


async def _measure(
    turns: int, calls: int, barge_ins: int, url: str | None, spawn: bool, llm: str
) -> dict[str, Any]:
    runner = None
    process = None
    mouth_box = None
    if url is None and spawn:
        url, process = await spawn_server("--llm", llm)
    elif url is None:
        url, runner, factory = await _server(llm=llm)
        mouth_box = factory.mouth_box if calls == 1 else None
    try:
        pcms = [await speech_pcm(q) for q in QUESTIONS]
        started = time.monotonic()
        per_call = await asyncio.gather(
            *(_turns(url, turns, pcms, c, mouth_box) for c in range(calls))
        )
        results = [r for call in per_call for r in call]
        cuts = await _barge_ins(url, barge_ins) if barge_ins else []
        elapsed = time.monotonic() - started
    finally:
        if runner is not None:
            await runner.cleanup()
        if process is not None:
            process.terminate()
            await process.wait()
    client = [r["client_first_audio_ms"] for r in results if r["client_first_audio_ms"] is not None]
    frames = [
        r["client_first_speaking_frame_ms"]
        for r in results
        if r["client_first_speaking_frame_ms"] is not None
    ]
    return {
        "client_first_speaking_frame_ms": summary(frames),
        "calls": calls,
        "turns": len(results),
        "client_first_audio_ms": summary(client),
        "server_stages_ms": stage_table(results),
        "barge_in_ms": summary(cuts),
        "raw": {"turns": results, "barge_in_ms": cuts},
        "elapsed_s": elapsed,
    }


async def spawn_server(
    *extra_args: str,
    ice_address: str = "127.0.0.1",
    log: IO[bytes] | None = None,
    tls: ssl.SSLContext | None = None,
    env: Mapping[str, str] | None = None,
) -> tuple[str, asyncio.subprocess.Process]:
    """``avatar-rtc serve`` in its own process on a free 127.0.0.1 port; waits for /readyz.

    ``extra_args`` go to ``serve``; ``log`` receives the server's stderr (default: discarded).
    With ``tls`` (a client context trusting the server's certificate, whose files are in
    ``extra_args``) the server is reached over HTTPS. ``env`` is added to this process's
    environment for the server (API keys, base URLs).
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "rtc_server",
        "serve",
        "--port",
        str(port),
        "--ice-address",
        ice_address,
        # One process unless asked otherwise: a front with a worker per core measures the
        # front too (bench load --workers N asks for it).
        *([] if "--workers" in extra_args else ["--workers", "1"]),
        # Every caller of a benchmark is on 127.0.0.1, one client address to the server.
        *([] if "--max-calls-per-client" in extra_args else ["--max-calls-per-client", "0"]),
        # The deterministic stand-in for an LLM unless one is asked for (--llm local: the
        # local model, openai: a stand-in's).
        *([] if "--llm" in extra_args else ["--llm", "echo"]),
        *extra_args,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=log if log is not None else asyncio.subprocess.DEVNULL,
        env={**os.environ, **env} if env else None,
    )
    url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=tls or True)) as http:
        for _ in range(600):
            if process.returncode is not None:
                raise RuntimeError(f"the server exited with {process.returncode}")
            try:
                async with http.get(url + "/readyz") as resp:
                    if resp.status == 200:
                        return url, process
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    process.terminate()
    raise RuntimeError("the server did not become ready in 60 s")


def run(
    turns: int,
    calls: int = 1,
    barge_ins: int = 0,
    url: str | None = None,
    spawn: bool = False,
    llm: str = "echo",
) -> dict[str, Any]:
    """``llm``: the server's LLM when the bench starts it (``echo``, ``local``)."""
    return asyncio.run(_measure(turns, calls, barge_ins, url, spawn, llm))
