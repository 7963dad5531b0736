"""Which STT, LLM and TTS a server uses, and why: chosen once at start-up and logged.

``auto`` takes a cloud provider when its key is in the environment, else the offline default
(faster-whisper tiny.en, the local language model, Piper; ``echo`` where the local model is
not installed or its weights were refused). The local voice is loaded in every case: it
speaks the apology when a cloud TTS fails.
"""

from __future__ import annotations

import logging
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp

from rtc_server.config import ServerConfig
from rtc_server.cpu_priority import side_by_side
from rtc_server.providers.base import LLM, STT, TTS
from rtc_server.providers.http import ELEVENLABS_BASE_URL, HTTPPolicy
from rtc_server.providers.openai_realtime import OpenAIRealtime
from rtc_server.providers.openai_sdk import OPENAI_BASE_URL, openai_client

if TYPE_CHECKING:
    from openai import AsyncOpenAI

    from rtc_server.local_llm.process import ModelSettings

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Choice:
    slot: str
    name: str
    reason: str


@dataclass(frozen=True, slots=True)
class Chosen:
    stt: STT | None
    llm: LLM
    tts: TTS
    local_tts: TTS
    choices: tuple[Choice, ...]
    realtime: OpenAIRealtime | None = None
    """``--conversation openai-realtime``: the model that hears and answers."""
    openai: AsyncOpenAI | None = None
    """The SDK client every OpenAI provider here shares; the app closes it at shutdown."""
    model: ModelSettings | None = None
    """The local model's process, for the app to start (``llm`` talks to it); None when the
    LLM is not local or the front runs the process."""


OFFLINE = "auto: no cloud key in the environment, offline default"


def _pick(slot: str, wanted: str, cloud: list[tuple[str, bool, str]], local: str) -> Choice:
    """``cloud``: (name, usable, why) in order of preference."""
    if wanted != "auto":
        return Choice(slot, wanted, "asked for")
    for name, usable, why in cloud:
        if usable:
            return Choice(slot, name, f"auto: {why}")
    return Choice(slot, local, OFFLINE)


def _offline_llm(choice: Choice) -> Choice:
    """``local`` as chosen, or ``echo`` with the reason when the local model is not installed
    (its weights' hash is checked when the providers load: :func:`_local_llm`)."""
    if choice.name != "local":
        return choice
    from rtc_server import local_llm

    why = local_llm.missing()
    if why is None:
        return choice
    return Choice("llm", "echo", f"{choice.reason}; the local model cannot run: {why}")


def refused_local_llm(choice: Choice, reason: str) -> Choice:
    """The ``echo`` fallback of a local model that was chosen but could not be used."""
    return Choice("llm", "echo", f"{choice.reason}; the local model was refused: {reason}")


def choose(config: ServerConfig) -> tuple[Choice, Choice, Choice]:
    openai_key = bool(config.conversation.openai_api_key)
    stt = _pick(
        "stt", config.conversation.stt, [("openai", openai_key, "OPENAI_API_KEY is set")], "local"
    )
    llm = _pick(
        "llm",
        config.conversation.llm,
        [
            (
                "openai",
                openai_key or bool(config.conversation.openai_base_url),
                "an OpenAI key or base URL is set",
            )
        ],
        "local",
    )
    llm = _offline_llm(llm)
    tts = _pick(
        "tts",
        config.conversation.tts,
        [
            (
                "elevenlabs",
                bool(config.conversation.elevenlabs_api_key),
                "ELEVENLABS_API_KEY is set",
            ),
            ("openai", openai_key, "OPENAI_API_KEY is set"),
        ],
        "piper",
    )
    return stt, llm, tts


