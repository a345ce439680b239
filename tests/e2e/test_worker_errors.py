"""Bad input, auth, a full queue: clear OpenAI-style 4xx/503 answers, and the worker stays up."""

from __future__ import annotations

import asyncio

import pytest

from pd.worker.api.server import make_app
from tests.e2e.conftest import assert_all_pages_free, chat, make_worker, wait_idle

pytestmark = pytest.mark.slow  # loads the real model

LONG = "word " * 3000  # longer than the test worker's 2048-token context

BAD_INPUT = [
    # (case, path, raw body, status, error code)
    ("malformed JSON", "/v1/chat/completions", b'{"messages": [', 400, "invalid_json"),
    ("not an object", "/v1/completions", b"[1, 2]", 400, "invalid_json"),
    ("missing messages", "/v1/chat/completions", b'{"max_tokens": 4}', 400, "missing_field"),
    ("missing prompt", "/v1/completions", b'{"max_tokens": 4}', 400, "missing_field"),
    (
        "mistyped max_tokens",
        "/v1/completions",
        b'{"prompt": "hi", "max_tokens": "ten"}',
        400,
        "invalid_type",
    ),
    ("mistyped messages", "/v1/chat/completions", b'{"messages": "hello"}', 400, "invalid_value"),
    (
        "max_tokens < 1",
        "/v1/completions",
        b'{"prompt": "hi", "max_tokens": 0}',
        400,
        "invalid_value",
    ),
    (
        "prompt longer than the context",
        "/v1/completions",
        b'{"prompt": "' + LONG.encode() + b'", "max_tokens": 4}',
        400,
        "context_length_exceeded",
    ),
    (
        "unknown model",
        "/v1/completions",
        b'{"prompt": "hi", "model": "gpt-17"}',
        404,
        "model_not_found",
    ),
    ("n > 16", "/v1/completions", b'{"prompt": "hi", "n": 17}', 400, "invalid_value"),
    (
        "a field pd does not serve",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "hi"}], "use_beam_search": true}',
        400,
        "unsupported_parameter",
    ),
    ("an unknown field", "/v1/completions", b'{"prompt": "hi", "tempreture": 0}', 400,
     "unknown_parameter"),  # fmt: skip
    (
        "top_logprobs > 20",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 21}',
        400,
        "invalid_value",
    ),
    (
        "token id out of vocabulary",
        "/v1/completions",
        b'{"prompt": [1, 99999999]}',
        400,
        "invalid_value",
    ),
]


@pytest.mark.parametrize("case,path,raw,status,code", BAD_INPUT, ids=[c[0] for c in BAD_INPUT])
async def test_bad_input_is_a_clear_4xx(client, case, path, raw, status, code):
    resp = await client.post(path, data=raw, headers={"Content-Type": "application/json"})
    body = await resp.json()
    assert resp.status == status, body
    err = body["error"]
    assert err["message"] and err["type"] and err["code"] == code, err
    # The worker is still up and answers a good request.
    good = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert good.status == 200


async def test_api_key_is_required_when_set(aiohttp_client):
    worker = make_worker(api_key="sekret")
    client = await aiohttp_client(make_app(worker))
    resp = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert resp.status == 401
    assert (await resp.json())["error"]["type"] == "authentication_error"
    resp = await client.post(
        "/v1/completions",
        json={"prompt": "Hi", "max_tokens": 1},
        headers={"Authorization": "Bearer wrong"},
    )
    assert resp.status == 401
    resp = await client.post(
        "/v1/completions",
        json={"prompt": "Hi", "max_tokens": 1},
        headers={"Authorization": "Bearer sekret"},
    )
    assert resp.status == 200
    assert (await client.get("/health")).status == 200  # health stays open for routers
    # The full walk over the pages costs ~0.2 s at 500k pages: it is behind the key.
    assert (await client.get("/integrity")).status == 401
    walk = await client.get("/integrity", headers={"Authorization": "Bearer sekret"})
    assert walk.status == 200 and (await walk.json()) == {"integrity": "ok"}


async def test_a_full_queue_answers_503_with_retry_after(aiohttp_client):
    worker = make_worker(max_running_requests=1, max_waiting_requests=1)
    client = await aiohttp_client(make_app(worker), server_kwargs={"handler_cancellation": True})
    long = {"prompt": "Tell me everything.", "max_tokens": 400, "ignore_eos": True}
    first = asyncio.create_task(client.post("/v1/completions", json=long))
    while not worker.engine.scheduler.running:
        await asyncio.sleep(0.005)
    second = asyncio.create_task(client.post("/v1/completions", json=long))
    while not worker.engine.scheduler.waiting:
        await asyncio.sleep(0.005)
    resp = await client.post("/v1/completions", json=long)
    assert resp.status == 503
    assert resp.headers["Retry-After"] == "1"
    assert (await resp.json())["error"]["code"] == "queue_full"
    for task in (first, second):
        task.cancel()
    await asyncio.gather(first, second, return_exceptions=True)
    await wait_idle(worker)
    assert_all_pages_free(worker)


async def test_streaming_chat_through_the_openai_package(client):
    openai = pytest.importorskip("openai", reason="the OpenAI client is a test dependency")
    api = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused")
    stream = await api.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=30,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage:
            usage = chunk.usage
    await api.close()
    assert "Paris" in text
    assert usage is not None and usage.completion_tokens > 0


async def test_chat_template_and_options_errors_do_not_leak_pages(client, worker):
    resp = await client.post("/v1/chat/completions", json=chat("hi", temperature=5))
    assert resp.status == 400
    resp = await client.post("/v1/chat/completions", json=chat("hi", stop=[""]))
    assert resp.status == 400
    await wait_idle(worker)
    assert_all_pages_free(worker)


async def test_a_huge_prompt_is_refused_before_it_is_tokenized(client, worker, monkeypatch):
    # A 4 MiB prompt used to be tokenized on the event loop first (seconds without /health).
    encoded: list[int] = []
    real = worker.tokenizer.encode

    def counting(text: str, *args, **kwargs):
        encoded.append(len(text))
        return real(text, *args, **kwargs)

    monkeypatch.setattr(worker.tokenizer, "encode", counting)
    large, huge = "word " * ((1 << 20) // 5), "word " * ((4 << 20) // 5)
    for path, body, status, code in [
        ("/v1/completions", {"prompt": large, "max_tokens": 4}, 400, "context_length_exceeded"),
        ("/v1/chat/completions", chat(large, max_tokens=4), 400, "context_length_exceeded"),
        ("/v1/completions", {"prompt": [1] * 200_000}, 400, "context_length_exceeded"),
        # Larger than any body within the context (2048 tokens here): refused unparsed.
        ("/v1/completions", {"prompt": huge, "max_tokens": 4}, 413, "request_too_large"),
        ("/v1/completions", {"prompt": [1] * (1 << 20), "max_tokens": 4}, 413, "request_too_large"),
    ]:
        resp = await client.post(path, json=body)
        error = (await resp.json())["error"]
        assert resp.status == status and error["code"] == code, error
    assert encoded == []  # refused by its byte length alone
    resp = await client.post("/v1/completions", json={"prompt": "word " * 20_000, "max_tokens": 1})
    assert resp.status == 400 and encoded == [100_000]  # under the bound: tokenized, then refused
    health = await client.get("/health")
    assert health.status == 200
