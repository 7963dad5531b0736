"""The turn controller on its own: no peer, no server, a clock moved by hand.

The call's real speech output and scheduler are used; the test presents the media units itself
(as the audio track would, one per 40 ms of the manual clock), and the providers are small
fakes that record what they were asked.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import Executor, Future
from typing import Any

import numpy as np
import pytest

from musetalk_core.types import AudioChunk
from rtc_server.call_tasks import CallTasks
from rtc_server.media.clock import ManualClock
from rtc_server.media.scheduler import AVScheduler
from rtc_server.metrics import Metrics
from rtc_server.providers.base import ChatMessage, ProviderError
from rtc_server.speech import SpeechOutput
from rtc_server.turn_controller import (
    APOLOGY,
    PAUSE_TAIL,
    CallState,
    ListenSettings,
    Providers,
    TurnController,
)
from rtc_server.vad import SpeechEnd, SpeechPause, SpeechResume, SpeechStart
from signaling.messages import ClientEvent
from tests.fakes import CountingEngine
from tests.waiting import wait_until

UNIT_S = 0.04
SENTENCE_S = 0.4
"""How long the fake voice speaks each sentence: 10 units."""

log = logging.getLogger("test-turns")


class FakeSTT:
    """Hears what the test says it hears; can be held, or fail."""

    name = "fake-stt"

    def __init__(self, text: str = "what is the capital of france") -> None:
        self.text = text
        self.heard: list[int] = []
        """Samples of each audio it was given."""
        self.gate: asyncio.Event | None = None
        self.fail = False

    async def transcribe(self, pcm: np.ndarray, sample_rate: int) -> str:
        assert sample_rate == 16_000
        self.heard.append(len(pcm))
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            raise ProviderError("fake-stt", "no ears today", retryable=True, code="stt_failed")
        return self.text


class FakeLLM:
    name = "fake-llm"

    def __init__(self, reply: str = "Paris is the capital. It is lovely.") -> None:
        self.reply = reply
        self.asked: list[list[ChatMessage]] = []

    async def stream(self, messages: Sequence[ChatMessage]) -> AsyncGenerator[str, None]:
        self.asked.append(list(messages))
        for word in self.reply.split(" "):
            yield word + " "


class FakeTTS:
    """Speaks every text as SENTENCE_S of a steady tone at the call's rate."""

    name = "fake-tts"
    sample_rate = 48_000

    def __init__(self) -> None:
        self.spoken: list[str] = []

    async def synthesize(
        self, text: str, *, previous_text: str = ""
    ) -> AsyncGenerator[AudioChunk, None]:
        self.spoken.append(text)
        yield AudioChunk(np.full(int(48_000 * SENTENCE_S), 3000, np.int16), 48_000)


class Call:
    """A controller wired to a real speech output, with the test as the audio track."""

    def __init__(
        self, *, stt: FakeSTT | None = None, llm: FakeLLM | None = None, **settings: Any
    ) -> None:
        self.clock = ManualClock()
        self.scheduler = AVScheduler(CountingEngine(), self.clock, on_unit=self._on_unit)
        self.scheduler.register("audio")
        self.tts, self.fallback = FakeTTS(), FakeTTS()
        self.stt = stt or FakeSTT()
        self.llm = llm or FakeLLM()
        self.events: list[dict[str, Any]] = []
        self.tasks = CallTasks("0" * 32, log)
        self.turns = TurnController(
            Providers(tts=self.tts, llm=self.llm, stt=self.stt, fallback_tts=self.fallback),
            SpeechOutput(self.scheduler, InlineExecutor(), clock=self.clock.now),
            sink=self.events.append,
            tasks=self.tasks,
            metrics=Metrics(),
            log=log,
            settings=ListenSettings(**settings),
            clock=self.clock.now,
        )
        self.next_unit = 0
        self.spoken_units = 0

    def _on_unit(self, index: int, unit: Any) -> None:
        self.spoken_units += unit.speaking
        self.turns.on_unit(index, unit)

    def present(self, units: int) -> None:
        """Play ``units`` instants, as the audio track does on the clock."""
        for _ in range(units):
            self.clock.advance(UNIT_S)
            self.scheduler.unit(self.next_unit, "audio")
            self.next_unit += 1

    async def play_until(self, done: Callable[[], bool], limit_units: int = 500) -> None:
        """Present units (letting the tasks run in between) until ``done()``."""
        for _ in range(limit_units):
            if done():
                return
            self.present(1)
            await settle()
        if done():
            return
        raise AssertionError(f"not done after {limit_units} units; events {self.events}")

    def states(self) -> list[str]:
        return [e["state"] for e in self.events if e["type"] == "state"]

    def of_type(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind]

    async def close(self) -> None:
        await self.tasks.cancel_all()


