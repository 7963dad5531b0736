"""A call's conversation without the network: what the caller does in, the avatar's speech and
events out.

In: the caller's VAD events (:meth:`TurnController.on_vad`), typed turns, says and interrupts,
and each media unit as the tracks present it (:meth:`~TurnController.on_unit`, which drives the
state). Out: replies and says spoken through the call's :class:`~rtc_server.speech.SpeechOutput`,
and the data channel's events (``state``, ``transcript``, ``response``, ``turn``, ``error``)
handed to a sink. Nothing here knows aiortc; the clock is injected.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rtc_server.call_tasks import CallTasks
from rtc_server.end_of_turn import EndOfTurnParams, SmartTurnModel, judge_pause
from rtc_server.media.scheduler import Unit
from rtc_server.metrics import Metrics
from rtc_server.providers.base import LLM, STT, TTS, ProviderError
from rtc_server.providers.openai_realtime import OpenAIRealtime
from rtc_server.realtime_turns import RealtimeTurns
from rtc_server.sentences import FirstWords, SentenceSplitter, bounded_pieces
from rtc_server.speculation import SpeculativeReply
from rtc_server.speech import SpeechOutput, Utterance
from rtc_server.turns import DEFAULT_SYSTEM_PROMPT, Conversation, TurnTimer
from rtc_server.vad import SAMPLE_RATE as VAD_RATE
from rtc_server.vad import (
    SileroModel,
    SpeechEnd,
    SpeechPause,
    SpeechResume,
    SpeechStart,
    VADEvent,
    VADParams,
    VADStream,
)
from signaling.errors import SignalingError
from signaling.messages import MAX_TEXT_CHARS, ClientEvent

APOLOGY = "Sorry, I ran into a problem answering that."
PAUSE_TAIL = VAD_RATE // 5
"""Silence (200 ms) added after the audio of a pause before it is transcribed."""
MAX_QUEUED_SAYS = 16
"""Says (and a reply) a call may have waiting or playing: more are refused, not queued."""
JUDGE_AFTER_S = 0.1
"""How long a pause lasts before the end-of-turn model is asked about it: 13 of 20 pauses
inside the bundled voice's sentences were over by then (32-96 ms; the longest 224 ms)."""

EventSink = Callable[[dict[str, Any]], None]
"""Takes one data-channel event (a JSON object)."""


class CallState(enum.StrEnum):
    """What the avatar is doing, as the ``state`` event names it."""

    LISTENING = "listening"
    THINKING = "thinking"
    SPEAKING = "speaking"


@dataclass(frozen=True, slots=True)
class Providers:
    """What a call talks with; shared by all calls of a process."""

    tts: TTS
    llm: LLM | None = None
    stt: STT | None = None
    vad: SileroModel | None = None
    fallback_tts: TTS | None = None
    """The local voice, for a spoken apology when a cloud TTS fails."""
    realtime: OpenAIRealtime | None = None
    """A speech-to-speech model that hears and answers in place of STT, LLM and TTS (which
    still speaks says)."""
    end_of_turn: SmartTurnModel | None = None
    """Judges at each pause whether the caller has finished (``ListenSettings.end_of_turn``)."""


@dataclass(frozen=True, slots=True)
class ListenSettings:
    vad: VADParams = field(default_factory=VADParams)
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    history_chars: int = 6000
    barge_in: bool = True
    max_text_chars: int = MAX_TEXT_CHARS
    """Longest say or typed turn on the data channel; longer ones get an error event."""
    end_of_turn: EndOfTurnParams | None = None
    """The hang-overs of a turn the end-of-turn model judges finished or not; None (or no
    model): every turn ends after ``vad.hangover_ms``."""
    speculate: bool = True
    """Start the reply (LLM and first sentence's voice) at a pause, before the turn ends."""
    first_words: FirstWords | None = None
    """The reply's first piece is spoken after its first words when its sentence has not
    ended by then and the LLM writes fast enough (rtc_server/sentences.py); None: after its
    first sentence or clause."""


