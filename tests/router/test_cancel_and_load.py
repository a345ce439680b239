"""Client disconnects cancel upstream at once; load-aware routing and its accounting."""

from __future__ import annotations

import asyncio

from tests.router.conftest import COMPLETION, registry_of, wait_for


async def test_disconnect_during_decode_cancels_the_decode_request(stub, router):
    p = await stub("prefill")
    d = await stub("decode", chunks=100, chunk_delay=0.05)
    client = await router(prefill=[p], decode=[d])
    resp = await client.post("/v1/completions", json={**COMPLETION, "stream": True})
    assert resp.status == 200
    await resp.content.readany()  # the first chunk arrived
    resp.close()  # the client goes away
    await wait_for(lambda: d.cancelled == 1, timeout=1.0)
    await wait_for(lambda: all(w.inflight == 0 for w in registry_of(client)), timeout=1.0)
    assert d.completed == 0


async def test_disconnect_during_prefill_cancels_it_and_skips_decode(stub, router):
    p = await stub("prefill", delay=5.0)
    d = await stub("decode")
    client = await router(prefill=[p], decode=[d])
    task = asyncio.create_task(client.post("/v1/completions", json=COMPLETION))
    await wait_for(lambda: p.active == 1)
    assert registry_of(client).prefill.healthy[0].inflight == 1
    task.cancel()  # closes the client's connection
    await wait_for(lambda: p.cancelled == 1, timeout=1.0)
    await wait_for(
        lambda: all(w.inflight == 0 and w.inflight_tokens == 0 for w in registry_of(client)),
        timeout=1.0,
    )
    assert d.requests == []


async def test_load_aware_prefers_the_less_loaded_by_reported_load(stub, router):
    p = await stub("prefill")
    busy = await stub("decode")
    busy.load = {**busy.load, "running": 40, "kv_pages_free": 10}
    calm = await stub("decode")
    client = await router(prefill=[p], decode=[busy, calm], policy="load-aware")
    for _ in range(6):
        assert (await client.post("/v1/completions", json=COMPLETION)).status == 200
    assert len(calm.requests) == 6 and busy.requests == []


async def test_load_aware_counts_in_flight_and_releases_on_cancel(stub, router):
    p = await stub("prefill")
    d1 = await stub("decode", chunks=100, chunk_delay=0.05)
    d2 = await stub("decode", chunks=100, chunk_delay=0.05)
    client = await router(prefill=[p], decode=[d1, d2], policy="load-aware")
    reg = registry_of(client)
    first = await client.post("/v1/completions", json={**COMPLETION, "stream": True})
    await first.content.readany()
    held = d1 if d1.requests else d2
    other = d2 if held is d1 else d1
    assert reg.find(held.url).inflight == 1
    second = await client.post("/v1/completions", json={**COMPLETION, "stream": True})
    await second.content.readany()
    assert len(other.requests) == 1  # the idle one, not the one holding a stream
    first.close()
    second.close()
    await wait_for(lambda: all(w.inflight == 0 for w in reg))


async def test_load_aware_releases_on_error(stub, router):
    p = await stub("prefill")
    d1 = await stub("decode", fail_status=500)
    d2 = await stub("decode", fail_status=500)
    client = await router(prefill=[p], decode=[d1, d2], policy="load-aware")
    for _ in range(4):
        assert (await client.post("/v1/completions", json=COMPLETION)).status == 500
    assert all(w.inflight == 0 and w.inflight_tokens == 0 for w in registry_of(client))


async def test_sticky_room_maps_to_the_same_prefill_and_decode(stub, router):
    ps = [await stub("prefill") for _ in range(3)]
    ds = [await stub("decode") for _ in range(3)]
    client = await router(prefill=ps, decode=ds, policy="sticky-to-room")
    for room in ("a", "b", "c", "d"):
        for _ in range(3):
            resp = await client.post(
                "/v1/completions", json=COMPLETION, headers={"X-Room-Id": room}
            )
            assert resp.status == 200
        for pool in (ps, ds):  # one worker of each pool saw all three of this room
            assert sorted(len(s.requests) for s in pool)[-1] >= 3
        for s in ps + ds:
            s.requests.clear()
    # The body's `user` is a room key too.
    for _ in range(3):
        await client.post("/v1/completions", json={**COMPLETION, "user": "alice"})
    assert sorted(len(s.requests) for s in ps) == [0, 0, 3]
    assert sorted(len(s.requests) for s in ds) == [0, 0, 3]


async def test_sticky_prefill_with_load_aware_decode(stub, router):
    p = await stub("prefill")
    d = await stub("decode")
    client = await router(
        prefill=[p], decode=[d], prefill_policy="sticky-to-room", decode_policy="round-robin"
    )
    reg = registry_of(client)
    assert reg.prefill.policy.name == "sticky-to-room"
    assert reg.decode.policy.name == "round-robin"
    assert reg.both.policy.name == "load-aware"
