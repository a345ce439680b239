"""Retries before the first byte only; prefill failure never reaches decode; load released."""

from __future__ import annotations

import orjson

from tests.router.conftest import COMPLETION, registry_of, sse_events, wait_for


def idle(client) -> bool:
    return all(w.inflight == 0 and w.inflight_tokens == 0 for w in registry_of(client))


async def test_prefill_retried_on_another_worker_before_first_byte(stub, router):
    p1 = await stub("prefill", fail_status=503)
    p2 = await stub("prefill")
    d = await stub("decode")
    client = await router(prefill=[p1, p2], decode=[d], policy="round-robin")
    for _ in range(2):  # whichever P round-robin starts with, the answer comes
        resp = await client.post("/v1/completions", json=COMPLETION)
        assert resp.status == 200
    assert len(p1.requests) == 2 and len(p2.requests) == 2
    assert len(d.requests) == 2
    assert idle(client)


async def test_decode_retried_before_first_byte_with_the_same_params(stub, router):
    p = await stub("prefill")
    d1 = await stub("decode", fail_status=503)
    d2 = await stub("decode")
    client = await router(prefill=[p], decode=[d1, d2], policy="round-robin")
    resp = await client.post("/v1/completions", json={**COMPLETION, "stream": True})
    assert sse_events(await resp.read())[-1] == b"[DONE]"
    assert len(p.requests) == 1  # P is not asked again
    assert d1.requests[0]["kv_transfer_params"] == d2.requests[0]["kv_transfer_params"]
    assert idle(client)


async def test_no_retry_after_the_first_byte(stub, router):
    p = await stub("prefill")
    d1 = await stub("decode", break_after=2)  # crashes mid-stream
    d2 = await stub("decode")
    client = await router(prefill=[p], decode=[d1, d2], policy="round-robin")
    resp = await client.post("/v1/completions", json={**COMPLETION, "stream": True})
    assert resp.status == 200
    events = sse_events(await resp.read())
    assert len(events) == 3  # two chunks, then the error, no [DONE]
    assert orjson.loads(events[-1])["error"]["code"] == "stream_broken"
    assert d2.requests == []
    assert idle(client)


async def test_decode_stream_break_without_client_stream_is_a_502(stub, router):
    p = await stub("prefill")
    d = await stub("decode", break_after=2)
    client = await router(prefill=[p], decode=[d])
    resp = await client.post("/v1/completions", json=COMPLETION)
    assert resp.status == 502
    assert (await resp.json())["error"]["code"] == "stream_broken"
    assert idle(client)


async def test_prefill_failure_never_reaches_decode(stub, router):
    p1 = await stub("prefill", fail_status=500)
    p2 = await stub("prefill", fail_status=500)
    d = await stub("decode")
    client = await router(prefill=[p1, p2], decode=[d], max_retries=5)
    resp = await client.post("/v1/completions", json=COMPLETION)
    assert resp.status == 500
    assert (await resp.json())["error"]["message"] == "stub failure"
    assert len(p1.requests) == 1 and len(p2.requests) == 1  # each tried once, no more
    assert d.requests == []
    assert idle(client)


async def test_client_error_from_prefill_is_passed_on_without_retry(stub, router):
    p1 = await stub("prefill", fail_status=400)
    p2 = await stub("prefill", fail_status=400)
    d = await stub("decode")
    client = await router(prefill=[p1, p2], decode=[d])
    resp = await client.post("/v1/completions", json=COMPLETION)
    assert resp.status == 400
    assert len(p1.requests) + len(p2.requests) == 1
    assert d.requests == []


async def test_unreachable_prefill_is_ejected_and_skipped(stub, router, unused_tcp_port):
    dead = f"http://127.0.0.1:{unused_tcp_port}"
    p = await stub("prefill")
    d = await stub("decode")
    client = await router(prefill=[p], decode=[d], policy="round-robin")
    registry = registry_of(client)
    w = registry.prefill.add(dead)  # added behind the checks' back, as if it just died
    w.healthy = True
    registry.prefill._refresh()
    for _ in range(3):
        resp = await client.post("/v1/completions", json=COMPLETION)
        assert resp.status == 200
    assert not w.healthy and w.ejections == 1
    assert len(p.requests) == 3


async def test_prefill_timeout_is_a_504(stub, router):
    p = await stub("prefill", delay=2.0)
    d = await stub("decode")
    client = await router(prefill=[p], decode=[d], prefill_timeout=0.2, max_retries=0)
    resp = await client.post("/v1/completions", json=COMPLETION)
    assert resp.status == 504
    assert (await resp.json())["error"]["code"] == "prefill_timeout"
    assert d.requests == []
    assert idle(client)


async def test_decode_silence_past_read_timeout_fails(stub, router):
    p = await stub("prefill")
    d = await stub("decode", chunk_delay=2.0)
    client = await router(prefill=[p], decode=[d], read_timeout=0.2)
    resp = await client.post("/v1/completions", json={**COMPLETION, "stream": True})
    events = sse_events(await resp.read())
    error = orjson.loads(events[-1])["error"]
    assert error["code"] == "stream_broken" and "silent" in error["message"]
    await wait_for(lambda: d.cancelled == 1)  # the silent worker was told
    assert idle(client)


async def test_decode_silent_before_its_first_byte_is_retried(stub, router):
    p = await stub("prefill")
    d1 = await stub("decode", delay=2.0)
    d2 = await stub("decode")
    client = await router(prefill=[p], decode=[d1, d2], policy="round-robin", read_timeout=0.2)
    for _ in range(2):
        resp = await client.post("/v1/completions", json=COMPLETION)
        assert resp.status == 200
    assert len(d1.requests) == 2 and len(d2.requests) == 2
    d2.fail_status = 500
    resp = await client.post("/v1/completions", json=COMPLETION)
    assert resp.status in (500, 504)  # the last failure is answered
    assert idle(client)


async def test_all_decode_busy_passes_503_and_retry_after(stub, router):
    p = await stub("prefill")
    d = await stub("decode", fail_status=503)
    client = await router(prefill=[p], decode=[d])
    resp = await client.post("/v1/completions", json=COMPLETION)
    assert resp.status == 503 and resp.headers["Retry-After"] == "1"
    assert idle(client)


async def test_decode_dying_after_headers_but_before_a_byte_is_retried(stub, router):
    p = await stub("prefill")
    d1 = await stub("decode", break_after=0)  # 200 and headers, then the connection drops
    d2 = await stub("decode")
    client = await router(prefill=[p], decode=[d1, d2], policy="round-robin")
    for _ in range(2):
        resp = await client.post("/v1/completions", json={**COMPLETION, "stream": True})
        assert sse_events(await resp.read())[-1] == b"[DONE]"
    assert len(d1.requests) == 2 and len(d2.requests) == 2
    assert idle(client)
