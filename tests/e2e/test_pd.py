"""The disaggregated stack for real: a prefill and a decode worker process (real NIXL between them)
behind `pd-router`, against the co-located worker as the reference.

After every scenario both workers must hold no page and no transfer.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import orjson
import pytest

from pd.router import RouterConfig
from pd.router import make_app as make_router
from pd.signing import sign_params, unsigned
from pd.transfer import nixl_available
from tests.e2e.processes import CLUSTER_TOKEN, start_worker, start_workers, stop, wait_pages_free

TOKEN = CLUSTER_TOKEN.encode()

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not nixl_available(), reason="the KV pull needs a NIXL package"),
]

FLAGS = (
    "--dtype",
    "float32",
    "--quantization",
    "none",
    "--kv-pages",
    "128",
    "--max-model-len",
    "2048",
    "--lease-ttl-s",
    "5",
)


@pytest.fixture(scope="module")
def pair():
    (p, p_url), (d, d_url) = start_workers(
        ("--role", "prefill", *FLAGS), ("--role", "decode", *FLAGS)
    )
    try:
        yield p_url, d_url
    finally:
        for proc in (p, d):
            stop(proc)


async def start_router(aiohttp_server, p_url: str, d_url: str) -> str:
    """An in-process pd-router (test servers cancel handlers on disconnect) once it sees both."""
    # Decode-local prefill off: these scenarios test the transfer path.
    cfg = RouterConfig(
        port=0,
        prefill=(p_url,),
        decode=(d_url,),
        health_interval=0.2,
        local_prefill_max_tokens=0,
    )
    server = await aiohttp_server(make_router(cfg))
    url = str(server.make_url("")).rstrip("/")
    async with aiohttp.ClientSession() as http:
        deadline = time.monotonic() + 10
        while (await http.get(f"{url}/health")).status != 200:
            assert time.monotonic() < deadline, "the router never saw both workers healthy"
            await asyncio.sleep(0.05)
    return url


@pytest.fixture
async def router(pair, aiohttp_server):
    p_url, d_url = pair
    url = await start_router(aiohttp_server, p_url, d_url)
    async with aiohttp.ClientSession() as http:
        yield url, http
        for worker_url in pair:
            await wait_pages_free(http, worker_url)


async def ask(http, url: str, path: str, body: dict) -> dict:
    resp = await http.post(f"{url}{path}", json=body)
    answer = await resp.json()
    assert resp.status == 200, answer
    return answer


def chat(content: str, **kw) -> dict:
    return {"messages": [{"role": "user", "content": content}], **kw}


PROMPTS = ["What is the capital of France?", "Name three colors.", "Who wrote Hamlet?"]


def counts(usage: dict) -> dict:
    """Token counts of a usage (cached_tokens depends on what each worker saw before)."""
    return {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


SHARED = "A long shared preamble about rivers, mountains and the cities beside them. " * 6


async def half_cached_matches_colocated(http, url: str, client) -> None:
    """A prompt whose first half P has cached: same text as one worker, and usage says so."""
    first = {
        "prompt": SHARED + "Which river flows through Rome?",
        "max_tokens": 12,
        "temperature": 0,
    }
    second = {
        "prompt": SHARED + "Which river flows through Cairo?",
        "max_tokens": 12,
        "temperature": 0,
    }
    await ask(http, url, "/v1/completions", first)
    pd_answer = await ask(http, url, "/v1/completions", second)
    both = await (await client.post("/v1/completions", json=second)).json()
    assert pd_answer["choices"][0]["text"] == both["choices"][0]["text"]
    usage = pd_answer["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert 64 <= cached < usage["prompt_tokens"], usage  # P's hits, reported by D


async def test_greedy_answers_match_the_colocated_worker(router, client):
    url, http = router
    for prompt in PROMPTS:
        body = chat(prompt, temperature=0, max_tokens=24)
        pd_answer = await ask(http, url, "/v1/chat/completions", body)
        both = await (await client.post("/v1/chat/completions", json=body)).json()
        assert pd_answer["choices"][0]["message"] == both["choices"][0]["message"]
        assert counts(pd_answer["usage"]) == counts(both["usage"])
    assert (
        "Paris"
        in (
            await ask(
                http, url, "/v1/chat/completions", chat(PROMPTS[0], temperature=0, max_tokens=24)
            )
        )["choices"][0]["message"]["content"]
    )


async def test_seeded_sampling_gives_the_same_text_as_one_worker(router, client):
    url, http = router
    body = chat("Tell me a story about a dragon.", temperature=0.9, seed=7, max_tokens=24)
    pd_text = (await ask(http, url, "/v1/chat/completions", body))["choices"][0]["message"]
    both = await (await client.post("/v1/chat/completions", json=body)).json()
    assert pd_text == both["choices"][0]["message"]


async def test_streaming_through_the_pair(router, client):
    url, http = router
    body = {"prompt": "Count: one, two, three,", "max_tokens": 12, "temperature": 0}
    resp = await http.post(
        f"{url}/v1/completions",
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert resp.status == 200
    events = [ln[6:] for ln in (await resp.read()).split(b"\n\n") if ln.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    usage = counts(chunks[-1]["usage"])
    both = await (await client.post("/v1/completions", json=body)).json()
    assert text == both["choices"][0]["text"]
    assert usage == counts(both["usage"])


async def test_concurrent_requests_through_the_pair(router, client):
    url, http = router
    prompts = [
        "Say hello.",
        "What is 2 + 2?",
        "Name a fruit.",
        "Describe the sky.",
        "What is the largest ocean?",
        "Give me a color.",
    ]
    bodies = [chat(p, temperature=0, max_tokens=16) for p in prompts]
    answers = await asyncio.gather(*(ask(http, url, "/v1/chat/completions", b) for b in bodies))
    for body, answer in zip(bodies, answers):
        both = await (await client.post("/v1/chat/completions", json=body)).json()
        assert answer["choices"][0]["message"] == both["choices"][0]["message"]


async def test_client_disconnect_frees_pages_on_both_sides(router, pair):
    url, http = router
    resp = await http.post(
        f"{url}/v1/completions",
        json={
            "prompt": "Write a very long essay about rivers.",
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
        },
    )
    got = 0
    async for line in resp.content:
        got += line.startswith(b"data: ")
        if got >= 4:
            break
    resp.close()
    for worker_url in pair:
        await wait_pages_free(http, worker_url)


async def prefill_for_remote_decode(http: aiohttp.ClientSession, p_url: str) -> dict:
    """Ask P alone what the router asks it: prefill, first token, KV kept for a decode worker."""
    body = {
        "prompt": "Hello there",
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    return await (await http.post(f"{p_url}/v1/completions", json=body)).json()


async def test_decode_worker_refuses_bad_params_and_serves_plain_requests(pair):
    p_url, d_url = pair
    async with aiohttp.ClientSession() as http:
        # A plain request (no params) is prefilled on D itself: decode-local prefill.
        resp = await http.post(f"{d_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert resp.status == 200, await resp.text()
        # Real params from P, then tampered: a different model shape is refused before any pull.
        first = await prefill_for_remote_decode(http, p_url)
        params = first["kv_transfer_params"]
        assert params["do_remote_prefill"] and params["num_tokens"] == len(
            params["prompt_token_ids"]
        )
        for field, value in (("model_fingerprint", "0000"), ("page_size", 32), ("pd_version", 9)):
            # Changed, P's signature no longer holds: a 403 (pd/signing.py) ...
            changed = {**params, field: value}
            body = {"prompt": "x", "max_tokens": 4, "kv_transfer_params": changed}
            resp = await http.post(f"{d_url}/v1/completions", json=body)
            assert resp.status == 403, field
            # ... and signed again (as a P of another model would), D's own checks refuse it.
            resigned = sign_params(TOKEN, unsigned(changed))
            body = {"prompt": "x", "max_tokens": 4, "kv_transfer_params": resigned}
            resp = await http.post(f"{d_url}/v1/completions", json=body)
            assert resp.status == 400, field
        # The untampered params still work: D pulls and decodes.
        resp = await http.post(
            f"{d_url}/v1/completions",
            json={"prompt": "x", "max_tokens": 4, "kv_transfer_params": params},
        )
        assert resp.status == 200, await resp.text()
        # A prefill worker that is not there fails fast with a clear error.
        t0 = time.monotonic()
        resp = await http.post(
            f"{d_url}/v1/completions",
            json={
                "prompt": "x",
                "max_tokens": 4,
                "kv_transfer_params": sign_params(
                    TOKEN, unsigned({**params, "remote_port": 1, "transfer_id": "gone"})
                ),
            },
        )
        assert resp.status == 502
        assert time.monotonic() - t0 < 8
        for worker_url in pair:
            await wait_pages_free(http, worker_url)


async def test_pinned_pages_are_freed_when_decode_never_comes(pair):
    p_url, _ = pair
    async with aiohttp.ClientSession() as http:
        first = await prefill_for_remote_decode(http, p_url)
        load = (await (await http.get(f"{p_url}/health")).json())["load"]
        assert load["inflight_transfers"] == 1 and load["kv_pages_free"] < load["kv_pages_total"]
        assert first["kv_transfer_params"]["lease_ttl_s"] == 5.0
        # Nobody dials P for these pages (a decode worker would renew the lease): it runs out.
        await wait_pages_free(http, p_url, timeout=15)


async def test_heterogeneous_tp_prefill_tp1_to_decode_tp3(pair, client, aiohttp_server):
    """D with 3 ranks (one KV head each) pulls each rank's head slice from P's single rank."""
    p_url, _ = pair
    d3, d3_url = start_worker("--role", "decode", "--tp", "3", *FLAGS)
    try:
        url = await start_router(aiohttp_server, p_url, d3_url)
        async with aiohttp.ClientSession() as http:
            body = chat("Write a haiku about the sea.", temperature=0, max_tokens=32)
            pd_answer = await ask(http, url, "/v1/chat/completions", body)
            both = await (await client.post("/v1/chat/completions", json=body)).json()
            assert pd_answer["choices"][0]["message"] == both["choices"][0]["message"]
            await half_cached_matches_colocated(http, url, client)
            for worker_url in (p_url, d3_url):
                await wait_pages_free(http, worker_url)
    finally:
        stop(d3)


async def test_a_prompt_half_cached_on_prefill(router, client, pair):
    url, http = router
    await half_cached_matches_colocated(http, url, client)
    # D keeps the finished requests' KV (prompt and answer) for a follow-up turn.
    d_health = await (await http.get(f"{pair[1]}/health")).json()
    assert d_health["kv_pages_cached"] >= 6 and d_health["integrity"] == "ok"


async def test_logprobs_through_the_pair_match_one_worker(router, client):
    url, http = router
    body = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0, "logprobs": 3}
    pd_lp = (await ask(http, url, "/v1/completions", body))["choices"][0]["logprobs"]
    both = (await (await client.post("/v1/completions", json=body)).json())["choices"][0]
    assert pd_lp["tokens"] == both["logprobs"]["tokens"]  # token 0's come from P, the rest from D
    assert len(pd_lp["token_logprobs"]) == 6
    for ours, theirs in zip(pd_lp["token_logprobs"], both["logprobs"]["token_logprobs"]):
        assert abs(ours - theirs) < 1e-3
    assert [list(t) for t in pd_lp["top_logprobs"]] == [
        list(t) for t in both["logprobs"]["top_logprobs"]
    ]
