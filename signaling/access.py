"""Who may call the API: allowed browser origins (CORS, 403) and optional signed tokens.

Tokens are ``<payload>.<signature>``, both base64url: the payload is JSON with an expiry
(``exp``, Unix seconds), an optional avatar scope and a random id; the signature is
HMAC-SHA256 over the payload with a key derived from the server's API key. Checks use
``hmac.compare_digest``; tokens and keys are never logged.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from aiohttp import web

from signaling.errors import SignalingError
from signaling.quota import CallQuota, client_key
from signaling.ratelimit import RateLimiter

MAX_TTL_S = 3600
DEFAULT_TTL_S = 300
API_PATHS = ("/offer", "/token", "/sessions/", "/ice-servers")
ORIGIN = re.compile(r"https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(:[0-9]{1,5})?")
"""What an allowed origin looks like: ``scheme://host[:port]``, as browsers send ``Origin``."""


def origin_of(url: str) -> str | None:
    """``scheme://host[:port]`` of an http(s) URL (e.g. a Referer), or None."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return None
    origin = f"{parts.scheme}://{parts.netloc.rpartition('@')[2].lower()}"
    return origin if ORIGIN.fullmatch(origin) else None


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True, slots=True)
class Grant:
    """What a valid token allows."""

    token: str
    avatar: str | None
    expires_at: float
    id: str
    """The token's own id (``jti``): what its call limit counts."""


class TokenSigner:
    def __init__(self, api_key: str) -> None:
        self._api_key = api_key.encode("utf-8", "surrogatepass")
        self._key = hashlib.sha256(b"avatar-rtc token v1\0" + self._api_key).digest()

    def is_api_key(self, candidate: str) -> bool:
        # Header values hold any byte: aiohttp decodes the non-UTF-8 ones to lone surrogates,
        # which plain .encode() refuses.
        return hmac.compare_digest(candidate.encode("utf-8", "surrogatepass"), self._api_key)

    def mint(self, *, ttl_s: int, avatar: str | None = None, now: float | None = None) -> str:
        payload = {"exp": int((now or time.time()) + ttl_s), "jti": secrets.token_hex(8)}
        if avatar is not None:
            payload["avatar"] = avatar
        body = _b64(json.dumps(payload, separators=(",", ":")).encode())
        return f"{body}.{self._sign(body)}"

    def _sign(self, body: str) -> str:
        return _b64(hmac.new(self._key, body.encode(), hashlib.sha256).digest())

    def verify(self, token: str, *, now: float | None = None) -> Grant:
        """The grant of a valid token; SignalingError 401 for anything else."""
        if not token.isascii():  # compare_digest refuses non-ASCII str (TypeError)
            raise SignalingError(401, "bad_token", "the token is not valid")
        body, sep, signature = token.partition(".")
        if not sep or not hmac.compare_digest(signature, self._sign(body)):
            raise SignalingError(401, "bad_token", "the token is not valid")
        try:
            payload = json.loads(_unb64(body))
            expires = float(payload["exp"])
        except (ValueError, KeyError, TypeError) as exc:
            raise SignalingError(401, "bad_token", "the token is not valid") from exc
        if expires < (now or time.time()):
            raise SignalingError(401, "token_expired", "the token has expired")
        avatar = payload.get("avatar")
        jti = payload.get("jti")
        if not isinstance(jti, str) or not jti:  # minted elsewhere: the token is its own id
            jti = hashlib.sha256(body.encode()).hexdigest()[:16]
        return Grant(token, avatar if isinstance(avatar, str) else None, expires, jti)


def bearer(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


@dataclass(frozen=True)
class AccessPolicy:
    allowed_origins: frozenset[str]
    """Browser origins allowed besides the server's own."""
    signer: TokenSigner | None
    """None: no auth (the default for a server on localhost)."""
    limiter: RateLimiter | None = None
    """Per-client limit on /offer and /token."""
    quota: CallQuota | None = None
    """Live calls per client and per token."""
    public_origin: str | None = None
    """The server's own origin as callers reach it; None: the request's scheme and host."""

    def origin_allowed(self, request: web.Request) -> bool:
        origin = request.headers.get("Origin")
        if origin is None:
            return True  # not a browser page: Origin is what browsers add, and only they
        return self.is_allowed(origin, request)

    def is_allowed(self, origin: str, request: web.Request) -> bool:
        """Whether a page of ``origin`` may use this server (its own origin always may)."""
        own = self.public_origin or f"{request.scheme}://{request.host}"
        return origin == own or origin in self.allowed_origins or "*" in self.allowed_origins

    def frame_ancestors(self) -> str:
        """The CSP directive that lets the server's own and the allowed origins frame a page."""
        if "*" in self.allowed_origins:
            return "frame-ancestors 'self' *"
        # Anything but a plain origin could smuggle another directive into the header.
        origins = sorted(o for o in self.allowed_origins if ORIGIN.fullmatch(o))
        return " ".join(["frame-ancestors", "'self'", *origins])

    def embedder_allowed(self, request: web.Request) -> bool:
        """False for a frame navigation whose embedding page is of an origin not allowed.

        Browsers mark frame loads (``Sec-Fetch-Dest: iframe``) and name the embedding page in
        ``Referer`` (its origin at least, under the default referrer policy). Without those we
        cannot tell who frames the page, and CSP ``frame-ancestors`` is the guard.
        """
        if request.headers.get("Sec-Fetch-Dest") not in ("iframe", "frame"):
            return True
        if request.headers.get("Sec-Fetch-Site") == "same-origin":
            return True
        source = request.headers.get("Origin") or request.headers.get("Referer")
        if not source:
            return True
        origin = origin_of(source)
        return origin is not None and self.is_allowed(origin, request)

    def require_token(self, request: web.Request) -> Grant | None:
        """The request's grant when auth is on (401 without a valid one); None when off."""
        if self.signer is None:
            return None
        token = bearer(request)
        if token is None:
            raise SignalingError(
                401, "unauthorized", "this server needs 'Authorization: Bearer <token>'"
            )
        return self.signer.verify(token)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def access_middleware(policy: AccessPolicy) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Origin check (403) and CORS headers on the API routes; preflights answered here."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not request.path.startswith(API_PATHS):
            return await handler(request)
        origin = request.headers.get("Origin")
        if not policy.origin_allowed(request):
            raise SignalingError(403, "origin_not_allowed", f"origin {origin!r} is not allowed")
        cors = {}
        if origin is not None:
            cors = {
                "Access-Control-Allow-Origin": origin,
                "Vary": "Origin",
                "Access-Control-Allow-Headers": "Authorization, Content-Type",
                "Access-Control-Allow-Methods": "GET, POST, DELETE, OPTIONS",
                "Access-Control-Max-Age": "600",
            }
        if request.method == "OPTIONS":
            return web.Response(status=204, headers=cors)
        if policy.limiter is not None and request.path in ("/offer", "/token"):
            wait = policy.limiter.take(client_key(request.remote))
            if wait > 0:
                raise SignalingError(
                    429,
                    "rate_limited",
                    f"too many requests; try again in {wait:.1f} s",
                    headers={**cors, "Retry-After": RateLimiter.retry_after(wait)},
                )
        try:
            response = await handler(request)
        except SignalingError as exc:
            exc.headers.update(cors)
            raise
        response.headers.update(cors)
        return response

    return middleware
