"""The router's part of issue 19 (hardening): every body `parse_request` accepts is served or
refused with a 4xx; a prompt size limit of the router's own; what the router keeps per client
input is bounded in bytes; `cache_salt` isolates tenants in the prefix index; the index learns
only from answers that ended well, of workers still healthy in their pool; a failed
`/kv/release` shows."""

from __future__ import annotations

import asyncio
import logging
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pd.protocol import MAX_TOKEN_ID, parse_request
from pd.router import RouterConfig, policies
from pd.router import proxy as proxy_module
from pd.router.main import parse_config
from pd.router.policies import StickyToRoom
from pd.router.prefix_index import (
    INDEX_BLOCK_BYTES,
    PrefixIndex,
    PromptKey,
    answer_bytes,
    prompt_bytes,
)
from tests.router.conftest import COMPLETION, registry_of, sse_events, wait_for
from tests.router.test_cache_routing import metric
from tests.router.test_policies import rooms, workers

CHAT_PATH, COMPLETION_PATH = "/v1/chat/completions", "/v1/completions"


def chat(content: str, **kw) -> dict:
    return {"model": "stub-model", "messages": [{"role": "user", "content": content}], **kw}


def prompt_of(body: dict) -> bytes:
    return prompt_bytes(parse_request(CHAT_PATH if "messages" in body else COMPLETION_PATH, body))


# ------------------------------------------------------------------ 1. every valid body is served


@pytest.mark.parametrize("index_blocks", [1 << 16, 0])
async def test_a_one_token_prompt_is_served_and_a_token_id_beyond_int32_is_a_400(
    stub, router, index_blocks
):
    p, d, w = await stub("prefill"), await stub("decode"), await stub("both")
    pd_router = await router(prefill=[p], decode=[d], prefix_index_blocks=index_blocks)
    both_router = await router(worker=[w], prefix_index_blocks=index_blocks)
    for client in (pd_router, both_router):
        for prompt in ([123], [[123]], ["x"], [7, 8, 9], [MAX_TOKEN_ID]):
            resp = await client.post(COMPLETION_PATH, json={**COMPLETION, "prompt": prompt})
            assert resp.status == 200, (prompt, await resp.text())
        for prompt in ([2**32], [MAX_TOKEN_ID + 1], [[2**40]], [-1]):
            resp = await client.post(COMPLETION_PATH, json={**COMPLETION, "prompt": prompt})
            assert resp.status == 400, prompt
            error = (await resp.json())["error"]
            assert error["type"] == "invalid_request_error" and error["param"] == "prompt"


def test_prompt_bytes_reads_the_parsed_request():
    assert prompt_of({"prompt": [123]}) == (123).to_bytes(4, "little")
    assert prompt_of({"prompt": [[1, 2]]}) == prompt_of({"prompt": [1, 2]})
    assert prompt_of({"prompt": ["abc"]}) == prompt_of({"prompt": "abc"}) == b"abc"
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "h"}] * 2}]}
    assert prompt_of(parts) == prompt_of(chat("hh")) == b"user\nhh\0"
    assistant = {"messages": [{"role": "assistant", "content": None}]}
    assert prompt_of(assistant) == b"assistant\n\0"


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, MAX_TOKEN_ID), min_size=1, max_size=20))
def test_any_token_id_prompt_serializes_to_four_bytes_a_token(ids):
    assert len(prompt_of({"prompt": ids})) == 4 * len(ids)


# ------------------------------------------------------------------ 2. the router's prompt limit


