"""HTTP signaling: non-trickle offer/answer and per-session control, over a SessionFactory."""

from __future__ import annotations

from typing import Protocol

from aiohttp import web

from signaling.errors import SignalingError, read_json_object
from signaling.messages import Answer, Offer, SayRequest, parse_offer, parse_say


class SessionFactory(Protocol):
    """What the media server implements for signaling; signaling never reaches further in."""

    async def create_session(self, offer: Offer) -> Answer:
        """Answer ``offer`` with a new session, or raise SignalingError (e.g. 503 at capacity)."""
        ...

    def say(self, session_id: str, request: SayRequest) -> str:
        """Queue speech; returns the utterance id. KeyError for an unknown session."""
        ...

    async def close_session(self, session_id: str) -> bool:
        """Tear the session down; False if there was none."""
        ...


def add_routes(app: web.Application, factory: SessionFactory) -> None:
    async def offer(request: web.Request) -> web.Response:
        parsed = parse_offer(await read_json_object(request))
        answer = await factory.create_session(parsed)
        return web.json_response(
            {"sdp": answer.sdp, "type": "answer", "session_id": answer.session_id}
        )

    async def say(request: web.Request) -> web.Response:
        session_id = request.match_info["session_id"]
        body = parse_say(await read_json_object(request))
        try:
            utterance_id = factory.say(session_id, body)
        except KeyError:
            raise SignalingError(404, "unknown_session", f"no session {session_id!r}") from None
        return web.json_response({"utterance_id": utterance_id}, status=202)

    async def delete(request: web.Request) -> web.Response:
        session_id = request.match_info["session_id"]
        if not await factory.close_session(session_id):
            raise SignalingError(404, "unknown_session", f"no session {session_id!r}")
        return web.Response(status=204)

    app.router.add_post("/offer", offer)
    app.router.add_post("/sessions/{session_id}/say", say)
    app.router.add_delete("/sessions/{session_id}", delete)
