"""The load callers time packets by the kernel's receive time, not by their own busy loop."""

from __future__ import annotations

import asyncio
import socket
import time

import numpy as np

from benchmarks.latency import spawn_server
from benchmarks.load import connect_light_caller
from rtc_server.aiortc_compat import kernel_arrival

SENTENCE = (
    "While this caller is busy with something else, the server goes on sending the picture "
    "and the voice at their own pace, frame after frame, without waiting for anybody."
)


def test_a_datagram_read_late_is_dated_when_it_came() -> None:
    with (
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as rx,
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx,
    ):
        rx.bind(("127.0.0.1", 0))
        rx.setblocking(False)
        kernel_arrival(rx)  # the first ask turns the socket's receive times on
        time.sleep(0.05)
        before = time.monotonic()
        tx.sendto(b"x", rx.getsockname())  # on loopback, received within this call
        after = time.monotonic()
        time.sleep(0.3)
        rx.recv(16)
        arrived = kernel_arrival(rx)
        read = time.monotonic()
    # The two clocks are matched at the reading: 5 ms allowed for that, however busy.
    assert before - 0.005 <= arrived <= after + 0.005, (before, arrived, after)
    assert read - arrived >= 0.25
    assert kernel_arrival(None) <= time.monotonic()  # no socket: now


async def test_frames_keep_their_pace_while_the_caller_is_busy() -> None:
    url, server = await spawn_server("--piper-deterministic", "--no-headroom")
    try:
        client, _ = await connect_light_caller(url)
        try:
            await client.say(SENTENCE)
            await client.wait_state("speaking", 30)
            await asyncio.sleep(1.0)
            busy_from = time.monotonic()
            time.sleep(0.8)  # noqa: ASYNC251  the caller busy: its loop reads nothing, the server sends on
            busy_to = time.monotonic()
            await asyncio.sleep(1.0)
            frames = [
                (arrived, read)
                for (arrived, _, _), read in zip(
                    client.received.video, client.received.video_read, strict=True
                )
                if busy_from <= arrived <= busy_to
            ]
        finally:
            await client.close()
    finally:
        server.terminate()
        await server.wait()
    # 25 fps while speaking: ~20 frames came during the 0.8 s, each dated when it came, all
    # read after the loop was free again. Timed by the loop, none would fall inside.
    assert len(frames) >= 10, frames
    assert all(read >= busy_to for _, read in frames)
    arrivals = np.array([busy_from] + [a for a, _ in frames] + [busy_to])
    assert np.diff(arrivals).max() < 0.25, np.diff(arrivals)
