"""Which STT, LLM and TTS a server uses, and why: chosen once at start-up, logged."""

from __future__ import annotations

import logging
from concurrent.futures import Executor
from dataclasses import dataclass

from rtc_server.providers.base import LLM, STT, TTS

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Choice:
    slot: str
    name: str
    reason: str


def load_local(executor: Executor | None) -> tuple[STT | None, LLM, TTS, list[Choice]]:
    """The offline defaults: faster-whisper tiny.en, the echo LLM, Piper."""
    from rtc_server.providers.echo_llm import EchoLLM
    from rtc_server.providers.piper_tts import PiperTTS

    choices = []
    tts = PiperTTS.load(executor)
    choices.append(Choice("tts", tts.name, "offline default"))
    stt: STT | None
    try:
        from rtc_server.providers.whisper_stt import WhisperSTT

        stt = WhisperSTT.load(executor)
        choices.append(Choice("stt", stt.name, "offline default"))
    except RuntimeError as exc:
        stt = None
        choices.append(Choice("stt", "none", str(exc)))
    llm = EchoLLM()
    choices.append(Choice("llm", llm.name, "offline default"))
    for c in choices:
        logger.info("%s: %s (%s)", c.slot, c.name, c.reason)
    return stt, llm, tts, choices
