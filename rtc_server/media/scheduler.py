"""Presents speech and the engine's frames on the session clock. Audio is the master; video adapts.

Unit k (one video frame and its 1/fps of audio) is due at ``k / fps`` of session time.

Speech goes into the engine through the scheduler (:meth:`AVScheduler.push_audio`), so the
scheduler owns what the caller hears. It cuts the speech into frame-sized pieces (segment s,
piece j) and places them on the clock as soon as they arrive: a run of speech starts
``engine.latency`` after now, its pieces follow one another unit after unit, whatever the
engine does next. Only the TTS can leave a gap (its audio was not there in time).

The engine's k-th speaking frame of a segment shows the sound of piece k; frames are matched to
pieces by (segment, index). A speech unit's image is taken when the video track asks for it: the
engine's frame for that piece if it is there, else the last image presented (held). A frame that
arrives after its instant is dropped, so the picture of an engine that fell behind skips ahead
to the clock. Idle units take the engine's idle frames whole (image and audio together, as the
sync-test engine's flash and beep), or the held image and silence when none is ready.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from musetalk_core.segments import Piece, SegmentQueue
from musetalk_core.types import AudioChunk, AvatarFrame, LipSyncEngine
from musetalk_core.visemes import VisemeTimeline
from rtc_server.media.clock import MediaClock, MonotonicClock

logger = logging.getLogger(__name__)

MAX_HISTORY_S = 30
"""Longest a unit waits for a lagging track before it is dropped."""
RESYNC_COOLDOWN_S = 0.5
"""Least time between two catch-ups of an engine that fell behind (twice its latency, if more)."""
LATE_FRAMES = 2
"""A frame that missed its instant by at most this many frames is shown at the next instant
without its own frame: one frame late beats holding an older image, and keeps the mouth of an
engine that runs at real time but one phase behind moving instead of frozen."""


@dataclass(slots=True)
class SchedulerStats:
    units: int = 0
    """Units presented (video frame instants)."""
    speaking_units: int = 0
    held_units: int = 0
    """Speech instants whose frame was not ready when the video track asked: last image held."""
    idle_held: int = 0
    """Idle instants with no idle frame from the engine ready: last image, silence."""
    stale_frames: int = 0
    """Speaking frames the engine delivered after their instant had been presented."""
    resyncs: int = 0
    """Times the engine fell more than ``LATE_FRAMES`` behind and was moved ahead to the clock."""
    late_shown: int = 0
    """Held instants that showed a frame at most ``LATE_FRAMES`` late instead of the last image."""
    video_sent: int = 0
    video_dropped: int = 0
    """Video frames skipped because the video track fell behind the clock."""
    video_still: int = 0
    """Idle instants not sent because the picture had not changed (see tracks.py)."""


@dataclass(slots=True)
class Unit:
    """What one instant presents. ``image`` is None until the video track resolves it."""

    audio: AudioChunk
    speaking: bool
    segment_id: int
    """-1 for idle units."""
    index: int
    """The piece of its segment this unit plays; -1 for idle units."""
    image: np.ndarray | None = None
    timeline: VisemeTimeline | None = None
    """The visemes of the speech this unit plays, when it came with phonemes."""
    time: float = 0.0
    """The middle of this unit's speech on its segment's clock, where ``timeline`` applies."""


class AVScheduler:
    """Owns the output of one call: speech placed on the clock, the engine's frames matched."""

    def __init__(
        self,
        engine: LipSyncEngine,
        clock: MediaClock | None = None,
        *,
        lead_frames: int = 3,
        video_lead_s: float = 0.0,
        on_unit: Callable[[int, Unit], None] | None = None,
        on_video: Callable[[int, bool], None] | None = None,
        on_behind: Callable[[], None] | None = None,
        on_clear: Callable[[], None] | None = None,
        on_queued: Callable[[], None] | None = None,
    ) -> None:
        self.engine = engine
        self.clock: MediaClock = clock if clock is not None else MonotonicClock()
        self.fps = engine.fps
        self.sample_rate = engine.sample_rate
        self.samples_per_unit = engine.sample_rate // engine.fps
        self.stats = SchedulerStats()
        self._lead = max(1, lead_frames)
        self.video_lead_s = video_lead_s
        """How long before its instant the video track takes a unit's frame (to encode it
        then and send it at the instant): speech is placed this much later, so its frames
        are as ready as without the lead."""
        self._speech = SegmentQueue(self.samples_per_unit)
        self._speech_from: int | None = None
        """The first unit the current run of speech may play at; None between runs."""
        self._audio_from: int | None = 0
        """The first unit the audio track plays; None while a new track has not started."""
        self._top_segment = -1
        """The highest segment id pushed."""
        self._live_from = 0
        """Segments below this id are gone (played, or cleared): their frames are stale."""
        self._faces: dict[tuple[int, int], np.ndarray] = {}
        """Engine frames for speech pieces not yet presented, by (segment, index)."""
        self._rendered: dict[int, int] = {}
        """Speaking frames the engine delivered per segment: the index of the next one."""
        self._shown: tuple[int, int] = (-1, -1)
        """(segment, index) of the last speech unit the video track resolved."""
        self._late: tuple[tuple[int, int], np.ndarray] | None = None
        """The newest frame that arrived after its instant, for the next instant that has none."""
        self._idle: collections.deque[AvatarFrame] = collections.deque()
        self._space = asyncio.Event()
        self._fed = asyncio.Event()
        """Set when the engine is handed speech (or its end, or a clear)."""
        self._generation = 0
        self._units: dict[int, Unit] = {}
        self._position: dict[str, int] = {}
        """The latest instant each consumer asked for."""
        self._next_unit = 0
        self._on_unit = on_unit
        self._on_video = on_video
        self._on_behind = on_behind
        self.on_clear = on_clear
        """Called after :meth:`clear` dropped the queued speech (a barge-in)."""
        self.on_queued = on_queued
        """Called after speech was queued and placed on the clock."""
        self._behind = False
        """A frame came in more than ``LATE_FRAMES`` after its instant: catch up."""
        self._resynced_at = -RESYNC_COOLDOWN_S
        self._task: asyncio.Task[None] | None = None
        self._silence = AudioChunk(np.zeros(self.samples_per_unit, np.int16), self.sample_rate)
        self._last_image: np.ndarray | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._pull(), name="av-scheduler")

    # -- speech in ---------------------------------------------------------------------------

    async def push_audio(self, chunk: AudioChunk, segment_id: int) -> None:
        """Queue speech for ``segment_id``: placed on the clock now, then handed to the engine."""
        if chunk.sample_rate != self.sample_rate:
            raise ValueError(f"audio at {chunk.sample_rate} Hz; the call plays {self.sample_rate}")
        if segment_id < self._live_from:
            return  # cleared while it was being synthesized
        self._speech.push_chunk(chunk, segment_id)
        self._top_segment = max(self._top_segment, segment_id)
        self._place()
        if self.on_queued is not None:
            self.on_queued()
        await self.engine.push_audio(chunk, segment_id)
        self._fed.set()

    async def end_segment(self, segment_id: int) -> None:
        """No more audio for ``segment_id``: its last partial piece is padded and plays."""
        self._speech.end(segment_id)
        self._place()
        if self.on_queued is not None:
            self.on_queued()  # its last partial piece can play now
        await self.engine.end_segment(segment_id)
        self._fed.set()

    def audio_from(self, unit: int | None) -> None:
        """The audio track's first unit: speech is placed no earlier, so none of it goes
        unheard. None: a new audio track has not started yet (speech waits to be placed)."""
        self._audio_from = unit
        self._place()

    def _place(self) -> None:
        """Start a run of speech ``engine.latency`` from now, unless one is running."""
        if self._speech_from is not None or not self._speech.pending:
            return
        if self._audio_from is None:
            return
        self._speech_from = max(self._ready_unit(), self._next_unit, self._audio_from)
        # Idle frames rendered ahead would be stale once the speech is over.
        self._idle.clear()
        self._space.set()

    def _ready_unit(self) -> int:
        """The first instant a frame the engine starts on now can be ready for."""
        due = (self.clock.now() + self._ahead_s) * self.fps
        return math.ceil(due - 1e-6)  # 0.24 s * 25 is instant 6, not 6.000000000000001

    @property
    def _ahead_s(self) -> float:
        """How long before its instant a frame is taken, at the latest: the engine's latency
        (its first frame takes that) and the video track's lead."""
        return max(0.0, self.engine.latency) + self.video_lead_s

    def clear(self) -> None:
        """Barge-in: queued speech and frames rendered ahead are dropped; the next unit is idle."""
        self._generation += 1
        self._speech.clear()
        self._speech_from = None
        self._live_from = self._top_segment + 1
        self._faces.clear()
        self._rendered.clear()
        self._late = None
        self.engine.clear()
        self._space.set()
        self._fed.set()
        for index in [i for i in self._units if i >= self._next_unit]:
            del self._units[index]
        if self.on_clear is not None:
            self.on_clear()

    @property
    def next_unit(self) -> int:
        """The first instant no track has asked for yet."""
        return self._next_unit

    def upcoming(self, through: int) -> list[tuple[int, Piece]]:
        """The speech queued to play from :attr:`next_unit` to ``through``, as (instant,
        piece), if no barge-in comes: a run of speech plays its pieces one instant after
        another. What the TTS has not delivered yet is not in it (it may still come in time)."""
        if self._speech_from is None:
            return []
        first = max(self._next_unit, self._speech_from)
        pieces = self._speech.upcoming(through - first + 1)
        return [(first + j, piece) for j, piece in enumerate(pieces)]

    @property
    def speech_pending(self) -> bool:
        """Speech queued that no unit has played yet."""
        return self._speech.pending

    # -- frames in ---------------------------------------------------------------------------

    def _room(self) -> bool:
        faces_lead = self._lead + math.ceil(self._ahead_s * self.fps)
        if self._speech_from is not None:
            return len(self._faces) < faces_lead
        return len(self._idle) < self._lead and len(self._faces) < faces_lead

    async def _pull(self) -> None:
        frames = self.engine.frames()
        try:
            while True:
                while not self._room():
                    self._space.clear()
                    await self._space.wait()
                generation = self._generation
                self._fed.clear()  # speech handed over while the engine works is kept
                try:
                    frame = await anext(frames)
                except StopAsyncIteration:
                    return
                if frame.speaking:
                    if generation == self._generation:
                        self._take_face(frame)
                    if self._behind:
                        await self._catch_up()
                    continue
                self._idle.append(frame)
                while len(self._idle) > self._lead:
                    self._idle.popleft()
                if self._speech_from is not None:
                    await self._wait_for_speech()
        except asyncio.CancelledError:
            raise
        except Exception:
            # The engine failing must not end the call: the speech plays on over a still image.
            logger.exception("lip-sync engine failed; its last image is held from now on")

    async def _wait_for_speech(self) -> None:
        """Speech is running, but the engine had none of it to render (the TTS's next piece
        has not come, or only part of a frame's): wait until it is handed more, or for one
        frame's time, before asking again. The room for frames only counts faces while speech
        runs, so otherwise the engine's idle frames would be pulled as fast as the loop turns
        (about 130 a second on one speaking call, measured)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._fed.wait(), 1 / self.fps)

    def _take_face(self, frame: AvatarFrame) -> None:
        segment = frame.segment_id
        if segment < self._live_from or segment > self._top_segment:
            return  # a segment cleared (or never pushed here)
        index = self._rendered.get(segment, 0)
        self._rendered[segment] = index + 1
        if (segment, index) <= self._shown:
            self.stats.stale_frames += 1
            self._late = ((segment, index), frame.image)
            shown_segment, shown_index = self._shown
            if segment != shown_segment or shown_index - index > LATE_FRAMES:
                self._behind = True
            return
        self._faces[(segment, index)] = frame.image

    async def _catch_up(self) -> None:
        """The engine fell behind: hand it the speech from the first instant it can still make.

        Its queue is cleared and refilled with the speech that plays ``latency`` (and a frame)
        from now on; the pieces before that play over the held picture. An engine that is only
        slow for a while (a burst of load) is back in sync after one catch-up.
        """
        self._behind = False
        now = self.clock.now()
        # An engine that renders in batches needs at least its latency to deliver after a
        # catch-up: catching up again sooner would throw every batch away.
        if now - self._resynced_at < max(RESYNC_COOLDOWN_S, 2 * self.engine.latency):
            return
        self._resynced_at = now
        self.stats.resyncs += 1
        if self.stats.resyncs == 1 and self._on_behind is not None:
            self._on_behind()
        first = self._ready_unit() + 1
        playing_from = max(self._next_unit, self._speech_from or 0)
        skip = max(0, first - playing_from)
        self.engine.clear()
        self._faces.clear()
        self._rendered.clear()
        for segment_id, taken, pcm, ended in self._speech.remaining():
            cut = min(skip, len(pcm) // self.samples_per_unit)
            skip -= cut
            self._rendered[segment_id] = taken + cut
            rest = pcm[cut * self.samples_per_unit :]
            if len(rest):
                phonemes = self._speech.phonemes_from(segment_id, taken + cut)
                chunk = AudioChunk(rest, self.sample_rate, phonemes)
                await self.engine.push_audio(chunk, segment_id)
            if ended:
                await self.engine.end_segment(segment_id)

    # -- units out ---------------------------------------------------------------------------

    def register(self, consumer: str) -> None:
        """A track that will ask for units: none is dropped before it has passed them."""
        self._position.setdefault(consumer, -1)

    def unit(self, k: int, consumer: str = "audio") -> Unit:
        """The unit presented at instant k; assigned on first request, never blocking.

        ``consumer`` ("audio" or "video") says which track asks: a unit is kept until both
        tracks have passed it, so either may lag the other. Audio walks every instant; video
        may skip ahead, and a unit it asks for after audio dropped it comes back as filler.
        For the video track the unit's image is resolved (the engine's frame, or held).
        """
        self._position[consumer] = max(k, self._position.get(consumer, k))
        unit = self._units.get(k)
        if unit is None and k < self._next_unit:
            unit = Unit(self._silence, False, -1, -1, self._held_image())
        if unit is None:
            self._assign_through(k)
            unit = self._units[k]
        if consumer == "video":
            self._resolve(unit)
        self._evict()
        return unit

    def _assign_through(self, k: int) -> None:
        while self._next_unit <= k:
            index = self._next_unit
            self._next_unit += 1
            piece = None
            if self._speech_from is not None and index >= self._speech_from:
                piece = self._speech.next_piece()
                if piece is None:
                    self._speech_from = None  # the run is over, or the TTS is late
            if piece is not None:
                audio = AudioChunk(piece.pcm, self.sample_rate)
                unit = Unit(
                    audio, True, piece.segment_id, piece.index, None, piece.timeline, piece.time
                )
                self.stats.speaking_units += 1
                if "video" not in self._position:
                    self._forget_faces_through((piece.segment_id, piece.index))
            elif self._idle:
                frame = self._idle.popleft()
                self._space.set()
                unit = Unit(frame.audio, False, -1, -1, frame.image)
            else:
                unit = Unit(self._silence, False, -1, -1)
                self.stats.idle_held += 1
            self._units[index] = unit
            self.stats.units += 1
            if self._on_unit is not None:
                self._on_unit(index, unit)

    def _resolve(self, unit: Unit) -> None:
        if unit.image is not None:
            self._last_image = unit.image
            return
        held = False
        if unit.speaking:
            key = (unit.segment_id, unit.index)
            face = self._faces.pop(key, None)
            self._forget_faces_through(key)
            if face is None:
                held = True
                self.stats.held_units += 1
                late, self._late = self._late, None
                if late is not None and late[0][0] == key[0] and key[1] - late[0][1] <= LATE_FRAMES:
                    face = late[1]
                    self.stats.late_shown += 1
            unit.image = face if face is not None else self._held_image()
        else:
            unit.image = self._held_image()
        self._last_image = unit.image
        if held and self._on_video is not None:
            self._on_video(0, True)

    def _forget_faces_through(self, key: tuple[int, int]) -> None:
        """Piece ``key`` is presented: frames for it and earlier ones will never be shown."""
        self._shown = max(self._shown, key)
        for face in [f for f in self._faces if f <= key]:
            del self._faces[face]
        segment = key[0]
        for gone in [s for s in self._rendered if s < segment]:
            del self._rendered[gone]
        self._live_from = max(self._live_from, min(segment, self._top_segment + 1))
        self._space.set()

    def _held_image(self) -> np.ndarray:
        if self._last_image is None:
            w, h = self.engine.frame_size
            self._last_image = np.zeros((h, w, 3), np.uint8)
        return self._last_image

    def _evict(self) -> None:
        passed = min(self._position.values())
        # A consumer that stopped asking must not hold units forever: keep 30 s at most.
        passed = max(passed, self._next_unit - MAX_HISTORY_S * self.fps)
        units = self._units
        # Units are added in order of their instants: the passed ones are the first.
        while units and (first := next(iter(units))) < passed:
            del units[first]
        if len(units) > 2 * self.fps and "video" in self._position:
            # Audio lags far behind (an overloaded sender): keep its sound, not the images.
            video = self._position["video"]
            last = self._last_image
            for i, u in self._units.items():
                if i < video and u.image is not None and u.image is not last:
                    u.image = last

    def note_still(self, dropped: int) -> None:
        """The video track skipped an idle instant whose picture had not changed."""
        self.stats.video_still += 1
        self.stats.video_dropped += dropped

    def note_video(self, dropped: int) -> None:
        """The video track sent one frame after skipping ``dropped`` late ones."""
        self.stats.video_sent += 1
        self.stats.video_dropped += dropped
        if self._on_video is not None:
            self._on_video(dropped, False)

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        # An engine may swallow one cancellation (a library's own wait racing it): cancel
        # again until the task is done, so closing a call never hangs on its engine.
        while not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=1.0)
        with contextlib.suppress(asyncio.CancelledError, Exception):
            task.result()
