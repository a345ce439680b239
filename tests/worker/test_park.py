"""`POST /park` (a `--park` worker's, pd/worker/api/server.py): a spare node's worker that was
activated goes back to the pool. It drains as on SIGTERM (new requests refused with 503 while
it does, the running ones finish), then is parked: every page free, not ready until the next
`POST /activate`, a new instance. A simulated worker in this process (no device, no weights)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from pd.config import WorkerConfig
from pd.worker.api.server import make_app
from pd.worker.build import build_worker

BODY = {"prompt": "Write about the sea.", "max_tokens": 40, "ignore_eos": True, "stream": True}


async def spare(aiohttp_server) -> str:
    """A simulated worker started as a spare node's (`--park`), served in this process."""
    cfg = WorkerConfig(simulate="llama-3.1-8b:h100", time_scale=1.0, role="both", port=0,
                       kv_pages=256, park=True)  # fmt: skip
    return str((await aiohttp_server(make_app(build_worker(cfg)))).make_url("")).rstrip("/")


async def test_a_drained_spare_parks_and_serves_again_when_activated(aiohttp_server):
    url = await spare(aiohttp_server)
    async with aiohttp.ClientSession() as http:

        async def health() -> dict:
            return await (await http.get(f"{url}/health")).json()

        assert (await health())["not_ready_reason"] == "parked"
        await http.post(f"{url}/activate")
        first = (await health())["instance"]
        resp = await http.post(f"{url}/v1/completions", json=BODY)
        assert resp.status == 200
        head = await resp.content.readline()
        assert head.startswith(b"data: ")
        park = asyncio.create_task(http.post(f"{url}/park"))
        await asyncio.sleep(0.1)
        refused = await http.post(f"{url}/v1/completions", json={**BODY, "stream": False})
        assert refused.status == 503 and (await refused.json())["error"]["code"] == "draining"
        again = await http.post(f"{url}/park")  # a second drain at once is refused
        assert again.status == 409 and (await again.json())["error"]["code"] == "draining"
        rest = await resp.content.read()  # the running request finishes before the park
        assert rest.rstrip().endswith(b"data: [DONE]")
        assert len([c for c in (head + rest).split(b"\n\n") if c.startswith(b"data: {")]) == 40
        parked = await park
        assert parked.status == 200
        assert await parked.json() == {"parked": True, "migrated": 0, "integrity": "ok"}
        now = await health()
        assert now["not_ready_reason"] == "parked" and now["instance"] != first
        assert now["load"]["kv_pages_free"] == now["load"]["kv_pages_total"]
        assert (await (await http.post(f"{url}/park")).json())["parked"]  # parked: nothing to do
        await http.post(f"{url}/activate")
        assert (await health())["not_ready_reason"] is None  # --startup-s 0: ready at once
        served = await http.post(f"{url}/v1/completions", json={**BODY, "stream": False})
        assert served.status == 200
        assert (await served.json())["usage"]["completion_tokens"] == 40


async def test_a_caller_that_leaves_mid_drain_still_gets_it_parked(aiohttp_server):
    url = await spare(aiohttp_server)
    async with aiohttp.ClientSession() as http:
        await http.post(f"{url}/activate")
        resp = await http.post(f"{url}/v1/completions", json=BODY)
        await resp.content.readline()
        with pytest.raises(TimeoutError):
            await http.post(f"{url}/park", timeout=aiohttp.ClientTimeout(total=0.1))
        assert (await resp.content.read()).rstrip().endswith(b"data: [DONE]")
        for _ in range(100):
            health = await (await http.get(f"{url}/health")).json()
            if health["not_ready_reason"] == "parked":
                break
            await asyncio.sleep(0.05)
        assert health["not_ready_reason"] == "parked" and health["status"] == "ok"
