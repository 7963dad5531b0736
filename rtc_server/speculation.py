"""Speculative replies: the answer to a pause prepared while the caller may still go on.

When the VAD hears the caller pause, the utterance so far is transcribed at once (the turn
controller did that before this module). A :class:`SpeculativeReply` then also starts the LLM
on that text and synthesizes the reply's first sentence, keeping both to itself: nothing is
played, sent on the data channel or added to the history. If the turn then ends with the same
words and the same history, the reply is taken (:meth:`SpeculativeReply.llm` and
:meth:`~SpeculativeReply.tts` give what was read ahead, then the rest as it comes) and the
caller hears the answer without waiting for the LLM's first token or the voice's first audio.
If the caller goes on, it is closed: the LLM request and the synthesis are closed, and the
metrics count a discarded speculation (what a cloud LLM charged for nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Generic, TypeVar

from musetalk_core.types import AudioChunk
from rtc_server.call_tasks import CallTasks
from rtc_server.providers.base import LLM, TTS, ChatMessage
from rtc_server.sentences import FirstWords, SentenceSplitter

__all__ = ["ReadAhead", "SpeculativeReply"]

T = TypeVar("T")


class ReadAhead(Generic[T]):
    """An async generator read by a task of its own into a buffer, as fast as it yields.

    :meth:`replay` yields what was read, then the rest as it comes, and the source's error if
    it failed. Closing the replay, or :meth:`cancel`, stops the reading and closes the source
    (an HTTP response behind it is released at once).
    """

    def __init__(self, source: AsyncGenerator[T, None], tasks: CallTasks, name: str) -> None:
        self._items: list[T] = []
        self._done = False
        self._error: Exception | None = None
        self._changed = asyncio.Event()
        self._task = tasks.spawn(self._read(source), name, quiet=True)

    async def _read(self, source: AsyncGenerator[T, None]) -> None:
        try:
            async with contextlib.aclosing(source):
                async for item in source:
                    self._items.append(item)
                    self._changed.set()
        except Exception as exc:  # the replay raises it where the reply would have met it
            self._error = exc
        finally:
            self._done = True
            self._changed.set()

    @property
    def items(self) -> Sequence[T]:
        """What was read so far."""
        return self._items

    @property
    def done(self) -> bool:
        return self._done

    async def wait_for(self, count: int) -> None:
        """Until ``count`` items are read or the source has ended."""
        while len(self._items) < count and not self._done:
            self._changed.clear()
            await self._changed.wait()

    async def replay(self) -> AsyncGenerator[T, None]:
        index = 0
        try:
            while True:
                while index < len(self._items):
                    yield self._items[index]
                    index += 1
                if self._done:
                    if self._error is not None:
                        raise self._error
                    return
                self._changed.clear()
                await self._changed.wait()
        finally:
            if not self._done:
                self.cancel()

    def cancel(self) -> None:
        self._task.cancel()


class SpeculativeReply:
    """The reply to ``text`` after ``history``, its LLM stream and first sentence read ahead."""

    def __init__(
        self,
        llm: LLM,
        tts: TTS,
        history: Sequence[ChatMessage],
        text: str,
        tasks: CallTasks,
        *,
        first_words: FirstWords | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.text = text
        self.started_at = clock()
        """When its LLM request went out (the turn reports how long before its end)."""
        self.history = tuple(history)
        self._llm = llm
        self._tts = tts
        self._tasks = tasks
        self._first_words = first_words
        """The reply's rule for its first piece; the reply then cuts where this one did."""
        self._clock = clock
        self._deltas: ReadAhead[str] = ReadAhead(
            llm.stream([*self.history, ChatMessage("user", text)]), tasks, "speculative-llm"
        )
        self._first_sentence: str | None = None
        self._audio: ReadAhead[AudioChunk] | None = None
        self._voicing = tasks.spawn(self._voice_first_sentence(), "speculative-tts", quiet=True)
        self.closed = False
        self.taken = False
        """A reply took it (then the reply closes it when it is over)."""

    def matches(self, history: Sequence[ChatMessage], text: str) -> bool:
        """Whether this is the reply a turn of ``text`` after ``history`` would ask for."""
        return not self.closed and text == self.text and tuple(history) == self.history

    async def _voice_first_sentence(self) -> None:
        splitter = SentenceSplitter(first_words=self._first_words, clock=self._clock)
        read = 0
        while True:
            await self._deltas.wait_for(read + 1)
            deltas = self._deltas.items
            if read >= len(deltas):  # the stream ended (or failed) before a sentence did
                rest = splitter.flush()
                first = rest[0] if rest else None
                break
            sentences = splitter.feed(deltas[read])
            read += 1
            if sentences:
                first = sentences[0]
                break
        if first is not None:
            self._first_sentence = first
            self._audio = ReadAhead(self._tts.synthesize(first), self._tasks, "speculative-audio")

    def take(self) -> str | None:
        """A reply takes it: the first piece it cut, which the reply cuts too (its synthesis
        is the one :meth:`audio_for` gives). None when none is cut yet: the reply cuts its
        own, and the voicing here stops, its piece no longer wanted."""
        self.taken = True
        if self._first_sentence is None:
            self._voicing.cancel()
        return self._first_sentence

    def llm(self) -> LLM:
        """An LLM whose stream of this reply's messages is the one read ahead."""
        return _ReadAheadLLM(self._llm, [*self.history, ChatMessage("user", self.text)], self)

    def tts(self) -> TTS:
        """A voice whose first sentence of this reply is the one synthesized ahead."""
        return _ReadAheadTTS(self._tts, self)

    @property
    def deltas(self) -> ReadAhead[str]:
        return self._deltas

    def audio_for(self, text: str, previous_text: str) -> ReadAhead[AudioChunk] | None:
        """The first sentence's synthesis, when ``text`` is that sentence, spoken first."""
        if previous_text or text != self._first_sentence or self._audio is None:
            return None
        audio, self._audio = self._audio, None  # one reply takes it, once
        return audio

    def close(self) -> None:
        """Stop what still runs of it (the LLM request, the synthesis): the speculation was
        discarded, or the reply that took it is over."""
        self.closed = True
        self._deltas.cancel()
        self._voicing.cancel()
        if self._audio is not None:
            self._audio.cancel()
            self._audio = None


class _ReadAheadLLM:
    def __init__(self, llm: LLM, messages: list[ChatMessage], reply: SpeculativeReply) -> None:
        self._llm = llm
        self._messages = messages
        self._reply: SpeculativeReply | None = reply

    @property
    def name(self) -> str:
        return self._llm.name

    def stream(self, messages: Sequence[ChatMessage]) -> AsyncGenerator[str, None]:
        reply, self._reply = self._reply, None
        if reply is not None and list(messages) == self._messages:
            return reply.deltas.replay()
        return self._llm.stream(messages)


class _ReadAheadTTS:
    def __init__(self, tts: TTS, reply: SpeculativeReply) -> None:
        self._tts = tts
        self._reply = reply

    @property
    def name(self) -> str:
        return self._tts.name

    @property
    def sample_rate(self) -> int:
        return self._tts.sample_rate

    def synthesize(self, text: str, *, previous_text: str = "") -> AsyncGenerator[AudioChunk, None]:
        audio = self._reply.audio_for(text, previous_text)
        if audio is not None:
            return audio.replay()
        return self._tts.synthesize(text, previous_text=previous_text)
