"""Worker admin API: GET (list), POST (add or re-role), DELETE (remove) on /workers.

Protected by `--admin-token` (bearer). Without a token the list is public and changes are
refused (403), so an open router cannot be re-pointed by anyone who reaches it.
"""

from __future__ import annotations

import hmac

from aiohttp import web

from pd.protocol import APIError, bad_request, header_bytes, parse_json_body
from pd.router.config import POOLS
from pd.router.keys import CONFIG, HEALTH, REGISTRY
from pd.router.proxy import json_response


def _authorize(request: web.Request, change: bool) -> None:
    token = request.app[CONFIG].admin_token
    if token is None:
        if change:
            raise APIError(
                403,
                "the admin API is read-only: start the router with --admin-token",
                "permission_error",
                "admin_disabled",
            )
        return
    given = header_bytes(request.headers.get("Authorization", ""))
    if not hmac.compare_digest(given, f"Bearer {token}".encode()):
        raise APIError(
            401, "invalid or missing admin token", "invalid_request_error", "invalid_admin_token"
        )


async def list_workers(request: web.Request) -> web.Response:
    _authorize(request, change=False)
    return json_response({"workers": [w.to_dict() for w in request.app[REGISTRY]]})


async def add_worker(request: web.Request) -> web.Response:
    """Body {"url": ..., "role": "prefill"|"decode"|"both"}. Checked at once; admitted if good."""
    _authorize(request, change=True)
    body = parse_json_body(await request.read())
    url, role = body.get("url"), body.get("role")
    if not isinstance(url, str) or not url:
        raise bad_request("'url' must be a worker URL", "url")
    if role not in POOLS:
        raise bad_request(f"'role' must be one of {', '.join(POOLS)}", "role")
    try:
        w, created = request.app[REGISTRY].add(url, role)
    except ValueError as e:
        raise bad_request(str(e), "url") from None
    await request.app[HEALTH].check(w)
    return json_response({"worker": w.to_dict(), "created": created}, 201 if created else 200)


async def remove_worker(request: web.Request) -> web.Response:
    """`?url=...` or body {"url": ...}. In-flight requests on it finish."""
    _authorize(request, change=True)
    url = request.query.get("url")
    if url is None and request.can_read_body:
        url = parse_json_body(await request.read()).get("url")
    if not isinstance(url, str) or not url:
        raise bad_request('give the worker as ?url=... or a body {"url": ...}', "url")
    try:
        w = request.app[REGISTRY].remove(url)
    except ValueError as e:
        raise bad_request(str(e), "url") from None
    if w is None:
        raise APIError(404, f"no worker {url}", "invalid_request_error", "not_found")
    return json_response({"removed": w.to_dict()})


def add_routes(app: web.Application) -> None:
    app.router.add_get("/workers", list_workers)
    app.router.add_post("/workers", add_worker)
    app.router.add_delete("/workers", remove_worker)
