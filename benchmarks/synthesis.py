"""``bench synthesis``: replies that begin together on one process's synthesis threads.

Each reply is spoken as the server speaks an LLM answer: a short first piece (up to the first
clause, so that it begins soon), then the rest as soon as the first is synthesized. Its first
piece plays once synthesized; the rest must be ready before the first piece's audio has played,
or the caller hears a gap inside the reply. ``--replies N`` replies start at the same instant on
a pool of ``--threads`` threads with the bundled Piper voice, run through the server's pool
(earliest deadline first: rtc_server/synthesis_pool.py) and through a plain first-come pool,
one after the other. No network and no engine: what is measured is the order of the work.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any

from benchmarks.report import summary, table
from rtc_server.providers.piper_tts import PiperTTS
from rtc_server.synthesis_pool import DeadlinePool, due_in

FIRST = "You said:"
REST = "what is the capital of France, number {}."
POOLS = ("deadline", "first-come")


async def _speak(tts: PiperTTS, text: str) -> tuple[float, float]:
    """Synthesize ``text`` on the voice's pool as the server does, to the end of its chunks:
    (when its first chunk came, seconds of audio). The server plays a chunk as it comes."""
    first = None
    seconds = 0.0
    async for chunk in tts.synthesize(text):
        first = first or time.monotonic()
        seconds += len(chunk.pcm) / chunk.sample_rate
    assert first is not None
    return first, seconds


async def _reply(tts: PiperTTS, n: int, t0: float) -> dict[str, float]:
    ready, first_s = await _speak(tts, FIRST)
    # As rtc_server/speech.py does: the rest is due when the first piece has played.
    with due_in(first_s - (time.monotonic() - ready)):
        done, _ = await _speak(tts, REST.format(n))
    return {
        "first_audio_ms": (ready - t0) * 1000,
        "gap_ms": max(0.0, (done - (ready + first_s)) * 1000),
        "spare_ms": max(0.0, (ready + first_s - done) * 1000),
    }


def _pool(kind: str, threads: int) -> Executor:
    return DeadlinePool(threads) if kind == "deadline" else ThreadPoolExecutor(threads)


async def _measure(replies: list[int], threads: int, rounds: int) -> dict[str, Any]:
    await _speak(PiperTTS.load(deterministic=True), FIRST)  # loaded and warm
    out: dict[str, Any] = {"threads": threads, "rounds": rounds, "runs": []}
    for n in replies:
        for kind in POOLS:
            rows: list[dict[str, float]] = []
            for _ in range(rounds):
                pool = _pool(kind, threads)
                tts = PiperTTS.load(pool, deterministic=True)
                t0 = time.monotonic()
                rows += await asyncio.gather(*(_reply(tts, i, t0) for i in range(n)))
                pool.shutdown()
            out["runs"].append(
                {
                    "replies": n,
                    "pool": kind,
                    "torn": sum(1 for r in rows if r["gap_ms"] > 0),
                    "of": len(rows),
                    "gap_ms": summary([r["gap_ms"] for r in rows]),
                    "first_audio_ms": summary([r["first_audio_ms"] for r in rows]),
                    "replies_ms": rows,
                }
            )
    return out


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "synthesis", help="replies beginning together: gaps inside them, time to their start"
    )
    p.add_argument("--replies", type=int, nargs="+", default=[8, 12], help="replies at once")
    p.add_argument("--threads", type=int, default=2, help="synthesis threads (the server's)")
    p.add_argument("--rounds", type=int, default=3, help="times each is run")
    return p


HEADERS = ["replies", "pool", "torn", "gap p50 ms", "gap max", "first audio p50 ms", "max"]


def rows(r: dict[str, Any]) -> list[list[Any]]:
    return [
        [
            run["replies"],
            run["pool"],
            f"{run['torn']}/{run['of']}",
            run["gap_ms"]["p50"],
            run["gap_ms"]["max"],
            run["first_audio_ms"]["p50"],
            run["first_audio_ms"]["max"],
        ]
        for run in r["runs"]
    ]


def command(args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    if min(args.replies) < 1 or args.threads < 1 or args.rounds < 1:
        raise SystemExit("bench synthesis: --replies, --threads and --rounds are at least 1")
    r = asyncio.run(_measure(args.replies, args.threads, args.rounds))
    print(table(HEADERS, rows(r)))
    return {"replies": args.replies, "threads": args.threads, "rounds": args.rounds}, r
