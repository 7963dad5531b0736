"""Callers in a process of their own: ``python -m tests.caller_process URL [options]``.

Two uses, both with :class:`benchmarks.client.CallClient` (ICE on 127.0.0.1 only):

- Stay (default): connect, wait for the events channel and the first video frames, print one
  JSON line ``{"session_id": ..., "sending": [...]}`` on stdout, then stay in the call,
  receiving, until killed. A SIGKILL sends nothing more: no DTLS close alert, no SCTP ABORT,
  no DELETE; to the server the caller just vanishes. ``--text-only`` offers no microphone
  (audio and video both receive-only, as a typed-chat page would): such a caller sends no RTP
  at all, only RTCP reports and data-channel traffic.
- ``--calls N --at-once K``: N complete calls, K at a time, each doing real work: connect, get
  video, have the avatar speak (a ``say`` over HTTP, or a typed turn on the data channel
  answered by the LLM), hear it, hang up (``DELETE``, or closing the peer connection). One
  JSON line per call, then ``{"done": N}``. The server's memory is then its own, not the
  callers'.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

import aiohttp
from aiortc.mediastreams import MediaStreamTrack

from benchmarks.analysis import loud_frames
from benchmarks.client import CallClient
from tests.waiting import wait_for_video

HEARD_S = 0.3
"""Loud audio that counts as the reply heard (the shortest reply, "Hello there.", has 0.5 s)."""


class _ReceiveOnly(CallClient):
    """A CallClient whose audio transceiver is receive-only: no microphone, no RTP out."""

    async def connect(self, **kwargs: Any) -> str:
        add = self.pc.addTransceiver

        def recvonly(track: MediaStreamTrack | str, direction: str = "sendrecv") -> Any:
            if track is self.microphone:
                return add("audio", direction="recvonly")
            return add(track, direction=direction)

        self.pc.addTransceiver = recvonly  # type: ignore[method-assign]
        try:
            return await super().connect(**kwargs)
        finally:
            self.pc.addTransceiver = add  # type: ignore[method-assign]


async def stay(url: str, text_only: bool) -> int:
    cls = _ReceiveOnly if text_only else CallClient
    client = cls(url, record_video=False)
    await client.connect()
    await client.wait_channel_open()
    await client.wait_state("listening", 10)
    await wait_for_video(client, 3)
    client.record = False  # from here on, received media is decoded and dropped
    senders = [t.kind for t in client.pc.getTransceivers() if t.direction != "recvonly"]
    print(json.dumps({"session_id": client.session_id, "sending": senders}), flush=True)
    await asyncio.Event().wait()  # in the call until killed
    return 0


async def one_call(url: str, index: int) -> dict[str, Any]:
    """A short real call; what it saw."""
    started = time.monotonic()
    client = CallClient(url, record_video=False)
    result: dict[str, Any] = {"call": index}
    phases: dict[str, float] = {}
    result["phases"] = phases

    def mark(name: str) -> None:
        phases[name] = round(time.monotonic() - started, 2)

    try:
        result["session_id"] = await client.connect()
        mark("answered")
        await client.wait_channel_open()
        await client.wait_state("listening", 20)
        mark("channel")
        await wait_for_video(client, 5, 20)
        mark("video")
        first_audio = len(client.received.audio)
        if index % 2:
            client.channel.send(json.dumps({"type": "text", "text": "hello"}))
        else:
            await client.say("Hello there.")
        await client.wait_state("speaking", 30)
        mark("speaking")
        await client.wait_state("listening", 30)
        mark("listening")
        # The reply's audio is decoded after its packets came: under load, a while after.
        loud = 0.0
        for _ in range(100):
            pcm = [p for _, _, p in client.received.audio[first_audio:]]
            loud = float(loud_frames(pcm).sum()) * 0.020 if pcm else 0.0
            if loud >= HEARD_S:
                break
            await asyncio.sleep(0.1)
        result["loud_s"] = round(loud, 2)
        mark("heard")
        result["video"] = len(client.received.video)
        result["errors"] = [e for e in client.events if e.get("type") == "error"]
        if index % 2 == 0:
            async with aiohttp.ClientSession() as http:
                async with http.delete(f"{url}/sessions/{client.session_id}") as resp:
                    result["deleted"] = resp.status
            mark("deleted")
    except Exception as exc:  # reported, not raised: the test decides
        result["failed"] = f"{type(exc).__name__}: {exc}"
    finally:
        await client.close()
    result["seconds"] = round(time.monotonic() - started, 2)
    return result


async def calls(url: str, count: int, at_once: int) -> int:
    queue = iter(range(count))

    async def worker() -> None:
        for index in queue:
            print(json.dumps(await one_call(url, index)), flush=True)

    await asyncio.gather(*(worker() for _ in range(at_once)))
    print(json.dumps({"done": count}), flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("--text-only", action="store_true")
    parser.add_argument("--calls", type=int, default=0)
    parser.add_argument("--at-once", type=int, default=1)
    args = parser.parse_args()
    if args.calls:
        return asyncio.run(calls(args.url, args.calls, args.at_once))
    return asyncio.run(stay(args.url, args.text_only))


if __name__ == "__main__":
    sys.exit(main())
