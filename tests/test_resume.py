"""A call whose link is lost carries on over a new peer connection (``POST
/sessions/{id}/resume``), its conversation intact; one not resumed in its grace period is freed.

The link is cut by the network stand-in (tests/netrelay.py): every packet dropped, no DTLS
close, as a caller whose network went away. The resumed caller comes from a new peer
connection, as the page makes one after ICE failed.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from aiortc import RTCPeerConnection

from benchmarks.analysis import loud_frames
from benchmarks.client import CallClient
from benchmarks.vendor_standin import CHAT, VendorServer
from rtc_server.session import PEER_SILENCE_S
from tests.conftest import RESUME_GRACE_S, LiveServer
from tests.netrelay import NetRelay
from tests.waiting import wait_until


async def _typed_turn(client: CallClient, text: str) -> None:
    client.skip_events()
    client.channel.send(json.dumps({"type": "text", "text": text}))
    await client.wait_event(lambda e: e.get("type") == "turn", 30)
    await client.wait_state("listening", 30)


async def _cut_caller(resumable_server: LiveServer, relay: NetRelay) -> CallClient:
    """A caller through ``relay``, connected and listening."""
    client = CallClient(resumable_server.url)
    await client.connect(rewrite_offer=relay.rewrite_offer, rewrite_answer=relay.rewrite_answer)
    await client.wait_channel_open()
    await client.wait_state("listening", 10)
    return client


async def _post(url: str, body: dict[str, object]) -> tuple[int, str]:
    """The status and error code of a POST."""
    async with aiohttp.ClientSession() as http, http.post(url, json=body) as resp:
        return resp.status, str((await resp.json())["error"]["code"])


async def _offer_sdp() -> str:
    """An offer a caller would send (audio both ways, video to receive)."""
    pc = RTCPeerConnection()
    try:
        pc.addTransceiver("audio", direction="sendrecv")
        pc.addTransceiver("video", direction="recvonly")
        await pc.setLocalDescription(await pc.createOffer())
        return str(pc.localDescription.sdp)
    finally:
        await pc.close()


async def test_a_lost_call_resumes_with_its_conversation(
    resumable_server: LiveServer, chat_vendor: VendorServer
) -> None:
    relay = NetRelay()
    first = await _cut_caller(resumable_server, relay)
    second: CallClient | None = None
    try:
        session_id = first.session_id
        assert len(first.resume_credential) >= 32
        await _typed_turn(first, "My name is Ada.")

        relay.outage(3600)  # the caller's network is gone: nothing more either way
        await asyncio.sleep(1.0)

        # A wrong credential, none, and an unknown session are refused, and change nothing.
        offer = {"sdp": await _offer_sdp(), "type": "offer"}
        resume_url = f"{resumable_server.url}/sessions/{session_id}/resume"
        for body, status, code in (
            ({**offer, "resume": "not-it"}, 401, "bad_resume"),
            (offer, 400, "bad_resume"),
            ({**offer, "resume": first.resume_credential, "sdp": "v=0"}, 400, "no_audio"),
        ):
            assert await _post(resume_url, body) == (status, code), body
        unknown = f"{resumable_server.url}/sessions/nosuch/resume"
        assert await _post(unknown, {**offer, "resume": first.resume_credential}) == (
            404,
            "unknown_session",
        )
        assert list(resumable_server.manager.sessions) == [session_id]

        # The page's way back: a new peer connection with the credential.
        second = CallClient(resumable_server.url)
        assert await second.connect(resume=(session_id, first.resume_credential)) == session_id
        await second.wait_channel_open()
        await second.wait_state("listening", 10)
        assert list(resumable_server.manager.sessions) == [session_id]
        assert second.resume_credential == first.resume_credential

        # The conversation goes on: the next question reaches the model with the earlier turn.
        await _typed_turn(second, "What is my name?")
        messages = chat_vendor.seen(CHAT)[-1].json["messages"]
        said = [(m["role"], m["content"]) for m in messages]
        assert ("user", "My name is Ada.") in said
        assert ("assistant", "Nice to meet you.") in said
        assert said[-1] == ("user", "What is my name?")
        # And it is heard: reply audio on the new connection.
        assert loud_frames([pcm for _, _, pcm in second.received.audio]).any()
        registry = resumable_server.manager.metrics.registry
        assert registry.get_sample_value("avatar_rtc_calls_resumed_total") == 1

        # The old peer, closed now, ends nothing.
        await first.close()
        await asyncio.sleep(1.0)
        assert list(resumable_server.manager.sessions) == [session_id]
    finally:
        await first.close()
        if second is not None:
            await second.close()
        relay.close()
    await wait_until(lambda: not resumable_server.manager.sessions, 10, "the resumed call closed")


async def test_a_lost_call_not_resumed_in_its_grace_period_is_freed(
    resumable_server: LiveServer,
) -> None:
    relay = NetRelay()
    client = await _cut_caller(resumable_server, relay)
    try:
        session_id, credential = client.session_id, client.resume_credential
        relay.outage(3600)
        cut = time.monotonic()
        # Still resumable after the server noticed the silence...
        await asyncio.sleep(PEER_SILENCE_S + 1)
        assert session_id in resumable_server.manager.sessions
        # ...and freed once the grace period, counted from the cut, has run out.
        await wait_until(lambda: session_id not in resumable_server.manager.sessions, 20, "freed")
        freed_after = time.monotonic() - cut
        assert RESUME_GRACE_S - 1 <= freed_after, freed_after
        late = CallClient(resumable_server.url)
        try:
            with pytest.raises(RuntimeError, match="404"):
                await late.connect(resume=(session_id, credential))
        finally:
            await late.close()
    finally:
        await client.close()
        relay.close()


async def test_two_resumes_at_once_leave_one_peer_connection(resumable_server: LiveServer) -> None:
    """Resumes are taken one at a time: the later one wins, the earlier one's peer connection
    is closed by the server, none is left behind."""
    import gc

    relay = NetRelay()
    client = await _cut_caller(resumable_server, relay)
    callers = [CallClient(resumable_server.url), CallClient(resumable_server.url)]
    try:
        relay.outage(3600)
        resume = (client.session_id, client.resume_credential)
        await asyncio.gather(*(c.connect(resume=resume) for c in callers))
        session = resumable_server.manager.sessions[client.session_id]
        await wait_until(
            lambda: any(c.pc.connectionState == "connected" for c in callers), 10, "resumed"
        )
        ours = {id(c.pc) for c in [client, *callers]}
        live = [
            o
            for o in gc.get_objects()
            if isinstance(o, RTCPeerConnection)
            and id(o) not in ours
            and o.connectionState != "closed"
        ]
        assert live == [session.pc], live
    finally:
        await client.close()
        for c in callers:
            await c.close()
        relay.close()
