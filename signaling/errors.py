"""The one JSON error shape of the HTTP API: ``{"error": {"code": ..., "message": ...}}``."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web

from musetalk_core.types import AvatarRtcError

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024


class SignalingError(AvatarRtcError):
    """A request the API refuses; becomes a JSON error response with ``status``."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = dict(headers or {})


def error_response(
    status: int, code: str, message: str, headers: Mapping[str, str] | None = None
) -> web.Response:
    body = json.dumps({"error": {"code": code, "message": message}})
    return web.Response(status=status, text=body, content_type="application/json", headers=headers)


_HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    413: "body_too_large",
    415: "unsupported_media_type",
    429: "too_many_requests",
    503: "unavailable",
}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure of every route leaves as the JSON error shape; none takes the server down."""
    try:
        return await handler(request)
    except SignalingError as exc:
        return error_response(exc.status, exc.code, exc.message, exc.headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = _HTTP_CODES.get(exc.status, "http_error")
        message = exc.reason
        if exc.status == 413:
            message = f"request body is larger than {MAX_BODY_BYTES} bytes"
        return error_response(exc.status, code, message)
    except Exception:
        logger.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(500, "internal", "internal server error")


def loads_json(raw: str | bytes, code: str, what: str) -> object:
    """``json.loads``, failing only with a 400 SignalingError ``code``.

    Beyond JSONDecodeError and UnicodeDecodeError, json raises a plain ValueError for integers
    over 4300 digits and RecursionError for arrays or objects nested a few thousand deep: both
    fit in a 64 KiB body or a data-channel message.
    """
    try:
        return json.loads(raw)
    except RecursionError:
        raise SignalingError(400, code, f"{what} is not valid JSON: nested too deep") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SignalingError(400, code, f"{what} is not valid JSON: {exc}") from exc
    except ValueError:
        raise SignalingError(400, code, f"{what} has a number too long to read") from None


def is_json_type(header: str | None) -> bool:
    """Whether a Content-Type header names JSON (``application/json``, parameters aside)."""
    return header is not None and header.split(";", 1)[0].strip().lower() == "application/json"


async def read_json_object(request: web.Request) -> dict[str, object]:
    """The request body as a JSON object, or a 400/413/415 SignalingError."""
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        raise SignalingError(413, "body_too_large", f"body is over {MAX_BODY_BYTES} bytes")
    if request.headers.get("Content-Encoding", "").strip().lower() not in ("", "identity"):
        # Clients send their JSON as is. aiohttp would inflate a compressed body, and one that
        # claims deflate but does not end as a deflate stream never ends: the read would wait
        # until the client gives up.
        raise SignalingError(
            415, "unsupported_encoding", "request bodies must not be compressed (Content-Encoding)"
        )
    if not is_json_type(request.headers.get("Content-Type")):
        # A browser page may POST text/plain (or a Blob with no type) to any origin without a
        # CORS preflight: only a JSON body makes it ask first.
        raise SignalingError(
            415,
            "unsupported_media_type",
            "request bodies must be JSON (Content-Type: application/json)",
        )
    try:
        raw = await request.read()
    except web.RequestPayloadError as exc:  # a chunked body that breaks off, and the like
        raise SignalingError(400, "bad_body", f"the body could not be read: {exc}") from exc
    except ConnectionResetError as exc:  # the client hung up halfway: nothing went wrong here
        raise SignalingError(400, "bad_body", "the connection closed during the body") from exc
    if len(raw) > MAX_BODY_BYTES:
        raise SignalingError(413, "body_too_large", f"body is over {MAX_BODY_BYTES} bytes")
    body = loads_json(raw, "bad_json", "body")
    if not isinstance(body, dict):
        raise SignalingError(400, "bad_json", "body must be a JSON object")
    return body
