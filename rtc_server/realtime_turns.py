"""A call's turns when one speech-to-speech model hears and answers (the OpenAI Realtime API).

The call's :class:`~rtc_server.turn_controller.TurnController` keeps what it does for every call
(state events, says in the local voice, the apology, turn metrics); this part replaces STT, LLM
and TTS with the call's :class:`~rtc_server.providers.openai_realtime.RealtimeLink`:

* The caller's audio, at 24 kHz, streams to the service while the caller speaks: from the VAD's
  start of speech (with the audio before it that the VAD keeps as pre-roll) to the end of the
  turn, in 100 ms pieces. At the end of the turn: commit, and a response. With the service's
  own turn detection (``--realtime-turns service``) all audio goes, our VAD's turn events are
  not used (the call's controller ignores them), the service commits and starts the responses,
  and its ``speech_started`` is the barge-in: the service cancels its response itself (our
  cancel after it is answered ``response_cancel_not_active``, which is harmless) and we
  truncate at what was heard.
* The reply's audio goes into the speech output as it arrives, one segment per response; its
  transcript becomes ``response`` events, sentence by sentence; the caller's transcription
  becomes the ``transcript`` event. Both go into the call's history, which seeds a renewed
  connection.
* A barge-in cuts the reply where the caller stopped hearing it: the audio of the frames
  presented (plus the leading silence trimmed before them), not a wall-clock estimate.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rtc_server.providers.openai_realtime import SAMPLE_RATE, OpenAIRealtime, RealtimeReply
from rtc_server.sentences import SentenceSplitter
from rtc_server.speech import Utterance
from rtc_server.turns import TurnTimer

if TYPE_CHECKING:
    from rtc_server.turn_controller import TurnController

APPEND_SAMPLES = SAMPLE_RATE // 10
"""The caller's audio goes in pieces of 100 ms."""
KEEP_SAMPLES = 2 * SAMPLE_RATE
"""Audio kept from before the start of speech is detected (the VAD reports it late)."""


@dataclass(slots=True)
class _Live:
    reply: RealtimeReply
    utterance: Utterance


class RealtimeTurns:
    """The speech-to-speech half of one call's turns (see the module docstring)."""

    def __init__(self, turns: TurnController, service: OpenAIRealtime) -> None:
        self._turns = turns
        self.service_turns = service.settings.service_turns
        """The service's turn detection ends the caller's turns (and barges in), not our VAD."""
        self.link = service.link(
            turns.tasks,
            history=turns.conversation.messages,
            on_transcript=self._heard,
            on_reply=self._unasked,
            on_speech_started=self._service_heard_speech,
            log=turns.log,
        )
        self._streaming = self.service_turns
        self._recent: deque[np.ndarray] = deque()
        self._recent_samples = 0
        self._pending: list[np.ndarray] = []
        self._pending_samples = 0
        self._received = 0
        """Samples of the caller's audio so far (its clock starts with the VAD's)."""
        self._live: _Live | None = None

    def start(self) -> None:
        """Connect as the call starts, so the first turn does not wait for a handshake."""
        self.link.ensure()

    # -- the caller's audio ----------------------------------------------------------------

    def on_audio(self, pcm: np.ndarray) -> None:
        """The caller's microphone, int16 at 24 kHz, as it is heard."""
        self._received += len(pcm)
        if self._streaming:
            self._queue(pcm)
            return
        self._recent.append(pcm)
        self._recent_samples += len(pcm)
        while self._recent and self._recent_samples - len(self._recent[0]) >= KEEP_SAMPLES:
            self._recent_samples -= len(self._recent.popleft())

    def speech_started(self, at: float, pre_roll_s: float) -> None:
        """The VAD heard speech begin at ``at`` (its clock, seconds): stream from there."""
        if self.service_turns:
            return
        self.link.ensure()
        back = int((self._received / SAMPLE_RATE - at + pre_roll_s) * SAMPLE_RATE)
        if self._recent:
            recent = np.concatenate(self._recent)
            self._queue(recent[-back:] if back > 0 else recent[:0])
        self._recent.clear()
        self._recent_samples = 0
        self._streaming = True

    def _queue(self, pcm: np.ndarray) -> None:
        self._pending.append(pcm)
        self._pending_samples += len(pcm)
        if self._pending_samples >= APPEND_SAMPLES:
            self._flush()

    def _flush(self) -> None:
        if self._pending_samples:
            self.link.append(np.concatenate(self._pending))
        self._pending.clear()
        self._pending_samples = 0

    # -- turns -----------------------------------------------------------------------------

    def speech_ended(self, timer: TurnTimer) -> Awaitable[None]:
        """The caller's turn ended (our VAD): commit what they said and answer it."""
        self._flush()
        self._streaming = self.service_turns
        return self._answer(lambda: self.link.respond(commit=True), timer)

    def typed(self, text: str, timer: TurnTimer) -> Awaitable[None]:
        def start() -> RealtimeReply:
            reply = self.link.ask(text)  # before the history has it: a renewal seeds that
            self._turns.conversation.add("user", text)
            return reply

        return self._answer(start, timer)

    def _unasked(self, reply: RealtimeReply) -> None:
        """A response the service's turn detection started."""
        turns = self._turns
        turns.interrupt()
        turns.start_turn(self._answer(lambda: reply, TurnTimer(turns.clock(), clock=turns.clock)))

    def _service_heard_speech(self) -> None:
        turns = self._turns
        if turns.settings.barge_in:
            turns.log.info("barge-in (the service heard speech)")
            turns.interrupt()

    def _heard(self, text: str) -> None:
        text = text.strip()
        if text:
            self._turns.send({"type": "transcript", "text": text, "final": True})
            self._turns.conversation.add("user", text)

    def interrupted(self) -> None:
        """The reply playing is cut (barge-in, a new turn, hang-up): tell the service what was
        heard of it."""
        live, self._live = self._live, None
        if live is not None:
            heard = sum(seg.heard_s for seg in live.utterance.segments)
            self.link.cut(live.reply, round(heard * 1000))

    async def _answer(self, start: Callable[[], RealtimeReply], timer: TurnTimer) -> None:
        from rtc_server.turn_controller import CallState

        turns = self._turns
        turns.set_state(CallState.THINKING)
        timer.mark("llm_start")
        reply = start()
        utterance = Utterance()
        live = self._live = _Live(reply, utterance)
        splitter = SentenceSplitter()

        def on_text(delta: str) -> None:
            timer.mark("llm_first_token")
            for sentence in splitter.feed(delta):
                turns.send({"type": "response", "text": sentence})

        reply.follow(on_text)
        try:
            await turns.speech.play(
                reply.chunks(), utterance, on_audio=lambda: timer.mark("tts_first_audio")
            )
            for rest in splitter.flush():
                turns.send({"type": "response", "text": rest})
            if utterance.first_push_at is not None:
                timer.mark("engine_first_push", utterance.first_push_at)
            await turns.speech.wait_played(utterance)
        except Exception as exc:
            await turns.reply_failed(exc)
        finally:
            if self._live is live:
                self._live = None
            for seg in utterance.segments:
                seg.text = reply.transcript
            turns.reply_ended(utterance, timer)
