"""A worker whose connection breaks before its first byte may have been crashed by the request:
the router checks the worker's /health at once; a dead worker is ejected and the request not
retried (502 `worker_died`); a live one is followed by one other worker at most, and a second
disconnect ends the request (502 `workers_disconnected`). Other failures retry as before."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from pd.router.proxy import is_disconnect
from tests.router.conftest import COMPLETION, registry_of, wait_for
from tests.router.test_cache_routing import metric
from tests.router.test_failures import idle

DISCONNECTS = "pd_router_disconnects_total"
# "local": decode-local prefill (D alone, then P and D when D fails before its first byte)
ROLES = ("prefill", "decode", "both", "local")


async def setup(stub, router, role: str, **victim):
    """Three workers of `role` (the victims, with the stub knobs `victim`), and what the other
    role needs to serve a request; the router over them (round-robin, --max-retries 2: every
    victim would be tried, as before)."""
    pool = pool_of(role)
    victims = [await stub(pool, **victim) for _ in range(3)]
    if role == "both":
        return victims, [], await router(worker=victims, policy="round-robin")
    others = [await stub("decode" if pool == "prefill" else "prefill")]
    cfg = {"local_prefill_max_tokens": 1 << 20} if role == "local" else {}
    prefill, decode = (victims, others) if pool == "prefill" else (others, victims)
    client = await router(prefill=prefill, decode=decode, policy="round-robin", **cfg)
    return victims, others, client


def pool_of(role: str) -> str:
    return "decode" if role == "local" else role


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("role", ROLES)
async def test_a_disconnect_is_retried_on_one_other_worker_and_a_second_ends_it(
    stub, router, role, stream
):
    victims, others, client = await setup(stub, router, role, disconnect=True)
    resp = await client.post("/v1/completions", json={**COMPLETION, "stream": stream})
    assert resp.status == 502
    error = (await resp.json())["error"]
    assert error["type"] == "upstream_error" and error["code"] == "workers_disconnected"
    assert "disconnected two workers" in error["message"]
    seen = [len(v.requests) for v in victims]
    assert sorted(seen) == [0, 1, 1], seen  # one other worker, and never the third
    assert all(f"worker {v.url}" in error["message"] for v in victims if v.requests)
    registry = registry_of(client)
    assert all(w.healthy for w in registry)  # they answer /health: not ejected
    assert metric(client, DISCONNECTS, pool=pool_of(role), outcome="alive") == 2
    assert metric(client, DISCONNECTS, outcome="dead") == 0
    if role == "decode":  # each try of D had a prefill of its own, released when D failed
        (p,) = others
        assert len(p.requests) == 2
        await wait_for(lambda: len(p.released) == 2)
    if role == "local":  # D alone, then P and another D: P once
        assert len(others[0].requests) == 1
    await wait_for(lambda: idle(client))


@pytest.mark.parametrize("role", ["prefill", "decode", "both"])
async def test_a_disconnect_then_a_good_answer_serves_the_request(stub, router, role):
    victims, others, client = await setup(stub, router, role)
    victims[0].disconnect = True  # it never answers; the worker after it does
    for _ in range(3):
        resp = await client.post("/v1/completions", json=COMPLETION)
        assert resp.status == 200, await resp.text()
    n = len(victims[0].requests)
    assert n >= 1 and metric(client, DISCONNECTS, pool=role, outcome="alive") == n
    assert all(w.healthy for w in registry_of(client))
    await wait_for(lambda: idle(client))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("role", ROLES)
async def test_a_worker_that_disconnects_and_fails_its_health_check_is_not_retried(
    stub, router, role, stream
):
    victims, others, client = await setup(stub, router, role, disconnect=True, dies=True)
    resp = await client.post("/v1/completions", json={**COMPLETION, "stream": stream})
    assert resp.status == 502
    error = (await resp.json())["error"]
    assert error["type"] == "upstream_error" and error["code"] == "worker_died"
    assert "disconnected before answering" in error["message"]
    assert "failed a health check" in error["message"]
    assert "not retried" in error["message"]
    assert sum(len(v.requests) for v in victims) == 1  # no other worker saw it
    (dead,) = [v for v in victims if v.requests]
    assert dead.url in error["message"]
    pool = registry_of(client).pools[pool_of(role)]
    assert not pool.workers[dead.url].healthy  # ejected
    assert len(pool.healthy) == 2
    assert metric(client, DISCONNECTS, pool=pool_of(role), outcome="dead") == 1
    assert metric(client, DISCONNECTS, outcome="alive") == 0
    if role == "decode":
        (p,) = others
        assert len(p.requests) == 1
        await wait_for(lambda: len(p.released) == 1)
    if role == "local":  # D died: P is not tried either
        assert others[0].requests == []
    await wait_for(lambda: idle(client))


async def test_a_disconnect_after_another_failure_still_gets_one_more_try(stub, router):
    """P1 answers 503 (retried as before), P2 disconnects: one more P, P3, then no more."""
    p1 = await stub("prefill", fail_status=503)
    p2 = await stub("prefill", disconnect=True)
    p3 = await stub("prefill", fail_status=503)
    p4 = await stub("prefill")
    d = await stub("decode")
    client = await router(prefill=[p1, p2, p3, p4], decode=[d], policy="round-robin", max_retries=5)
    registry = registry_of(client)
    # round-robin from P1: the router's pool keeps the order the workers were given in
    assert [w.url for w in registry.prefill.healthy] == [p.url for p in (p1, p2, p3, p4)]
    resp = await client.post("/v1/completions", json=COMPLETION)
    assert resp.status == 503  # P3's answer: P4 was never tried
    assert [len(p.requests) for p in (p1, p2, p3, p4)] == [1, 1, 1, 0]
    assert d.requests == []
    await wait_for(lambda: idle(client))


def test_what_counts_as_a_disconnect():
    key: Any = type("Key", (), {"ssl": False, "host": "h", "port": 1})()
    info: Any = None
    yes = [
        aiohttp.ServerDisconnectedError(),
        aiohttp.ClientOSError(104, "Connection reset by peer"),
        aiohttp.ClientPayloadError("Response payload is not completed"),
        aiohttp.ClientConnectionResetError("Cannot write to closing transport"),
        aiohttp.ClientConnectionError("Connection lost: [Errno 104]"),
    ]
    no = [
        aiohttp.ClientConnectorError(key, OSError(111, "Connection refused")),  # never connected
        aiohttp.ServerTimeoutError("Timeout on reading data from socket"),
        aiohttp.ClientResponseError(info, (), status=400, message="Invalid response"),
        aiohttp.InvalidURL("nope"),
    ]
    assert [is_disconnect(e) for e in yes] == [True] * len(yes)
    assert [is_disconnect(e) for e in no] == [False] * len(no)
