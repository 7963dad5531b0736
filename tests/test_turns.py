"""Conversation history, what-was-played bookkeeping, and the streaming overlap."""

from __future__ import annotations

import pytest

from rtc_server.speech import Segment, Utterance
from rtc_server.turns import Conversation, TurnTimer


def test_history_keeps_the_system_prompt_and_the_newest_turns() -> None:
    convo = Conversation("Be brief.", budget_chars=60)
    for i in range(10):
        convo.add("user", f"question number {i}")
        convo.add("assistant", f"answer {i}")
    messages = convo.messages()
    assert messages[0].role == "system" and messages[0].content == "Be brief."
    assert messages[-1].content == "answer 9"
    assert sum(len(m.content) for m in messages[1:]) <= 60 - len("Be brief.")
    assert all("question number 0" != m.content for m in messages)
    convo.add("assistant", "   ")
    assert convo.messages()[-1].content == "answer 9"  # nothing said, nothing kept
    with pytest.raises(ValueError):
        Conversation("x" * 100, budget_chars=50)


def _segment(text: str, frames: int, played: int, complete: bool = True) -> Segment:
    seg = Segment(0, text, frame_samples=1920, samples=frames * 1920, complete=complete)
    seg.played = played
    return seg


def test_played_text_keeps_only_what_was_heard() -> None:
    heard_all = Utterance([_segment("One two three.", 10, 10), _segment("Four five six.", 10, 10)])
    assert heard_all.played_text() == "One two three. Four five six."
    cut = Utterance([_segment("One two three.", 10, 10), _segment("Four five six seven.", 20, 10)])
    assert cut.played_text() == "One two three. Four five"
    not_started = Utterance([_segment("One two.", 10, 0)])
    assert not_started.played_text() == ""
    still_synthesizing = Utterance([_segment("One two three four.", 8, 4, complete=False)])
    assert still_synthesizing.played_text() == "One two"


def test_turn_metrics_use_the_architecture_names() -> None:
    timer = TurnTimer(speech_end=100.0, vad_end_s=0.5)
    for name, at in [
        ("stt_start", 100.0),
        ("stt_end", 100.2),
        ("llm_start", 100.2),
        ("llm_first_token", 100.3),
        ("tts_start", 100.3),
        ("tts_first_audio", 100.4),
        ("engine_first_push", 100.41),
        ("first_frame", 100.45),
    ]:
        timer.mark(name, at)
    m = timer.metrics()
    assert m == {
        "vad_end_ms": 500.0,
        "stt_ms": 200.0,
        "llm_first_token_ms": 100.0,
        "tts_first_audio_ms": 100.0,
        "engine_first_frame_ms": 40.0,
        "first_audio_out_ms": 450.0,
    }
