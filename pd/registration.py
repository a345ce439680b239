"""Client side of the router's admin API: how a worker registers itself with a router (and
leaves), and what a worker URL is (`normalize_url`, which the router's flags use too). Below
both the router and the worker: the worker calls it, the router's package re-exports it.

`pd-worker --register-with ROUTER_URL` calls `register_with_router` once it serves, and
`deregister_from_router` when it drains.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp
import orjson


def host_port(url: str) -> str:
    """`host:port` of a worker URL (IPv6 in brackets; the scheme's port when none is given): what
    Envoy dials for the endpoint picker's pick, and how a decode worker knows its prefill peers."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    return f"{host}:{parts.port or (443 if parts.scheme == 'https' else 80)}"


def normalize_url(url: str) -> str:
    """'host:port' or 'http://host:port/' -> 'http://host:port'; raises ValueError if unusable."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    scheme, _, rest = url.partition("://")
    if scheme not in ("http", "https") or not rest or " " in rest:
        raise ValueError(f"not a worker URL: {url!r} (want http://host:port)")
    return url


class RegistrationError(RuntimeError):
    """The router could not be reached or refused the request."""


def _headers(admin_token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {admin_token}"} if admin_token else {}


def _message(data: bytes) -> str:
    try:
        return orjson.loads(data)["error"]["message"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return data[:200].decode(errors="replace")


async def register_with_router(
    router_url: str,
    worker_url: str,
    role: str,
    admin_token: str | None,
    session: aiohttp.ClientSession,
    timeout: float = 10.0,
) -> dict[str, Any]:
    """POST {url, role} to ROUTER/workers. Returns the router's answer:
    `{"worker": {...,"healthy": bool}, "created": bool}`. Raises RegistrationError."""
    url = normalize_url(router_url) + "/workers"
    body = {"url": worker_url, "role": role}
    try:
        async with session.post(
            url,
            data=orjson.dumps(body),
            headers={**_headers(admin_token), "Content-Type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as resp:
            data = await resp.read()
    except (aiohttp.ClientError, TimeoutError) as e:
        raise RegistrationError(f"cannot reach router {url}: {type(e).__name__} {e}") from e
    if resp.status not in (200, 201):
        raise RegistrationError(
            f"router {url} refused to register {worker_url} ({resp.status}): {_message(data)}"
        )
    return orjson.loads(data)


async def deregister_from_router(
    router_url: str,
    worker_url: str,
    admin_token: str | None,
    session: aiohttp.ClientSession,
    timeout: float = 10.0,
) -> bool:
    """DELETE ROUTER/workers?url=WORKER. True if removed, False if the router did not know it."""
    url = f"{normalize_url(router_url)}/workers?url={quote(worker_url, safe='')}"
    try:
        async with session.delete(
            url, headers=_headers(admin_token), timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            data = await resp.read()
    except (aiohttp.ClientError, TimeoutError) as e:
        raise RegistrationError(f"cannot reach router {url}: {type(e).__name__} {e}") from e
    if resp.status == 404:
        return False
    if resp.status != 200:
        raise RegistrationError(
            f"router refused to remove {worker_url} ({resp.status}): {_message(data)}"
        )
    return True
