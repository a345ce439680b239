"""The worker's OpenAI API on the real model: answers, batching, seeds, streaming, page accounting."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from pd.worker.api.server import make_app
from tests.e2e.conftest import assert_all_pages_free, chat, make_worker, wait_idle

pytestmark = pytest.mark.slow  # loads the real model


async def post(client, path: str, body: dict) -> tuple[int, dict]:
    resp = await client.post(path, json=body)
    return resp.status, await resp.json()


async def read_sse(resp) -> list[dict]:
    events = []
    async for line in resp.content:
        line = line.strip()
        if not line:
            continue
        assert line.startswith(b"data: "), line
        payload = line[len(b"data: ") :]
        if payload == b"[DONE]":
            events.append("[DONE]")
        else:
            events.append(orjson.loads(payload))
    return events


async def test_chat_answers_paris(client):
    status, body = await post(
        client,
        "/v1/chat/completions",
        chat("What is the capital of France?", temperature=0, max_tokens=30),
    )
    assert status == 200, body
    answer = body["choices"][0]["message"]["content"]
    print("answer:", answer)
    assert "Paris" in answer
    usage = body["usage"]
    assert usage["completion_tokens"] >= 1
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert body["object"] == "chat.completion" and body["choices"][0]["finish_reason"] in (
        "stop",
        "length",
    )


PROMPTS = [
    "Name three colors.",
    "What is 2 + 2?",
    "Write one sentence about the moon.",
    "List two fruits.",
    "Who wrote Hamlet?",
    "Say hello in French.",
    "What is the largest ocean?",
    "Give me a word that rhymes with cat.",
]


async def test_concurrent_requests_give_the_same_greedy_text_as_alone(client):
    async def ask(p: str) -> str:
        status, body = await post(
            client, "/v1/chat/completions", chat(p, temperature=0, max_tokens=24)
        )
        assert status == 200, body
        return body["choices"][0]["message"]["content"]

    alone = [await ask(p) for p in PROMPTS]
    together = await asyncio.gather(*(ask(p) for p in PROMPTS))
    assert together == alone


async def test_seeded_sampling_repeats(client):
    body = chat(
        "Tell me a story about a dragon.", temperature=1.0, top_p=0.9, seed=1234, max_tokens=24
    )
    first = (await post(client, "/v1/chat/completions", body))[1]["choices"][0]["message"]
    second = (await post(client, "/v1/chat/completions", body))[1]["choices"][0]["message"]
    other = (await post(client, "/v1/chat/completions", {**body, "seed": 99}))[1]
    assert first == second
    assert other["choices"][0]["message"] != first


async def test_completions_text_and_token_ids_prompts(client, worker):
    status, by_text = await post(
        client,
        "/v1/completions",
        {"prompt": "The capital of France is", "max_tokens": 5, "temperature": 0},
    )
    assert status == 200, by_text
    ids = worker.tokenizer.encode("The capital of France is")
    status, by_ids = await post(
        client, "/v1/completions", {"prompt": ids, "max_tokens": 5, "temperature": 0}
    )
    assert status == 200, by_ids
    assert by_text["choices"][0]["text"] == by_ids["choices"][0]["text"]
    assert by_text["object"] == "text_completion"
    assert by_text["usage"]["prompt_tokens"] == len(ids)


async def test_streaming_chat_with_usage(client):
    resp = await client.post(
        "/v1/chat/completions",
        json=chat(
            "Count from one to five.",
            temperature=0,
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
        ),
    )
    assert resp.status == 200 and resp.content_type == "text/event-stream"
    events = await read_sse(resp)
    assert events[-1] == "[DONE]"
    usage = events[-2]["usage"]
    assert events[-2]["choices"] == []
    chunks = events[:-2]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert usage["completion_tokens"] == len(chunks) - 1  # one chunk per token after the role
    status, plain = await post(
        client,
        "/v1/chat/completions",
        chat("Count from one to five.", temperature=0, max_tokens=20),
    )
    assert plain["choices"][0]["message"]["content"] == text


async def test_stop_strings_max_tokens_and_logprobs(client):
    status, body = await post(
        client,
        "/v1/completions",
        {
            "prompt": "1, 2, 3, 4, 5, 6,",
            "max_tokens": 30,
            "temperature": 0,
            "stop": [" 9"],
            "logprobs": 2,
        },
    )
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and " 9" not in choice["text"]
    assert "7" in choice["text"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == body["usage"]["completion_tokens"]
    assert all(len(t) == 2 for t in lp["top_logprobs"]) and all(
        x <= 0 for x in lp["token_logprobs"]
    )
    status, body = await post(
        client, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 3, "temperature": 0}
    )
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3


async def test_model_names_models_health_and_metrics(client, worker):
    for model in (worker.model_name, "default", None):
        body = {"prompt": "Hi", "max_tokens": 1}
        if model:
            body["model"] = model
        status, answer = await post(client, "/v1/completions", body)
        assert status == 200, answer
    models = await (await client.get("/v1/models")).json()
    assert models["data"][0]["id"] == "SmolLM2-135M-Instruct" == worker.model_name
    health = await (await client.get("/health")).json()
    assert health["role"] == "both" and health["model"] == worker.model_name
    assert health["integrity"] == "ok"
    for key in ("running", "waiting", "queued_prefill_tokens", "kv_pages_total", "kv_pages_free"):
        assert key in health["load"]
    text = await (await client.get("/metrics")).text()
    for name in (
        "pd_kv_pages_total",
        "pd_kv_pages_free",
        "pd_requests_running",
        "pd_requests_waiting",
        "pd_prompt_tokens_total",
        "pd_generation_tokens_total",
        "pd_time_to_first_token_seconds_bucket",
        "pd_inter_token_latency_seconds_bucket",
        # the model-server protocol's names, with vLLM's model_name label (issue 44)
        f'vllm:num_requests_waiting{{model_name="{worker.model_name}"}}',
        f'vllm:num_requests_running{{model_name="{worker.model_name}"}}',
        f'vllm:kv_cache_usage_perc{{model_name="{worker.model_name}"}}',
        "vllm:cache_config_info{",
    ):
        assert name in text, name


async def test_client_disconnect_mid_stream_frees_pages(client, worker):
    resp = await client.post(
        "/v1/completions",
        json={
            "prompt": "Write a very long essay about rivers.",
            "max_tokens": 500,
            "ignore_eos": True,
            "stream": True,
        },
    )
    assert resp.status == 200
    got = 0
    async for line in resp.content:
        if line.startswith(b"data: "):
            got += 1
        if got >= 3:
            break
    assert worker.engine.scheduler.cache.num_used > 0
    resp.close()  # the client goes away mid-stream
    await wait_idle(worker, timeout=10)
    assert_all_pages_free(worker)


async def test_client_disconnect_while_waiting_for_a_plain_answer(client, worker):
    task = asyncio.create_task(
        client.post(
            "/v1/completions",
            json={
                "prompt": "Write a very long essay about mountains.",
                "max_tokens": 500,
                "ignore_eos": True,
            },
        )
    )
    while worker.engine.scheduler.cache.num_used == 0:
        await asyncio.sleep(0.01)
    task.cancel()  # closes the connection before any answer
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_idle(worker, timeout=10)
    assert_all_pages_free(worker)


async def test_preemption_under_a_tiny_page_budget(aiohttp_client):
    # 8 pages of 16 tokens: four requests growing to 3 pages each cannot all stay resident.
    small = make_worker(kv_pages=8, page_size=16)
    client = await aiohttp_client(make_app(small))
    prompts = ["Describe a cat.", "Describe a dog.", "Describe a bird.", "Describe a fish."]

    async def ask(p: str) -> str:
        status, body = await post(
            client,
            "/v1/completions",
            {"prompt": p, "max_tokens": 40, "temperature": 0, "ignore_eos": True},
        )
        assert status == 200, body
        return body["choices"][0]["text"]

    alone = [await ask(p) for p in prompts]
    preemptions_before = small.metrics.preemptions._value.get()
    together = await asyncio.gather(*(ask(p) for p in prompts))
    assert small.metrics.preemptions._value.get() > preemptions_before, "nothing was preempted"
    assert together == alone
    await wait_idle(small)
    assert_all_pages_free(small)


async def test_health_answers_during_a_long_prefill(client, worker):
    task = asyncio.create_task(
        client.post("/v1/completions", json={"prompt": "word " * 1500, "max_tokens": 1})
    )
    while not worker.engine.scheduler.running:
        await asyncio.sleep(0.002)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    resp = await client.get("/health")
    answered_in = loop.time() - t0
    assert resp.status == 200
    assert not task.done(), "the prefill finished before /health was asked"
    resp = await task
    assert resp.status == 200
    print(f"/health answered in {answered_in * 1000:.1f} ms during a 1500-token prefill")


async def test_cache_salt_isolates_the_prefix_cache_and_its_hit_counts(client):
    prompt = "Tell me about salted caches. " * 8  # several pages, new to this worker

    async def cached(**body) -> int:
        status, answer = await post(
            client, "/v1/completions", {"prompt": prompt, "max_tokens": 1, **body}
        )
        assert status == 200, answer
        return answer["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert await cached(cache_salt="tenant-a") == 0
    assert await cached(cache_salt="tenant-b") == 0  # the same prompt, another tenant: no hit
    assert await cached() == 0  # nor unsalted requests
    assert await cached(cache_salt="tenant-a") > 0  # the same tenant hits its own pages
    status, body = await post(client, "/v1/completions", {"prompt": "x", "cache_salt": 7})
    assert status == 400 and body["error"]["param"] == "cache_salt"


async def test_logit_bias_min_tokens_allowed_ids_and_include_stop_are_served(client, worker):
    tok = worker.tokenizer
    the = tok.encode(" the")[0]
    status, body = await post(client, "/v1/completions", {
        "prompt": "Once upon a time", "max_tokens": 5, "temperature": 0,
        "logit_bias": {str(the): 100},
    })  # fmt: skip
    assert status == 200 and body["choices"][0]["text"] == " the" * 5, body
    eos = min(tok.eos_token_ids)
    status, body = await post(client, "/v1/completions", {
        "prompt": "Say nothing.", "max_tokens": 12, "temperature": 0, "min_tokens": 12,
        "logit_bias": {str(eos): 100},  # it would stop at once
    })  # fmt: skip
    assert status == 200 and body["usage"]["completion_tokens"] == 12, body
    allowed = tok.encode(" yes no maybe")
    status, body = await post(client, "/v1/completions", {
        "prompt": "Answer:", "max_tokens": 6, "temperature": 1.0, "seed": 3,
        "allowed_token_ids": allowed, "logprobs": 1,
    })  # fmt: skip
    lp = body["choices"][0]["logprobs"]
    assert status == 200 and set(tok.encode("".join(lp["tokens"]))) <= set(allowed), body
    status, body = await post(client, "/v1/completions", {
        "prompt": "Count: 1, 2, 3,", "max_tokens": 12, "temperature": 0, "stop": [" 5"],
        "include_stop_str_in_output": True,
    })  # fmt: skip
    assert status == 200 and body["choices"][0]["text"].endswith(" 5"), body
    status, body = await post(
        client, "/v1/completions", {"prompt": "x", "logit_bias": {"99999999": 1}}
    )
    assert status == 400 and body["error"]["param"] == "logit_bias"
