"""Readiness apart from liveness: a worker whose /health says it is not ready (draining, or
unable to admit for a while) gets no new request, yet is neither ejected nor cut off: the
requests it serves go on; ready again, it gets requests again."""

from __future__ import annotations

from tests.router.conftest import registry_of, wait_for

BODY = {"prompt": "hi", "max_tokens": 2}


async def test_a_worker_that_is_not_ready_gets_no_new_request_and_is_not_ejected(stub, router):
    a, b = await stub("both"), await stub("both")
    client = await router(worker=[a, b], policy="round-robin")
    pool = registry_of(client).both
    await wait_for(lambda: len(pool.healthy) == 2)
    wa = next(w for w in pool.workers.values() if w.url == a.url)
    a.ready = False
    await wait_for(lambda: not wa.ready)
    seen = len(a.requests)
    for _ in range(6):
        assert (await client.post("/v1/completions", json=BODY)).status == 200
    assert len(a.requests) == seen and len(b.requests) >= 6
    assert wa.healthy and wa.ejections == 0 and wa.not_ready == "the KV pool is full"
    a.ready = True
    await wait_for(lambda: wa.ready and wa in pool.healthy)
    for _ in range(4):
        assert (await client.post("/v1/completions", json=BODY)).status == 200
    assert len(a.requests) > seen


async def test_when_none_is_ready_the_busy_ones_serve_and_each_choice_is_counted(stub, router):
    """Every worker busy: requests queue on them rather than being refused, and each such
    choice is a fallback, counted in pd_router_busy_choices_total."""
    a, b = await stub("both"), await stub("both")
    client = await router(worker=[a, b], policy="round-robin")
    pool = registry_of(client).both
    await wait_for(lambda: len(pool.healthy) == 2)
    a.ready = b.ready = False
    await wait_for(lambda: pool.all_busy)
    for _ in range(3):
        assert (await client.post("/v1/completions", json=BODY)).status == 200
    text = await (await client.get("/metrics")).text()
    assert 'pd_router_busy_choices_total{pool="both"} 3.0' in text
    a.ready = b.ready = True
    await wait_for(lambda: not pool.all_busy)
    assert (await client.post("/v1/completions", json=BODY)).status == 200
    assert pool.busy_choices == 3
