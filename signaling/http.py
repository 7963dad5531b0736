"""HTTP signaling: non-trickle offer/answer and per-session control, over a SessionFactory."""

from __future__ import annotations

import contextlib
import hmac
from typing import Protocol

from aiohttp import web

from signaling.access import DEFAULT_TTL_S, MAX_TTL_S, AccessPolicy, bearer
from signaling.errors import SignalingError, read_json_object
from signaling.messages import (
    MAX_TEXT_CHARS,
    Answer,
    Offer,
    SayRequest,
    parse_offer,
    parse_resume,
    parse_say,
)
from signaling.offer_rules import PeerRule
from signaling.quota import Reservation, client_key


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

    async def resume_session(self, session_id: str, credential: str, offer: Offer) -> Answer:
        """Attach ``offer``'s new peer connection to a session whose link was lost; 404
        unknown_session when it is gone (or its grace period ran out), 401 bad_resume for a
        wrong credential."""
        ...

    def exists(self, session_id: str) -> bool:
        """Whether the session is still open."""
        ...


def add_routes(
    app: web.Application,
    factory: SessionFactory,
    access: AccessPolicy | None = None,
    *,
    max_say_chars: int = MAX_TEXT_CHARS,
    peers: PeerRule | None = None,
) -> None:
    """``peers``: the offers' candidates the server may check (default: public addresses)."""
    access = access or AccessPolicy(frozenset(), None)
    peers = peers or PeerRule()
    session_tokens: dict[str, str] = {}
    """With auth on: the token each session was opened with; its routes need the same."""

    def check_session_token(request: web.Request, session_id: str) -> None:
        if access.signer is None:
            return
        grant = access.require_token(request)
        assert grant is not None
        expected = session_tokens.get(session_id)
        if expected is None or not hmac.compare_digest(grant.token, expected):
            raise SignalingError(401, "unauthorized", "this token does not open that session")

    async def offer(request: web.Request) -> web.Response:
        grant = access.require_token(request)
        parsed = parse_offer(await read_json_object(request), peers=peers)
        if grant is not None and grant.avatar is not None:
            # Minted elsewhere (this server mints none): it serves one avatar, not that one.
            raise SignalingError(
                401, "wrong_scope", "tokens scoped to an avatar open no call on this server"
            )
        held: contextlib.AbstractContextManager[Reservation | None] = contextlib.nullcontext()
        if access.quota is not None:
            access.quota.keep_only(factory.exists)
            token_id = grant.id if grant is not None else None
            held = access.quota.admit(client_key(request.remote), token_id)
        with held as reservation:
            answer = await factory.create_session(parsed)
            if reservation is not None:
                reservation.bind(answer.session_id)
        if grant is not None:
            # Sessions that ended on their own (the caller hung up) leave their token here.
            for ended in [s for s in session_tokens if not factory.exists(s)]:
                del session_tokens[ended]
            session_tokens[answer.session_id] = grant.token
        return _answer(answer)

    async def resume(request: web.Request) -> web.Response:
        # The credential opens the session, not a call token: a token may have expired in a
        # long call, and the credential went only to whoever opened this one.
        session_id = request.match_info["session_id"]
        credential, parsed = parse_resume(await read_json_object(request), peers=peers)
        return _answer(await factory.resume_session(session_id, credential, parsed))

    async def token(request: web.Request) -> web.Response:
        signer = access.signer
        if signer is None:
            raise SignalingError(404, "auth_off", "tokens are off: this server has no API key")
        key = bearer(request)
        if key is None or not signer.is_api_key(key):
            raise SignalingError(401, "unauthorized", "POST /token needs the server's API key")
        body = await read_json_object(request) if request.can_read_body else {}
        ttl = body.get("ttl_s", DEFAULT_TTL_S)
        if not isinstance(ttl, int) or isinstance(ttl, bool) or not 1 <= ttl <= MAX_TTL_S:
            raise SignalingError(400, "bad_ttl", f"'ttl_s' must be 1..{MAX_TTL_S} seconds")
        if body.get("avatar") is not None:
            raise SignalingError(
                400, "bad_avatar", "this server has one avatar: tokens are not scoped to one"
            )
        minted = signer.mint(ttl_s=ttl)
        return web.json_response({"token": minted, "expires_in": ttl})

    async def say(request: web.Request) -> web.Response:
        session_id = request.match_info["session_id"]
        check_session_token(request, session_id)
        body = parse_say(await read_json_object(request), max_chars=max_say_chars)
        try:
            utterance_id = factory.say(session_id, body)
        except KeyError:
            raise SignalingError(404, "unknown_session", f"no session {session_id!r}") from None
        return web.json_response({"utterance_id": utterance_id}, status=202)

    async def delete(request: web.Request) -> web.Response:
        session_id = request.match_info["session_id"]
        check_session_token(request, session_id)
        if not await factory.close_session(session_id):
            raise SignalingError(404, "unknown_session", f"no session {session_id!r}")
        session_tokens.pop(session_id, None)
        if access.quota is not None:
            access.quota.end(session_id)
        return web.Response(status=204)

    app.router.add_post("/offer", offer)
    app.router.add_post("/token", token)
    app.router.add_post("/sessions/{session_id}/say", say)
    app.router.add_post("/sessions/{session_id}/resume", resume)
    app.router.add_delete("/sessions/{session_id}", delete)


def _answer(answer: Answer) -> web.Response:
    body = {"sdp": answer.sdp, "type": "answer", "session_id": answer.session_id}
    if answer.resume:
        body["resume"] = answer.resume
    return web.json_response(body)
