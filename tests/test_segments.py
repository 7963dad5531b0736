"""The one segment queue: speech cut into frame slices, the same way wherever it is held."""

from __future__ import annotations

import numpy as np

from musetalk_core.segments import SegmentQueue


def _drain(queue: SegmentQueue) -> list[tuple[int, int, np.ndarray]]:
    out = []
    while (piece := queue.next_piece()) is not None:
        out.append((piece.segment_id, piece.index, piece.pcm))
    return out


def test_pieces_are_continuous_slices_whatever_the_push_sizes() -> None:
    queue = SegmentQueue(10)
    pcm = np.arange(1, 36, dtype=np.int16)
    for a, b in [(0, 3), (3, 17), (17, 18), (18, 35)]:
        queue.push(pcm[a:b], 5)
    pieces = _drain(queue)
    # 35 samples: three full pieces; the partial fourth waits for more audio or the end.
    assert [(s, i) for s, i, _ in pieces] == [(5, 0), (5, 1), (5, 2)]
    assert np.array_equal(np.concatenate([p for _, _, p in pieces]), pcm[:30])
    assert queue.pending and queue.queued_samples == 5
    queue.end(5)
    (last,) = _drain(queue)
    assert last[1] == 3 and np.array_equal(last[2], np.r_[pcm[30:], np.zeros(5, np.int16)])
    assert not queue.pending


def test_a_new_segment_ends_the_one_before() -> None:
    queue = SegmentQueue(4)
    queue.push(np.ones(6, np.int16), 1)
    queue.push(np.full(4, 2, np.int16), 2)
    pieces = _drain(queue)
    assert [(s, i) for s, i, _ in pieces] == [(1, 0), (1, 1), (2, 0)]
    assert pieces[1][2].tolist() == [1, 1, 0, 0]


def test_pushed_audio_is_copied() -> None:
    queue = SegmentQueue(4)
    buffer = np.ones(4, np.int16)
    queue.push(buffer, 0)
    buffer[:] = 9
    piece = queue.next_piece()
    assert piece is not None and piece.pcm.tolist() == [1, 1, 1, 1]


def test_skip_and_remaining_follow_what_was_presented_elsewhere() -> None:
    queue = SegmentQueue(4)
    queue.push(np.arange(1, 11, dtype=np.int16), 0)
    queue.end(0)
    queue.push(np.arange(20, 26, dtype=np.int16), 1)
    queue.skip(0)  # one piece of segment 0 was presented by someone else
    remaining = queue.remaining()
    assert [(s, taken, pcm.tolist(), ended) for s, taken, pcm, ended in remaining] == [
        (0, 1, [5, 6, 7, 8, 9, 10], True),
        (1, 0, [20, 21, 22, 23, 24, 25], False),
    ]
    queue.skip(1)  # segment 0 is over for whoever skips into segment 1
    assert [s for s, _, _, _ in queue.remaining()] == [1]
    queue.clear()
    assert queue.next_piece() is None and not queue.pending


def test_peek_names_the_next_piece_without_taking_it_and_taken_counts_per_segment() -> None:
    q = SegmentQueue(4)
    assert q.peek() is None and q.taken(0) is None
    q.push(np.arange(6, dtype=np.int16), 0)
    assert q.peek() == (0, 0) and q.peek() == (0, 0)  # looking takes nothing
    assert q.next_piece() is not None and q.taken(0) == 1
    assert q.peek() is None  # 2 samples left of a segment that may still grow
    q.push(np.arange(3, dtype=np.int16), 1)  # a new segment ends the one before
    assert q.peek() == (0, 1)
    piece = q.next_piece()
    assert piece is not None and piece.index == 1 and list(piece.pcm) == [4, 5, 0, 0]
    assert q.peek() is None  # segment 1 has 3 of 4 samples and has not ended
    q.end(1)
    assert q.peek() == (1, 0) and q.taken(1) == 0
    q.next_piece()
    assert q.peek() is None and q.next_piece() is None
    assert q.taken(0) is None  # played out and dropped
    q.push(np.arange(8, dtype=np.int16), 2)
    q.clear()
    assert q.peek() is None and q.taken(2) is None


def test_phonemes_build_the_segment_timeline_across_chunks() -> None:
    from musetalk_core import visemes as vm
    from musetalk_core.types import AudioChunk, PhonemeSpan

    rate = 1000
    queue = SegmentQueue(40)  # 40 ms pieces
    first = AudioChunk(np.ones(100, np.int16), rate, (PhonemeSpan("a", 0.0, 0.1),))
    second = AudioChunk(
        np.ones(100, np.int16), rate, (PhonemeSpan("m", 0.0, 0.05), PhonemeSpan("u", 0.05, 0.1))
    )
    queue.push_chunk(first, 3)
    queue.push_chunk(second, 3)
    queue.push(np.ones(40, np.int16), 4)  # speech without phonemes
    queue.end(4)
    pieces = []
    while (piece := queue.next_piece()) is not None:
        pieces.append(piece)
    seg3 = [p for p in pieces if p.segment_id == 3]
    assert [p.time for p in seg3] == [0.02, 0.06, 0.1, 0.14, 0.18]
    timeline = seg3[0].timeline
    assert timeline is not None and all(p.timeline is timeline for p in seg3)
    # The second chunk's phonemes sit after the first chunk on the segment's clock.
    assert int(np.argmax(timeline.weights(0.05))) == vm.VISEMES.index("aa")
    assert int(np.argmax(timeline.weights(0.125))) == vm.VISEMES.index("PP")
    assert int(np.argmax(timeline.weights(0.18))) == vm.VISEMES.index("ou")
    (seg4,) = [p for p in pieces if p.segment_id == 4]
    assert seg4.timeline is None


def test_phonemes_from_a_piece_start_on_its_own_clock() -> None:
    from musetalk_core.types import AudioChunk, PhonemeSpan

    queue = SegmentQueue(40)
    spans = tuple(PhonemeSpan(c, 0.05 * i, 0.05 * (i + 1)) for i, c in enumerate("abcd"))
    queue.push_chunk(AudioChunk(np.ones(200, np.int16), 1000, spans), 0)
    queue.next_piece()  # piece 0 taken
    # From piece 2 (80 ms) on: "b" is cut at its start, "c" and "d" move back by 80 ms.
    got = queue.phonemes_from(0, 2)
    assert [s.phoneme for s in got] == ["b", "c", "d"]
    assert got[0].start == 0.0 and abs(got[0].end - 0.02) < 1e-9
    assert abs(got[1].start - 0.02) < 1e-9 and abs(got[2].end - 0.12) < 1e-9
    assert queue.phonemes_from(7, 0) == ()
