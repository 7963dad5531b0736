"""``GET /embed``: the avatar page made for other sites' iframes.

The page is static/embed-frame.js around the same Call as the call page. Its settings (query
``autostart``, ``avatar``, ``theme``) and the origins it may talk to over postMessage are
rendered into data attributes of ``<html>``; its CSP's ``frame-ancestors`` lets only the
server's own and the allowed origins frame it, and a frame load from an embedding page of
another origin is refused outright (403).
"""

from __future__ import annotations

import html
import json
from string import Template

from aiohttp import web

from rtc_server.pages import TEMPLATES_DIR
from signaling.access import AccessPolicy, origin_of
from signaling.errors import SignalingError

TEMPLATE = TEMPLATES_DIR / "embed.html"
THEMES = ("dark", "light")
MAX_AVATAR_CHARS = 200
TRUE = ("1", "true", "yes", "on")


def page_attributes(request: web.Request, access: AccessPolicy) -> dict[str, str]:
    """The page's settings, from the query and the access policy."""
    query = request.query
    theme = query.get("theme", "")
    avatar = query.get("avatar", "")
    if len(avatar) > MAX_AVATAR_CHARS:
        raise SignalingError(400, "bad_avatar", f"'avatar' is over {MAX_AVATAR_CHARS} characters")
    own = f"{request.scheme}://{request.host}"
    origins = [own, *sorted(access.allowed_origins - {own})]
    return {
        "data-theme": theme if theme in THEMES else "auto",
        "data-autostart": "true" if query.get("autostart", "").lower() in TRUE else "false",
        "data-avatar": avatar,
        "data-allowed-origins": json.dumps(origins),
    }


def add_embed_route(app: web.Application, access: AccessPolicy) -> None:
    template = Template(TEMPLATE.read_text(encoding="utf-8"))

    async def embed(request: web.Request) -> web.Response:
        headers = {"Cache-Control": "no-store"}  # the other headers: signaling.headers
        if not access.embedder_allowed(request):
            source = request.headers.get("Origin") or request.headers.get("Referer") or ""
            raise SignalingError(
                403,
                "origin_not_allowed",
                f"pages of {origin_of(source) or 'that origin'} may not embed the avatar; "
                "the server allows them with --allowed-origin",
                headers=headers,
            )
        try:
            settings = page_attributes(request, access)
        except SignalingError as exc:
            exc.headers.update(headers)
            raise
        attributes = " ".join(
            f'{name}="{html.escape(value, quote=True)}"' for name, value in settings.items()
        )
        return web.Response(
            text=template.substitute(attributes=attributes),
            content_type="text/html",
            headers=headers,
        )

    app.router.add_get("/embed", embed)
