"""A call's watchdogs: each returns when its call should end, and the session ends it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiortc import RTCPeerConnection

PEER_SILENCE_S = 15.0
"""A connected caller from whom nothing (RTP, RTCP, data channel, DTLS) arrived for this long
has vanished (killed, unplugged) and its call is closed. Every live client sends RTCP reports
for the media it receives, about once a second, even with no microphone. aioice's own consent
check alone takes 24-36 s (6 unanswered checks about 5 s apart)."""


async def connected_within(pc: RTCPeerConnection, seconds: float) -> bool:
    """Whether ``pc`` is connected ``seconds`` from now."""
    await asyncio.sleep(seconds)
    return pc.connectionState == "connected"


async def idle_for(
    seconds: float,
    last_activity: Callable[[], float],
    listening: Callable[[], bool],
    clock: Callable[[], float],
) -> None:
    """Return once, for ``seconds``, nothing happened while the avatar listened.

    Thinking or speaking is not idle: the state's return to listening counts as activity, so
    waking a full period later is never late.
    """
    while True:
        left = last_activity() + seconds - clock()
        if left <= 0 and listening():
            return
        await asyncio.sleep(left if left > 0 else seconds)


async def peer_silent_for(pc: RTCPeerConnection, seconds: float) -> None:
    """Return once nothing has come from the caller for ``seconds``.

    Silence is counted in polls that saw no new packet, not in wall time: an event loop held
    up for a while (the datagrams wait in the socket meanwhile) costs one poll, so a busy
    server does not mistake itself for a silent caller.
    """
    interval = min(1.0, seconds / 4)
    polls = max(1, round(seconds / interval))
    last, quiet = -1, 0
    while quiet < polls:
        await asyncio.sleep(interval)
        report = await pc.getStats()
        # One DTLS transport (BUNDLE): every datagram after ICE, whatever it carries.
        count = sum(s.packetsReceived for s in report.values() if s.type == "transport")
        quiet = quiet + 1 if count == last else 0
        last = count
