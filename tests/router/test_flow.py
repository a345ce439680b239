"""The PD flow of DESIGN.md §3 and the co-located flow, end to end through stub workers."""

from __future__ import annotations

import orjson

from tests.router.conftest import CHAT, COMPLETION, sse_events


async def pd_pair(stub, router, **kw):
    p = await stub("prefill")
    d = await stub("decode")
    return p, d, await router(prefill=[p], decode=[d], **kw)


async def test_pd_stream_relays_decode_sse(stub, router):
    p, d, client = await pd_pair(stub, router)
    body = {**COMPLETION, "stream": True, "kv_transfer_params": {"evil": 1}, "user": "u1"}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    raw = await resp.read()
    assert raw == d.sse(False)  # relayed byte for byte
    (p_body,) = p.requests
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False
    assert p_body["kv_transfer_params"] == {"do_remote_decode": True, "max_tokens": 8}
    (d_body,) = d.requests
    assert d_body["stream"] is True and d_body["max_tokens"] == 8 and d_body["user"] == "u1"
    assert d_body["kv_transfer_params"]["transfer_id"].startswith("cmpl-")  # P's, opaque
    assert "evil" not in d_body["kv_transfer_params"]


async def test_pd_no_stream_collects_one_json_answer(stub, router):
    p, d, client = await pd_pair(stub, router)
    resp = await client.post("/v1/completions", json=COMPLETION)
    assert resp.status == 200
    answer = await resp.json()
    assert answer["object"] == "text_completion"
    assert answer["choices"][0]["text"] == "xxxx"
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 4
    (d_body,) = d.requests
    assert d_body["stream"] is True and d_body["stream_options"] == {"include_usage": True}


async def test_pd_chat_stream_and_json(stub, router):
    p, d, client = await pd_pair(stub, router)
    resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    events = sse_events(await resp.read())
    assert events[-1] == b"[DONE]"
    assert orjson.loads(events[0])["choices"][0]["delta"]["role"] == "assistant"
    resp = await client.post("/v1/chat/completions", json={**CHAT, "max_completion_tokens": 3})
    answer = await resp.json()
    assert answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": "xxxx"}
    assert p.requests[1]["max_completion_tokens"] == 1 and p.requests[1]["max_tokens"] == 1
    assert d.requests[1]["max_completion_tokens"] == 3


async def test_final_prefill_answer_never_reaches_decode(stub, router):
    p, d, client = await pd_pair(stub, router)
    p.final = True  # EOS or a stop on the first token: no params
    resp = await client.post("/v1/completions", json=COMPLETION)
    answer = await resp.json()
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert "kv_transfer_params" not in answer
    resp = await client.post(
        "/v1/chat/completions",
        json={**CHAT, "stream": True, "stream_options": {"include_usage": True}},
    )
    events = [orjson.loads(e) for e in sse_events(await resp.read())[:-1]]
    assert events[0]["object"] == "chat.completion.chunk"
    assert events[0]["choices"][0]["delta"]["content"] == "x"
    assert events[0]["choices"][0]["finish_reason"] == "stop"
    assert events[-1]["usage"]["completion_tokens"] == 1
    assert d.requests == []


async def test_client_max_tokens_one_is_served_by_prefill_alone(stub, router):
    p, d, client = await pd_pair(stub, router)
    resp = await client.post(
        "/v1/completions", json={**COMPLETION, "max_tokens": 1, "stream": True}
    )
    events = sse_events(await resp.read())
    assert orjson.loads(events[0])["choices"][0]["text"] == "x"
    assert events[-1] == b"[DONE]"
    assert "kv_transfer_params" not in p.requests[0]  # P is not told to keep KV for D
    assert d.requests == []


async def test_colocated_workers_relay_stream_and_json(stub, router):
    w = await stub("both")
    client = await router(worker=[w])
    resp = await client.post("/v1/completions", json={**COMPLETION, "stream": True})
    assert await resp.read() == w.sse(False)
    resp = await client.post("/v1/chat/completions", json=CHAT)
    assert (await resp.json())["choices"][0]["message"]["content"] == "xxxx"
    assert all("kv_transfer_params" not in b for b in w.requests)
    # A client without a stream is served from a stream collected by the router, as in PD.
    assert [b["stream"] for b in w.requests] == [True, True]
    assert w.requests[1]["stream_options"] == {"include_usage": True}
    assert "stream_options" not in w.requests[0]


async def test_pd_preferred_and_colocated_when_a_pd_pool_is_empty(stub, router):
    p = await stub("prefill")
    w = await stub("both")
    client = await router(prefill=[p], worker=[w])  # no decode worker: co-located serves
    resp = await client.post("/v1/completions", json=COMPLETION)
    assert resp.status == 200
    assert len(w.requests) == 1 and p.requests == []


async def test_models_lists_what_workers_serve(stub, router):
    p, d, client = await pd_pair(stub, router)
    resp = await client.get("/v1/models")
    assert [m["id"] for m in (await resp.json())["data"]] == ["stub-model"]
