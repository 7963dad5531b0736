"""What a server says of itself during a benchmark: its ``/metrics`` text, and the figures read
from it (frames held or dropped, how late frames left by the server's own histogram, how long
its garbage collector held it)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import aiohttp


async def server_metrics(url: str) -> str | None:
    """The server's /metrics text (all its workers); None when it cannot be read."""
    try:
        async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
            return await resp.text() if resp.status == 200 else None
    except aiohttp.ClientError:
        return None


def _samples(text: str, name: str) -> Iterator[tuple[dict[str, str], float]]:
    """Each sample of metric ``name`` in a /metrics text: its labels and value."""
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, _, value = line[len(name) + 1 :].partition("} ")
            pairs = (item.partition("=") for item in labels.split(","))
            yield {k: v.strip('"') for k, _, v in pairs}, float(value)


def server_late_counts(text: str | None) -> dict[str, int] | None:
    """``avatar_rtc_video_frames_late_total`` by reason (None without a text)."""
    if text is None:
        return None
    counts = {"held": 0, "dropped": 0}
    for labels, value in _samples(text, "avatar_rtc_video_frames_late_total"):
        if labels.get("reason") in counts:
            counts[labels["reason"]] += int(value)
    return counts


def server_delay_buckets(text: str | None, kind: str = "video") -> dict[float, float] | None:
    """``avatar_rtc_frame_send_delay_seconds`` of ``kind``: cumulative count by bucket bound
    (s), summed over workers; None without a text."""
    if text is None:
        return None
    buckets: dict[float, float] = {}
    for labels, value in _samples(text, "avatar_rtc_frame_send_delay_seconds_bucket"):
        if labels.get("kind") == kind:
            bound = float(labels["le"])
            buckets[bound] = buckets.get(bound, 0.0) + value
    return buckets


def delay_summary(
    before: dict[float, float] | None, after: dict[float, float] | None
) -> dict[str, float | int | None] | None:
    """The frames that left during the step: how many, and the bucket bounds (ms) their
    median and 99th percentile fell under (None past the last bound)."""
    if before is None or after is None or not after:
        return None
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1]
    out: dict[str, float | int | None] = {"frames": int(total), "p50": None, "p99": None}
    for q, key in ((0.5, "p50"), (0.99, "p99")):
        for bound, count in zip(bounds, counts, strict=True):
            if total and count >= q * total:
                out[key] = None if bound == float("inf") else bound * 1000
                break
    return out


def late_delta(
    before: dict[str, int] | None, after: dict[str, int] | None
) -> dict[str, int] | None:
    if before is None or after is None:
        return None
    return {k: after[k] - before[k] for k in after}


def gc_pauses(before: str | None, after: str | None) -> dict[str, Any] | None:
    """``avatar_rtc_gc_pause_seconds`` between two /metrics texts, summed over workers: how
    many collections ran, how many of them full (generation 2), and the bucket bound (ms) the
    longest fell under (None past the last bound). None without both texts, and from a server
    that does not report its collector."""
    if before is None or after is None:
        return None

    def buckets(text: str) -> tuple[dict[float, float], float]:
        out: dict[float, float] = {}
        full = 0.0
        for labels, value in _samples(text, "avatar_rtc_gc_pause_seconds_bucket"):
            bound = float(labels["le"])
            out[bound] = out.get(bound, 0.0) + value
            if labels.get("generation") == "2" and bound == float("inf"):
                full += value
        return out, full

    (b0, full0), (b1, full1) = buckets(before), buckets(after)
    if not b1:
        return None  # a server that does not time its collector (an older one)
    counts = {bound: b1[bound] - b0.get(bound, 0.0) for bound in sorted(b1)}
    total = counts.get(float("inf"), 0.0)
    longest = next((b for b, c in counts.items() if c >= total), None) if total else 0.0
    return {
        "collections": int(total),
        "full": int(full1 - full0),
        "longest_ms": None if longest is None or longest == float("inf") else longest * 1000,
    }


def step_readings(before: str | None, after: str | None) -> dict[str, Any]:
    """What the server said of one step, from its /metrics before and after: ``late`` (video
    instants held or dropped), ``delays`` (how late frames left, by track: :func:`delay_summary`)
    and ``gc`` (:func:`gc_pauses`)."""
    return {
        "late": late_delta(server_late_counts(before), server_late_counts(after)),
        "delays": {
            kind: delay_summary(
                server_delay_buckets(before, kind), server_delay_buckets(after, kind)
            )
            for kind in ("video", "audio")
        },
        "gc": gc_pauses(before, after),
    }
