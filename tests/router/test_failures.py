"""Retries before the first byte only; prefill failure never reaches decode; load released."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
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


async def test_a_decode_failure_before_first_byte_releases_p_and_reruns_p_then_d(stub, router):
    """D1's failure may have aborted P's transfer: the params are not sent twice."""
    p = await stub("prefill")
    d1 = await stub("decode", fail_status=503)
    d2 = await stub("decode")
    client = await router(prefill=[p], decode=[d1, d2], policy="round-robin")
    resp = await client.post("/v1/completions", json={**COMPLETION, "stream": True})
    assert sse_events(await resp.read())[-1] == b"[DONE]"
    assert len(p.requests) == 2  # prefilled again for D2
    first, second = (d.requests[0]["kv_transfer_params"] for d in (d1, d2))
    assert first["transfer_id"] != second["transfer_id"]
    await wait_for(lambda: len(p.released) == 1)
    assert p.released[0]["transfer_id"] == first["transfer_id"]
    assert "503" in p.released[0]["reason"]
    assert idle(client)


async def test_p_gets_the_clients_max_tokens_to_check_the_whole_request(stub, router):
    p = await stub("prefill")
    d = await stub("decode")
    client = await router(prefill=[p], decode=[d])
    resp = await client.post("/v1/completions", json={**COMPLETION, "max_tokens": 77})
    assert resp.status == 200
    assert p.requests[0]["max_tokens"] == 1
    assert p.requests[0]["kv_transfer_params"] == {"do_remote_decode": True, "max_tokens": 77}


async def test_a_decode_refusal_releases_p_and_is_not_retried(stub, router):
    p = await stub("prefill")
    d1 = await stub("decode", fail_status=400)  # e.g. the params do not match it
    d2 = await stub("decode")
    client = await router(prefill=[p], decode=[d1, d2], policy="round-robin")
    resp = await client.post("/v1/completions", json=COMPLETION)
    assert resp.status == 400
    await wait_for(lambda: len(p.released) == 1)
    assert p.released[0]["transfer_id"] == d1.requests[0]["kv_transfer_params"]["transfer_id"]
    assert d2.requests == [] and idle(client)


async def test_no_healthy_decode_worker_after_prefill_releases_p(stub, router):
    p = await stub("prefill")
    d = await stub("decode", fail_status=503)
    client = await router(prefill=[p], decode=[d])
    resp = await client.post("/v1/completions", json=COMPLETION)
    assert resp.status == 503
    # One try on the only D, then no other D to try: every prefilled transfer is released.
    await wait_for(lambda: len(p.released) == len(p.requests) >= 1)
    assert idle(client)


async def test_a_client_that_leaves_before_decode_answers_releases_p(stub, router):
    p = await stub("prefill")
    d = await stub("decode", delay=5.0)  # D is slow to answer
    client = await router(prefill=[p], decode=[d])
    with contextlib.suppress(asyncio.TimeoutError):
        await client.post("/v1/completions", json=COMPLETION, timeout=aiohttp.ClientTimeout(0.5))
    await wait_for(lambda: len(p.released) == 1, timeout=5)
    assert "client left" in p.released[0]["reason"]
    await wait_for(lambda: idle(client))


async def test_no_retry_after_the_first_byte_without_migration(stub, router):
    p = await stub("prefill")
    d1 = await stub("decode", break_after=2)  # crashes mid-stream
    d2 = await stub("decode")
    client = await router(
        prefill=[p], decode=[d1, d2], policy="round-robin", migration_limit=0
    )
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


async def test_decode_silence_past_the_idle_timeout_fails_without_migration(stub, router):
    p = await stub("prefill")
    d = await stub("decode", chunk_delay=2.0)
    client = await router(prefill=[p], decode=[d], stream_idle_timeout_s=0.2, migration_limit=0)
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


async def test_a_frozen_prefill_worker_misses_its_deadline_and_the_next_one_answers(stub, router):
    """The deadline is base + tokens in flight / min rate, not the 300 s --prefill-timeout."""
    frozen = await stub("prefill", delay=30.0)
    p2 = await stub("prefill")
    d = await stub("decode")
    client = await router(
        prefill=[frozen, p2], decode=[d], policy="round-robin",
        prefill_deadline_base=0.3, prefill_min_rate=1e6,
    )  # fmt: skip
    loop = asyncio.get_running_loop()
    for _ in range(2):  # whichever P comes first
        t0 = loop.time()
        resp = await client.post("/v1/completions", json=COMPLETION)
        assert resp.status == 200 and loop.time() - t0 < 3
    assert len(frozen.requests) >= 1 and len(p2.requests) == 2
    await wait_for(lambda: idle(client), timeout=5)


async def test_the_prefill_deadline_grows_with_the_prompt(stub, router):
    slow = await stub("prefill", delay=1.0)  # 1 s for a prompt of ~1,000 estimated tokens
    d = await stub("decode")
    long_prompt = {**COMPLETION, "prompt": "y" * 4000}
    client = await router(
        prefill=[slow], decode=[d], prefill_deadline_base=0.3, prefill_min_rate=500.0
    )
    resp = await client.post("/v1/completions", json=long_prompt)  # 0.3 + ~2 s: in time
    assert resp.status == 200
    resp = await client.post("/v1/completions", json=COMPLETION)  # 0.3 s: too short for 1 s
    assert resp.status == 504
    assert (await resp.json())["error"]["code"] == "prefill_timeout"


async def test_ejecting_a_prefill_worker_fails_its_in_flight_requests_at_once(stub, router):
    frozen = await stub("prefill", delay=30.0)
    d = await stub("decode")
    client = await router(prefill=[frozen], decode=[d], health_failures=2)
    loop = asyncio.get_running_loop()
    request = asyncio.ensure_future(client.post("/v1/completions", json=COMPLETION))
    await wait_for(lambda: frozen.active == 1)
    t0 = loop.time()
    frozen.health_status = 503  # its health checks fail: ejected after two (0.05 s apart)
    resp = await request
    assert loop.time() - t0 < 2  # not the prefill deadline (10 s)
    assert resp.status == 502
    assert "ejected" in (await resp.json())["error"]["message"]
    await wait_for(lambda: frozen.active == 0 and idle(client), timeout=5)


async def test_ejecting_a_decode_worker_ends_its_streams_with_an_error(stub, router):
    p = await stub("prefill")
    d = await stub("decode", chunks=50, chunk_delay=0.1)
    client = await router(prefill=[p], decode=[d], health_failures=2)
    resp = await client.post("/v1/completions", json={**COMPLETION, "stream": True})
    assert resp.status == 200
    await resp.content.readline()  # the stream is flowing: one event's line, and the blank one
    await resp.content.readline()
    d.health_status = 503
    raw = await asyncio.wait_for(resp.read(), 3)
    events = sse_events(raw)
    assert events, raw
    error = orjson.loads(events[-1])["error"]
    assert error["code"] == "stream_broken" and "ejected" in error["message"]
    await wait_for(lambda: idle(client), timeout=5)
