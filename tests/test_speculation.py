"""Speculative replies and the end-of-turn model's hang-overs, in the turn controller alone.

The controller's harness of tests/test_turn_controller.py: a real speech output and scheduler,
a manual clock, providers that record what they were asked.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence

import numpy as np

from rtc_server.end_of_turn import EndOfTurnParams
from rtc_server.providers.base import ChatMessage
from rtc_server.sentences import FirstWords
from rtc_server.turn_controller import CallState
from rtc_server.vad import SpeechPause, SpeechResume, SpeechStart
from tests.test_turn_controller import Call, FakeLLM, FakeSTT, end_of, utterance
from tests.waiting import wait_until


class HeldLLM(FakeLLM):
    """Streams its first words, then waits for the test; knows whether it was closed early."""

    def __init__(self, reply: str = "Paris is the capital. It is lovely.") -> None:
        super().__init__(reply)
        self.release = asyncio.Event()
        self.closed_early = 0
        self.finished = 0

    async def stream(self, messages: Sequence[ChatMessage]) -> AsyncGenerator[str, None]:
        self.asked.append(list(messages))
        words = self.reply.split(" ")
        done = False
        try:
            for i, word in enumerate(words):
                if i == 4:  # past the first sentence: the rest comes when the test says
                    await self.release.wait()
                yield word + " "
            done = True
        finally:
            if done:
                self.finished += 1
            else:
                self.closed_early += 1


def speculated(call: Call, outcome: str) -> float:
    value = call.turns._metrics.registry.get_sample_value(
        "avatar_rtc_speculative_replies_total", {"outcome": outcome}
    )
    return value or 0.0


def pause(call: Call, audio: np.ndarray) -> None:
    call.turns.on_vad(SpeechStart(at=0.0))
    call.turns.on_vad(SpeechPause(audio=audio))


async def test_the_reply_started_at_the_pause_is_the_one_played_when_the_turn_ends() -> None:
    call = Call()
    audio = utterance(1.0)
    pause(call, audio)
    # Asked and its first sentence voiced, before the turn has ended...
    await wait_until(lambda: call.tts.spoken == ["Paris is the capital."])
    assert len(call.llm.asked) == 1
    assert call.llm.asked[0][-1] == ChatMessage("user", "what is the capital of france")
    # ...and nothing of it told, played or kept.
    assert call.events == []
    assert [m.role for m in call.turns.conversation.messages()] == ["system"]
    assert call.scheduler.speech_pending == 0
    call.clock.advance(0.5)
    call.turns.on_vad(end_of(audio))
    await call.play_until(lambda: bool(call.of_type("turn")))
    await call.play_until(lambda: call.turns.state is CallState.LISTENING, 2)
    assert len(call.llm.asked) == 1  # the LLM was not asked again
    assert call.tts.spoken == ["Paris is the capital.", "It is lovely."]  # nor the voice
    assert [e["text"] for e in call.of_type("response")] == [
        "Paris is the capital.",
        "It is lovely.",
    ]
    assert call.spoken_units == 20  # both sentences, whole
    turn = call.of_type("turn")[0]
    assert turn["speculated"] is True
    assert turn["metrics"]["tts_first_audio_ms"] == 0.0  # voiced before the turn ended
    assert [m.role for m in call.turns.conversation.messages()] == ["system", "user", "assistant"]
    assert (speculated(call, "used"), speculated(call, "discarded")) == (1.0, 0.0)
    await call.close()


async def end_and_answer(call: Call, llm: HeldLLM, audio: np.ndarray) -> None:
    """The turn ends 0.5 s after the pause; the LLM writes the rest; the reply plays out."""
    call.clock.advance(0.5)
    call.turns.on_vad(end_of(audio))
    await wait_until(lambda: call.turns.state is CallState.THINKING)
    llm.release.set()
    await call.play_until(lambda: bool(call.of_type("turn")))
    await call.play_until(lambda: call.turns.state is CallState.LISTENING, 2)


async def test_a_slow_model_s_first_words_are_voiced_at_the_pause_and_played() -> None:
    # The local model's setting: the first piece ends after four words, not the sentence.
    llm = HeldLLM("The capital of France is Paris. It is lovely.")
    call = Call(llm=llm, first_words=FirstWords(4))
    audio = utterance(1.0)
    pause(call, audio)
    # Four words are in, the rest of the sentence not yet: they are voiced already.
    await wait_until(lambda: call.tts.spoken == ["The capital of France"])
    await end_and_answer(call, llm, audio)
    # The reply took the speculation's first piece (not synthesized again) and went on.
    assert len(llm.asked) == 1
    assert call.tts.spoken == ["The capital of France", "is Paris. It is lovely."]
    assert [e["text"] for e in call.of_type("response")] == call.tts.spoken
    turn = call.of_type("turn")[0]
    assert turn["speculated"] is True
    assert turn["metrics"]["tts_first_audio_ms"] == 0.0
    assert turn["metrics"]["speculation_lead_ms"] >= 500.0  # asked at the pause, 0.5 s before
    history = call.turns.conversation.messages()
    assert history[-1].content == "The capital of France is Paris. It is lovely."
    await call.close()


async def test_a_turn_that_ends_before_the_first_words_are_in_cuts_its_own() -> None:
    # Four words in, the last leaning on the next ("the"): nothing is cut when the turn ends.
    llm = HeldLLM("I cannot know the weather today, sorry.")
    call = Call(llm=llm, first_words=FirstWords(4))
    audio = utterance(1.0)
    pause(call, audio)
    await wait_until(lambda: len(llm.asked) == 1)
    await asyncio.sleep(0.05)
    assert call.tts.spoken == []
    await end_and_answer(call, llm, audio)
    # The reply cut and voiced the first piece; the speculation voiced nothing of its own.
    assert len(llm.asked) == 1
    assert call.tts.spoken == ["I cannot know the weather", "today, sorry."]
    assert call.of_type("turn")[0]["speculated"] is True
    await call.close()


async def test_a_caller_who_goes_on_after_the_pause_leaves_nothing_of_the_speculation() -> None:
    llm = HeldLLM()
    call = Call(llm=llm, stt=FakeSTT("I would like to"))
    first = utterance(0.6)
    pause(call, first)
    await wait_until(lambda: call.tts.spoken == ["Paris is the capital."])
    call.turns.on_vad(SpeechResume())  # the caller goes on
    await wait_until(lambda: llm.closed_early == 1)  # the request is closed, mid-stream
    assert call.events == []
    assert [m.role for m in call.turns.conversation.messages()] == ["system"]
    assert speculated(call, "discarded") == 1.0
    # What it wrote for nothing is counted: its four words, one delta each.
    registry = call.turns._metrics.registry
    assert registry.get_sample_value("avatar_rtc_discarded_speculation_deltas_total") == 4.0
    # The whole turn is answered on its own words.
    call.stt.text = "I would like to know more about the bridges"
    llm.release.set()
    whole = utterance(1.6)
    call.turns.on_vad(SpeechPause(audio=whole))
    call.clock.advance(0.5)
    call.turns.on_vad(end_of(whole))
    await call.play_until(lambda: bool(call.of_type("turn")))
    assert [e["text"] for e in call.of_type("transcript")] == [
        "I would like to know more about the bridges"
    ]
    history = call.turns.conversation.messages()
    assert [m.role for m in history] == ["system", "user", "assistant"]
    assert history[1].content == "I would like to know more about the bridges"
    assert [m[-1].content for m in llm.asked] == [
        "I would like to",
        "I would like to know more about the bridges",
    ]
    assert call.of_type("turn")[0]["speculated"] is True
    assert (speculated(call, "used"), speculated(call, "discarded")) == (1.0, 1.0)
    await call.close()


async def test_a_pause_whose_words_are_not_in_yet_asks_nothing_when_the_caller_goes_on() -> None:
    call = Call()
    call.stt.gate = asyncio.Event()  # the transcription outlasts the pause
    pause(call, utterance(0.6))
    await wait_until(lambda: len(call.stt.heard) == 1)
    call.turns.on_vad(SpeechResume())
    call.stt.gate.set()
    for _ in range(20):
        await asyncio.sleep(0)
    assert call.llm.asked == [] and call.tts.spoken == []
    assert speculated(call, "discarded") == 0.0  # no request was made, none is counted
    await call.close()


async def test_a_speculation_made_on_another_history_is_not_played() -> None:
    call = Call()
    audio = utterance(1.0)
    pause(call, audio)
    await wait_until(lambda: len(call.llm.asked) == 1)
    call.turns.conversation.add("assistant", "Something said meanwhile.")
    call.turns.on_vad(end_of(audio))
    await call.play_until(lambda: bool(call.of_type("turn")))
    assert len(call.llm.asked) == 2  # asked again, with the history as it is now
    assert call.llm.asked[1][-2] == ChatMessage("assistant", "Something said meanwhile.")
    assert call.of_type("turn")[0]["speculated"] is False
    assert (speculated(call, "used"), speculated(call, "discarded")) == (0.0, 1.0)
    await call.close()


async def test_without_speculation_nothing_is_asked_before_the_turn_ends() -> None:
    call = Call(speculate=False)
    audio = utterance(1.0)
    pause(call, audio)
    await wait_until(lambda: len(call.stt.heard) == 1)
    for _ in range(20):
        await asyncio.sleep(0)
    assert call.llm.asked == [] and call.tts.spoken == []
    call.turns.on_vad(end_of(audio))
    await call.play_until(lambda: bool(call.of_type("turn")))
    assert len(call.llm.asked) == 1 and call.of_type("turn")[0]["speculated"] is False
    await call.close()


class FakeTurnModel:
    def __init__(self, probability: float) -> None:
        self.p = probability
        self.heard: list[int] = []

    def probability(self, pcm: np.ndarray) -> float:
        self.heard.append(len(pcm))
        return self.p


class RecordingVAD:
    def __init__(self) -> None:
        self.hangovers: list[int] = []

    def end_pause_after(self, hangover_ms: int) -> None:
        self.hangovers.append(hangover_ms)


async def test_the_end_of_turn_model_sets_the_pause_s_hang_over() -> None:
    params = EndOfTurnParams(complete_hangover_ms=150, incomplete_hangover_ms=1500)
    for p, expected in ((0.9, 150), (0.2, 1500)):
        call = Call(end_of_turn=params)
        model = FakeTurnModel(p)
        call.turns.providers = type(call.turns.providers)(
            **{**_fields(call.turns.providers), "end_of_turn": model}  # type: ignore[arg-type]
        )
        vad = RecordingVAD()
        call.turns.hear_through(vad)  # type: ignore[arg-type]
        audio = utterance(0.8)
        pause(call, audio)
        # The long one while the model thinks, then its verdict.
        await wait_until(lambda: len(vad.hangovers) == 2)  # noqa: B023
        assert vad.hangovers == [1500, expected]
        assert model.heard == [len(audio)]  # the words so far, without the transcript's tail
        call.turns.on_vad(end_of(audio, hangover_s=expected / 1000))
        await call.play_until(lambda: bool(call.of_type("turn")))  # noqa: B023
        assert call.of_type("turn")[0]["metrics"]["end_of_turn_ms"] >= 0.0
        await call.close()


async def test_without_the_model_the_vad_keeps_its_own_hang_over() -> None:
    call = Call(end_of_turn=EndOfTurnParams())
    vad = RecordingVAD()
    call.turns.hear_through(vad)  # type: ignore[arg-type]
    pause(call, utterance(0.8))
    for _ in range(20):
        await asyncio.sleep(0)
    assert vad.hangovers == []
    await call.close()


def _fields(providers: object) -> dict[str, object]:
    return {name: getattr(providers, name) for name in providers.__slots__}  # type: ignore[attr-defined]
