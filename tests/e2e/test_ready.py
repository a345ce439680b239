"""A real worker's /ready: a filled KV pool turns it 503 (after 2 s), freeing it turns it 200
again (after 2 s); /health stays 200 throughout and says whether the worker is ready."""

from __future__ import annotations

import asyncio

import pytest

from pd.worker.api.server import make_app
from tests.e2e.conftest import assert_all_pages_free

pytestmark = pytest.mark.slow


async def wait_status(client, path: str, status: int, timeout: float = 6.0) -> dict:
    for _ in range(int(timeout / 0.1)):
        resp = await client.get(path)
        if resp.status == status:
            return await resp.json()
        await asyncio.sleep(0.1)
    raise AssertionError(f"{path} never answered {status}")


async def test_a_full_kv_pool_turns_ready_503_then_200(worker, aiohttp_client):
    client = await aiohttp_client(make_app(worker))
    await wait_status(client, "/ready", 200)
    cache = worker.engine.scheduler.cache
    pages = cache.allocate(cache.num_free)
    assert pages is not None
    cache.hold("test-fill", pages)
    try:
        body = await wait_status(client, "/ready", 503)
        assert body == {
            "ready": False,
            "reason": "unable to admit a request for 2s: the KV pool is full",
        }
        health = await client.get("/health")
        assert health.status == 200 and (await health.json())["ready"] is False
    finally:
        worker.engine.give_back("test-fill")
    await wait_status(client, "/ready", 200)
    assert (await (await client.get("/health")).json())["ready"] is True
    assert_all_pages_free(worker)
