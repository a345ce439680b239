"""Prompt logprobs on the real model (fp32) through router + P + D and on one co-located worker:
lm-eval-harness's loglikelihood body (`echo: true, logprobs: 1, max_tokens: 0 or 1, temperature:
0`: P alone answers it), vLLM's `prompt_logprobs` with a decode on D (P carries them to D in
`kv_transfer_params`), streamed and not; the shapes lm-eval reads and values equal to the
co-located worker's. Every page is free on P and D after each scenario, and on the co-located
worker (a prompt-logprobs request skips the prefix cache's match, so repeats give all positions).
"""

from __future__ import annotations

import aiohttp
import openai
import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer

from pd.transfer import nixl_available
from pd.worker.api.server import make_app
from tests.e2e.conftest import assert_all_pages_free, make_worker, wait_idle
from tests.e2e.processes import wait_pages_free
from tests.e2e.test_pd import start_router

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not nixl_available(), reason="the KV pull needs a NIXL package"),
]

TOL = 1e-4  # fp32: chunk boundaries and batch shapes move the last bits only
TEXT = "Question: What is the capital of France?\nAnswer: Paris"
# lm-eval sends token ids (context + continuation), a batch of one.
IDS = [[17872, 42, 1812, 314, 260, 3575, 282, 4649, 47, 198, 21350, 42, 7042]]


@pytest.fixture(scope="module")
def pair(fp32_pair):
    return fp32_pair


@pytest.fixture
async def router(pair, aiohttp_server):
    url = await start_router(aiohttp_server, *pair)
    async with aiohttp.ClientSession() as http:
        yield url, http
        for worker_url in pair:
            await wait_pages_free(http, worker_url)


async def ask(http, url: str, body: dict, path: str = "/v1/completions") -> dict:
    resp = await http.post(f"{url}{path}", json=body)
    answer = await resp.json()
    assert resp.status == 200, answer
    return answer


async def collect(http, url: str, body: dict) -> dict:
    """A streamed completion put together as a client would: texts and logprob lists joined."""
    resp = await http.post(f"{url}/v1/completions", json={**body, "stream": True})
    assert resp.status == 200, await resp.text()
    choice: dict = {"text": "", "logprobs": None}
    async for line in resp.content:
        line = line.strip()
        if not line.startswith(b"data: {"):
            continue
        c = orjson.loads(line[6:])["choices"][0]
        choice["text"] += c["text"]
        if c.get("prompt_logprobs") is not None:
            assert "prompt_logprobs" not in choice, "prompt_logprobs came twice"
            choice["prompt_logprobs"] = c["prompt_logprobs"]
        if c["logprobs"]:
            lp = choice["logprobs"] = choice["logprobs"] or {k: [] for k in c["logprobs"]}
            for k, v in c["logprobs"].items():
                lp[k].extend(v)
        choice["finish_reason"] = c["finish_reason"] or choice.get("finish_reason")
    return choice


def assert_close(got: list, want: list) -> None:
    assert len(got) == len(want)
    worst = max(abs(a - b) for a, b in zip(got, want) if a is not None)
    print(f"max |logprob difference| = {worst:.2e}")
    assert worst < TOL and [a is None for a in got] == [b is None for b in want]


def assert_same_prompt_logprobs(got: list, want: list) -> None:
    assert len(got) == len(want) and got[0] is None and want[0] is None
    for g, w in zip(got[1:], want[1:]):
        assert list(g) == list(w)  # the prompt token first, then the same top k
        for key in g:
            assert abs(g[key]["logprob"] - w[key]["logprob"]) < TOL
            assert g[key]["decoded_token"] == w[key]["decoded_token"]


LM_EVAL = {"prompt": IDS, "echo": True, "logprobs": 1, "temperature": 0}