class TurnController:
    """Turns, barge-in, early transcription, says and the apology of one call."""

    def __init__(
        self,
        providers: Providers,
        speech: SpeechOutput,
        *,
        sink: EventSink,
        tasks: CallTasks,
        metrics: Metrics,
        log: logging.Logger | logging.LoggerAdapter[Any],
        settings: ListenSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.providers = providers
        self.speech = speech
        self.settings = settings or ListenSettings()
        self.conversation = Conversation(self.settings.system_prompt, self.settings.history_chars)
        self.state = CallState.LISTENING
        self.last_turn: dict[str, float] | None = None
        """The stage metrics of the last finished turn."""
        self.clock = clock
        self.last_activity = clock()
        """When the caller spoke, typed or a say came in, or the state last changed."""
        self._sink = sink
        self.tasks = tasks
        self._metrics = metrics
        self.log = log
        self._speaking: set[asyncio.Task[Any]] = set()
        """Tasks producing speech (says and replies): barge-in cancels them all."""
        self._early_transcript: asyncio.Task[str] | None = None
        self._judging: asyncio.Task[None] | None = None
        self._speculating: asyncio.Task[SpeculativeReply | None] | None = None
        self._vad: VADStream | None = None
        self.judged_ms: float | None = None
        """How long the end-of-turn model took to judge the last pause."""
        self.realtime = (
            RealtimeTurns(self, providers.realtime) if providers.realtime is not None else None
        )

    def hear_through(self, vad: VADStream) -> None:
        """The VAD whose events come to :meth:`on_vad` (its pauses are judged here)."""
        self._vad = vad

    def start(self) -> None:
        """The call is up."""
        if self.realtime is not None:
            self.realtime.start()

    @property
    def listens(self) -> bool:
        """Whether the caller's speech is heard (it needs the VAD and something to hear it)."""
        return self.providers.vad is not None and (
            self.providers.stt is not None or self.realtime is not None
        )

    # -- in --------------------------------------------------------------------------------

    def on_vad(self, event: VADEvent) -> None:
        self.touch()
        if self.realtime is not None and self.realtime.service_turns:
            return  # the service's turn detection ends the turns, and barges in
        if isinstance(event, SpeechStart):
            if self.settings.barge_in and self.state is not CallState.LISTENING:
                self.log.info("barge-in")
                self.interrupt()
            if self.realtime is not None:
                self.realtime.speech_started(event.at, self.settings.vad.pre_roll_ms / 1000)
        elif self.realtime is not None:
            # The model hears the audio itself; our VAD (and the end-of-turn model) end turns.
            if isinstance(event, SpeechPause):
                self._judge(event.audio)
            elif isinstance(event, SpeechResume):
                self._drop_early_transcript()
            elif isinstance(event, SpeechEnd):
                self._judging = None
                self.interrupt()
                self.start_turn(self.realtime.speech_ended(self._timer(event)))
        elif isinstance(event, SpeechPause):
            # Transcribe while the hang-over runs: if the caller stays quiet, the text is
            # (nearly) ready when the turn ends, instead of only starting then.
            self._drop_early_transcript()
            # The pause is declared on the first quiet chunk, so the audio stops right at the
            # last sound; Whisper needs the silence after a word to hear its ending ("France"
            # came out "friends" without it). The end-of-turn audio has it from the hang-over.
            audio = np.concatenate([event.audio, np.zeros(PAUSE_TAIL, np.int16)])
            self._early_transcript = self.tasks.spawn(
                self._transcribe(audio), "early-stt", quiet=True
            )
            self._judge(event.audio)
            if self.settings.speculate and self.providers.llm is not None:
                self._speculating = self.tasks.spawn(
                    self._speculate(self._early_transcript), "speculate", quiet=True
                )
        elif isinstance(event, SpeechResume):
            self._drop_early_transcript()
        elif isinstance(event, SpeechEnd):
            timer = self._timer(event)
            early, self._early_transcript = self._early_transcript, None
            speculating, self._speculating = self._speculating, None
            self._judging = None
            self.interrupt()
            self.start_turn(self._hear(event, timer, early, speculating))

    def _timer(self, event: SpeechEnd) -> TurnTimer:
        timer = TurnTimer(self.clock() - (event.detected_at - event.at), clock=self.clock)
        timer.vad_end_s = event.detected_at - event.at
        return timer

    def handle(self, event: ClientEvent) -> None:
        """One valid message from the caller's data channel.

        An interrupt is not activity for the idle limit (a bot could hold a call open with
        them); says and typed text are.
        """
        if event.type == "say":
            self.say(event.text)
        elif event.type == "interrupt":
            self.interrupt()
        else:
            self.typed(event.text)

    def typed(self, text: str) -> None:
        """A turn the caller typed: answered as if spoken, after what is playing is cut."""
        self.touch()
        if self.realtime is not None:
            self.interrupt()
            timer = TurnTimer(self.clock(), clock=self.clock)
            self.start_turn(self.realtime.typed(text, timer))
            return
        if self.providers.llm is None:
            self.send({"type": "error", "code": "not_available", "message": "no LLM is configured"})
            return
        self.interrupt()
        self.start_turn(self._reply(text, TurnTimer(self.clock(), clock=self.clock)))

    def say(self, text: str, *, interrupt: bool = False) -> str:
        """Queue ``text`` to be spoken verbatim; returns its utterance id.

        SignalingError 429 ``say_queue_full`` when ``MAX_QUEUED_SAYS`` are waiting already."""
        if len(self._speaking) >= MAX_QUEUED_SAYS:
            raise SignalingError(
                429,
                "say_queue_full",
                f"{MAX_QUEUED_SAYS} says are queued in this call already; wait for them to play",
                headers={"Retry-After": "2"},
            )
        self.touch()
        if interrupt:
            self.interrupt()
        utterance_id = uuid.uuid4().hex
        task = self.tasks.spawn(self._say(text), f"say-{utterance_id[:8]}")
        self._speaking.add(task)
        task.add_done_callback(self._speaking.discard)
        self._metrics.utterances.inc()
        return utterance_id

    @property
    def speculation(self) -> SpeculativeReply | None:
        """The reply being prepared at the caller's pause, once its LLM request is made."""
        task = self._speculating
        if task is None or not task.done() or task.cancelled() or task.exception() is not None:
            return None
        return task.result()

    @property
    def queued_says(self) -> int:
        """Says and replies waiting or playing."""
        return len(self._speaking)

    def interrupt(self) -> None:
        """Stop speaking now: text queued, synthesis in flight and frames rendered are dropped."""
        if self.realtime is not None:
            self.realtime.interrupted()
        for task in list(self._speaking):
            task.cancel()
        self._speaking.clear()
        self.speech.clear()
        self.set_state(CallState.LISTENING)

    def on_unit(self, index: int, unit: Unit) -> None:
        """Called as each unit is presented: drives the state events."""
        if unit.speaking and self.speech.is_live(unit.segment_id):
            self.speech.on_unit(unit)
            self.set_state(CallState.SPEAKING)
        elif self.state is CallState.SPEAKING and not self._speaking:
            self.set_state(CallState.LISTENING)

    # -- out -------------------------------------------------------------------------------

    def send(self, event: dict[str, Any]) -> None:
        self._sink(event)

    def error(self, code: str, message: str) -> None:
        self.send({"type": "error", "code": code, "message": message})

    def touch(self) -> None:
        """Something happened in the call (for its idle limit)."""
        self.last_activity = self.clock()

    def set_state(self, state: CallState) -> None:
        if state is not self.state:
            self.state = state
            self.touch()
            self.send({"type": "state", "state": state.value})

    # -- turns -----------------------------------------------------------------------------

    def _drop_early_transcript(self) -> None:
        """The caller went on after a pause: what it started is of no use."""
        if self._early_transcript is not None:
            self._early_transcript.cancel()
            self._early_transcript = None
        if self._judging is not None:
            self._judging.cancel()
            self._judging = None
        if self._speculating is not None:
            self._discard(self._speculating)
            self._speculating = None

    def _discard(self, speculating: asyncio.Task[SpeculativeReply | None]) -> None:
        """Close a speculative reply not taken, once it exists; count it if it asked the LLM."""

        def closed(task: asyncio.Task[SpeculativeReply | None]) -> None:
            reply = None if task.cancelled() or task.exception() else task.result()
            if reply is not None and not reply.taken:
                reply.close()
                self._metrics.speculative_replies.labels("discarded").inc()
                self._metrics.discarded_speculation_deltas.inc(len(reply.deltas.items))

        if speculating.done():
            closed(speculating)
        else:
            speculating.cancel()  # still transcribing: no request was made
            speculating.add_done_callback(closed)

    def _judge(self, audio: np.ndarray) -> None:
        """Ask the end-of-turn model whether the turn is over: its pause then ends after the
        short hang-over or the long one (the long one while it thinks)."""
        model, params, vad = self.providers.end_of_turn, self.settings.end_of_turn, self._vad
        if model is None or params is None or vad is None:
            return
        vad.end_pause_after(params.incomplete_hangover_ms)

        async def judge() -> None:
            # Most pauses between words are over sooner: those ask the model nothing (its
            # thread would still be busy with them when the real end of the turn comes).
            await asyncio.sleep(JUDGE_AFTER_S)
            probability, self.judged_ms = await judge_pause(model, audio)
            self.log.debug("end of turn: p=%.2f in %.0f ms", probability, self.judged_ms)
            vad.end_pause_after(params.hangover_ms(probability))

        self._judging = self.tasks.spawn(judge(), "end-of-turn")

    async def _speculate(self, transcript: asyncio.Task[str]) -> SpeculativeReply | None:
        """The reply to the words so far, read ahead (None when no words were heard)."""
        text = await asyncio.shield(transcript)
        llm = self.providers.llm
        if not text or llm is None:
            return None
        return SpeculativeReply(
            llm,
            self.providers.tts,
            self.conversation.messages(),
            text,
            self.tasks,
            first_words=self.settings.first_words,
            clock=self.clock,
        )

    async def _transcribe(self, audio: np.ndarray) -> str:
        stt = self.providers.stt
        assert stt is not None
        return await stt.transcribe(audio, VAD_RATE)

    def start_turn(self, coro: Awaitable[None]) -> None:
        task = self.tasks.spawn(coro, "turn")
        self._speaking.add(task)
        task.add_done_callback(self._speaking.discard)

    async def _hear(
        self,
        event: SpeechEnd,
        timer: TurnTimer,
        early: asyncio.Task[str] | None,
        speculating: asyncio.Task[SpeculativeReply | None] | None = None,
    ) -> None:
        try:
            await self._hear_and_answer(event, timer, early, speculating)
        finally:
            if speculating is not None:
                self._discard(speculating)  # unless the reply took it (then it is closed)

    async def _hear_and_answer(
        self,
        event: SpeechEnd,
        timer: TurnTimer,
        early: asyncio.Task[str] | None,
        speculating: asyncio.Task[SpeculativeReply | None] | None,
    ) -> None:
        self.set_state(CallState.THINKING)
        # stt_ms counts from the end of the turn: the share of transcription the hang-over
        # did not already hide.
        timer.mark("stt_start")
        try:
            text = await (early if early is not None else self._transcribe(event.audio))
        except ProviderError as exc:
            self.log.warning("STT failed: %s", exc)
            self.error(exc.code, exc.public_message("speech recognition"))
            await self.apologize()
            return
        timer.mark("stt_end")
        if not text:
            self.set_state(CallState.LISTENING)
            return
        self.send({"type": "transcript", "text": text, "final": True})
        speculation = await _outcome(speculating) if speculating is not None else None
        if self.judged_ms is not None and self.settings.end_of_turn is not None:
            timer.stages["end_of_turn_ms"] = self.judged_ms
        await self._reply(text, timer, speculation)

    async def _reply(
        self, text: str, timer: TurnTimer, speculation: SpeculativeReply | None = None
    ) -> None:
        llm, tts = self.providers.llm, self.providers.tts
        assert llm is not None
        self.set_state(CallState.THINKING)
        first_piece = None
        if speculation is not None and speculation.matches(self.conversation.messages(), text):
            llm, tts = speculation.llm(), speculation.tts()
            first_piece = speculation.take()
            timer.speculated = True
            timer.stages["speculation_lead_ms"] = (self.clock() - speculation.started_at) * 1000
            self._metrics.speculative_replies.labels("used").inc()
        self.conversation.add("user", text)
        utterance = Utterance()
        try:
            await self.speech.speak(
                tts,
                self._sentences(llm, timer, first_piece),
                utterance,
                on_tts_audio=lambda: timer.mark("tts_first_audio"),
            )
            if utterance.first_push_at is not None:
                timer.mark("engine_first_push", utterance.first_push_at)
            await self.speech.wait_played(utterance)
        except Exception as exc:
            await self.reply_failed(exc)
        finally:
            if timer.speculated and speculation is not None:
                speculation.close()
            self.reply_ended(utterance, timer)

    async def reply_failed(self, exc: Exception) -> None:
        """A reply broke off: the caller is told how, and hears the apology."""
        if isinstance(exc, ProviderError):
            self.log.warning("reply failed: %s", exc)
            self.error(exc.code, exc.public_message("the reply"))
        else:
            # Not the provider's failure but ours: without the apology's speech the call
            # would stay "thinking" (and never idle out).
            self.log.exception("reply failed", exc_info=exc)
            self.error("internal", "the reply failed")
        await self.apologize()

    def reply_ended(self, utterance: Utterance, timer: TurnTimer) -> None:
        """A reply is over (played, failed or cut): its heard part goes into the history and
        the turn's metrics out."""
        self.conversation.add("assistant", utterance.played_text())
        self.speech.forget(utterance)
        if utterance.first_push_at is not None:
            timer.mark("engine_first_push", utterance.first_push_at)
        if utterance.first_played_at is not None:
            timer.mark("first_frame", utterance.first_played_at)
        self.finish_turn(timer)

    async def _sentences(
        self, llm: LLM, timer: TurnTimer, first_piece: str | None = None
    ) -> AsyncGenerator[str, None]:
        """The reply's pieces as the LLM writes them; ``first_piece``: the one a speculation
        cut (and voiced) from the same stream."""
        splitter = SentenceSplitter(
            first_words=self.settings.first_words, first_piece=first_piece, clock=self.clock
        )
        timer.mark("llm_start")
        async for delta in llm.stream(self.conversation.messages()):
            timer.mark("llm_first_token")
            for sentence in splitter.feed(delta):
                self.send({"type": "response", "text": sentence})
                timer.mark("tts_start")
                yield sentence
        for rest in splitter.flush():
            self.send({"type": "response", "text": rest})
            timer.mark("tts_start")
            yield rest

    def finish_turn(self, timer: TurnTimer) -> None:
        metrics = timer.metrics()
        self.last_turn = metrics
        for name, value in metrics.items():
            self._metrics.turn_stage.labels(name.removesuffix("_ms")).observe(value / 1000)
        self.send(
            {
                "type": "turn",
                "turn_id": uuid.uuid4().hex,
                "metrics": metrics,
                "speculated": timer.speculated,
            }
        )

    async def apologize(self) -> None:
        voice = self.providers.fallback_tts or self.providers.tts
        utterance = Utterance()
        with contextlib.suppress(ProviderError):
            await self.speech.speak(voice, _one(APOLOGY), utterance)
            await self.speech.wait_played(utterance)
        self.speech.forget(utterance)

    async def _say(self, text: str) -> None:
        utterance = Utterance()
        try:
            await self.speech.speak(self.providers.tts, _pieces(text), utterance)
            await self.speech.wait_played(utterance)
        except ProviderError as exc:
            self.log.warning("say failed: %s", exc)
            self.error(exc.code, exc.public_message("speech synthesis"))
        except Exception:
            self.log.exception("say failed")
            self.error("internal", "speech synthesis failed")
        finally:
            self.speech.forget(utterance)


async def _outcome(
    speculating: asyncio.Task[SpeculativeReply | None],
) -> SpeculativeReply | None:
    """The speculative reply, once its task has made it (None if it made none or failed)."""
    await asyncio.wait([speculating])
    if speculating.cancelled() or speculating.exception() is not None:
        return None
    return speculating.result()


async def _pieces(text: str) -> AsyncGenerator[str, None]:
    """A say's text in pieces short enough that barge-in and hang-up can cut in between."""
    for piece in bounded_pieces(text):
        yield piece


async def _one(text: str) -> AsyncGenerator[str, None]:
    yield text
