"""Worker admin API, worker self-registration, client auth, bad input, metrics."""

from __future__ import annotations

import aiohttp

from pd.router import deregister_from_router, register_with_router
from pd.registration import RegistrationError
from tests.router.conftest import COMPLETION, registry_of, wait_for

ADMIN = {"Authorization": "Bearer admin-secret"}


async def test_admin_api_lists_adds_and_removes(stub, router):
    d = await stub("decode")
    p = await stub("prefill")
    client = await router(decode=[d], admin_token="admin-secret")
    assert (await client.get("/workers")).status == 401
    resp = await client.post("/workers", json={"url": p.url, "role": "prefill"}, headers=ADMIN)
    assert resp.status == 201
    assert (await resp.json())["worker"]["healthy"] is True
    listed = await (await client.get("/workers", headers=ADMIN)).json()
    assert {(w["url"], w["role"]) for w in listed["workers"]} == {
        (p.url, "prefill"),
        (d.url, "decode"),
    }
    # A loaded CI machine can time out the first probe of d; the next one admits it.
    await wait_for(lambda: registry_of(client).decode.workers[d.url].healthy, timeout=15.0)
    assert (await client.post("/v1/completions", json=COMPLETION)).status == 200
    assert len(p.requests) == 1
    resp = await client.delete("/workers", params={"url": p.url}, headers=ADMIN)
    assert resp.status == 200
    assert (await client.delete("/workers", params={"url": p.url}, headers=ADMIN)).status == 404
    assert (await client.post("/v1/completions", json=COMPLETION)).status == 503


async def test_admin_api_refuses_bad_tokens_and_bad_bodies(stub, router):
    client = await router(admin_token="admin-secret")
    wrong = {"Authorization": "Bearer nope"}
    resp = await client.post(
        "/workers", json={"url": "http://x:1", "role": "decode"}, headers=wrong
    )
    assert resp.status == 401 and (await resp.json())["error"]["code"] == "invalid_admin_token"
    resp = await client.post("/workers", json={"url": "http://x:1", "role": "chef"}, headers=ADMIN)
    assert resp.status == 400
    resp = await client.post("/workers", json={"url": "ftp://x", "role": "decode"}, headers=ADMIN)
    assert resp.status == 400


async def test_admin_api_is_read_only_without_a_token(router):
    client = await router()
    assert (await client.get("/workers")).status == 200
    resp = await client.post("/workers", json={"url": "http://x:1", "role": "decode"})
    assert resp.status == 403 and (await resp.json())["error"]["code"] == "admin_disabled"


async def test_worker_registers_and_deregisters_itself(stub, router):
    p = await stub("prefill")
    d = await stub("decode")
    client = await router(admin_token="admin-secret")
    base = str(client.make_url("")).rstrip("/")
    async with aiohttp.ClientSession() as session:
        answer = await register_with_router(base, p.url, "prefill", "admin-secret", session)
        assert answer["created"] is True and answer["worker"]["healthy"] is True
        again = await register_with_router(base, p.url, "prefill", "admin-secret", session)
        assert again["created"] is False
        await register_with_router(base, d.url, "decode", "admin-secret", session)
        assert (await client.post("/v1/completions", json=COMPLETION)).status == 200
        assert len(d.requests) == 1
        try:
            await register_with_router(base, d.url, "decode", "wrong", session)
            raise AssertionError("a wrong token must be refused")
        except RegistrationError as e:
            assert "401" in str(e)
        assert await deregister_from_router(base, d.url, "admin-secret", session) is True
        assert await deregister_from_router(base, d.url, "admin-secret", session) is False
    assert registry_of(client).find(d.url) is None


async def test_register_with_an_unreachable_router_raises(unused_tcp_port):
    async with aiohttp.ClientSession() as session:
        try:
            await register_with_router(
                f"http://127.0.0.1:{unused_tcp_port}",
                "http://w:1",
                "decode",
                None,
                session,
                timeout=1.0,
            )
            raise AssertionError("must raise")
        except RegistrationError as e:
            assert "cannot reach router" in str(e)