async def test_a_prompt_over_the_routers_limit_is_a_400_before_any_routing(stub, router):
    w = await stub("both")
    client = await router(worker=[w], max_prompt_bytes=1000)
    # The limit is on the prompt's canonical bytes: text, "role\ncontent\0", 4 bytes a token id.
    at_limit = (
        {**COMPLETION, "prompt": "a" * 1000},
        chat("b" * 994),  # "user\n" + 994 + "\0"
        {**COMPLETION, "prompt": [5] * 250},
    )
    over = (
        ({**COMPLETION, "prompt": "a" * 1001}, "prompt"),
        (chat("b" * 995), "messages"),
        ({**COMPLETION, "prompt": [5] * 251}, "prompt"),
    )
    for body in at_limit:
        path = CHAT_PATH if "messages" in body else COMPLETION_PATH
        assert (await client.post(path, json=body)).status == 200
    for body, param in over:
        path = CHAT_PATH if "messages" in body else COMPLETION_PATH
        resp = await client.post(path, json=body)
        assert resp.status == 400
        error = (await resp.json())["error"]
        assert error["code"] == "prompt_too_large" and error["param"] == param
        assert "1000 bytes" in error["message"] and "--max-prompt-bytes" in error["message"]
    assert len(w.requests) == len(at_limit)  # nothing over the limit reached the worker
    # A body near --max-body-bytes is refused as cheaply, and before routing: no worker at all
    # is not a 503 for it.
    empty = await router(max_prompt_bytes=1000)
    resp = await empty.post(COMPLETION_PATH, json={**COMPLETION, "prompt": "z" * (7 << 20)})
    assert resp.status == 400 and (await resp.json())["error"]["code"] == "prompt_too_large"