def load_providers(
    config: ServerConfig, http: aiohttp.ClientSession, executor: Executor | None
) -> Chosen:
    """Build the chosen providers; blocking (model loads), so run it off the event loop."""
    from rtc_server.providers.piper_tts import PiperTTS

    stt_choice, llm_choice, tts_choice = choose(config)
    key = config.conversation.openai_api_key or ""
    base = config.conversation.openai_base_url or OPENAI_BASE_URL
    local_tts = PiperTTS.load(
        executor,
        deterministic=config.conversation.piper_deterministic,
        cache_dir=config.server.cache_dir,
    )
    policy = HTTPPolicy(
        max_attempts=config.conversation.provider_attempts,
        backoff_initial_s=config.conversation.provider_backoff_s,
        read_timeout_s=config.conversation.provider_read_timeout_s,
    )

    realtime = _realtime(config, policy)
    if realtime is not None:
        # The model hears the caller and writes the replies: no STT to load, no LLM to ask.
        why = "--conversation openai-realtime"
        stt_choice = Choice("stt", realtime.name, why)
        llm_choice = Choice("llm", realtime.name, why)

    # One SDK client (one connection pool) for every OpenAI provider of the app.
    openai: AsyncOpenAI | None = None
    if realtime is not None:
        openai = realtime.client
    elif "openai" in (stt_choice.name, llm_choice.name, tts_choice.name):
        openai = openai_client(key, base, policy)

    stt: STT | None
    if realtime is not None:
        stt = None
    elif stt_choice.name == "openai":
        from rtc_server.providers.openai_stt import OpenAISTT

        assert openai is not None
        stt = OpenAISTT(openai, policy=policy)
    else:
        try:
            from rtc_server.providers.whisper_stt import WhisperSTT

            # As many turns transcribed at once as this process has cores to run them, each
            # on two threads: one question alone 0.09 s against 0.13 s on one (2 cores, 0.13 s
            # of CPU either way), two at once no slower (0.14 s).
            at_once = side_by_side(config.server.cpu_limit)
            stt = WhisperSTT.load(threads=min(2, at_once), parallel=at_once)
        except RuntimeError as exc:
            stt = None
            stt_choice = Choice("stt", "none", f"{exc}; calls take typed turns only")

    llm: LLM
    model: ModelSettings | None = None
    if realtime is None and llm_choice.name == "local":
        llm, model, llm_choice = _local_llm(config, policy, llm_choice)
    elif realtime is None and llm_choice.name == "openai":
        from rtc_server.providers.openai_llm import OpenAILLM

        assert openai is not None
        llm = OpenAILLM(
            openai,
            model=config.conversation.llm_model,
            max_tokens=config.conversation.max_tokens,
            system_prompt="",
            policy=policy,
        )
    else:
        from rtc_server.providers.echo_llm import EchoLLM

        llm = EchoLLM()

    tts: TTS
    if tts_choice.name == "elevenlabs":
        from rtc_server.providers.elevenlabs_tts import DEFAULT_VOICE_ID, ElevenLabsTTS

        tts = ElevenLabsTTS(
            http,
            api_key=config.conversation.elevenlabs_api_key or "",
            base_url=config.conversation.elevenlabs_base_url or ELEVENLABS_BASE_URL,
            voice_id=config.conversation.elevenlabs_voice or DEFAULT_VOICE_ID,
            policy=policy,
        )
    elif tts_choice.name == "openai":
        from rtc_server.providers.openai_tts import OpenAITTS

        assert openai is not None
        tts = OpenAITTS(
            openai,
            voice=config.conversation.openai_tts_voice,
            policy=policy,
        )
    else:
        tts = local_tts

    choices = (stt_choice, llm_choice, tts_choice)
    for c in choices:
        logger.info("%s: %s (%s)", c.slot, c.name, c.reason)
    return Chosen(stt, llm, tts, local_tts, choices, realtime, openai=openai, model=model)


def _local_llm(
    config: ServerConfig, policy: HTTPPolicy, choice: Choice
) -> tuple[LLM, ModelSettings | None, Choice]:
    """The local model's provider, and the process to start for it unless the front runs one;
    ``echo`` when its weights are refused (the reason logged and in the choice)."""
    from rtc_server.local_llm.process import ModelProcessError, model_settings, socket_dir
    from rtc_server.local_llm.provider import LocalLLM
    from rtc_server.local_llm.weights import WeightsRefused
    from rtc_server.providers.echo_llm import EchoLLM

    max_tokens = config.conversation.max_tokens
    socket = config.conversation.local_model_socket
    if socket is not None:
        return LocalLLM(socket, max_tokens=max_tokens, policy=policy), None, choice
    folder = socket_dir()
    try:
        settings = model_settings(config.server.cache_dir, folder / "model.sock")
    except (WeightsRefused, ModelProcessError) as exc:
        folder.rmdir()
        logger.error("the local model was refused, answering with echo: %s", exc)
        return EchoLLM(), None, refused_local_llm(choice, str(exc))
    llm = LocalLLM(settings.socket_path, max_tokens=max_tokens, policy=policy)
    return llm, settings, choice


def _realtime(config: ServerConfig, policy: HTTPPolicy) -> OpenAIRealtime | None:
    conversation = config.conversation
    if conversation.mode != "openai-realtime":
        return None
    from rtc_server.providers.openai_realtime import RealtimeSettings
    from rtc_server.turns import DEFAULT_SYSTEM_PROMPT

    client = openai_client(
        conversation.openai_api_key, conversation.openai_base_url or OPENAI_BASE_URL, policy
    )
    settings = RealtimeSettings(
        model=conversation.realtime_model,
        voice=conversation.realtime_voice,
        instructions=conversation.system_prompt or DEFAULT_SYSTEM_PROMPT,
        transcription_model=conversation.realtime_transcription_model or None,
        service_turns=conversation.realtime_turns == "service",
        connect_timeout_s=policy.connect_timeout_s,
        read_timeout_s=policy.read_timeout_s,
        max_session_s=conversation.realtime_session_s,
    )
    return OpenAIRealtime(client, settings)
