"""`/tokenize` and `/detokenize` on the router: forwarded to a healthy worker, which answers
with the model's tokenizer (pd/worker/api/tokenize.py; every worker of a cluster has the same)."""

from __future__ import annotations

import aiohttp
import orjson
from aiohttp import web

from pd.protocol import error_body
from pd.router.failure import Failure, json_response
from pd.router.keys import PROXY, REGISTRY

TIMEOUT = aiohttp.ClientTimeout(total=30.0)


async def forward(request: web.Request) -> web.StreamResponse:
    """The worker's answer as it is; a 503 when none is healthy, a 502 when the one tried failed."""
    proxy = request.app[PROXY]
    workers = [w for w in request.app[REGISTRY] if w.healthy]
    if not workers:
        error = error_body("no healthy worker", "service_unavailable", "no_healthy_worker")
        return Failure(503, orjson.dumps(error), retry_after="1").response()
    w = min(workers, key=lambda w: w.inflight)
    body = await request.read()
    assert proxy.session is not None, "set in the app's cleanup_ctx"
    try:
        async with proxy.session.post(
            w.url + request.path, data=body, headers=proxy.headers, timeout=TIMEOUT
        ) as resp:
            data = await resp.read()
            return web.Response(body=data, status=resp.status, content_type="application/json")
    except (aiohttp.ClientError, TimeoutError) as e:
        failure = Failure.local(502, f"worker {w.url} failed: {type(e).__name__}", "worker_failed")
        return failure.response()


__all__ = ["forward", "json_response"]
