"""Routing that uses the caches, through stub workers: what the prefix index learns, decode-local
prefill at its threshold's edges and its fallback through P, cache-aware prefill routing, and
the metrics that show it."""

from __future__ import annotations

import asyncio

import orjson

from pd.protocol import parse_request
from pd.router.keys import METRICS
from pd.router.prefix_index import answer_bytes, prompt_bytes
from tests.router.conftest import registry_of, sse_events, wait_for

T = 32  # --local-prefill-max-tokens in these tests; the stub's usage counts 4 bytes a token


def completion(prompt: str, **kw) -> dict:
    return {"model": "stub-model", "prompt": prompt, "max_tokens": 4, **kw}


def kv_of(body: dict):
    return body.get("kv_transfer_params")


async def setup(stub, router, **kw):
    p = await stub("prefill")
    d = await stub("decode")
    client = await router(prefill=[p], decode=[d], **{"local_prefill_max_tokens": T, **kw})
    return p, d, client


def metric(client, name: str, **labels) -> float:
    """One sample of the router's /metrics, summed over the labels not given."""
    total = 0.0
    for family in client.server.app[METRICS].collect():
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


async def test_local_prefill_at_the_threshold_edges(stub, router):
    p, d, client = await setup(stub, router)
    # Nothing cached anywhere: a prompt of exactly T estimated tokens goes straight to D ...
    resp = await client.post("/v1/completions", json=completion("a" * (4 * T)))
    assert resp.status == 200 and (await resp.json())["choices"][0]["text"] == "xxxx"
    assert len(p.requests) == 0 and kv_of(d.requests[-1]) is None
    # ... one token more goes through P, then D with P's params.
    resp = await client.post("/v1/completions", json=completion("b" * (4 * T + 4)))
    assert resp.status == 200
    assert len(p.requests) == 1 and kv_of(d.requests[-1])["transfer_id"].startswith("cmpl-")
    assert metric(client, "pd_router_requests_total", route="local") == 1
    assert metric(client, "pd_router_requests_total", route="pd") == 1


async def test_a_conversations_next_turn_goes_local_once_d_holds_the_history(stub, router):
    p, d, client = await setup(stub, router)
    system = {"role": "system", "content": "S" * 2000}  # 500 estimated tokens: too many for D
    turn = [system, {"role": "user", "content": "first question"}]
    body = {"model": "stub-model", "messages": turn, "max_tokens": 4, "stream": True}
    resp = await client.post("/v1/chat/completions", json=body)
    events = sse_events(await resp.read())
    assert events[-1] == b"[DONE]"
    assert len(p.requests) == 1  # through P
    answer = "".join(
        (c.get("delta") or {}).get("content") or ""
        for e in events[:-1]
        for c in orjson.loads(e)["choices"]
    )
    assert answer == "xxxx"
    # D holds the first turn's prompt and its answer; the next turn adds a few tokens.
    reg = registry_of(client)
    assert reg.decode.index.blocks(d.url) > 0 and reg.prefill.index.blocks(p.url) > 0
    turn2 = [*turn, {"role": "assistant", "content": answer}, {"role": "user", "content": "more?"}]
    resp = await client.post("/v1/chat/completions", json={**body, "messages": turn2})
    assert resp.status == 200 and sse_events(await resp.read())[-1] == b"[DONE]"
    assert len(p.requests) == 1, "the second turn never reached P"
    assert kv_of(d.requests[-1]) is None and d.requests[-1]["messages"] == turn2
    # A turn whose new text is long goes through P again.
    turn3 = [
        *turn2,
        {"role": "assistant", "content": "xxxx"},
        {"role": "user", "content": "Q" * 400},
    ]
    resp = await client.post("/v1/chat/completions", json={**body, "messages": turn3})
    assert resp.status == 200
    await resp.read()
    assert len(p.requests) == 2
    # Off: every turn goes through P.
    p2, d2, off = await setup(stub, router, local_prefill_max_tokens=0)
    for messages in (turn, turn2):
        resp = await off.post("/v1/chat/completions", json={**body, "messages": messages})
        await resp.read()
    assert len(p2.requests) == 2 and all(kv_of(b) for b in d2.requests)


async def test_the_answer_is_learnt_before_the_client_sees_the_streams_end(stub, router):
    """A client sends its next turn as soon as it reads [DONE]: by then the router must know
    what D holds, even when D closes the body later."""
    p, d, client = await setup(stub, router)
    d.eof_delay = 0.5
    system = {"role": "system", "content": "S" * 2000}
    body = {
        "model": "stub-model",
        "messages": [system, {"role": "user", "content": "q"}],
        "max_tokens": 4,
        "stream": True,
    }
    resp = await client.post("/v1/chat/completions", json=body)
    async for line in resp.content:
        if line.strip() == b"data: [DONE]":
            break
    reg = registry_of(client)
    prompt = prompt_bytes(parse_request("/v1/chat/completions", body))
    assert reg.decode.index.blocks(d.url) == len(prompt + answer_bytes("xxxx", True)) // 64
    resp.close()


