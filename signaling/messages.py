"""Parsing and validation of what clients send: HTTP bodies and ``events`` channel messages."""

from __future__ import annotations

import re
from dataclasses import dataclass

from aiortc.sdp import SessionDescription

from signaling.errors import SignalingError, loads_json
from signaling.offer_rules import PeerRule, check_sections, reachable_sdp

MAX_TEXT_CHARS = 2000
"""Longest text accepted for a say or a typed turn, unless the server sets its own
(``--max-say-chars``)."""


CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
"""Control characters a text may not hold: all but tab, line feed and carriage return."""


@dataclass(frozen=True, slots=True)
class Offer:
    sdp: str
    avatar: str | None
    has_audio: bool
    has_video: bool
    video_codecs: tuple[str, ...]
    """mimeTypes the offer's video m-line accepts, e.g. ("video/VP8", "video/H264")."""
    visemes: bool = False
    """The caller asks for ``viseme`` events on its events channel (rtc_server.viseme_stream)."""


@dataclass(frozen=True, slots=True)
class Answer:
    sdp: str
    session_id: str
    resume: str = ""
    """The call's resume credential: with it, ``POST /sessions/{id}/resume`` attaches a new
    peer connection to the same conversation after the link was lost (empty: not resumable)."""


MAX_RESUME_CHARS = 200


def parse_resume(body: dict[str, object], *, peers: PeerRule) -> tuple[str, Offer]:
    """The credential and the new offer of a ``/sessions/{id}/resume`` body."""
    resume = body.get("resume")
    if not isinstance(resume, str) or not resume or len(resume) > MAX_RESUME_CHARS:
        raise SignalingError(
            400, "bad_resume", "'resume' must be the call's resume credential (a string)"
        )
    return resume, parse_offer(body, peers=peers)


def parse_offer(body: dict[str, object], *, peers: PeerRule) -> Offer:
    """The offer of an /offer body, its candidates filtered by ``peers``; 400 for anything
    a call cannot be built from (signaling.offer_rules)."""
    sdp = body.get("sdp")
    if not isinstance(sdp, str) or not sdp.strip():
        raise SignalingError(400, "bad_offer", "'sdp' must be a non-empty string")
    if body.get("type") != "offer":
        raise SignalingError(400, "bad_offer", "'type' must be \"offer\"")
    avatar = body.get("avatar")
    if avatar is not None and not isinstance(avatar, str):
        raise SignalingError(400, "bad_offer", "'avatar' must be a string")
    visemes = body.get("visemes", False)
    if not isinstance(visemes, bool):
        raise SignalingError(400, "bad_offer", "'visemes' must be true or false")
    try:
        parsed = SessionDescription.parse(sdp)
    except Exception as exc:  # aiortc's parser raises whatever the bad line provokes
        raise SignalingError(400, "bad_sdp", f"the SDP offer could not be parsed: {exc}") from exc
    check_sections(parsed)
    video = next(m for m in parsed.media if m.kind == "video")
    codecs = tuple(dict.fromkeys(c.mimeType for c in video.rtp.codecs))
    return Offer(
        sdp=reachable_sdp(sdp, peers),
        avatar=avatar,
        has_audio=True,
        has_video=True,
        video_codecs=codecs,
        visemes=visemes,
    )


def parse_text(
    body: dict[str, object], field: str = "text", *, max_chars: int = MAX_TEXT_CHARS
) -> str:
    text = body.get(field)
    if not isinstance(text, str) or not text.strip():
        raise SignalingError(400, "bad_text", f"'{field}' must be a non-empty string")
    if len(text) > max_chars:
        raise SignalingError(413, "text_too_long", f"'{field}' is over {max_chars} characters")
    if CONTROL.search(text):  # Piper (espeak) refuses NUL; no voice speaks the others
        raise SignalingError(
            400, "bad_text", f"'{field}' must not contain control characters (but tab and newlines)"
        )
    if not text.isascii():
        try:
            # JSON may spell lone surrogates ("\ud800"): no voice can encode them.
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise SignalingError(
                400, "bad_text", f"'{field}' is not valid Unicode text: {exc.reason}"
            ) from None
    return text


@dataclass(frozen=True, slots=True)
class SayRequest:
    text: str
    interrupt: bool


def parse_say(body: dict[str, object], *, max_chars: int = MAX_TEXT_CHARS) -> SayRequest:
    text = parse_text(body, max_chars=max_chars)
    interrupt = body.get("interrupt", False)
    if not isinstance(interrupt, bool):
        raise SignalingError(400, "bad_interrupt", "'interrupt' must be true or false")
    return SayRequest(text, interrupt)


@dataclass(frozen=True, slots=True)
class ClientEvent:
    """A message from the ``events`` data channel: type is "say", "text" or "interrupt"."""

    type: str
    text: str = ""


def max_message_chars(max_text_chars: int) -> int:
    """The longest data-channel message that can hold a text of ``max_text_chars``: every
    character spelled as a JSON escape pair (12 characters), and room for the other fields."""
    return 12 * max_text_chars + 256


def parse_client_event(message: str | bytes, *, max_chars: int = MAX_TEXT_CHARS) -> ClientEvent:
    """Validate one data-channel message; SignalingError's code becomes the error event's code."""
    if isinstance(message, bytes):
        raise SignalingError(400, "bad_message", "messages must be JSON text, not binary")
    if len(message) > max_message_chars(max_chars):  # before any parsing
        raise SignalingError(
            413, "message_too_large", f"message is over {max_message_chars(max_chars)} characters"
        )
    body = loads_json(message, "bad_message", "message")
    if not isinstance(body, dict):
        raise SignalingError(400, "bad_message", "message must be a JSON object")
    kind = body.get("type")
    if kind == "interrupt":
        return ClientEvent("interrupt")
    if kind in ("say", "text"):
        return ClientEvent(str(kind), parse_text(body, max_chars=max_chars))
    raise SignalingError(400, "unknown_type", f"unknown message type: {kind!r}")
