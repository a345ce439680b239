"""The router pairs a prefill worker with a decode worker only when their runtime formats (compute
dtype, linear and LM head formats, attention; /health `runtime_format`) are equal, and says so in
its log and metrics (pd/router/pairing.py)."""

from __future__ import annotations

import asyncio
import logging

from tests.router.conftest import COMPLETION, registry_of, wait_for

INT4 = {"compute_dtype": "float32", "linear": "int4", "lm_head": "int8", "attention": "torch"}
NONE = {**INT4, "linear": "none", "lm_head": "none"}


async def test_each_request_goes_to_the_decode_worker_on_its_prefill_workers_format(
    stub, router, caplog
):
    p = await stub("prefill", runtime_format=INT4)
    d_other = await stub("decode", runtime_format=NONE)
    d_same = await stub("decode", runtime_format=INT4)
    with caplog.at_level(logging.WARNING, logger="pd.router"):
        client = await router(prefill=[p], decode=[d_other, d_same], policy="round-robin")
        reg = registry_of(client)
        await wait_for(lambda: len(reg.decode.healthy) == 2 and len(reg.prefill.healthy) == 1)
        for _ in range(4):  # round-robin would send half of them to d_other
            resp = await client.post("/v1/completions", json=COMPLETION)
            assert resp.status == 200, await resp.text()
    assert len(d_same.requests) == 4 and d_other.requests == []
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "will not be paired" in said and d_other.url in said and "linear=none" in said
    metrics = await (await client.get("/metrics")).text()
    assert "pd_router_unpaired_workers 1.0" in metrics


async def test_no_decode_worker_on_the_format_is_a_clear_503_and_p_is_never_asked(stub, router):
    p = await stub("prefill", runtime_format=INT4)
    d = await stub("decode", runtime_format=NONE)
    client = await router(prefill=[p], decode=[d])
    reg = registry_of(client)
    await wait_for(lambda: len(reg.decode.healthy) == 1 and len(reg.prefill.healthy) == 1)
    resp = await client.post("/v1/completions", json=COMPLETION)
    assert resp.status == 503
    error = (await resp.json())["error"]
    assert error["code"] == "no_paired_worker" and "linear=none" in error["message"]
    assert p.requests == [] and d.requests == []  # nothing prefilled for nobody
    metrics = await (await client.get("/metrics")).text()
    assert "pd_router_unpaired_refusals_total 1.0" in metrics
    # D comes back on P's format: paired again
    d.runtime_format = INT4
    await wait_for(lambda: reg.decode.workers[d.url].runtime_format == INT4)
    resp = await client.post("/v1/completions", json=COMPLETION)
    assert resp.status == 200 and len(d.requests) == 1


async def test_a_decode_worker_that_left_ps_format_during_the_prefill_gets_nothing_and_p_is_released(
    stub, router
):
    p = await stub("prefill", runtime_format=INT4, delay=0.5)
    d = await stub("decode", runtime_format=INT4)
    client = await router(prefill=[p], decode=[d])
    reg = registry_of(client)
    await wait_for(lambda: len(reg.decode.healthy) == 1 and len(reg.prefill.healthy) == 1)
    request = asyncio.ensure_future(client.post("/v1/completions", json=COMPLETION))
    await wait_for(lambda: len(p.requests) == 1)  # P prefills now (it answers in 0.5 s)
    d.runtime_format = NONE  # D restarts on another format meanwhile
    await wait_for(lambda: reg.decode.workers[d.url].runtime_format == NONE)
    resp = await request
    assert resp.status == 503 and (await resp.json())["error"]["code"] == "no_paired_worker"
    assert d.requests == []  # never sent P's params
    await wait_for(lambda: len(p.released) == 1)  # P's pages released
    await asyncio.sleep(0.2)
    assert len(p.released) == 1 and p.released[0]["transfer_id"].startswith("cmpl-")  # once
