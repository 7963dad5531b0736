"""``bench stt``: how well the offline recognizer hears voices it was never tuned on, and its CPU.

Twenty held-out questions, each spoken by espeak-ng (from Debian: ``apt-get install
espeak-ng``) in two voices, American and British, neither of them the bundled Piper voice the
tests speak with. Each is transcribed through the server's own path
(:class:`rtc_server.providers.whisper_stt.WhisperSTT`: the short window, the full one when the
short one is unsure), by the server's Whisper tiny.en and, with ``--model DIR``, by another
CTranslate2 Whisper model (English-only or multilingual) for comparison. Reported per model and
voice: the word error rate (words lower-cased, number words as digits, so "seven" and "7" are
the same word) and the CPU time per question.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import re
import shutil
import subprocess
import time
import wave
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from benchmarks.report import table

if TYPE_CHECKING:
    from rtc_server.providers.whisper_stt import WhisperSTT

QUESTIONS = (
    "What is the capital of France?",
    "What is the capital of Italy?",
    "Who wrote the play Hamlet?",
    "How many legs does a spider have?",
    "Can you tell me a short joke?",
    "Which city is the capital of Spain?",
    "Which planet is the largest in our solar system?",
    "What do bees make?",
    "How far away is the moon?",
    "What is seven times eight?",
    "Recommend a good book for the weekend.",
    "Where is the Eiffel Tower?",
    "What is the tallest mountain in the world?",
    "Who painted the Mona Lisa?",
    "How do I boil an egg?",
    "What language do they speak in Brazil?",
    "Tell me something about elephants.",
    "What is the weather like today?",
    "Can you help me plan a trip to Rome?",
    "What time is it in Tokyo?",
)
VOICES = ("en-us", "en-gb+m3")
"""espeak-ng's American English, and its British English with a male variant."""
RATE_WPM = 165
NUMBERS = {
    w: str(i)
    for i, w in enumerate(
        "zero one two three four five six seven eight nine ten eleven twelve".split()
    )
}
SPELLINGS = {"colour": "color", "favourite": "favorite"}


def normal_words(text: str) -> list[str]:
    words = re.findall(r"[a-z0-9']+", text.lower().replace("\u2019", "'"))
    return [NUMBERS.get(w, SPELLINGS.get(w, w)) for w in words]


def word_errors(reference: str, heard: str) -> tuple[int, int]:
    """(substitutions + deletions + insertions, words of the reference)."""
    ref, hyp = normal_words(reference), normal_words(heard)
    row = list(range(len(hyp) + 1))
    for i in range(1, len(ref) + 1):
        diagonal, row[0] = row[0], i
        for j in range(1, len(hyp) + 1):
            best = min(row[j] + 1, row[j - 1] + 1, diagonal + (ref[i - 1] != hyp[j - 1]))
            diagonal, row[j] = row[j], best
    return row[len(hyp)], len(ref)


def espeak(text: str, voice: str) -> tuple[np.ndarray, int]:
    """``text`` spoken by espeak-ng in ``voice``: mono int16 and its rate."""
    binary = shutil.which("espeak-ng")
    if binary is None:
        raise SystemExit("bench stt needs espeak-ng: apt-get install espeak-ng")
    out = subprocess.run(
        [binary, "-v", voice, "-s", str(RATE_WPM), "--stdout", text],
        capture_output=True,
        check=True,
    ).stdout
    with wave.open(io.BytesIO(out)) as w:
        return np.frombuffer(w.readframes(w.getnframes()), np.int16), w.getframerate()


async def transcribe_all(
    stt: WhisperSTT, clips: list[tuple[np.ndarray, int]]
) -> tuple[list[str], float]:
    """What ``stt`` heard in each clip, and the process's CPU seconds it took in all."""
    await stt.transcribe(*clips[0])  # the first run allocates; not counted
    heard = []
    cpu = time.process_time()
    for pcm, rate in clips:
        heard.append(await stt.transcribe(pcm, rate))
    return heard, time.process_time() - cpu


def _recognizers(model_dir: Path | None) -> list[WhisperSTT]:
    from rtc_server.cpu_priority import blas_on_calling_thread
    from rtc_server.providers.whisper_stt import WhisperSTT

    blas_on_calling_thread()  # as the server: the features' last bits depend on it
    dirs = [None] if model_dir is None else [None, model_dir]
    return [WhisperSTT.load(model_dir=d) for d in dirs]


async def measure(
    questions: tuple[str, ...], voices: tuple[str, ...], model_dir: Path | None
) -> list[dict[str, Any]]:
    clips = {v: [espeak(q, v) for q in questions] for v in voices}
    rows = []
    for stt in _recognizers(model_dir):
        for voice in voices:
            heard, cpu_s = await transcribe_all(stt, clips[voice])
            counts = [word_errors(q, h) for q, h in zip(questions, heard, strict=True)]
            errors, words = sum(e for e, _ in counts), sum(n for _, n in counts)
            rows.append(
                {
                    "model": stt.name,
                    "voice": voice,
                    "word_errors": errors,
                    "words": words,
                    "wer_pct": 100 * errors / words,
                    "cpu_ms_per_question": 1000 * cpu_s / len(questions),
                    "misheard": [
                        {"said": q, "heard": h}
                        for q, h, (e, _) in zip(questions, heard, counts, strict=True)
                        if e
                    ],
                }
            )
    return rows


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "stt", help="the offline recognizer's word error rate in two espeak-ng voices, and CPU"
    )
    p.add_argument(
        "--model", type=Path, default=None, help="also a CTranslate2 Whisper model directory"
    )
    p.add_argument("--questions", type=int, default=len(QUESTIONS), help="how many to ask")
    return p


def command(args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    questions = QUESTIONS[: max(1, args.questions)]
    rows = asyncio.run(measure(questions, VOICES, args.model))
    for r in rows:
        for m in r["misheard"]:
            print(f"  [{r['model']}, {r['voice']}] {m['said']!r} -> {m['heard']!r}")
    print(
        table(
            ["model", "voice", "WER %", "errors / words", "CPU ms a question"],
            [
                [
                    r["model"],
                    r["voice"],
                    r["wer_pct"],
                    f"{r['word_errors']}/{r['words']}",
                    r["cpu_ms_per_question"],
                ]
                for r in rows
            ],
        )
    )
    settings = {"questions": len(questions), "voices": list(VOICES), "model": str(args.model)}
    return settings, {"rows": rows}