async def test_lm_eval_loglikelihood_through_pd_equals_colocated(router, client):
    url, http = router
    sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    n = len(IDS[0])
    for max_tokens in (0, 1):
        body = {**LM_EVAL, "max_tokens": max_tokens}
        both = (await (await client.post("/v1/completions", json=body)).json())["choices"][0]
        got = await sdk.completions.create(model="default", **body)  # P alone answers
        choice = got.choices[0]
        lp = choice.logprobs
        assert lp is not None and len(lp.token_logprobs) == n + max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(len(top) == 1 for top in lp.top_logprobs[1:])
        assert lp.text_offset == both["logprobs"]["text_offset"] and lp.text_offset[0] == 0
        assert choice.text == both["text"] and choice.text.startswith(TEXT)
        assert choice.finish_reason == "length" and got.usage.completion_tokens == max_tokens
        assert_close(lp.token_logprobs, both["logprobs"]["token_logprobs"])
        assert lp.tokens == both["logprobs"]["tokens"]
        # lm-eval's greedy check reads the top-1 alternatives: the same tokens.
        assert [list(t or {}) for t in lp.top_logprobs] == [
            list(t or {}) for t in both["logprobs"]["top_logprobs"]
        ]
        streamed = await collect(http, url, body)
        assert streamed["text"] == choice.text
        assert_close(streamed["logprobs"]["token_logprobs"], lp.token_logprobs)
        assert streamed["logprobs"]["text_offset"] == lp.text_offset
    await sdk.close()


async def test_prompt_logprobs_with_a_decode_on_d_equal_colocated(router, client):
    url, http = router
    body = {"prompt": TEXT, "prompt_logprobs": 3, "echo": True, "logprobs": 2,
            "max_tokens": 6, "temperature": 0, "ignore_eos": True}  # fmt: skip
    both = (await (await client.post("/v1/completions", json=body)).json())["choices"][0]
    for choice in (
        (await ask(http, url, body))["choices"][0],  # D's stream, collected by the router
        await collect(http, url, body),  # D's stream relayed
    ):
        assert choice["text"] == both["text"] and choice["text"].startswith(TEXT)
        lp, want = choice["logprobs"], both["logprobs"]
        assert len(lp["tokens"]) == len(want["tokens"]) == len(IDS[0]) + 6
        assert_close(lp["token_logprobs"], want["token_logprobs"])
        assert lp["text_offset"] == want["text_offset"] and lp["tokens"] == want["tokens"]
        assert_same_prompt_logprobs(choice["prompt_logprobs"], both["prompt_logprobs"])
        assert len(choice["prompt_logprobs"]) == len(IDS[0])
    # Chat: vLLM's prompt_logprobs at the top level of the answer, through P then D.
    chat = {"messages": [{"role": "user", "content": "Hi"}], "prompt_logprobs": 1,
            "max_tokens": 4, "temperature": 0}  # fmt: skip
    pd_chat = await ask(http, url, chat, "/v1/chat/completions")
    resp = await client.post("/v1/chat/completions", json=chat)
    both_chat = await resp.json()
    assert_same_prompt_logprobs(pd_chat["prompt_logprobs"], both_chat["prompt_logprobs"])
    assert pd_chat["usage"]["prompt_tokens"] == len(pd_chat["prompt_logprobs"])


async def test_chunked_prefill_and_repeats_give_the_colocated_values(client):
    """A worker prefilling 5 tokens a step, asked twice (the second time its prefix cache holds
    the prompt: not matched), answers what the co-located worker (one chunk) does."""
    chunked = make_worker(chunk_size=5)
    prompt = [IDS[0] * 3]  # 39 tokens: two full pages to cache
    body = {**LM_EVAL, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2}
    both = (await (await client.post("/v1/completions", json=body)).json())["choices"][0]
    async with TestClient(TestServer(make_app(chunked))) as c:
        for _ in range(2):
            answer = await (await c.post("/v1/completions", json=body)).json()
            choice = answer["choices"][0]
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert_close(choice["logprobs"]["token_logprobs"], both["logprobs"]["token_logprobs"])
            assert_same_prompt_logprobs(choice["prompt_logprobs"], both["prompt_logprobs"])
        # A plain request after them is served from the pages they cached.
        plain = {"prompt": prompt, "max_tokens": 1}
        answer = await (await c.post("/v1/completions", json=plain)).json()
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
        await wait_idle(chunked)
        assert_all_pages_free(chunked)


async def test_lm_eval_batches_of_prompts_through_pd_equal_colocated(router, client):
    url, http = router
    prompts = [IDS[0], IDS[0][:-1] + [20003]]
    body = {**LM_EVAL, "prompt": prompts, "max_tokens": 1}
    got = await ask(http, url, body)
    want = (await (await client.post("/v1/completions", json=body)).json())
    assert [c["index"] for c in got["choices"]] == [0, 1]
    for g, w, ids in zip(got["choices"], want["choices"], prompts):
        assert len(g["logprobs"]["token_logprobs"]) == len(ids) + 1
        assert_close(g["logprobs"]["token_logprobs"], w["logprobs"]["token_logprobs"])
