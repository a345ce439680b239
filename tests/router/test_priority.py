"""Priority classes through the router (pd/router/admission.py behind app.py): a class named
by header reaches the workers as `priority`; with a budget, a higher class preempts a lower one
that has sent no byte yet (503, `Retry-After`), never one that has; a full queue is a 429 and a
long wait a 408; `/metrics` counts each class's outcomes."""

from __future__ import annotations

import asyncio

from tests.router.conftest import COMPLETION, wait_for


async def _metric(client, name: str) -> dict[str, float]:
    text = await (await client.get("/metrics")).text()
    out = {}
    for line in text.splitlines():
        if line.startswith(name):
            labels, value = line.rsplit(" ", 1)
            out[labels] = float(value)
    return out


async def test_a_class_header_reaches_the_workers_as_priority(stub, router):
    p, d = await stub("prefill"), await stub("decode")
    client = await router(prefill=[p], decode=[d])
    r = await client.post("/v1/completions", json=COMPLETION, headers={"X-Priority-Class": "batch"})
    assert r.status == 200, await r.text()
    assert p.requests[-1]["priority"] == 1 and d.requests[-1]["priority"] == 1
    r = await client.post("/v1/completions", json={**COMPLETION, "priority": -1})
    assert r.status == 200
    assert d.requests[-1]["priority"] == -1
    r = await client.post(
        "/v1/completions",
        json={**COMPLETION, "priority": 3},
        headers={"X-Priority-Class": "system"},
    )
    assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_priority_class"
    r = await client.post("/v1/completions", json=COMPLETION, headers={"X-Priority-Class": "vip"})
    assert r.status == 400
    counts = await _metric(client, "pd_router_class_requests_total")
    assert counts['pd_router_class_requests_total{class="batch",outcome="admitted"}'] == 1
    assert counts['pd_router_class_requests_total{class="interactive",outcome="admitted"}'] == 1


async def test_a_higher_class_preempts_one_that_has_sent_nothing(stub, router):
    p, d = await stub("prefill"), await stub("decode")
    p.delay = 1.0  # the batch request sits in prefill: no byte to its client yet
    client = await router(
        prefill=[p], decode=[d], max_concurrency=1, class_reserved="", stream_idle_timeout_s=30
    )
    batch = asyncio.create_task(client.post("/v1/completions", json={**COMPLETION, "priority": 1}))
    await wait_for(lambda: len(p.requests) == 1)
    p.delay = 0.0
    r = await client.post("/v1/completions", json={**COMPLETION, "priority": -1})
    assert r.status == 200, await r.text()
    preempted = await batch
    assert preempted.status == 503 and preempted.headers["Retry-After"] == "1"
    assert (await preempted.json())["error"]["code"] == "preempted"
    counts = await _metric(client, "pd_router_class_requests_total")
    assert counts['pd_router_class_requests_total{class="batch",outcome="preempted"}'] == 1
    inflight = await _metric(client, "pd_router_class_inflight")
    assert sum(inflight.values()) == 0


async def test_a_stream_that_has_sent_its_first_byte_is_never_preempted(stub, router):
    p, d = await stub("prefill"), await stub("decode")
    d.chunk_delay = 0.3  # the batch stream is under way, slowly
    client = await router(prefill=[p], decode=[d], max_concurrency=1, class_reserved="")
    resp = await client.post("/v1/completions", json={**COMPLETION, "priority": 1, "stream": True})
    assert resp.status == 200
    first = await resp.content.readany()  # its first byte is out
    assert first
    d.chunk_delay = 0.0
    interactive = asyncio.create_task(
        client.post("/v1/completions", json={**COMPLETION, "priority": -1})
    )
    rest = await resp.read()
    assert rest.rstrip().endswith(b"data: [DONE]")  # whole: not preempted
    r = await interactive
    assert r.status == 200  # it waited for the slot


async def test_a_full_queue_is_a_429_and_a_long_wait_a_408(stub, router):
    p, d = await stub("prefill"), await stub("decode")
    p.delay = 1.0
    client = await router(
        prefill=[p], decode=[d], max_concurrency=1, class_reserved="",
        class_queue="default=1", class_deadline_s="default=0.3",
    )  # fmt: skip
    first = asyncio.create_task(client.post("/v1/completions", json=COMPLETION))
    await wait_for(lambda: len(p.requests) == 1)
    second = asyncio.create_task(client.post("/v1/completions", json=COMPLETION))
    await wait_for(lambda: True)
    await asyncio.sleep(0.05)
    third = await client.post("/v1/completions", json=COMPLETION)
    assert third.status == 429 and third.headers["Retry-After"] == "1"
    assert (await third.json())["error"]["code"] == "queue_full"
    r2 = await second
    assert r2.status == 408 and (await r2.json())["error"]["code"] == "queue_timeout"
    assert (await first).status == 200
    counts = await _metric(client, "pd_router_class_requests_total")
    assert counts['pd_router_class_requests_total{class="default",outcome="refused"}'] == 1
    assert counts['pd_router_class_requests_total{class="default",outcome="timed_out"}'] == 1


async def test_no_priority_sends_no_class_to_the_workers_and_refuses_a_priority(stub, router):
    p, d = await stub("prefill"), await stub("decode")
    client = await router(prefill=[p], decode=[d], no_priority=True)
    r = await client.post("/v1/completions", json=COMPLETION, headers={"X-Priority-Class": "batch"})
    assert r.status == 200
    assert "priority" not in p.requests[-1] and "priority" not in d.requests[-1]
    counts = await _metric(client, "pd_router_class_requests_total")  # still counted by class
    assert counts['pd_router_class_requests_total{class="batch",outcome="admitted"}'] == 1
    r = await client.post("/v1/completions", json={**COMPLETION, "priority": 1})
    assert r.status == 400 and (await r.json())["error"]["param"] == "priority"
    r = await client.post("/v1/completions", json={**COMPLETION, "priority": 0})
    assert r.status == 200
