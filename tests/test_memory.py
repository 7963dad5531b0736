"""rtc_server/memory.py: the start-up objects out of the collector's reach, its pauses timed."""

from __future__ import annotations

import gc

import aiohttp

from rtc_server.memory import CollectorPauses, freeze_startup_objects
from tests.conftest import LiveServer


class _Node:
    """A cycle's member: only the collector frees it."""

    def __init__(self) -> None:
        self.me = self


def test_collector_pauses_times_each_collection_while_installed() -> None:
    seen: list[tuple[int, float]] = []
    with CollectorPauses() as pauses:
        assert pauses in gc.callbacks
        gc.collect(1)
        gc.collect()
    assert pauses not in gc.callbacks
    assert pauses.drain(lambda gen, s: seen.append((gen, s))) == len(seen) >= 2
    gens = [gen for gen, _ in seen]  # with any automatic young collections in between
    assert 1 in gens and 2 in gens[gens.index(1) :], gens
    assert all(0.0 <= s < 10.0 for _, s in seen)
    gc.collect()
    assert pauses.drain(lambda gen, s: seen.append((gen, s))) == 0, "removed: told nothing more"


def test_a_collection_inside_the_metrics_lock_does_not_wait_for_it() -> None:
    """A collection can start in a thread that holds prometheus_client's lock (a scrape
    copies the children under it): timing it must not take that lock again."""
    from rtc_server.metrics import Metrics

    metrics = Metrics()
    metrics.observe_gc_pause(0, 0.001)  # the child exists, as on a running server
    with CollectorPauses() as pauses:
        with metrics.gc_pause._lock:  # what a scrape holds while it copies
            gc.collect(0)  # would hang here if the callback recorded straight into it
    assert pauses.drain(metrics.observe_gc_pause) >= 1


def test_frozen_objects_are_left_out_of_collections_and_new_ones_are_not() -> None:
    before = _Node()
    try:
        frozen = freeze_startup_objects()
        after = _Node()
        tracked = {id(o) for o in gc.get_objects()}
        assert frozen == gc.get_freeze_count() > 0
        assert id(before) not in tracked, "an object alive at the freeze is still walked"
        assert id(after) in tracked
        # Garbage made after the freeze is still collected.
        _Node()
        assert gc.collect() >= 1
    finally:
        gc.unfreeze()


async def test_a_live_server_reports_its_collector_pauses(live_server: LiveServer) -> None:
    gc.collect(0)
    async with aiohttp.ClientSession() as http:
        async with http.get(live_server.url + "/metrics") as resp:
            text = await resp.text()
    counts = {
        line.split("{")[1].split("}")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("avatar_rtc_gc_pause_seconds_count")
    }
    assert counts.get('generation="0"', 0) >= 1, counts
