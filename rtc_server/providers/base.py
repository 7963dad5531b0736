"""Provider seams: small protocols returning async iterators, and the errors they raise."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np

from musetalk_core.types import AudioChunk, AvatarRtcError


class ProviderError(AvatarRtcError):
    """A provider call that failed; ``retryable`` says whether trying again may help.

    Vendor and transport exceptions are translated into this at the provider boundary, so the
    turn logic deals with one type: 4xx (but 408/429) are final, 5xx/429/timeouts retryable.
    """

    def __init__(
        self,
        provider: str,
        message: str,
        *,
        retryable: bool,
        status: int | None = None,
        code: str = "provider_error",
    ) -> None:
        super().__init__(f"{provider}: {message}")
        self.provider = provider
        self.message = message
        self.retryable = retryable
        self.status = status
        self.code = code

    def public_message(self, what: str) -> str:
        """What a caller is told: ``what`` failed and how, in our words. The vendor's own text
        (it can name accounts, quotas, models or internal addresses) goes to the log only."""
        return f"{what} failed: the provider {PUBLIC_REASONS.get(self.code, 'failed')}"


PUBLIC_REASONS = {
    "timeout": "did not answer in time",
    "connection": "could not be reached",
    "rate_limited": "is rate limiting this server",
    "quota_exceeded": "has no quota left",
    "unauthorized": "refused this server's credentials",
    "server_error": "failed on its side",
    "bad_request": "refused the request",
    "bad_response": "sent an answer that could not be used",
    "vendor_error": "reported an error",
}
"""How a provider failed, by ProviderError code, as a caller may read it."""


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: Literal["system", "user", "assistant"]
    content: str


class STT(Protocol):
    """One VAD-segmented utterance in, its text out."""

    @property
    def name(self) -> str: ...

    async def transcribe(self, pcm: np.ndarray, sample_rate: int) -> str:
        """``pcm``: mono int16. Returns the text ("" for no speech)."""
        ...


class LLM(Protocol):
    """A chat turn in, the reply's text deltas out, as they are generated."""

    @property
    def name(self) -> str: ...

    def stream(self, messages: Sequence[ChatMessage]) -> AsyncGenerator[str, None]: ...


class TTS(Protocol):
    """Text in, mono int16 audio out, one chunk per sentence or finer, as soon as it is ready."""

    @property
    def name(self) -> str: ...

    @property
    def sample_rate(self) -> int: ...

    def synthesize(self, text: str, *, previous_text: str = "") -> AsyncGenerator[AudioChunk, None]:
        """Speak ``text``. ``previous_text``: what was just spoken before it in the same
        utterance ("" for none), so a voice that can may carry its prosody on; others ignore it.
        """
        ...
