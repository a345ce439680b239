"""Property-based: generated request bodies, valid and not, sent to an in-process router in front
of stub workers (PD with decode-local prefill, and co-located; each with the prefix index on).
Never a 5xx, every 4xx an OpenAI error object."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer

from pd.router import RouterConfig, make_app
from pd.bench.stub_worker import StubWorker
from tests.api_bodies import fuzz



@pytest.mark.parametrize("mode", ["pd", "colocated"])
def test_generated_bodies_get_an_answer_or_a_clear_4xx(mode: str):
    loop = asyncio.new_event_loop()
    servers: list[TestServer] = []

    async def start() -> TestClient:
        async def worker(role: str) -> str:
            server = TestServer(StubWorker(role, record=False).app())
            await server.start_server()
            servers.append(server)
            return str(server.make_url("")).rstrip("/")

        if mode == "pd":
            urls = {"prefill": (await worker("prefill"),), "decode": (await worker("decode"),)}
        else:
            urls = {"worker": (await worker("both"),)}
        cfg = RouterConfig(
            health_interval=0.5, local_prefill_max_tokens=64, policy="cache-aware", **urls
        )
        client = TestClient(TestServer(make_app(cfg)))
        await client.start_server()
        return client

    client = loop.run_until_complete(start())
    try:
        seen = fuzz(loop, client)
    finally:
        loop.run_until_complete(client.close())
        for server in servers:
            loop.run_until_complete(server.close())
        loop.close()
    assert seen.get(200, 0) >= 5, seen  # a good share was served, not only refused
