"""Errors answered on behalf of workers, and JSON responses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from pd.protocol import APIError, error_body
from pd.router.worker import Worker

JSON = "application/json"
RETRYABLE = frozenset((429, 500, 502, 503, 504))  # upstream statuses worth another worker


def json_response(
    obj: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type=JSON, headers=headers)


def error_response(e: APIError) -> web.Response:
    """`e` as an OpenAI-style error answer."""
    return json_response(e.body(), e.status, e.headers)


@dataclass(slots=True)
class Failure:
    """Why the last attempt failed; becomes the client's answer when no retry is left."""

    status: int
    body: bytes
    retry_after: str | None = None
    retryable: bool = True  # another worker may succeed (not so for a 4xx about the request)
    # The worker's connection broke before its first byte (`proxy.is_disconnect`): the request
    # may be what broke it, so `Proxy.retry` tries at most one other worker after it.
    disconnect: bool = False

    @classmethod
    def local(
        cls,
        status: int,
        message: str,
        code: str,
        *,
        retryable: bool = True,
        disconnect: bool = False,
    ) -> Failure:
        body = orjson.dumps(error_body(message, "upstream_error", code))
        return cls(status, body, retryable=retryable, disconnect=disconnect)

    @classmethod
    def upstream(cls, w: Worker, resp: aiohttp.ClientResponse, data: bytes) -> Failure:
        try:
            ok = isinstance(orjson.loads(data).get("error"), dict)
        except (orjson.JSONDecodeError, AttributeError):
            ok = False
        if not ok:
            text = data[:200].decode(errors="replace")
            data = orjson.dumps(
                error_body(
                    f"{w.role} worker answered {resp.status}: {text}",
                    "upstream_error",
                    "upstream_error",
                )
            )
        return cls(resp.status, data, resp.headers.get("Retry-After"), resp.status in RETRYABLE)

    def response(self) -> web.Response:
        headers = {"Retry-After": self.retry_after} if self.retry_after else None
        return web.Response(body=self.body, status=self.status, content_type=JSON, headers=headers)
