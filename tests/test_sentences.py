from __future__ import annotations

import pytest

from rtc_server.sentences import MAX_PIECE_CHARS, FirstWords, SentenceSplitter, bounded_pieces


def _split(deltas: list[str]) -> list[str]:
    splitter = SentenceSplitter(first_clause_chars=None)
    out = []
    for delta in deltas:
        out += splitter.feed(delta)
    return out + splitter.flush()


def test_sentences_come_out_as_soon_as_they_end() -> None:
    splitter = SentenceSplitter(first_clause_chars=None)
    assert splitter.feed("Hello there, how") == []
    assert splitter.feed(" are you today? I am") == ["Hello there, how are you today?"]
    assert splitter.feed(" fine, thanks. ") == ["I am fine, thanks."]
    assert splitter.flush() == []


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


def test_long_unpunctuated_text_is_cut_into_bounded_pieces() -> None:
    """TTS cannot be interrupted inside a piece: no piece may be long (a fuzzed say of 2,000
    characters without a full stop took Piper over a minute of CPU in one go)."""
    words = " ".join(f"word{i}" for i in range(400))  # 3,000 characters, no punctuation
    pieces = bounded_pieces(words)
    assert all(len(p) <= MAX_PIECE_CHARS for p in pieces)
    assert " ".join(pieces) == words  # cut at spaces, nothing lost or split mid-word
    # A sentence end inside the limit wins over a later space; then a clause.
    text = "a" * 100 + ". " + "b " * 100 + ", " + "c" * 300
    first, second, *rest = bounded_pieces(text)
    assert first == "a" * 100 + "." and second.endswith(",")
    assert "".join(p.replace(" ", "") for p in [first, second, *rest]) == text.replace(" ", "")
    # No space at all: hard cuts at the limit.
    assert [len(p) for p in bounded_pieces("x" * 500)] == [240, 240, 20]
    # The streaming splitter does the same when an LLM writes on and on without a full stop.
    splitter = SentenceSplitter(first_clause_chars=None)
    out: list[str] = []
    for word in words.split(" "):
        out += splitter.feed(word + " ")
    assert out and all(len(p) <= MAX_PIECE_CHARS for p in out)
    assert " ".join(out + splitter.flush()) == words


def _fed(splitter: SentenceSplitter, deltas: list[str]) -> list[list[str]]:
    return [splitter.feed(delta) for delta in deltas]


def test_a_slow_model_s_first_piece_ends_after_its_first_words() -> None:
    # Token by token: the fourth word is whole once the space after it arrives.
    splitter = SentenceSplitter(first_words=FirstWords(4))
    deltas = ["The", " capital", " of", " France", " is", " Paris", ".", " It", " is", " big", "."]
    pieces = _fed(splitter, deltas)
    assert pieces[:4] == [[], [], [], []]  # "France" may go on ("Francesca")
    assert pieces[4] == ["The capital of France"]
    assert sum(pieces[5:], []) + splitter.flush() == ["is Paris. It is big."]


@pytest.mark.parametrize(
    ("text", "first"),
    [
        # Never on a word that leans on the next: the voice would drop its pitch there.
        ("I cannot know the weather today, sorry. ", "I cannot know the weather"),
        ("It is in the north of Italy. ", "It is in the north"),
        # A sentence or a clause that ends first is the first piece, as without the count.
        ("Two plus two is four. Easy. ", "Two plus two is four."),
        ("You said: what is the capital of France? ", "You said:"),
        # A too-short sentence still waits; the count goes on past it.
        ("Yes. The capital of France is Paris. ", "Yes. The capital of France"),
    ],
)
def test_where_the_first_words_end(text: str, first: str) -> None:
    tokens = [text[i : i + 2] for i in range(0, len(text), 2)]
    splitter = SentenceSplitter(first_words=FirstWords(4))
    pieces = sum(_fed(splitter, tokens), []) + splitter.flush()
    assert pieces[0] == first
    assert " ".join(pieces) == text.strip()  # nothing lost, nothing doubled


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_model_writing_slower_than_the_rule_s_rate_keeps_its_sentence_whole() -> None:
    deltas = ["The", " capital", " of", " France", " is", " Paris", ".", " It"]
    for gap_s, first in ((0.05, "The capital of France"), (0.2, "The capital of France is Paris.")):
        clock = Clock()
        splitter = SentenceSplitter(first_words=FirstWords(4, min_rate=10.0), clock=clock)
        pieces = []
        for delta in deltas:  # 20 deltas a second, then 5 (a model shared by many calls)
            pieces += splitter.feed(delta)
            clock.now += gap_s
        assert pieces[0] == first, gap_s


def test_a_given_first_piece_is_cut_whatever_the_pace() -> None:
    # The speculation cut "The capital of France" while the model wrote fast; the reply reads
    # the same stream from its buffer at another pace and cuts the same piece.
    clock = Clock()
    splitter = SentenceSplitter(
        first_words=FirstWords(4), first_piece="The capital of France", clock=clock
    )
    assert splitter.feed("The capital") == []
    clock.now += 10.0  # slow as can be
    assert splitter.feed(" of France") == []
    assert splitter.feed(" is Paris. It is big. ") == [
        "The capital of France",
        "is Paris. It is big.",
    ]
    # A stream that turns out otherwise is cut by the usual rules.
    splitter = SentenceSplitter(first_piece="The capital of France")
    assert splitter.feed("The capital city, as you know, is Paris. ") == [
        "The capital city,",
        "as you know, is Paris.",
    ]