def test_the_bounds_are_flags_and_help_states_them_in_bytes(capsys):
    cfg = parse_config([])
    assert cfg.max_prompt_bytes == 1 << 20 and cfg.max_prompt_bytes < cfg.max_body_bytes // 4
    cfg = parse_config(
        [
            "--max-prompt-bytes",
            "2048",
            "--sticky-room-table-bytes",
            "1000000",
            "--prefix-index-answer-bytes",
            "4096",
        ]
    )
    assert cfg.max_prompt_bytes == 2048
    assert cfg.sticky_room_table_bytes == 1_000_000 and cfg.prefix_index_answer_bytes == 4096
    with pytest.raises(ValueError):
        RouterConfig(max_prompt_bytes=0)
    with pytest.raises(SystemExit):
        parse_config(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in (
        "--max-prompt-bytes",
        "--sticky-room-table-bytes",
        "--prefix-index-answer-bytes",
        "--prefix-index-blocks",
    ):
        at = text.rindex(flag)  # its help (the usage line comes first)
        assert "bytes" in text[at + len(flag) : at + 400], flag
    assert "MiB" in text[text.rindex("--prefix-index-blocks") :][:400]


# ------------------------------------------------------------------ 3. bounded in bytes


def test_sticky_room_keys_are_kept_at_a_fixed_size_and_the_table_is_bounded_in_bytes():
    ws = workers(3)
    sticky = StickyToRoom()
    sticky.rebuild(ws)
    homes = {}
    tracemalloc.start()
    try:
        for i in range(50):  # 50 client-chosen keys of 1 MiB each
            key = f"{i}:" + "k" * (1 << 20)
            homes[i] = sticky.choose(ws, key)
            del key
        kept, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sticky.num_rooms == 50
    assert kept < 50 * 1024, kept  # fixed-size entries, not 50 MiB of keys
    # The whole key still decides the room.
    assert all(sticky.home_of(f"{i}:" + "k" * (1 << 20)) is homes[i] for i in range(50))
    assert sticky.home_of("0:" + "k" * ((1 << 20) - 1)) is None
    # The table's bound is in bytes.
    small = StickyToRoom(max_bytes=100 * policies.ROOM_BYTES)
    small.rebuild(ws)
    for k in rooms(500):
        small.choose(ws, k)
    assert small.num_rooms == 100 and small.home_of("room-499") is not None


def test_the_prefix_index_costs_its_blocks_whatever_the_prompt():
    index = PrefixIndex(max_blocks=1000)
    tracemalloc.start()
    try:
        for i in range(4):  # 1 MiB prompts: 16,384 blocks each, far over the bound
            index.insert("w", PromptKey.of(bytes([i]) * (1 << 20)).blocks)
        kept, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert index.blocks("w") == 1000
    # INDEX_BLOCK_BYTES (the figure --help gives) a block, twice over at most: a dict does not
    # shrink, and holds a new chain before the LRU cuts the oldest.
    assert kept < 2 * 1000 * INDEX_BLOCK_BYTES, kept


async def test_a_long_streamed_answer_is_not_kept_past_the_cap(stub, router, monkeypatch):
    w = await stub("both", chunks=200)  # ~30 KB of SSE
    client = await router(worker=[w], prefix_index_answer_bytes=4096)
    read: list[int] = []
    real = proxy_module.stream_text

    def spy(data: bytes):
        read.append(len(data))
        return real(data)

    monkeypatch.setattr(proxy_module, "stream_text", spy)
    index = registry_of(client).both.index
    body = chat("S" * 640, max_tokens=200, stream=True)
    events = sse_events(await (await client.post(CHAT_PATH, json=body)).read())
    assert events[-1] == b"[DONE]" and len(events) == 201
    assert read == []  # past the cap nothing is kept, and only the prompt is learnt
    assert index.blocks(w.url) == len(prompt_of(body)) // 64
    # A short answer, under the cap, is learnt with its prompt.
    w.chunks = 4
    body2 = chat("T" * 640, max_tokens=4, stream=True)
    events = sse_events(await (await client.post(CHAT_PATH, json=body2)).read())
    assert events[-1] == b"[DONE]" and len(read) == 1 and read[0] <= 4096
    learnt = len(prompt_of(body2) + answer_bytes("xxxx", True)) // 64
    assert index.blocks(w.url) == len(prompt_of(body)) // 64 + learnt


# ------------------------------------------------------------------ 4. cache_salt


async def test_requests_with_different_cache_salts_share_nothing_in_the_prefix_index(
    stub, router
):
    ps = [await stub("prefill") for _ in range(2)]
    d = await stub("decode")
    client = await router(prefill=ps, decode=[d], policy="cache-aware")
    reg = registry_of(client)
    decisions = reg.prefill.policy.decisions
    body = {**COMPLETION, "prompt": "shared system prompt " * 50}
    resp = await client.post(COMPLETION_PATH, json={**body, "cache_salt": "tenant-a"})
    assert resp.status == 200 and decisions == {"no_match": 1}
    data = prompt_of(body)
    for pool in (reg.prefill, reg.decode):
        (held,) = [w for w in pool.workers.values() if pool.index.blocks(w.url)]
        assert pool.expected_cached_bytes(held, PromptKey.of(data, "tenant-a")) > 0
        for salt in ("tenant-b", None):
            key = PromptKey.of(data, salt)
            assert all(pool.expected_cached_bytes(w, key) == 0 for w in pool.workers.values())
    # The same prompt under another salt (or none): no match, so no cache hit; the same salt hits.
    for salt, decision in (("tenant-b", "no_match"), (None, "no_match"), ("tenant-a", "cache_hit")):
        before = dict(decisions)
        extra = {"cache_salt": salt} if salt else {}
        assert (await client.post(COMPLETION_PATH, json={**body, **extra})).status == 200
        assert decisions.get(decision, 0) == before.get(decision, 0) + 1, salt
    # Workers get the salt in the body: their own caches keep tenants apart too.
    salts = ["tenant-a", "tenant-b", None, "tenant-a"]
    assert [b.get("cache_salt") for b in d.requests] == salts
    p_salts = [b.get("cache_salt") for p in ps for b in p.requests]
    assert sorted(map(str, p_salts)) == sorted(map(str, salts))


async def test_a_next_turn_under_another_cache_salt_is_not_decode_local(stub, router):
    p, d = await stub("prefill"), await stub("decode")
    client = await router(prefill=[p], decode=[d], local_prefill_max_tokens=32)
    system = {"role": "system", "content": "shared system prompt " * 50}  # ~250 tokens: via P
    turn1 = [system, {"role": "user", "content": "q"}]
    turn2 = [*turn1, {"role": "assistant", "content": "xxxx"}, {"role": "user", "content": "r"}]
    body = {"model": "stub-model", "max_tokens": 4, "stream": True}
    for messages, salt, via_p in (
        (turn1, "tenant-a", True),
        (turn2, "tenant-b", True),  # D holds tenant-a's turn 1: nothing of tenant-b's
        (turn2, "tenant-a", False),  # D holds all but the new user message: local
    ):
        before = len(p.requests)
        resp = await client.post(CHAT_PATH, json={**body, "messages": messages, "cache_salt": salt})
        assert sse_events(await resp.read())[-1] == b"[DONE]"
        assert len(p.requests) == before + via_p, salt
        assert d.requests[-1]["cache_salt"] == salt


# ------------------------------------------------------------------ 5. smaller defects


async def test_a_worker_removed_while_answering_is_not_relearnt_nor_inherited_on_re_add(
    stub, router
):
    p = await stub("prefill", delay=0.3)
    d = await stub("decode", chunk_delay=0.05)
    client = await router(prefill=[p], decode=[d])
    reg = registry_of(client)
    body = {**COMPLETION, "prompt": "L" * 1000, "stream": True}
    task = asyncio.create_task(client.post(COMPLETION_PATH, json=body))
    await wait_for(lambda: p.active == 1)
    reg.remove(p.url)  # P is prefilling: its answer comes after it left the pool
    await wait_for(lambda: d.active == 1)
    reg.remove(d.url)  # D is streaming: it finishes after it left the pool
    resp = await task
    assert sse_events(await resp.read())[-1] == b"[DONE]"  # in-flight requests finish
    assert reg.prefill.index.blocks(p.url) == 0 and reg.decode.index.blocks(d.url) == 0
    reg.add(p.url, "prefill")
    reg.add(d.url, "decode")
    assert reg.prefill.index.blocks(p.url) == 0 and reg.decode.index.blocks(d.url) == 0
    # An ejected worker's late answer is not recorded either.
    w = reg.decode.workers[d.url]
    await wait_for(lambda: w.healthy)
    reg.decode.set_healthy(w, False, "test")
    reg.decode.record(w, PromptKey.of(b"e" * 640).blocks)
    assert reg.decode.index.blocks(d.url) == 0


@pytest.mark.parametrize("path", [CHAT_PATH, COMPLETION_PATH])
async def test_a_stream_that_did_not_end_well_is_not_recorded_as_held(stub, router, path):
    p, d = await stub("prefill"), await stub("decode")
    client = await router(prefill=[p], decode=[d])
    index = registry_of(client).decode.index
    body = chat("L" * 1000) if path == CHAT_PATH else {**COMPLETION, "prompt": "L" * 1000}
    body = {**body, "max_tokens": 4, "stream": True}
    for failure in ({"error_after": 2}, {"send_done": False}, {"break_after": 2}):
        for name, value in failure.items():
            setattr(d, name, value)
        events = sse_events(await (await client.post(path, json=body)).read())
        # Without [DONE] but every token there: nothing to migrate, the router ends it; else
        # there is no other D to continue on.
        assert (events[-1] == b"[DONE]") == ("send_done" in failure), failure
        assert index.blocks(d.url) == 0, failure
        d.error_after, d.send_done, d.break_after = None, True, None
    events = sse_events(await (await client.post(path, json=body)).read())
    assert events[-1] == b"[DONE]" and index.blocks(d.url) > 0


async def test_a_failed_release_is_logged_and_counted(stub, router, caplog):
    p = await stub("prefill", release_status=500)
    d = await stub("decode", fail_status=400)  # D refuses: P is told to release
    client = await router(prefill=[p], decode=[d])
    with caplog.at_level(logging.WARNING, logger="pd.router"):
        assert (await client.post(COMPLETION_PATH, json=COMPLETION)).status == 400
        await wait_for(lambda: metric(client, "pd_router_prefill_release_failures_total") == 1)
    (tid,) = [r["transfer_id"] for r in p.released]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(tid in m and "500" in m for m in warnings), warnings
    p.release_status = 400
    assert (await client.post(COMPLETION_PATH, json=COMPLETION)).status == 400
    await wait_for(lambda: metric(client, "pd_router_prefill_release_failures_total") == 2)
    p.release_status = 200  # a good release is not a failure
    assert (await client.post(COMPLETION_PATH, json=COMPLETION)).status == 400
    await wait_for(lambda: len(p.released) == 3)
    await asyncio.sleep(0.05)
    assert metric(client, "pd_router_prefill_release_failures_total") == 2
    assert metric(client, "pd_router_prefill_releases_total") == 3
