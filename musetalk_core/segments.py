"""Speech audio per utterance segment, taken out one video frame's slice at a time.

One type for every place that holds speech between the TTS and the caller: the media server's
scheduler (which owns what is heard) and the engines (which only need the sound of each frame).
Slicing is continuous within a segment, so piece ``j`` of segment ``s`` is always samples
``[j * n, (j + 1) * n)`` of everything pushed for ``s``, whatever sizes the pushes had; only
the last piece of an ended segment is short, and it is padded with silence.

Speech pushed as an :class:`AudioChunk` with phonemes (:meth:`SegmentQueue.push_chunk`) builds
its segment's :class:`~musetalk_core.visemes.VisemeTimeline` as it arrives, on the segment's own
clock; each piece carries that timeline and its own middle on it, so an engine can shape the
mouth of every frame from the phonemes around it.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .types import AudioChunk, PhonemeSpan, phonemes_after
from .visemes import VisemeTimeline

__all__ = ["Piece", "SegmentQueue"]

I16 = npt.NDArray[np.int16]


@dataclass(frozen=True, slots=True)
class Piece:
    """One frame's slice of speech: exactly ``frame_samples`` samples."""

    segment_id: int
    index: int
    """Position of this slice within its segment: 0, 1, 2, ..."""
    pcm: I16
    timeline: VisemeTimeline | None = None
    """The segment's visemes, when its speech came with phonemes; None otherwise."""
    time: float = 0.0
    """The middle of this slice on the segment's clock (seconds), where ``timeline`` applies."""


class _Segment:
    __slots__ = (
        "segment_id",
        "chunks",
        "offset",
        "available",
        "taken",
        "ended",
        "pushed",
        "rate",
        "spans",
        "timeline",
    )

    def __init__(self, segment_id: int) -> None:
        self.segment_id = segment_id
        self.pushed = 0
        """Samples pushed so far."""
        self.rate = 0
        """Sample rate of chunks pushed with :meth:`SegmentQueue.push_chunk` (0: none were)."""
        self.spans: tuple[PhonemeSpan, ...] = ()
        """Phonemes on the segment's clock."""
        self.timeline: VisemeTimeline | None = None
        self.chunks: collections.deque[I16] = collections.deque()
        self.offset = 0
        """Samples of ``chunks[0]`` already taken."""
        self.available = 0
        self.taken = 0
        """Pieces taken out so far."""
        self.ended = False

    def take(self, n: int) -> I16:
        """Up to ``n`` samples, zero-padded to exactly ``n``."""
        out = np.zeros(n, np.int16)
        filled = 0
        while filled < n and self.chunks:
            head = self.chunks[0]
            k = min(n - filled, len(head) - self.offset)
            out[filled : filled + k] = head[self.offset : self.offset + k]
            filled += k
            self.offset += k
            if self.offset == len(head):
                self.chunks.popleft()
                self.offset = 0
        self.available -= filled
        self.taken += 1
        return out

    def look(self, n: int, skip: int) -> I16:
        """The ``n`` samples :meth:`take` would return after ``skip`` samples, not taken."""
        out = np.zeros(n, np.int16)
        at, filled = self.offset + skip, 0
        for chunk in self.chunks:
            if at >= len(chunk):
                at -= len(chunk)
                continue
            k = min(n - filled, len(chunk) - at)
            out[filled : filled + k] = chunk[at : at + k]
            filled += k
            at = 0
            if filled == n:
                break
        return out


