"""CORS for the router and the workers (`--allowed-origins`), so that a browser UI on another
origin can call the OpenAI endpoints: preflight OPTIONS requests are answered and every answer
carries `Access-Control-Allow-Origin` for an allowed origin (aiohttp-cors). Off by default: no
origin is allowed, and browsers keep their same-origin rule."""

from __future__ import annotations

import re

from aiohttp import web

ORIGINS_HELP = (
    "an origin (scheme://host[:port]) browsers may call this server from: CORS, preflight "
    "answered (repeatable; '*' for any); none by default"
)
_ORIGIN = re.compile(r"https?://[^/\s]+")


def check_origins(origins: tuple[str, ...]) -> None:
    """A ValueError for an origin a browser never sends (a path, a trailing slash, no scheme):
    it would never match, silently."""
    for origin in origins:
        if origin != "*" and not _ORIGIN.fullmatch(origin):
            raise ValueError(
                f"--allowed-origins {origin!r} is no origin: give '*' or scheme://host[:port], "
                "without a path or a trailing slash"
            )


def enable_cors(app: web.Application, origins: tuple[str, ...]) -> None:
    """Allow `origins` on every route of `app` registered so far. Credentials (cookies) are never
    allowed: the API key travels in the Authorization header, which a preflight allows like any
    other header."""
    if not origins:
        return
    import aiohttp_cors  # only when asked for

    options = aiohttp_cors.ResourceOptions(
        allow_credentials=False,
        expose_headers="*",
        allow_headers="*",
        allow_methods="*",
        max_age=600,
    )
    cors = aiohttp_cors.setup(app, defaults={origin: options for origin in origins})
    for route in list(app.router.routes()):
        cors.add(route)
