from __future__ import annotations

import pytest

from rtc_server.sentences import SentenceSplitter


def _split(deltas: list[str]) -> list[str]:
    splitter = SentenceSplitter(first_clause_chars=None)
    out = []
    for delta in deltas:
        out += splitter.feed(delta)
    rest = splitter.flush()
    return out + ([rest] if rest else [])


def test_sentences_come_out_as_soon_as_they_end() -> None:
    splitter = SentenceSplitter(first_clause_chars=None)
    assert splitter.feed("Hello there, how") == []
    assert splitter.feed(" are you today? I am") == ["Hello there, how are you today?"]
    assert splitter.feed(" fine, thanks. ") == ["I am fine, thanks."]
    assert splitter.flush() == ""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "Dr. Smith lives at No. 5 on the hill. He is nice.",
            ["Dr. Smith lives at No. 5 on the hill.", "He is nice."],
        ),
        (
            "Pi is about 3.14 and that is enough for today. Thanks!",
            ["Pi is about 3.14 and that is enough for today.", "Thanks!"],
        ),
        ("Yes. I think that this is right.", ["Yes. I think that this is right."]),
        (
            "Wait... what did you just say to me?! Really.",
            ["Wait... what did you just say to me?!", "Really."],
        ),
        ("No trailing punctuation here", ["No trailing punctuation here"]),
    ],
)
def test_sentence_boundaries(text: str, expected: list[str]) -> None:
    # Token by token, as an LLM streams it.
    tokens = [text[i : i + 3] for i in range(0, len(text), 3)]
    assert _split(tokens) == expected
    assert _split([text]) == expected


def test_the_first_piece_may_end_at_a_clause() -> None:
    splitter = SentenceSplitter(first_clause_chars=8)
    assert splitter.feed("You said: what is") == ["You said:"]
    assert splitter.feed(" the capital, of France? And then, more. ") == [
        "what is the capital, of France?",
        "And then, more.",
    ]
    # Too short a clause waits for the sentence.
    splitter = SentenceSplitter(first_clause_chars=8)
    assert splitter.feed("Yes, it is the one you want. ") == ["Yes, it is the one you want."]