class SegmentQueue:
    """Queued speech in segments, consumed in frame-sized :class:`Piece` s.

    Audio of a new ``segment_id`` implicitly ends the segment before it, since a frame never
    mixes two segments. A partial piece of a segment that has not ended waits for more audio
    (:meth:`next_piece` returns None): never pad audio that may still come.
    """

    def __init__(self, frame_samples: int) -> None:
        if frame_samples <= 0:
            raise ValueError("frame_samples must be positive")
        self.frame_samples = frame_samples
        self._segments: collections.deque[_Segment] = collections.deque()

    def push(self, pcm: npt.NDArray[np.generic], segment_id: int) -> None:
        """Queue mono int16 samples for ``segment_id`` (copied: the caller may reuse them)."""
        tail = self._segments[-1] if self._segments else None
        if tail is None or tail.segment_id != segment_id or tail.ended:
            if tail is not None:
                tail.ended = True
            tail = _Segment(segment_id)
            self._segments.append(tail)
        if len(pcm):
            tail.chunks.append(np.array(pcm, np.int16, copy=True).reshape(-1))
            tail.available += len(pcm)
            tail.pushed += len(pcm)

    def push_chunk(self, chunk: AudioChunk, segment_id: int) -> None:
        """:meth:`push` a chunk's samples, and its phonemes on the segment's clock."""
        self.push(chunk.pcm, segment_id)
        if not chunk.phonemes:
            return
        tail = self._segments[-1]
        tail.rate = chunk.sample_rate
        at = (tail.pushed - len(chunk.pcm)) / chunk.sample_rate
        shifted = [PhonemeSpan(s.phoneme, s.start + at, s.end + at) for s in chunk.phonemes]
        tail.spans += tuple(shifted)
        if tail.timeline is None:
            tail.timeline = VisemeTimeline()
        tail.timeline.add(shifted, 0.0)

    def phonemes_from(self, segment_id: int, index: int) -> tuple[PhonemeSpan, ...]:
        """The phonemes of ``segment_id`` from the start of its piece ``index`` on, on a clock
        that starts there (for speech handed on from that piece, as a catch-up does)."""
        for segment in self._segments:
            if segment.segment_id == segment_id and segment.rate:
                return phonemes_after(segment.spans, index * self.frame_samples / segment.rate)
        return ()

    def end(self, segment_id: int) -> None:
        """No more audio for ``segment_id``: its last partial piece is padded and released."""
        for segment in self._segments:
            if segment.segment_id == segment_id:
                segment.ended = True

    def next_piece(self) -> Piece | None:
        """The next full piece of speech, or None while there is none (yet)."""
        n = self.frame_samples
        while self._segments:
            head = self._segments[0]
            if head.available >= n or (head.ended and head.available > 0):
                index = head.taken
                t = (index + 0.5) * n / head.rate if head.rate else 0.0
                return Piece(head.segment_id, index, head.take(n), head.timeline, t)
            if not head.ended:
                return None
            self._segments.popleft()
        return None

    def upcoming(self, limit: int) -> list[Piece]:
        """The next ``limit`` pieces :meth:`next_piece` would return if nothing were pushed or
        cleared meanwhile (fewer when less is queued), none of them taken."""
        n = self.frame_samples
        out: list[Piece] = []
        for segment in self._segments:
            whole, left = divmod(segment.available, n)
            count = whole + (1 if segment.ended and left else 0)
            for j in range(min(count, limit - len(out))):
                index = segment.taken + j
                t = (index + 0.5) * n / segment.rate if segment.rate else 0.0
                pcm = segment.look(n, j * n)
                out.append(Piece(segment.segment_id, index, pcm, segment.timeline, t))
            if len(out) >= limit or not segment.ended:
                break
        return out

    def peek(self) -> tuple[int, int] | None:
        """(segment_id, index) of the piece :meth:`next_piece` would return now, not taken."""
        n = self.frame_samples
        for segment in self._segments:
            if segment.available >= n or (segment.ended and segment.available > 0):
                return segment.segment_id, segment.taken
            if not segment.ended:
                return None
        return None

    def taken(self, segment_id: int) -> int | None:
        """Pieces of ``segment_id`` taken so far; None once it is gone (cleared, or played
        out and dropped)."""
        for segment in self._segments:
            if segment.segment_id == segment_id:
                return segment.taken
        return None

    def skip(self, segment_id: int) -> None:
        """One piece of ``segment_id`` was presented elsewhere: drop it (and older segments)."""
        while self._segments and self._segments[0].segment_id != segment_id:
            self._segments.popleft()
        if self._segments:
            self._segments[0].take(self.frame_samples)

    def clear(self) -> None:
        self._segments.clear()

    @property
    def queued_samples(self) -> int:
        """Samples not yet taken out."""
        return sum(s.available for s in self._segments)

    @property
    def pending(self) -> bool:
        """Is there speech not yet taken out?"""
        return any(s.available for s in self._segments)

    def remaining(self) -> list[tuple[int, int, I16, bool]]:
        """(segment_id, pieces already taken, samples not yet taken, ended), oldest first."""
        out = []
        for s in self._segments:
            parts = list(s.chunks)
            if parts and s.offset:
                parts[0] = parts[0][s.offset :]
            pcm = np.concatenate(parts) if parts else np.zeros(0, np.int16)
            out.append((s.segment_id, s.taken, pcm, s.ended))
        return out
