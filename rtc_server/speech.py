"""Speech output: text into the call's output, one sentence a segment, and what got played.

Every sentence becomes its own engine segment, so the session knows, frame by frame, how much of
each sentence reached the caller. After a barge-in the conversation keeps only that part.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field

import numpy as np

from musetalk_core.types import AudioChunk, PhonemeSpan, phonemes_after
from rtc_server.media.resample import StreamResampler
from rtc_server.media.scheduler import AVScheduler, Unit
from rtc_server.media.viseme_estimator import EstimatorStream, shared_estimator
from rtc_server.providers.base import TTS
from rtc_server.synthesis_pool import due_in


@dataclass(slots=True)
class Segment:
    segment_id: int
    text: str
    frame_samples: int
    """Audio samples per video frame."""
    samples: int = 0
    """Audio samples pushed so far."""
    complete: bool = False
    """All its audio is in the engine."""
    played: int = 0
    """Speaking frames of it presented to the tracks."""
    first_played_at: float | None = None
    """When its first frame was presented (the speech output's clock)."""
    sample_rate: int = 48_000
    """Of its audio, as pushed."""
    lead_s: float = 0.0
    """Leading silence of its source audio cut before it was pushed."""

    @property
    def heard_s(self) -> float:
        """Seconds of its source audio presented so far, the cut lead included."""
        heard = min(self.played * self.frame_samples, self.samples) / self.sample_rate
        return self.lead_s + heard if heard else 0.0

    @property
    def frames(self) -> int:
        """Frames its audio fills; the engine pads the last one of a complete segment."""
        if self.complete:
            return math.ceil(self.samples / self.frame_samples)
        return self.samples // self.frame_samples


@dataclass(slots=True)
class Utterance:
    """One reply or say: its sentences in order, and timing marks for the turn metrics."""

    segments: list[Segment] = field(default_factory=list)
    first_push_at: float | None = None
    """When its first audio went into the engine (the speech output's clock)."""

    def played_text(self) -> str:
        """The sentences heard in full, plus the heard share of the words of a cut one."""
        parts = []
        for seg in self.segments:
            if seg.played == 0:
                break
            if seg.complete and seg.played >= seg.frames:
                parts.append(seg.text)
                continue
            words = seg.text.split()
            share = seg.played / max(seg.frames, 1)
            parts.append(" ".join(words[: math.floor(len(words) * share)]))
            break
        return " ".join(p for p in parts if p).strip()

    @property
    def first_played_at(self) -> float | None:
        return self.segments[0].first_played_at if self.segments else None

    @property
    def unplayed_s(self) -> float:
        """Seconds of its audio pushed into the engine and not yet presented."""
        samples = sum(max(0, s.samples - s.played * s.frame_samples) for s in self.segments)
        return samples / self.segments[0].sample_rate if self.segments else 0.0


class SpeechOutput:
    """Serializes speech into the call's output: utterances play one after another."""

    def __init__(
        self,
        output: AVScheduler,
        executor: Executor | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.output = output
        self._clock = clock
        self._executor = executor
        self._next_segment = 0
        self._segments: dict[int, Segment] = {}
        self._lock = asyncio.Lock()
        self._frame_samples = output.samples_per_unit
        self._progress = asyncio.Event()

    def on_unit(self, unit: Unit) -> None:
        """Count a presented speaking frame against its segment."""
        seg = self._segments.get(unit.segment_id) if unit.speaking else None
        if seg is not None:
            seg.played += 1
            if seg.first_played_at is None:
                seg.first_played_at = self._clock()
            self._progress.set()

    def clear(self) -> None:
        """Drop all speech not yet played: queued audio, frames rendered ahead (barge-in)."""
        self.output.clear()

    def is_live(self, segment_id: int) -> bool:
        return segment_id in self._segments

    async def speak(
        self,
        tts: TTS,
        sentences: AsyncGenerator[str, None],
        utterance: Utterance,
        *,
        on_tts_audio: Callable[[], None] | None = None,
    ) -> None:
        """Synthesize each sentence as it arrives and push it into the engine, in order; each
        after the first with the ones before it as its ``previous_text`` (their last
        :data:`PREVIOUS_TEXT_CHARS`)."""
        async with self._lock, contextlib.aclosing(sentences):
            # aclosing: a barge-in cancels us mid-stream, and the LLM's HTTP response behind
            # ``sentences`` must be released now, not whenever the generator is collected.
            spoken = ""  # the utterance so far, for a voice that continues its prosody
            async for text in sentences:
                # A later piece is due when the audio before it has played: synthesis shared
                # with other calls takes it before replies that have not begun
                # (rtc_server/synthesis_pool.py).
                due = due_in(utterance.unplayed_s) if spoken else contextlib.nullcontext()
                seg = self._segment(text, utterance)
                synthesis = tts.synthesize(text, previous_text=spoken)
                with due:
                    async with contextlib.aclosing(synthesis) as chunks:
                        if await self._play(seg, chunks, utterance, on_tts_audio):
                            on_tts_audio = None
                await self._end(seg)
                spoken = recent_text(f"{spoken} {text}")

    async def play(
        self,
        chunks: AsyncGenerator[AudioChunk, None],
        utterance: Utterance,
        *,
        on_audio: Callable[[], None] | None = None,
    ) -> Segment:
        """Speech that comes as audio (a speech-to-speech model's reply): one segment, its text
        unknown until the end (set ``Segment.text`` as it becomes known)."""
        async with self._lock, contextlib.aclosing(chunks):
            seg = self._segment("", utterance)
            await self._play(seg, chunks, utterance, on_audio)
            await self._end(seg)
        return seg

    def _segment(self, text: str, utterance: Utterance) -> Segment:
        seg = Segment(
            self._next_segment, text, self._frame_samples, sample_rate=self.output.sample_rate
        )
        self._next_segment += 1
        self._segments[seg.segment_id] = seg
        utterance.segments.append(seg)
        return seg

    async def _end(self, seg: Segment) -> None:
        await self.output.end_segment(seg.segment_id)
        seg.complete = True
        self._progress.set()

    async def _play(
        self,
        seg: Segment,
        chunks: AsyncGenerator[AudioChunk, None],
        utterance: Utterance,
        on_audio: Callable[[], None] | None,
    ) -> bool:
        """Push one segment's audio as it comes; True when any came."""
        loop = asyncio.get_running_loop()
        rate = self.output.sample_rate
        first = True
        # One resampler per segment: its chunks join as one stream would.
        resampler: StreamResampler | None = None
        # And one estimator, for a voice that gives no phoneme timing.
        estimating: EstimatorStream | None = None
        async for chunk in chunks:
            if first:
                # Voices lead with up to a few hundred ms of silence: time the caller would
                # spend waiting for the answer to begin.
                trimmed = _trimmed(chunk)
                seg.lead_s = (len(chunk.pcm) - len(trimmed.pcm)) / chunk.sample_rate
                chunk = trimmed
                first = False
            if on_audio is not None:
                on_audio()
                on_audio = None
            if resampler is None or resampler.src_rate != chunk.sample_rate:
                if resampler is not None:
                    await self._push(seg, resampler.flush())
                resampler = StreamResampler(chunk.sample_rate, rate)
            if not chunk.phonemes and len(chunk.pcm):
                if estimating is None:
                    estimating = _estimator_stream(chunk.sample_rate)
                if estimating is not None:
                    spans = await loop.run_in_executor(self._executor, estimating.feed, chunk.pcm)
                    chunk = AudioChunk(chunk.pcm, chunk.sample_rate, spans)
            # The chunk's sound comes out that much later than it went in.
            phonemes = _shifted(chunk.phonemes, resampler.behind_s)
            pcm = await loop.run_in_executor(self._executor, resampler.feed, chunk.pcm)
            await self._push(seg, pcm, phonemes)
            if utterance.first_push_at is None:
                utterance.first_push_at = self._clock()
        if resampler is not None:
            await self._push(seg, resampler.flush())
        return not first

    async def _push(
        self, seg: Segment, pcm: np.ndarray, phonemes: tuple[PhonemeSpan, ...] = ()
    ) -> None:
        if len(pcm):  # a chunk of a few samples may give none yet (its phonemes go)
            await self.output.push_audio(
                AudioChunk(pcm, self.output.sample_rate, phonemes), seg.segment_id
            )
            seg.samples += len(pcm)

    async def wait_played(self, utterance: Utterance) -> None:
        """Return once every frame of ``utterance`` has been presented."""
        while not all(s.complete and s.played >= s.frames for s in utterance.segments):
            self._progress.clear()
            await self._progress.wait()

    def forget(self, utterance: Utterance) -> None:
        """Stop counting for ``utterance``; frames of its still in flight count as stale."""
        for seg in utterance.segments:
            self._segments.pop(seg.segment_id, None)


PREVIOUS_TEXT_CHARS = 1000
"""Most of an utterance's earlier text a sentence is synthesized after: its tone, not more."""


def recent_text(text: str, limit: int = PREVIOUS_TEXT_CHARS) -> str:
    """The end of ``text``, at most ``limit`` characters, starting at a word (unless the cut
    falls in a run without spaces, as in Chinese or Japanese)."""
    text = text.strip()
    if len(text) <= limit:
        return text
    tail = text[-limit:]
    if not text[-limit - 1].isspace():
        rest = tail.split(maxsplit=1)
        if len(rest) == 2:
            tail = rest[1]
    return tail.lstrip()


def _estimator_stream(sample_rate: int) -> EstimatorStream | None:
    model = shared_estimator()
    return model.stream(sample_rate) if model is not None else None


def _shifted(spans: tuple[PhonemeSpan, ...], seconds: float) -> tuple[PhonemeSpan, ...]:
    return tuple(PhonemeSpan(s.phoneme, s.start + seconds, s.end + seconds) for s in spans)


def _trimmed(chunk: AudioChunk) -> AudioChunk:
    """``chunk`` without its leading silence; its phonemes move with the sound."""
    pcm = trim_leading_silence(chunk.pcm, chunk.sample_rate)
    cut = (len(chunk.pcm) - len(pcm)) / chunk.sample_rate
    return AudioChunk(pcm, chunk.sample_rate, phonemes_after(chunk.phonemes, cut))


def trim_leading_silence(
    pcm: np.ndarray, sample_rate: int, *, level: float = 0.003, keep_s: float = 0.02
) -> np.ndarray:
    """Drop leading samples quieter than ``level`` (-50 dBFS), keeping ``keep_s`` before sound."""
    loud = np.flatnonzero(np.abs(pcm) > level * 32768)
    if loud.size == 0:
        return pcm
    start = max(0, int(loud[0]) - int(keep_s * sample_rate))
    return pcm[start:]
