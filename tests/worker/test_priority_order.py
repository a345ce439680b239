"""A worker takes waiting requests by `priority` (issue 45): with its one running slot taken and
batch requests waiting, a later interactive request runs next, and every batch request still
finishes. A simulated worker process (the real engine and scheduler, modeled GPU steps)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from pd.bench.pd import _spawn, _wait_healthy
from pd.ports import free_port

PROFILE = "llama-3.1-8b:h100:tp1"


@pytest.fixture(scope="module")
def worker_url():
    port = free_port()
    proc = _spawn(
        "pd.worker.main", "--role", "both", "--port", str(port), "--simulate", PROFILE,
        "--max-running-requests", "1", "--time-scale", "4",
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(_wait_healthy(url, [proc], timeout=120))
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def _complete(http: aiohttp.ClientSession, url: str, name: str, priority: int, done: list):
    body = {"model": "default", "prompt": f"{name}: tell me a story", "max_tokens": 24,
            "ignore_eos": True, "priority": priority}  # fmt: skip
    async with http.post(f"{url}/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        answer = await r.json()
    assert answer["usage"]["completion_tokens"] == 24
    done.append((name, time.monotonic()))


async def _waiting(http: aiohttp.ClientSession, url: str) -> int:
    async with http.get(f"{url}/health") as r:
        return int((await r.json())["load"]["waiting"])


async def test_a_later_interactive_request_runs_before_the_waiting_batch(worker_url):
    done: list[tuple[str, float]] = []
    async with aiohttp.ClientSession() as http:
        tasks = [asyncio.create_task(_complete(http, worker_url, "batch-0", 1, done))]
        await asyncio.sleep(0.2)  # batch-0 holds the one running slot
        for i in range(1, 4):
            tasks.append(asyncio.create_task(_complete(http, worker_url, f"batch-{i}", 1, done)))
        for _ in range(100):  # the three batch requests wait
            if await _waiting(http, worker_url) == 3:
                break
            await asyncio.sleep(0.02)
        assert await _waiting(http, worker_url) == 3
        tasks.append(asyncio.create_task(_complete(http, worker_url, "interactive", -1, done)))
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
    order = [name for name, _ in done]
    assert order[:2] == ["batch-0", "interactive"], order  # next after the running one
    assert sorted(order[2:]) == ["batch-1", "batch-2", "batch-3"]  # every batch one finishes
    assert order[2:] == ["batch-1", "batch-2", "batch-3"]  # among equals, arrival order
    async with aiohttp.ClientSession() as http:  # every page back, the page walk clean
        for _ in range(100):
            async with http.get(f"{worker_url}/health") as r:
                health = await r.json()
            load = health["load"]
            if load["kv_pages_free"] == load["kv_pages_total"]:
                break
            await asyncio.sleep(0.05)
    assert load["kv_pages_free"] == load["kv_pages_total"], load
    assert health["integrity"] == "ok", health["integrity"]