async def test_a_local_request_that_fails_before_its_first_byte_goes_through_p(stub, router):
    p, d, client = await setup(stub, router)
    d.fail_status, d.fail_times = 503, 1
    resp = await client.post("/v1/completions", json=completion("hi"))
    assert resp.status == 200 and (await resp.json())["choices"][0]["text"] == "xxxx"
    assert [kv_of(b) is None for b in d.requests] == [True, False]  # local, then with params
    assert len(p.requests) == 1
    assert metric(client, "pd_router_local_prefill_fallbacks_total") == 1
    assert metric(client, "pd_router_requests_total", route="pd", status="200") == 1
    # A decode worker that refuses plain requests (an older one: 400) is handled the same way.
    d.fail_status, d.fail_times = 400, 1
    resp = await client.post("/v1/completions", json=completion("hi", stream=True))
    assert resp.status == 200 and sse_events(await resp.read())[-1] == b"[DONE]"
    assert len(p.requests) == 2
    for w in registry_of(client):
        assert w.inflight == 0 and w.inflight_tokens == 0


async def test_the_index_forgets_a_worker_that_restarts_is_ejected_or_removed(stub, router):
    p, d, client = await setup(stub, router, local_prefill_max_tokens=0)
    reg = registry_of(client)
    long = completion("L" * 1000)
    assert (await client.post("/v1/completions", json=long)).status == 200
    assert reg.prefill.index.blocks(p.url) == 1000 // 64
    assert reg.decode.index.blocks(d.url) == len("L" * 1000 + "xxxx") // 64
    p.instance = "stub-2"  # restarted: its cache is empty
    await wait_for(lambda: reg.prefill.index.blocks(p.url) == 0)
    assert reg.decode.index.blocks(d.url) > 0
    assert (await client.post("/v1/completions", json=long)).status == 200
    assert reg.prefill.index.blocks(p.url) > 0
    p.health_status = 503  # ejected
    await wait_for(lambda: not reg.prefill.workers[p.url].healthy)
    assert reg.prefill.index.blocks(p.url) == 0
    reg.remove(d.url)
    assert reg.decode.index.blocks(d.url) == 0


async def test_cache_aware_keeps_each_conversation_on_the_prefill_worker_that_has_it(stub, router):
    ps = [await stub("prefill") for _ in range(2)]
    d = await stub("decode")
    client = await router(prefill=ps, decode=[d], policy="cache-aware")
    firsts = {}
    for c in range(6):
        prompt = f"conversation {c}: " + "context " * 100
        await (await client.post("/v1/completions", json=completion(prompt))).read()
        firsts[c] = next(p for p in ps if p.requests and p.requests[-1]["prompt"] == prompt)
    for c in range(6):
        prompt = f"conversation {c}: " + "context " * 100 + "and a follow-up"
        await (await client.post("/v1/completions", json=completion(prompt))).read()
        assert firsts[c].requests[-1]["prompt"] == prompt, c
    decisions = registry_of(client).prefill.policy.decisions
    assert decisions["cache_hit"] >= 6
    # What the index expected P to have cached, against what P said it had (the stub: 0).
    assert metric(client, "pd_router_cached_tokens_expected_total", pool="prefill") > 0
    assert metric(client, "pd_router_cached_tokens_actual_total", pool="prefill") == 0
    assert metric(client, "pd_router_policy_decisions_total", policy="cache-aware") >= 12
    assert metric(client, "pd_router_prefix_index_blocks", pool="prefill") > 0
    # Every choice of a prefill worker is timed (12 requests, one choice each).
    assert metric(client, "pd_router_route_decision_seconds_count", pool="prefill") == 12
    assert 0 < metric(client, "pd_router_route_decision_seconds_sum", pool="prefill") < 1


async def test_prefill_is_charged_the_tokens_it_is_expected_to_lack(stub, router):
    p = await stub("prefill", delay=0.3)
    d = await stub("decode")
    client = await router(prefill=[p], decode=[d])
    reg = registry_of(client)
    w = reg.prefill.workers[p.url]
    long = completion("C" * 4000)  # 1,000 estimated tokens
    charged = []

    async def watch():
        while not charged or charged[-1] == 0:
            charged.append(w.inflight_tokens)
            await asyncio.sleep(0.01)

    watcher = asyncio.create_task(watch())
    assert (await client.post("/v1/completions", json=long)).status == 200
    await asyncio.wait_for(watcher, 5)
    assert max(charged) >= 1000  # nothing cached: the whole prompt
    charged.clear()
    watcher = asyncio.create_task(watch())
    assert (await client.post("/v1/completions", json=long)).status == 200
    await asyncio.wait_for(watcher, 5)
    assert 0 < max(charged) <= 20  # all but the last partial block is expected on P
    assert w.inflight_tokens == 0
