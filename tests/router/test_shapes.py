"""The router keeps every field the workers send, on every route (PD, decode-local, co-located,
P's final answer), streamed or not: streams are relayed as they come, and where the router
converts (D's stream into one answer, P's answer into SSE) it merges generically.

Each shape is what a newer worker might add: the fields its stream's chunks carry
(`extra_chunk_fields`, the i-th into the i-th chunk) and what one answer of it holds (the same
fields merged: top-level, per choice, in the message), which is also the JSON answer it gives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
import pytest

from pd.bench.stub_worker import merged
from tests.router.conftest import CHAT, COMPLETION, sse_events


def each(n: int, fields: dict[str, Any]) -> list[dict[str, Any]]:
    return [fields] * n


def in_delta(*deltas: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"choices": [{"delta": d}]} for d in deltas]


def call(index: int, **fields: Any) -> dict[str, Any]:
    """A delta of the tool call at `index`."""
    return {"tool_calls": [{"index": index, **fields}]}


def completion_logprobs(positions: Sequence[int]) -> dict[str, Any]:
    return {
        "tokens": ["x" for _ in positions],
        "token_logprobs": [-i for i in positions],
        "top_logprobs": [{"x": -i} for i in positions],
        "text_offset": list(positions),
    }


TOP = {"system_fingerprint": "fp_1", "service_tier": "default", "pd_new": {"a": [1]}}
TOOL_CALLS = [
    {"id": "call_0", "type": "function", "function": {"name": "get", "arguments": '{"q": 1}'}},
    {"id": "call_1", "type": "function", "function": {"name": "put", "arguments": "{}"}},
]

# name: (endpoints, chunk extras, what one answer holds: {"top", "choice", "message"})
SHAPES: dict[str, tuple[tuple[str, ...], list[dict[str, Any]], dict[str, Any]]] = {
    "top-level fields": (("chat", "completion"), each(4, TOP), {"top": TOP}),
    "per-choice fields": (
        ("chat", "completion"),
        [
            *each(3, {"choices": [{"stop_reason": None}]}),
            {"choices": [{"stop_reason": "\n", "matched_stop": 13}]},
        ],
        {"choice": {"stop_reason": "\n", "matched_stop": 13}},
    ),
    "reasoning_content": (
        ("chat",),
        in_delta({"reasoning_content": "th"}, {"reasoning_content": "ink"}),
        {"message": {"reasoning_content": "think"}},
    ),
    "tool_calls": (
        ("chat",),
        in_delta(
            call(0, id="call_0", type="function", function={"name": "get", "arguments": ""}),
            call(0, function={"arguments": '{"q": '}),
            call(1, id="call_1", type="function", function={"name": "put", "arguments": "{}"}),
            call(0, function={"arguments": "1}"}),
        ),
        {"message": {"tool_calls": TOOL_CALLS}},
    ),
    "chat logprobs": (
        ("chat",),
        [
            {"choices": [{"logprobs": {"content": [{"token": "x", "logprob": -i}]}}]}
            for i in range(4)
        ],
        {"choice": {"logprobs": {"content": [{"token": "x", "logprob": -i} for i in range(4)]}}},
    ),
    "completion logprobs": (
        ("completion",),
        [{"choices": [{"logprobs": completion_logprobs([i])}]} for i in range(4)],
        {"choice": {"logprobs": completion_logprobs(range(4))}},
    ),
}
ROUTES = ("pd", "local", "both", "prefill-final")
CASES = [
    (shape, route, endpoint)
    for shape, (endpoints, _, _) in SHAPES.items()
    for route in ROUTES
    for endpoint in endpoints
]


def answer_fields(expect: dict[str, Any], chat: bool) -> dict[str, Any]:
    """What the worker's one JSON answer adds, in its own shape."""
    choice = dict(expect.get("choice", {}))
    if chat and "message" in expect:
        choice["message"] = expect["message"]
    return {**expect.get("top", {}), "choices": [choice]}


def with_index(message: dict[str, Any]) -> dict[str, Any]:
    """A message's fields as a stream's delta carries them: each tool call with its index."""
    calls = message.get("tool_calls")
    if calls is None:
        return message
    return {**message, "tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}


def holds(outer: dict[str, Any], inner: dict[str, Any]) -> bool:
    return all(k in outer and outer[k] == v for k, v in inner.items())


@pytest.mark.parametrize(("shape", "route", "endpoint"), CASES)
async def test_every_field_a_worker_sends_reaches_the_client(stub, router, shape, route, endpoint):
    _, chunk_fields, expect = SHAPES[shape]
    chat = endpoint == "chat"
    fields = {
        "extra_chunk_fields": chunk_fields,
        "extra_answer_fields": answer_fields(expect, chat),
    }
    if route == "both":
        worker = await stub("both", **fields)
        client = await router(worker=[worker])
    else:
        p = await stub("prefill", final=route == "prefill-final", **fields)
        worker = await stub("decode", **fields)
        local = 1024 if route == "local" else 0
        client = await router(prefill=[p], decode=[worker], local_prefill_max_tokens=local)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = CHAT if chat else COMPLETION

    # Streamed: relayed as the worker wrote it, or P's answer as the chunks of a stream.
    resp = await client.post(path, json={**body, "stream": True})
    assert resp.status == 200
    raw = await resp.read()
    if route != "prefill-final":
        assert raw == worker.sse(chat)
    else:
        first, *rest = (orjson.loads(e) for e in sse_events(raw)[:-1])
        assert rest == [] and holds(first, expect.get("top", {}))
        (choice,) = first["choices"]
        assert holds(choice, expect.get("choice", {}))
        assert holds(choice.get("delta", {}), with_index(expect.get("message", {})))

    # Not streamed: D's (or the worker's) stream merged into one answer, or P's answer as it is.
    resp = await client.post(path, json=body)
    assert resp.status == 200
    answer = await resp.json()
    (choice,) = answer["choices"]
    assert holds(answer, expect.get("top", {}))
    assert holds(choice, expect.get("choice", {}))
    if chat:
        assert holds(choice["message"], expect.get("message", {}))
        assert choice["message"]["role"] == "assistant"
    text = choice["message"]["content"] if chat else choice["text"]
    assert text == ("x" if route == "prefill-final" else "xxxx")
    assert answer["usage"]["completion_tokens"] == len(text)
    if route == "local":
        assert all("kv_transfer_params" not in b for b in worker.requests)
    elif route == "pd":
        assert all("kv_transfer_params" in b for b in worker.requests)


def test_the_stubs_merge_of_extra_fields():
    base = {"a": 1, "choices": [{"index": 0, "delta": {"content": "x"}}]}
    extra = {"b": 2, "choices": [{"delta": {"tool_calls": [1]}}, {"index": 1}]}
    assert merged(base, extra) == {
        "a": 1,
        "choices": [{"index": 0, "delta": {"content": "x", "tool_calls": [1]}}, {"index": 1}],
        "b": 2,
    }


async def test_a_stream_event_that_is_no_json_object_is_a_502_not_a_500(stub, router):
    w = await stub("both", extra_chunk_fields=[[1, 2]])  # `data: [1,2]`: JSON, but no object
    client = await router(worker=[w])
    resp = await client.post("/v1/completions", json=COMPLETION)
    assert resp.status == 502 and (await resp.json())["error"]["code"] == "bad_stream"