class InlineExecutor(Executor):
    """Runs what it is given at once: the speech output's resampling, deterministically (a
    thread would finish after some unknown number of the test's presented units)."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:
            future.set_exception(exc)
        return future


async def settle() -> None:
    """Let every task that can run, run (nothing here waits on a thread or a timer)."""
    for _ in range(20):
        await asyncio.sleep(0)


def utterance(seconds: float) -> np.ndarray:
    return np.full(int(16_000 * seconds), 500, np.int16)


def end_of(audio: np.ndarray, *, hangover_s: float = 0.5) -> SpeechEnd:
    at = len(audio) / 16_000
    return SpeechEnd(at=at, detected_at=at + hangover_s, audio=audio)


async def test_a_spoken_turn_uses_the_transcript_started_at_the_pause() -> None:
    call = Call()
    audio = utterance(1.0)
    call.turns.on_vad(SpeechStart(at=0.0))
    call.turns.on_vad(SpeechPause(audio=audio))
    await wait_until(lambda: len(call.stt.heard) == 1)
    assert call.stt.heard == [len(audio) + PAUSE_TAIL]  # the pause's audio, with a tail
    call.clock.advance(0.5)  # the hang-over
    call.turns.on_vad(end_of(audio))
    await wait_until(lambda: bool(call.of_type("response")))
    await call.play_until(lambda: bool(call.of_type("turn")))
    # The state goes back with the first idle unit presented after the reply's task ended.
    await call.play_until(lambda: call.turns.state is CallState.LISTENING, 2)
    assert len(call.stt.heard) == 1  # the early transcript was the turn's
    assert call.of_type("transcript") == [
        {"type": "transcript", "text": "what is the capital of france", "final": True}
    ]
    assert [e["text"] for e in call.of_type("response")] == [
        "Paris is the capital.",
        "It is lovely.",
    ]
    assert call.tts.spoken == ["Paris is the capital.", "It is lovely."]
    assert call.states() == ["thinking", "speaking", "listening"]
    assert call.spoken_units == 2 * SENTENCE_S / UNIT_S  # both sentences, whole
    metrics = call.of_type("turn")[0]["metrics"]
    assert metrics["vad_end_ms"] == 500.0
    assert metrics["stt_ms"] == 0.0  # ready before the turn ended: the manual clock stood still
    assert metrics["first_audio_out_ms"] >= 500.0  # counted from where the speech ended
    assert [m.role for m in call.turns.conversation.messages()] == ["system", "user", "assistant"]
    assert call.turns.conversation.messages()[-1].content == "Paris is the capital. It is lovely."
    assert call.turns.last_turn == metrics
    await call.close()


async def test_speech_resumed_after_the_pause_is_transcribed_whole() -> None:
    call = Call()
    call.stt.gate = asyncio.Event()
    first = utterance(0.6)
    call.turns.on_vad(SpeechStart(at=0.0))
    call.turns.on_vad(SpeechPause(audio=first))
    await wait_until(lambda: len(call.stt.heard) == 1)
    call.turns.on_vad(SpeechResume())  # the early transcript is dropped
    whole = utterance(1.5)
    call.turns.on_vad(end_of(whole))
    call.stt.gate.set()
    await wait_until(lambda: bool(call.of_type("transcript")))
    assert call.stt.heard == [len(first) + PAUSE_TAIL, len(whole)]
    await call.close()


async def test_barge_in_cuts_the_reply_and_keeps_only_what_was_heard() -> None:
    call = Call(llm=FakeLLM("One two three four five six seven eight nine ten."))
    call.turns.typed("count for me")
    await wait_until(lambda: bool(call.of_type("response")))
    await call.play_until(lambda: call.turns.state is CallState.SPEAKING)
    call.present(4)  # half of the ten-unit sentence is heard (it started a unit ago)
    call.turns.on_vad(SpeechStart(at=3.0))
    assert call.turns.state is CallState.LISTENING
    assert call.states() == ["thinking", "speaking", "listening"]
    assert not call.scheduler.speech_pending  # what was queued is gone
    before = call.spoken_units
    call.present(20)
    assert call.spoken_units == before  # nothing more of it plays
    await wait_until(lambda: bool(call.of_type("turn")))
    heard = call.turns.conversation.messages()[-1]
    assert heard.role == "assistant" and heard.content == "One two three four five"
    await call.close()


async def test_without_barge_in_the_caller_speaking_does_not_cut_the_reply() -> None:
    call = Call(barge_in=False)
    call.turns.typed("hello")
    await call.play_until(lambda: call.turns.state is CallState.SPEAKING)
    call.turns.on_vad(SpeechStart(at=1.0))
    assert call.turns.state is CallState.SPEAKING
    await call.play_until(lambda: bool(call.of_type("turn")))
    assert call.spoken_units == 2 * SENTENCE_S / UNIT_S
    await call.close()


async def test_a_failed_transcription_is_told_and_apologised_for_in_the_local_voice(
    caplog: pytest.LogCaptureFixture,
) -> None:
    call = Call()
    call.stt.fail = True
    call.turns.on_vad(SpeechStart(at=0.0))
    call.turns.on_vad(end_of(utterance(1.0)))
    await call.play_until(lambda: bool(call.fallback.spoken) and call.spoken_units >= 10)
    await call.play_until(lambda: call.turns.state is CallState.LISTENING)
    errors = call.of_type("error")
    assert [e["code"] for e in errors] == ["stt_failed"]
    # The caller hears what failed; the provider's own words go to the log only.
    assert errors[0]["message"].startswith("speech recognition failed")
    assert "no ears today" not in errors[0]["message"]
    assert "no ears today" in caplog.text
    assert call.fallback.spoken == [APOLOGY] and call.tts.spoken == []
    assert call.llm.asked == []  # nothing to answer
    await call.close()


async def test_an_empty_transcript_goes_back_to_listening_without_a_reply() -> None:
    call = Call(stt=FakeSTT(""))
    call.turns.on_vad(end_of(utterance(0.5)))
    await wait_until(lambda: call.states() == ["thinking", "listening"])
    assert call.llm.asked == [] and call.of_type("transcript") == []
    await call.close()


async def test_a_say_is_spoken_verbatim_and_a_say_with_interrupt_replaces_it() -> None:
    call = Call()
    call.turns.handle(ClientEvent("say", "First words here."))
    await call.play_until(lambda: call.turns.state is CallState.SPEAKING)
    call.turns.say("Second words.", interrupt=True)
    await call.play_until(lambda: len(call.states()) == 4, 100)
    assert call.states() == ["speaking", "listening", "speaking", "listening"]
    assert call.tts.spoken == ["First words here.", "Second words."]
    assert call.llm.asked == []  # a say is not a turn
    await call.close()


async def test_a_typed_turn_without_an_llm_gets_an_error_and_changes_nothing() -> None:
    call = Call()
    call.turns.providers = Providers(tts=call.tts)
    call.turns.handle(ClientEvent("text", "hi"))
    assert call.events == [
        {"type": "error", "code": "not_available", "message": "no LLM is configured"}
    ]
    assert call.turns.state is CallState.LISTENING
    await call.close()


async def test_activity_is_stamped_on_the_injected_clock() -> None:
    call = Call()
    assert call.turns.last_activity == 0.0
    call.clock.advance(7.0)
    # An interrupt is no activity: a bot sending them must not keep the call open.
    call.turns.handle(ClientEvent("interrupt"))
    assert call.turns.last_activity == 0.0
    call.turns.handle(ClientEvent("say", "Hello."))
    assert call.turns.last_activity == 7.0
    call.clock.advance(2.0)
    call.turns.on_vad(SpeechStart(at=0.0))
    assert call.turns.last_activity == 9.0
    await call.close()


def test_states_are_the_event_names() -> None:
    assert [s.value for s in CallState] == ["listening", "thinking", "speaking"]
    assert CallState.LISTENING == "listening"  # a StrEnum: the wire's string


@pytest.mark.parametrize("kind", ["say", "text"])
async def test_a_failing_voice_is_told_and_the_call_listens_again(kind: str) -> None:
    class BrokenTTS(FakeTTS):
        async def synthesize(
            self, text: str, *, previous_text: str = ""
        ) -> AsyncGenerator[AudioChunk, None]:
            raise ProviderError("fake-tts", "hoarse", retryable=False, code="tts_failed")
            yield  # pragma: no cover

    call = Call()
    call.turns.providers = Providers(
        tts=BrokenTTS(), llm=call.llm, stt=call.stt, fallback_tts=call.fallback
    )
    call.turns.handle(ClientEvent(kind, "hello there"))
    await call.play_until(lambda: bool(call.of_type("error")))
    assert call.of_type("error")[0]["code"] == "tts_failed"
    if kind == "text":  # a turn apologises in the local voice; a say only reports
        await call.play_until(lambda: call.fallback.spoken == [APOLOGY])
    await call.play_until(lambda: call.turns.state is CallState.LISTENING)
    await call.close()
