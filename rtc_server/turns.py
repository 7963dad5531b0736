"""Conversation state of one call: bounded history and per-turn stage timings."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from rtc_server.providers.base import ChatMessage

DEFAULT_SYSTEM_PROMPT = (
    "You are a friendly avatar in a live video call, speaking out loud. Answer in one or two "
    "short sentences, without lists, markup or emojis. You have no internet, no clock and no "
    "camera: you cannot know today's weather, the news, the date or the time, and you cannot "
    "see the caller. When asked about those, say plainly that you cannot know them instead of "
    "guessing."
)
"""Written for the smallest model it meets, the local 0.5B one: shorter prompts let it invent
the weather and the time, longer ones (more topics, examples) made it worse at both
(benchmarks/README.md, "The local model's prompt")."""


class Conversation:
    """The chat history sent to the LLM: the system prompt always, then the newest turns
    that fit in ``budget_chars``."""

    def __init__(self, system_prompt: str = DEFAULT_SYSTEM_PROMPT, budget_chars: int = 6000):
        if budget_chars < len(system_prompt):
            raise ValueError("the history budget must hold at least the system prompt")
        self.system_prompt = system_prompt
        self.budget_chars = budget_chars
        self._turns: list[ChatMessage] = []

    def add(self, role: Literal["user", "assistant"], content: str) -> None:
        content = content.strip()
        if not content:
            return
        self._turns.append(ChatMessage(role, content))
        budget = self.budget_chars - len(self.system_prompt)
        while self._turns and sum(len(m.content) for m in self._turns) > budget:
            self._turns.pop(0)

    def messages(self) -> list[ChatMessage]:
        return [ChatMessage("system", self.system_prompt), *self._turns]


@dataclass
class TurnTimer:
    """Stage marks of one turn, on the call's clock; ``metrics()`` gives the turn event's names."""

    speech_end: float
    """When the user stopped speaking (or sent the typed turn)."""
    vad_end_s: float = 0.0
    marks: dict[str, float] = field(default_factory=dict)
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    """The clock of the marks (the call's)."""
    stages: dict[str, float] = field(default_factory=dict)
    """Durations (ms) measured elsewhere, reported as they are (``end_of_turn_ms``)."""
    speculated: bool = False
    """The reply was the one prepared at the caller's pause (rtc_server/speculation.py)."""

    def mark(self, name: str, at: float | None = None) -> None:
        self.marks.setdefault(name, self.clock() if at is None else at)

    def metrics(self) -> dict[str, float]:
        m = self.marks
        out: dict[str, float] = {"vad_end_ms": self.vad_end_s * 1000}

        def span(name: str, start: str, end: str) -> None:
            if start in m and end in m:
                out[name] = (m[end] - m[start]) * 1000

        span("stt_ms", "stt_start", "stt_end")
        span("llm_first_token_ms", "llm_start", "llm_first_token")
        span("tts_first_audio_ms", "tts_start", "tts_first_audio")
        span("engine_first_frame_ms", "engine_first_push", "first_frame")
        if "first_frame" in m:
            out["first_audio_out_ms"] = (m["first_frame"] - self.speech_end) * 1000
        out.update(self.stages)
        return {k: round(v, 1) for k, v in out.items()}
