"""``bench vad``: what Silero VAD costs per 32 ms chunk on this machine."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from benchmarks.clip import PARAGRAPH, speech_pcm
from benchmarks.report import summary
from rtc_server.vad import CHUNK, SAMPLE_RATE, SileroModel, VADStream


def run(seconds: float = 30.0) -> dict[str, Any]:
    speech = asyncio.run(speech_pcm(PARAGRAPH, SAMPLE_RATE))
    rng = np.random.default_rng(0)
    reps = int(np.ceil(seconds * SAMPLE_RATE / (2 * len(speech))))
    noise = (rng.normal(0, 100, len(speech))).astype(np.int16)
    track = np.concatenate([np.concatenate([speech, noise])] * reps)[: int(seconds * SAMPLE_RATE)]
    stream = VADStream(SileroModel())
    costs = []
    for i in range(0, len(track) - CHUNK + 1, CHUNK):
        t0 = time.perf_counter()
        stream.feed(track[i : i + CHUNK])
        costs.append((time.perf_counter() - t0) * 1000)
    s = summary(costs)
    return {
        "chunks": len(costs),
        "chunk_ms": CHUNK / SAMPLE_RATE * 1000,
        "cost_ms": s,
        "real_time_share": s["mean"] / (CHUNK / SAMPLE_RATE * 1000),
        "cost_ms_samples": costs,
    }
