"""What the planner reads of a running cluster (pd/planner/observe.py): router + simulated P + D
in one process (llama-3.1-70b on 4 x H100), the real HTTP apps and engines. After a few concurrent
streams the reader finds the arrivals, the mean uncached prompt and output lengths exactly, P's
prompt tokens and busy time, and D's decode steps, each no faster than its modeled time (the
clock only sleeps longer) and each seen once. A simulated worker that starts takes nothing, not
even as the fallback of a pool with no ready worker, until its start-up is over."""

from __future__ import annotations

import asyncio
import statistics
import time

import aiohttp
import pytest
from aiohttp import web

from pd.config import WorkerConfig
from pd.planner.observe import ClusterReader
from pd.router import RouterConfig
from pd.router import make_app as make_router
from pd.sim import CostModel, parse_profile
from pd.worker.api.server import make_app
from pd.worker.build import build_worker
from tests.e2e.processes import wait_pages_free

PROFILE = "llama-3.1-70b:h100:tp4"
SCALE = 1.0
TOKEN = "planner-observe-token-0123456789"
PROMPT = "Name the rivers of Europe and the seas they run to, from the Volga to the Tagus. "


def config(role: str, **kw) -> WorkerConfig:
    return WorkerConfig(
        simulate=PROFILE,
        time_scale=SCALE,
        role=role,
        port=0,
        cluster_token=TOKEN,
        **{"kv_pages": 512, **kw},
    )


async def serve(aiohttp_server, role: str, **kw) -> str:
    server = await aiohttp_server(make_app(build_worker(config(role, **kw))))
    return str(server.make_url("")).rstrip("/")


async def router_of(aiohttp_server, **kw) -> str:
    cfg = RouterConfig(port=0, health_interval=0.1, local_prefill_max_tokens=0, **kw)
    return str((await aiohttp_server(make_router(cfg))).make_url("")).rstrip("/")


async def completion(http, router: str, i: int, max_tokens: int) -> dict:
    body = {"prompt": f"{i}: {PROMPT}", "max_tokens": max_tokens, "stream": True}
    async with http.post(f"{router}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
    return body


async def test_the_reader_finds_rates_lengths_and_steps(aiohttp_server):
    p, d = await serve(aiohttp_server, "prefill"), await serve(aiohttp_server, "decode")
    router = await router_of(aiohttp_server, prefill=(p,), decode=(d,))
    reader = ClusterReader(router, time_scale=SCALE, window_s=600)
    async with aiohttp.ClientSession() as http:
        await _until_ready(http, router)
        first = await reader.observe(http)
        assert {(w.role, w.ready) for w in first.workers} == {("prefill", True), ("decode", True)}
        assert first.arrivals_per_s == 0 and first.prompt_tokens == 0
        await asyncio.gather(*(completion(http, router, i, 16) for i in range(6)))
        for url in (p, d):
            await wait_pages_free(http, url)
        obs = await reader.observe(http)
        prompt = (await (await http.post(f"{p}/tokenize", json={"prompt": f"1: {PROMPT}"})).json())[
            "count"
        ]
        assert obs.arrivals_per_s > 0
        assert obs.prompt_tokens == pytest.approx(prompt, abs=1)  # "1:" .. "5:": one token each
        assert obs.output_tokens == 16  # 1 on P, 15 on D, each request
        # the TTFT's part no prefill worker serves: the router's mean TTFT less P's own
        assert 0 < obs.ttft_overhead_s * SCALE < 2.0, obs.ttft_overhead_s
        (pw,) = obs.of("prefill")
        (dw,) = obs.of("decode")
        assert pw.prefill_tokens == pytest.approx(6 * prompt, abs=6) and pw.prefill_busy_s > 0
        assert not pw.steps and dw.prefill_tokens == 0
        assert 15 <= len(dw.steps) <= 6 * 15
        cost = CostModel(parse_profile(PROFILE))
        ratios = []
        for s in dw.steps:
            modeled = cost.batch_s(s.rows, s.kv_tokens - s.rows)  # (c, 1) rows: c + 1 KV tokens
            assert s.seconds >= SCALE * modeled * 0.999, (s, modeled)
            ratios.append(s.seconds / modeled)
        assert statistics.median(ratios) < 1.1  # the device time: late wake-ups left out
        again = await reader.observe(http)
        (dw2,) = again.of("decode")
        assert dw2.steps == () and dw2.running == 0  # each sample seen once


async def test_a_starting_worker_takes_nothing_until_it_is_ready(aiohttp_server):
    p = await serve(aiohttp_server, "prefill")
    d = await serve(aiohttp_server, "decode", startup_s=1.5)
    router = await router_of(aiohttp_server, prefill=(p,), decode=(d,))
    reader = ClusterReader(router, time_scale=SCALE)
    async with aiohttp.ClientSession() as http:
        t0 = time.monotonic()
        ready = await (await http.get(f"{d}/ready")).json()
        assert ready == {"ready": False, "reason": "starting"}
        await asyncio.sleep(0.3)  # the router's health checks have seen it
        body = {"prompt": PROMPT, "max_tokens": 2}
        resp = await http.post(f"{router}/v1/completions", json=body)
        assert resp.status == 503, await resp.text()  # not queued on a starting worker
        obs = await reader.observe(http)
        assert [w.ready for w in obs.workers if w.role == "decode"] == [False]
        while (await http.get(f"{d}/ready")).status != 200:
            assert time.monotonic() - t0 < 10, "the worker never became ready"
            await asyncio.sleep(0.05)
        assert time.monotonic() - t0 >= 1.4
        await asyncio.sleep(0.3)
        resp = await http.post(f"{router}/v1/completions", json=body)
        assert resp.status == 200, await resp.text()
        for url in (p, d):
            await wait_pages_free(http, url)


async def _until_ready(http: aiohttp.ClientSession, router: str) -> None:
    deadline = time.monotonic() + 10
    while (await http.get(f"{router}/health")).status != 200:
        assert time.monotonic() < deadline, "the router never saw its workers healthy"
        await asyncio.sleep(0.05)


async def test_the_ttft_taken_is_of_requests_a_prefill_worker_served(aiohttp_server):
    """Requests served decode-local (or by a `both` worker) have no part in P's latency: the
    TTFT outside prefill is taken over route `pd` alone."""
    text = "\n".join([
        "# HELP pd_router_arrivals_total Requests that arrived",
        "# TYPE pd_router_arrivals_total counter",
        "pd_router_arrivals_total 12.0",
        "# HELP pd_router_ttft_seconds Arrival to the first byte",
        "# TYPE pd_router_ttft_seconds histogram",
        *[f'pd_router_ttft_seconds_bucket{{le="+Inf",route="{r}"}} {n}' for r, n in
          (("pd", 4), ("local", 8))],
        'pd_router_ttft_seconds_count{route="pd"} 4.0',
        'pd_router_ttft_seconds_sum{route="pd"} 6.0',
        'pd_router_ttft_seconds_count{route="local"} 8.0',
        'pd_router_ttft_seconds_sum{route="local"} 0.8',
        "",
    ])  # fmt: skip

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=text)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    url = str((await aiohttp_server(app)).make_url("")).rstrip("/")
    async with aiohttp.ClientSession() as http:
        got = await ClusterReader(url, time_scale=SCALE)._router_counters(http)
    assert got == (12.0, 6.0, 4.0)


