"""Health checks: ejection, re-admission, the router's own /health, empty pools."""

from __future__ import annotations

from tests.router.conftest import COMPLETION, registry_of, wait_for


async def test_failing_worker_is_ejected_and_readmitted(stub, router):
    p = await stub("prefill")
    d1 = await stub("decode")
    d2 = await stub("decode")
    client = await router(
        prefill=[p], decode=[d1, d2], policy="round-robin", health_failures=2, health_successes=2
    )
    reg = registry_of(client)
    w1 = reg.find(d1.url)
    assert w1.healthy
    d1.health_status = 503
    await wait_for(lambda: not w1.healthy)
    for _ in range(4):
        assert (await client.post("/v1/completions", json=COMPLETION)).status == 200
    assert d1.requests == [] and len(d2.requests) == 4
    health = await (await client.get("/health")).json()
    decode = {w["url"]: w for w in health["pools"]["decode"]["workers"]}
    assert decode[d1.url]["healthy"] is False and "503" in decode[d1.url]["last_error"]
    assert health["status"] == "ok" and health["mode"] == "pd"
    d1.health_status = 200
    await wait_for(lambda: w1.healthy)
    for _ in range(4):
        await client.post("/v1/completions", json=COMPLETION)
    assert len(d1.requests) == 2
    metrics = (await (await client.get("/metrics")).read()).decode()
    assert 'pd_router_ejections_total{pool="decode"} 1.0' in metrics


async def test_empty_pool_is_a_503_with_an_openai_error(stub, router):
    p = await stub("prefill")
    d = await stub("decode")
    client = await router(prefill=[p], decode=[d])
    d.health_status = 503
    await wait_for(lambda: not registry_of(client).decode.healthy)
    resp = await client.post("/v1/completions", json=COMPLETION)
    assert resp.status == 503
    error = (await resp.json())["error"]
    assert error["code"] == "no_healthy_worker" and "decode" in error["message"]
    assert p.requests == []  # nothing is prefilled that could not be decoded
    health = await client.get("/health")
    assert health.status == 503 and (await health.json())["status"] == "unavailable"


async def test_no_workers_at_all(router):
    client = await router()
    resp = await client.post("/v1/completions", json=COMPLETION)
    assert resp.status == 503 and (await resp.json())["error"]["message"] == "no healthy worker"


async def test_worker_down_at_start_joins_when_it_comes_up(stub, router):
    p = await stub("prefill")
    d = await stub("decode", health_status=503)
    client = await router(prefill=[p], decode=[d])
    assert (await client.post("/v1/completions", json=COMPLETION)).status == 503
    d.health_status = 200
    await wait_for(lambda: bool(registry_of(client).decode.healthy))
    assert (await client.post("/v1/completions", json=COMPLETION)).status == 200


async def test_role_mismatch_is_never_admitted(stub, router):
    p = await stub("prefill")
    wrong = await stub("prefill")  # given as a decode worker
    client = await router(prefill=[p], decode=[wrong])
    w = registry_of(client).find(wrong.url)
    assert not w.healthy and "role" in w.last_error


async def test_reported_load_is_polled(stub, router):
    p = await stub("prefill")
    d = await stub("decode")
    client = await router(prefill=[p], decode=[d])
    w = registry_of(client).find(p.url)
    p.load = {**p.load, "queued_prefill_tokens": 1234}
    await wait_for(lambda: w.load is not None and w.load.queued_prefill_tokens == 1234)
