"""The local model as an LLM provider: the OpenAI-compatible one, on the model process's socket.

Nothing here is particular to llama.cpp but the address: the requests, the streamed answer,
its errors and retries are :class:`~rtc_server.providers.openai_llm.OpenAILLM`'s, as for any
local model server reached through ``OPENAI_BASE_URL``. The settings are deterministic
(temperature 0: the most likely token every time), so the same conversation gets the same
answer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path

from rtc_server.providers.base import ChatMessage
from rtc_server.providers.http import HTTPPolicy
from rtc_server.providers.openai_llm import OpenAILLM
from rtc_server.providers.openai_sdk import openai_client
from rtc_server.sentences import FirstWords

LOCAL_BASE_URL = "http://localhost/v1"
"""What the SDK is told; the requests go to the unix socket."""
RESTART_ATTEMPTS = 5
"""Tries of a request that could not reach the model process (0.25 + 0.5 + 1 + 2 s of waits):
one that died is back, loaded, within about a second."""

FIRST_WORDS = FirstWords(words=4, min_rate=10.0)
"""The local model writes about 27 tokens a second on two cores: a first sentence of 8-10
tokens is a third of a second, and its synthesis as long again. Its replies are spoken from
their first four words on (rtc_server/sentences.py), the rest of the sentence written and
synthesized while those play, unless it writes slower than 10 tokens a second (a model
shared by several speaking calls): then the rest would come after a gap mid-sentence
(benchmarks/README.md, "the local language model")."""


class LocalLLM:
    """Replies from the model process listening on ``socket_path``."""

    def __init__(self, socket_path: Path, *, max_tokens: int, policy: HTTPPolicy) -> None:
        self.socket_path = socket_path
        attempts = max(policy.max_attempts, RESTART_ATTEMPTS)
        policy = dataclasses.replace(policy, max_attempts=attempts)
        self._client = openai_client(None, LOCAL_BASE_URL, policy, uds=str(socket_path))
        self._llm = OpenAILLM(
            self._client,
            model="local",
            system_prompt="",
            max_tokens=max_tokens,
            temperature=0.0,
            policy=policy,
        )

    @property
    def name(self) -> str:
        return "local"

    def stream(self, messages: Sequence[ChatMessage]) -> AsyncGenerator[str, None]:
        return self._llm.stream(messages)

    async def aclose(self) -> None:
        await self._client.close()