async def test_api_key_accepted_and_refused(stub, router):
    w = await stub("both")
    client = await router(worker=[w], api_key="sk-client")
    resp = await client.post("/v1/completions", json=COMPLETION)
    assert resp.status == 401
    assert (await resp.json())["error"]["code"] == "invalid_api_key"
    bad = await client.post(
        "/v1/completions", json=COMPLETION, headers={"Authorization": "Bearer sk-other"}
    )
    assert bad.status == 401
    assert (await client.get("/v1/models")).status == 401
    ok = await client.post(
        "/v1/completions", json=COMPLETION, headers={"Authorization": "Bearer sk-client"}
    )
    assert ok.status == 200
    assert "Authorization" not in w.headers[0]  # the client's key is not passed on
    assert (await client.get("/health")).status == 200  # probes need no key


async def test_worker_api_key_is_sent_to_workers(stub, router):
    w = await stub("both")
    client = await router(worker=[w], api_key="sk-client", worker_api_key="sk-worker")
    await client.post(
        "/v1/completions",
        json=COMPLETION,
        headers={"Authorization": "Bearer sk-client", "X-Request-Id": "r1"},
    )
    assert w.headers[0]["Authorization"] == "Bearer sk-worker"
    assert w.headers[0]["X-Request-Id"] == "r1"


async def test_bad_input_is_answered_by_the_router(stub, router):
    w = await stub("both")
    client = await router(worker=[w], max_body_bytes=4096)
    cases = [
        (b"{not json", 400, "invalid_json"),
        (b"[1, 2]", 400, "invalid_json"),
        (b'{"model": "m"}', 400, "missing_field"),
        (b'{"prompt": "hi", "max_tokens": -3}', 400, "invalid_value"),
        (b'{"prompt": "' + b"x" * 5000 + b'"}', 413, "request_too_large"),
    ]
    for raw, status, code in cases:
        resp = await client.post(
            "/v1/completions", data=raw, headers={"Content-Type": "application/json"}
        )
        assert resp.status == status, raw[:40]
        assert (await resp.json())["error"]["code"] == code
    resp = await client.post("/v1/chat/completions", json={"messages": []})
    assert resp.status == 400
    resp = await client.get("/v1/nothing")
    assert resp.status == 404 and "error" in await resp.json()
    resp = await client.get("/v1/completions")
    assert resp.status == 405 and "error" in await resp.json()
    assert w.requests == []


async def test_metrics_are_exposed(stub, router):
    p1 = await stub("prefill", fail_status=503, fail_times=1)
    d = await stub("decode")
    client = await router(prefill=[p1], decode=[d], decode_policy="round-robin")
    assert (await client.post("/v1/completions", json=COMPLETION)).status == 503
    assert (await client.post("/v1/completions", json={**COMPLETION, "stream": True})).status == 200
    await client.post("/v1/completions", data=b"{", headers={"Content-Type": "application/json"})
    text = (await (await client.get("/metrics")).read()).decode()
    for line in (
        'pd_router_requests_total{policy="load-aware/round-robin",route="pd",status="200"} 1.0',
        'pd_router_requests_total{policy="load-aware/round-robin",route="pd",status="503"} 1.0',
        'pd_router_requests_total{policy="none",route="none",status="400"} 1.0',
        'pd_router_ttft_seconds_count{route="pd"} 1.0',
        'pd_router_e2e_seconds_count{route="pd"} 2.0',
        "pd_router_prefill_seconds_count 1.0",
        f'pd_router_worker_inflight{{pool="prefill",worker="{p1.url}"}} 0.0',
        f'pd_router_worker_healthy{{pool="decode",worker="{d.url}"}} 1.0',
        'pd_router_retries_total{pool="prefill"} 0.0',
        'pd_router_ejections_total{pool="decode"} 0.0',
    ):
        assert line in text, line


async def test_retries_are_counted(stub, router):
    p1 = await stub("prefill", fail_status=503)
    p2 = await stub("prefill")
    d = await stub("decode")
    client = await router(prefill=[p1, p2], decode=[d], prefill_policy="round-robin")
    for _ in range(2):
        assert (await client.post("/v1/completions", json=COMPLETION)).status == 200
    text = (await (await client.get("/metrics")).read()).decode()
    assert 'pd_router_retries_total{pool="prefill"} 2.0' in text  # each went to p1 first