async def test_a_worker_back_in_the_list_counts_from_its_return(aiohttp_server):
    """A spare parked and activated again keeps its process and its counters: what it did out of
    the router's list (its drain's last prefills) is not counted at its return, nor its steps
    of then read again. A fake router and P: the counters are the test's."""
    state = {"listed": True, "tokens": 0, "steps": 0}

    async def workers(request):
        listed = [{"url": p_url, "role": "prefill"}] if state["listed"] else []
        return web.json_response({"workers": listed})

    async def health(request):
        return web.json_response({"load": {}, "not_ready_reason": None})

    async def no_metrics(request):
        return web.Response(text="")

    async def steps(request):
        after = int(request.query.get("after", 0))
        return web.json_response({
            "steps": state["steps"], "prefill_tokens": state["tokens"],
            "prefill_busy_s": state["tokens"] / 1000, "prefills_done": state["tokens"] // 100,
            "sampled_tokens": 0, "samples": [[1, 100, 0.01]] * (state["steps"] - after),
        })  # fmt: skip

    worker_app = web.Application()
    worker_app.router.add_get("/health", health)
    worker_app.router.add_get("/steps", steps)
    p_url = str((await aiohttp_server(worker_app)).make_url("")).rstrip("/")
    router_app = web.Application()
    router_app.router.add_get("/workers", workers)
    router_app.router.add_get("/metrics", no_metrics)
    reader = ClusterReader(str((await aiohttp_server(router_app)).make_url("")).rstrip("/"))

    async with aiohttp.ClientSession() as http:

        async def counted() -> tuple[int, int]:
            (w,) = (await reader.observe(http)).of("prefill")
            return w.prefill_tokens, len(w.steps)

        state.update(tokens=500, steps=2)
        assert await counted() == (500, 2)  # first sight: all of it (a new worker's is 0)
        state.update(tokens=800, steps=3)
        assert await counted() == (300, 1)
        state.update(listed=False, tokens=1200, steps=5)  # its drain's last prefills, unlisted
        assert (await reader.observe(http)).workers == ()
        state.update(listed=True)
        assert await counted() == (0, 0)  # back: counted from here
        state.update(tokens=1500, steps=6)
        assert await counted() == (300, 1)
