"""`n` choices count against the running batch, and pulls keep a share of it: on a simulated
decode worker whose slots four local `n=4` (or `n=16`) streams would fill, a request through router + P + D is
served at once (before, it waited for pages until its deadline, after its first token)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from pd.router import RouterConfig
from pd.router import make_app as make_router
from pd.worker.api.server import make_app
from pd.worker.build import build_worker
from tests.e2e.processes import wait_pages_free
from tests.sim.test_sim_pd import config


# (16, 64): the case at the default running limit; its 64 choices need a larger pool.
@pytest.mark.parametrize("n, running, pages", [(4, 16, 512), (16, 64, 4096)])
async def test_local_n_streams_cannot_starve_a_pull(aiohttp_server, n, running, pages):
    workers = {}
    for role in ("prefill", "decode"):
        cfg = config(role, max_running_requests=running, page_wait_timeout_s=5.0, kv_pages=pages)
        w = build_worker(cfg)
        workers[role] = (w, str((await aiohttp_server(make_app(w))).make_url("")).rstrip("/"))
    (_, p), (d_worker, d) = workers["prefill"], workers["decode"]
    assert d_worker.engine.scheduler.arrival_slots == running // 4  # a quarter
    cfg = RouterConfig(
        port=0, prefill=(p,), decode=(d,), health_interval=0.2, local_prefill_max_tokens=0
    )
    router = str((await aiohttp_server(make_router(cfg))).make_url("")).rstrip("/")
    local = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "n": n}
    async with aiohttp.ClientSession() as http:
        deadline = time.monotonic() + 10
        while (await http.get(f"{router}/health")).status != 200:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        # Four requests of n choices straight to D (decode-local): 4n choices, 3n local slots.
        streams = [
            asyncio.ensure_future(http.post(f"{d}/v1/completions", json=local)) for _ in range(4)
        ]
        sched = d_worker.engine.scheduler
        deadline = time.monotonic() + 30
        while sched.running_choices < 3 * n:
            assert time.monotonic() < deadline and not any(s.done() for s in streams), [
                s.result().status for s in streams if s.done()
            ]
            await asyncio.sleep(0.01)
        assert sched.waiting_choices == n  # the fourth waits for local slots
        t = time.monotonic()
        resp = await http.post(
            f"{router}/v1/completions", json={"prompt": "Tell me a story.", "max_tokens": 8}
        )
        answer = await resp.json()
        assert resp.status == 200 and answer["choices"][0]["finish_reason"], answer
        assert time.monotonic() - t < 4.0  # no wait for pages (the deadline is 5 s)
        assert not all(s.done() for s in streams)  # served beside the local streams
        for s in streams:
            s.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        for url in (p, d):
            await wait_pages_free(http, url)
