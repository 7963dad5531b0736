"""``bench prompt``: what the local model answers under a system prompt, and what it declines.

Twelve questions it cannot know the answer to (no internet, clock or camera): six the default
prompt (``rtc_server.turns.DEFAULT_SYSTEM_PROMPT``) was written against and six held out, and
eight plain questions with the word a right answer holds. Each is asked alone (the prompt as
system message, then the question), temperature 0, through the server's own model process
and provider. A reply "declines" when it says it cannot know, see or tell (a word list, not a
judgement: the answers are printed and kept to be read).
"""

from __future__ import annotations

import argparse
import asyncio
import re
from pathlib import Path
from typing import Any

from benchmarks.report import table

TUNED = (
    "What's the weather like today?",
    "What can you see right now?",
    "What is the latest news?",
    "What time is it?",
    "What do I look like?",
    "Who won the football match last night?",
)
HELD_OUT = (
    "Is it raining outside?",
    "What's the date today?",
    "What's happening in the world right now?",
    "What colour is my shirt?",
    "What's the stock price of Apple?",
    "What's the score of the basketball game?",
)
PLAIN = (
    ("What is the capital of Italy?", "rome"),
    ("Who wrote Hamlet?", "shakespeare"),
    ("What is two plus two?", "four"),
    ("What is the boiling point of water?", "100"),
    ("How many days are in a week?", "7"),
    ("Which city is the capital of France?", "paris"),
    ("What is the largest planet?", "jupiter"),
    ("What do bees make?", "honey"),
)
DECLINES = re.compile(
    r"\b(can't|cannot|can not|unable|don't know|do not know|not able|no internet|no clock|"
    r"no camera|don't have access|do not have access)\b",
    re.IGNORECASE,
)


def declines(answer: str) -> bool:
    return DECLINES.search(answer.replace("\u2019", "'")) is not None


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "prompt", help="the local model under a system prompt: questions it declines, answers"
    )
    p.add_argument(
        "--system-prompt", default=None, help="the prompt to try (default: the server's)"
    )
    return p


async def _ask_all(prompt: str, cache_dir: Path) -> list[dict[str, Any]]:
    from rtc_server.local_llm.process import ModelProcess, model_settings, socket_dir
    from rtc_server.local_llm.provider import LocalLLM
    from rtc_server.providers.base import ChatMessage
    from rtc_server.providers.http import HTTPPolicy

    settings = model_settings(cache_dir, socket_dir() / "model.sock")
    process = ModelProcess(settings, warm_prompt=prompt)
    await process.start()
    llm = LocalLLM(settings.socket_path, max_tokens=80, policy=HTTPPolicy())
    asked: list[tuple[str, str, str | None]] = [(q, "tuned", None) for q in TUNED]
    asked += [(q, "held_out", None) for q in HELD_OUT]
    asked += [(q, "plain", word) for q, word in PLAIN]
    out = []
    try:
        for question, kind, word in asked:
            messages = [ChatMessage("system", prompt), ChatMessage("user", question)]
            answer = "".join([d async for d in llm.stream(messages)]).strip()
            out.append({"question": question, "kind": kind, "answer": answer, "word": word})
    finally:
        await llm.aclose()
        await process.stop()
    return out


def summary(answers: list[dict[str, Any]]) -> dict[str, int]:
    def count(kind: str) -> int:
        return sum(declines(a["answer"]) for a in answers if a["kind"] == kind)

    plain = [a for a in answers if a["kind"] == "plain"]
    right = sum(a["word"] in re.findall(r"[a-z0-9]+", a["answer"].lower()) for a in plain)
    return {
        "declined_tuned": count("tuned"),
        "declined_held_out": count("held_out"),
        "plain_right": right,
        "plain": len(plain),
    }


def command(args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    from rtc_server.config import default_cache_dir
    from rtc_server.turns import DEFAULT_SYSTEM_PROMPT

    prompt = args.system_prompt or DEFAULT_SYSTEM_PROMPT
    answers = asyncio.run(_ask_all(prompt, default_cache_dir()))  # where `serve` keeps it
    for a in answers:
        mark = "declined" if declines(a["answer"]) else "-"
        print(f"[{a['kind']}] {a['question']} -> {a['answer']!r} ({mark})")
    s = summary(answers)
    print(
        table(
            ["declined, tuned", "declined, held out", "plain right"],
            [
                [
                    f"{s['declined_tuned']}/{len(TUNED)}",
                    f"{s['declined_held_out']}/{len(HELD_OUT)}",
                    f"{s['plain_right']}/{s['plain']}",
                ]
            ],
        )
    )
    return {"system_prompt": prompt}, {**s, "answers": answers}
