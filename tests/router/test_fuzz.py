"""Property-based: generated request bodies, valid and not, sent to an in-process router in front
of stub workers (PD with decode-local prefill, and co-located; each with the prefix index on).
Never a 5xx, every 4xx an OpenAI error object."""

from __future__ import annotations

import asyncio
import os

import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings

from pd.router import RouterConfig, make_app
from pd.router.stub import StubWorker
from tests.api_bodies import assert_openai_answer, bodies, with_known_cases

EXAMPLES = int(os.environ.get("PD_FUZZ_EXAMPLES", "150"))  # PD_FUZZ_EXAMPLES=5000: longer


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
    seen: dict[int, int] = {}

    async def send(path: str, raw: bytes) -> None:
        resp = await client.post(path, data=raw, headers={"Content-Type": "application/json"})
        data = await resp.read()
        seen[resp.status] = seen.get(resp.status, 0) + 1
        assert_openai_answer(resp.status, data, resp.headers.get("Content-Type", ""))

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(bodies())
    @with_known_cases
    def check(case: tuple[str, bytes]) -> None:
        loop.run_until_complete(send(*case))

    try:
        check()
    finally:
        loop.run_until_complete(client.close())
        for server in servers:
            loop.run_until_complete(server.close())
        loop.close()
    print("answers by status:", seen)
    assert seen.get(200, 0) >= 5, seen  # a good share was served, not only refused
