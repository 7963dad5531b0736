"""The security headers of every response, pages, scripts, API answers and errors alike.

A page may be served from more than one path (``/`` and ``/static/index.html``), so the
guards belong to every response, not to a route: the pages' Content-Security-Policy, whose
``frame-ancestors`` lets only the server's own and the allowed origins frame them (no
click-jacking a call that opens the microphone), ``nosniff``, and no Referer, so that nothing
of a page's URL leaves it. A route that sets one of these headers itself keeps its own.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from signaling.access import AccessPolicy

PAGE_POLICY = (
    "default-src 'self'",
    "script-src 'self'",
    "style-src 'self'",
    "img-src 'self' data:",
    "media-src 'self' blob: mediastream:",
    "connect-src 'self'",
    "base-uri 'none'",
    "form-action 'none'",
    "object-src 'none'",
)
"""What the pages load: their own scripts, styles and API, nothing inline, nothing else."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def content_security_policy(access: AccessPolicy) -> str:
    return "; ".join([*PAGE_POLICY, access.frame_ancestors()])


def security_headers(access: AccessPolicy) -> dict[str, str]:
    return {
        "Content-Security-Policy": content_security_policy(access),
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
    }


def security_headers_middleware(
    access: AccessPolicy,
) -> Callable[..., Awaitable[web.StreamResponse]]:
    headers = security_headers(access)

    @web.middleware
    async def add_security_headers(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            response = await handler(request)
        except web.HTTPException as exc:  # redirects and the like, raised past the error shape
            for name, value in headers.items():
                exc.headers.setdefault(name, value)
            raise
        for name, value in headers.items():
            response.headers.setdefault(name, value)
        return response

    return add_security_headers
