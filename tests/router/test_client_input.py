"""Nothing a client sends is a 5xx (issue: hardening, round two, item 5): JSON nested past 64
levels, in the body or in tool-call arguments of the history, is a 400 at the router (and at
the workers, which parse with the same functions); headers are compared and hashed as bytes, so
a non-UTF-8 `Authorization` is a 401 and a non-UTF-8 `X-Room-Id` is served."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from pd.protocol import MAX_JSON_DEPTH, APIError, json_too_deep, parse_json_body


def nested(depth: int) -> dict:
    """A chat body whose deepest container is at `depth` (the body itself is level 1)."""
    value: object = "x"
    for _ in range(depth - 1):
        value = [value]
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "metadata": value}


def test_json_depth_is_counted_and_bounded():
    assert not json_too_deep(orjson.dumps(nested(MAX_JSON_DEPTH)), nested(MAX_JSON_DEPTH))
    assert json_too_deep(orjson.dumps(nested(MAX_JSON_DEPTH + 1)), nested(MAX_JSON_DEPTH + 1))
    parse_json_body(orjson.dumps(nested(MAX_JSON_DEPTH)))
    for depth in (MAX_JSON_DEPTH + 1, 300, 1000, 5000):
        raw = b'{"a":' + b"[" * depth + b"]" * depth + b"}"
        with pytest.raises(APIError) as e:
            parse_json_body(raw)
        assert e.value.status == 400, depth
    # Many brackets, little depth: a long list of short lists is walked, not refused.
    wide = {"prompt": [[1, 2]] * 5000}
    assert not json_too_deep(orjson.dumps(wide), wide)
    assert not json_too_deep("[" * 200, "a string with brackets")


async def raw_request(port: int, head: bytes, body: bytes) -> tuple[int, bytes]:
    """Send bytes as they are (aiohttp's client would refuse non-UTF-8 header values)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
    await writer.drain()
    data = await reader.read()
    writer.close()
    status = int(data.split(b" ", 2)[1])
    return status, data.split(b"\r\n\r\n", 1)[1]


async def test_deep_bodies_and_odd_header_bytes_are_4xx_json_never_5xx(stub, router):
    d = await stub("decode")
    p = await stub("prefill")
    client = await router(prefill=[p], decode=[d], api_key="secret")
    auth = {"Authorization": "Bearer secret"}
    for depth in (MAX_JSON_DEPTH + 1, 255, 300, 1023):
        raw = b'{"messages":[{"role":"user","content":"hi"}],"metadata":%s}' % (
            b"[" * (depth - 1) + b"]" * (depth - 1)
        )
        resp = await client.post(
            "/v1/chat/completions", data=raw, headers={**auth, "Content-Type": "application/json"}
        )
        error = (await resp.json())["error"]
        assert resp.status == 400 and "deeper than 64" in error["message"], (depth, error)
    args = orjson.dumps(nested(100)).decode()
    history = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ],
        "max_tokens": 2,
    }  # fmt: skip
    resp = await client.post("/v1/chat/completions", json=history, headers=auth)
    error = (await resp.json())["error"]
    assert resp.status == 400 and "arguments' nests deeper than 64" in error["message"], error

    port = client.server.port
    body = orjson.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    status, answer = await raw_request(port, head + b"Authorization: Bearer \xff\xfe\x80\r\n", body)
    assert status == 401 and orjson.loads(answer)["error"]["code"] == "invalid_api_key"
    status, answer = await raw_request(
        port, head + b"Authorization: Bearer secret\r\nX-Room-Id: \xc3\x28\xff\r\n", body
    )
    assert status == 200, answer


async def test_a_post_body_must_be_json_and_a_bodyless_admin_post_works(stub, router):
    """415 for a form or text body (a browser's cross-site POST), at router and workers, as
    vLLM answers; a body-less POST such as /reset_prefix_cache needs no Content-Type."""
    d, p = await stub("decode"), await stub("prefill")
    client = await router(prefill=[p], decode=[d])
    body = b'{"prompt": "hi", "max_tokens": 2}'
    for kind in ("application/x-www-form-urlencoded", "text/plain", "multipart/form-data"):
        resp = await client.post("/v1/completions", data=body, headers={"Content-Type": kind})
        error = (await resp.json())["error"]
        assert resp.status == 415 and error["code"] == "unsupported_media_type", error
    resp = await client.post(
        "/v1/completions", data=body, headers={"Content-Type": "application/json; charset=utf-8"}
    )
    assert resp.status == 200
