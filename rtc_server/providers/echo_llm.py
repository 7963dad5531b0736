"""The offline default LLM: a short, deterministic answer built from what the user said."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncGenerator, Sequence

from rtc_server.providers.base import ChatMessage


class EchoLLM:
    """Answers "You said: <the user's words>." streamed word by word, like a real model.

    Every word costs video frames, so the answer stays short: the echo is capped at
    ``max_words`` words.
    """

    def __init__(self, *, max_words: int = 40) -> None:
        self.max_words = max_words

    @property
    def name(self) -> str:
        return "echo"

    async def stream(self, messages: Sequence[ChatMessage]) -> AsyncGenerator[str, None]:
        user = next((m.content for m in reversed(messages) if m.role == "user"), "")
        words = re.findall(r"\S+", user)[: self.max_words]
        said = " ".join(words).rstrip(".!?,;:")
        reply = f"You said: {said}." if said else "I did not catch that."
        for i, word in enumerate(reply.split(" ")):
            await asyncio.sleep(0)
            yield word if i == 0 else " " + word
