"""The planner's `local` connector end to end (issue 43) on the real model: one P and one D
(pd-worker processes, fp32, one thread each) behind the router, the planner in process. A load
step fills D's small KV pool: the planner starts a second decode worker, which registers, becomes
ready and takes streams; the load stops: after the cool-down the planner drains the worker it
started (the router forgets it first) and stops it. Every stream ends whole, with every token;
every page of the workers left is free and accounted for."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import orjson
import pytest

from pd.planner.config import PlannerConfig
from pd.planner.service import PlannerService
from pd.router import RouterConfig
from pd.router import make_app as make_router
from pd.transfer import nixl_available
from tests.e2e.conftest import PAIR_FLAGS
from tests.e2e.processes import CLUSTER_TOKEN, start_workers, stop, wait_pages_free

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not nixl_available(), reason="the KV pull needs a NIXL package"),
]

# 40 pages of 16 tokens: eight streams of ~90 tokens (6 pages each) do not fit at once.
D_FLAGS = (*PAIR_FLAGS[:-4], "--kv-pages", "40", "--max-model-len", "512", "--threads", "1")
MAX_TOKENS = 48
PROMPT = (
    "Write a long letter to a friend about a journey by train across the mountains, the "
    "villages seen from the window, the people met in the dining car and the weather. "
)


async def stream(http: aiohttp.ClientSession, router: str, i: int) -> int:
    """A streamed completion: the tokens it got, all of them, without an error."""
    body = {"prompt": f"{i}. {PROMPT}", "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    usage, finish = None, None
    async with http.post(f"{router}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            obj = orjson.loads(line[6:])
            assert "error" not in obj, obj
            usage = obj.get("usage") or usage
            for c in obj["choices"]:
                finish = c.get("finish_reason") or finish
    assert finish == "length" and usage is not None, (finish, usage)
    return int(usage["completion_tokens"])


async def test_the_planner_adds_a_decode_worker_under_load_and_drains_it_after(
    aiohttp_server, tmp_path
):
    stopped = asyncio.Event()
    planner: asyncio.Task | None = None
    (p_proc, p), (d_proc, d) = start_workers(
        ("--role", "prefill", *PAIR_FLAGS), ("--role", "decode", *D_FLAGS)
    )
    try:
        rcfg = RouterConfig(port=0, prefill=(p,), decode=(d,), health_interval=0.2,
                            local_prefill_max_tokens=0, admin_token="admin")  # fmt: skip
        router = str((await aiohttp_server(make_router(rcfg))).make_url("")).rstrip("/")
        cfg = PlannerConfig(
            router=router, connector="local", slo_ttft_ms=120_000, slo_itl_ms=30_000,
            interval_s=0.5, cooldown_s=10, window_s=5, max_prefill=1, max_decode=2, budget=3,
            admin_token="admin", cluster_token=CLUSTER_TOKEN, worker_args=" ".join(D_FLAGS),
            log_dir=str(tmp_path), port=0,
        )  # fmt: skip
        # (a cool-down longer than a loaded machine's gap between two waves of the load step,
        # a worker's start-up included: the step is one plateau, one turn up and one down)
        service = PlannerService(cfg)
        planner = asyncio.create_task(service.run(stopped))
        connector = service.connector
        got: list[int] = []
        async with aiohttp.ClientSession() as http:
            # The load step: waves of streams until the planner's worker has served some.
            deadline = time.monotonic() + 240
            added = None
            while True:
                assert time.monotonic() < deadline, f"no second decode worker: {service.actions}"
                failed = sum(connector.failed_starts.values())
                assert not failed, [f.read_text()[-2000:] for f in tmp_path.glob("*.log")]
                got += await asyncio.gather(*(stream(http, router, i) for i in range(8)))
                ready = [m for m in connector.workers.values() if m.state == "ready"]
                if ready:
                    added = ready[0]
                    record = await (await http.get(f"{added.url}/steps")).json()
                    if record["sampled_tokens"] > 0:
                        break
            assert added is not None and added.role == "decode"
            assert service.planner.roles["decode"].target == 2
            # The load stops: the planner drains and stops its worker after the cool-down.
            while added.proc.poll() is None:
                assert time.monotonic() < deadline, f"never drained: {service.actions}"
                await asyncio.sleep(0.2)
            assert added.proc.returncode == 0
            assert service.planner.roles["decode"].target == 1
            admin = {"Authorization": "Bearer admin"}
            listed = (await (await http.get(f"{router}/workers", headers=admin)).json())["workers"]
            assert sorted(w["url"] for w in listed) == sorted([p, d])
            assert got == [MAX_TOKENS] * len(got)  # nothing lost or cut
            for url in (p, d):
                await wait_pages_free(http, url)
            lines = service.actions
            assert any(line.startswith("starting decode worker") for line in lines), lines
            assert any(line.startswith("draining decode worker") for line in lines), lines
            decisions = [x for x in service.planner.decisions if x.reasons != ("holds",)]
            assert service.planner.direction_changes == 1, [x.line() for x in decisions]
        stopped.set()
        await planner
        assert not connector.workers
    finally:
        stopped.set()
        if planner is not None:
            await planner  # stops what it started
        for proc in (p_proc, d_proc):
            stop(proc)
