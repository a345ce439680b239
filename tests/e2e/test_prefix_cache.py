"""The prefix cache on the real model (fp32): greedy answers with the cache on equal those with
it off, across hits, partial evictions, aborts and a page budget small enough to preempt.
Page accounting is checked after every scenario."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from pd.protocol import GenerationOptions
from pd.worker.build import Worker
from tests.admit import admit
from tests.e2e.conftest import make_worker

pytestmark = pytest.mark.slow
PAGE = 16


@pytest.fixture(scope="module")
def off() -> Worker:
    return make_worker(prefix_cache=False, kv_pages=256)


@pytest.fixture
async def on():
    worker = make_worker(kv_pages=256)
    worker.engine.start()
    yield worker
    await settle(worker)
    await worker.engine.stop()


async def settle(worker: Worker) -> None:
    for _ in range(500):
        if worker.engine.idle and not worker.engine.handles:
            break
        await asyncio.sleep(0.01)
    worker.check_integrity()
    cache = worker.engine.scheduler.cache
    assert cache.num_free == cache.num_total and cache.num_used == 0


async def run(worker: Worker, ids: list[int], max_tokens: int = 8) -> tuple[list[int], int]:
    """Greedy tokens of one request, and the prompt tokens its prefix cache served."""
    handle = worker.engine.add(admit(
        ids, GenerationOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ))
    out: list[int] = []
    while True:
        delta = await asyncio.wait_for(handle.queue.get(), 60)
        assert delta.error is None, delta.error
        out += delta.token_ids
        if delta.finish_reason:
            return out, handle.seq.num_cached_tokens or 0


async def reference(off: Worker, prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
    off.engine.start()
    try:
        return [(await run(off, p, max_tokens))[0] for p in prompts]
    finally:
        await settle(off)
        await off.engine.stop()


def ids(n: int, start: int) -> list[int]:
    return [(start + 7 * i) % 40000 + 100 for i in range(n)]


async def test_shared_prefix_mid_page_prefix_and_full_hit(on, off):
    shared = ids(40, 1)  # 2 full pages + 8 tokens
    a, b = shared + ids(10, 500), shared + ids(13, 900)
    mid = ids(24, 1) + ids(5, 3000)  # shares 24 tokens: 1 full page and half of the next
    want = await reference(off, [a, b, mid, a])
    got_a, cached_a = await run(on, a)
    got_b, cached_b = await run(on, b)
    got_mid, cached_mid = await run(on, mid)
    got_again, cached_again = await run(on, a)  # the same prompt again
    assert [got_a, got_b, got_mid, got_again] == want
    assert (cached_a, cached_b, cached_mid) == (0, 32, 16)
    assert cached_again == 48  # 50 tokens: 3 full pages; the last token is recomputed
    on.check_integrity()


async def test_a_full_hit_on_a_prompt_of_whole_pages(on, off):
    p = ids(48, 77)  # exactly 3 pages: the last one is recomputed into a page of its own
    want = await reference(off, [p, p])
    assert (await run(on, p))[0] == want[0]
    got, cached = await run(on, p)
    assert got == want[1] and cached == 32
    assert on.engine.scheduler.cache.num_cached >= 3


async def test_a_hit_after_part_of_the_chain_was_evicted(off):
    small = make_worker(kv_pages=12)  # 192 tokens of KV
    small.engine.start()
    try:
        a = ids(100, 5)  # 7 pages, 6 of them full and cached
        other = ids(120, 20000)  # needs 8 pages: evicts a's chain from its tail
        b = a[:96] + ids(10, 7000)
        want = await reference(off, [a, other, b])
        assert (await run(small, a))[0] == want[0]
        assert (await run(small, other))[0] == want[1]
        cache = small.engine.scheduler.cache
        kept, _ = cache.match(b, len(b) - 1)
        assert 0 < len(kept) < 6, "the test needs a partly evicted chain"
        got, cached = await run(small, b)
        assert got == want[2] and cached == len(kept) * PAGE
    finally:
        await settle(small)
        await small.engine.stop()


async def test_concurrent_shared_prefix_with_an_abort_mid_step(on, off):
    shared = ids(70, 11)
    prompts = [shared + ids(9, 100 * k) for k in range(4)]
    want = await reference(off, prompts, max_tokens=12)
    handles = [
        on.engine.add(admit(p, GenerationOptions(max_tokens=12, temperature=0.0, ignore_eos=True)))
        for p in prompts
    ]
    victim = handles[1]
    await asyncio.wait_for(victim.queue.get(), 60)  # it has its first token: decoding now
    on.engine.abort(victim)
    outs = {}
    for i, h in enumerate(handles):
        if h is victim:
            continue
        tokens = []
        while True:
            d = await asyncio.wait_for(h.queue.get(), 60)
            tokens += d.token_ids
            if d.finish_reason:
                break
        outs[i] = tokens
    assert outs == {i: want[i] for i in outs}
    on.check_integrity()


async def test_eviction_and_preemption_interleave_on_a_tiny_budget(off):
    tiny = make_worker(kv_pages=14, max_running_requests=8)  # 224 tokens for 6 requests
    tiny.engine.start()
    try:
        shared = ids(40, 3)
        prompts = [shared + ids(6 + k, 400 * k) for k in range(6)]
        want = await reference(off, prompts, max_tokens=20)
        results = await asyncio.gather(*(run(tiny, p, 20) for p in prompts))
        assert [r[0] for r in results] == want
        lines = tiny.metrics.render().decode().splitlines()
        preempted = [float(ln.split()[1]) for ln in lines if ln.startswith("pd_preemptions_total ")]
        assert preempted[0] > 0, "the budget should have forced preemptions"
        assert tiny.engine.scheduler.cache.hit_tokens > 0
    finally:
        await settle(tiny)
        await tiny.engine.stop()


async def test_http_usage_health_metrics_and_reset(client, worker):
    """cached_tokens in usage (JSON and SSE), kv_pages_cached in /health, the hit counters, and
    POST /reset_prefix_cache dropping what nobody holds."""
    prompt = [(31 * i) % 30000 + 200 for i in range(70)]
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0}
    first = await (await client.post("/v1/completions", json=body)).json()
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    resp = await client.post(
        "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    events = [e for e in (await resp.read()).split(b"\n\n") if e.startswith(b"data: {")]
    usage = orjson.loads(events[-1][6:])["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 64}
    health = await (await client.get("/health")).json()
    assert health["kv_pages_cached"] >= 4 and health["integrity"] == "ok"
    assert health["kv_pages_free"] == health["kv_pages_total"]  # evictable counts as free
    metrics = (await (await client.get("/metrics")).read()).decode()
    hits = [ln for ln in metrics.splitlines() if ln.startswith("pd_prefix_cache_hits_total ")]
    assert hits and float(hits[0].split()[1]) >= 64
    assert "pd_kv_pages_evictable " in metrics and "pd_prefix_cache_queries_total " in metrics
    reset = await (await client.post("/reset_prefix_cache")).json()
    assert reset["dropped_pages"] >= 4 and reset["kept_referenced_pages"] == 0
    assert (await (await client.get("/health")).json())["kv_pages_cached"] == 0
    again = await (await client.post("/v1/completions", json=body)).json()
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
