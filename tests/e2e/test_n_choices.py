"""`n` > 1 and lists of prompts for real: router + P + D processes, and a co-located worker, with
the openai SDK. After every scenario every worker holds no page and its accounting walks clean.
"""

from __future__ import annotations

import re

import aiohttp
import orjson
import pytest

from pd.router import RouterConfig
from pd.router import make_app as make_router
from pd.transfer import nixl_available
from tests.e2e.conftest import start_roles
from tests.e2e.processes import stop, wait_pages_free
from tests.e2e.test_pd import start_router

openai = pytest.importorskip("openai")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not nixl_available(), reason="the KV pull needs a NIXL package"),
]


@pytest.fixture(scope="module")
def workers(fp32_pair):
    """P, D (the session's pair) and a co-located worker."""
    [(proc, both)] = start_roles("both")
    try:
        yield (*fp32_pair, both)
    finally:
        stop(proc)


@pytest.fixture
async def urls(workers, aiohttp_server):
    """(PD router, co-located router) URLs; every worker is settled after the test."""
    p, d, both = workers
    pd_url = await start_router(aiohttp_server, p, d)
    cfg = RouterConfig(port=0, worker=(both,), health_interval=0.2)
    server = await aiohttp_server(make_router(cfg))
    both_url = str(server.make_url("")).rstrip("/")
    async with aiohttp.ClientSession() as http:
        while (await http.get(f"{both_url}/health")).status != 200:
            pass
        yield pd_url, both_url
        for w in workers:
            await wait_pages_free(http, w)


def sdk(url: str):
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


async def computed(http: aiohttp.ClientSession, worker: str) -> float:
    """Prompt tokens `worker` computed: prefix cache queries less hits (its /metrics)."""
    text = await (await http.get(f"{worker}/metrics")).text()

    def value(name: str) -> float:
        m = re.search(rf"^{name} (\S+)$", text, re.M)
        assert m, name
        return float(m.group(1))

    return value("pd_prefix_cache_queries_total") - value("pd_prefix_cache_hits_total")


MESSAGES = [{"role": "user", "content": "Name a color."}]


async def test_n4_gives_four_choices_stream_and_not(urls):
    seeded_texts = []
    for url in urls:
        client = sdk(url)
        greedy = await client.chat.completions.create(
            model="default", messages=MESSAGES, max_tokens=6, temperature=0, n=4
        )
        assert [c.index for c in greedy.choices] == [0, 1, 2, 3]
        assert len({c.message.content for c in greedy.choices}) == 1  # greedy: all alike
        one = await client.chat.completions.create(
            model="default", messages=MESSAGES, max_tokens=6, temperature=0
        )
        assert greedy.choices[0].message.content == one.choices[0].message.content
        assert greedy.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt once
        assert greedy.usage.completion_tokens == 4 * one.usage.completion_tokens
        stream = await client.chat.completions.create(
            model="default", messages=MESSAGES, max_tokens=6, temperature=1.0, seed=5, n=4,
            stream=True, stream_options={"include_usage": True},
        )  # fmt: skip
        texts, finished, usage = {}, {}, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
                if c.finish_reason is not None:
                    assert c.index not in finished, "a choice finished twice"
                    finished[c.index] = c.finish_reason
        assert sorted(finished) == [0, 1, 2, 3]
        assert usage is not None and usage.prompt_tokens == one.usage.prompt_tokens
        seeded = await client.chat.completions.create(
            model="default", messages=MESSAGES, max_tokens=6, temperature=1.0, seed=5, n=4
        )
        assert [c.message.content for c in seeded.choices] == [texts[i] for i in range(4)]
        seeded_texts.append(texts)
        await client.close()
    pd_texts, colocated_texts = seeded_texts
    assert pd_texts == colocated_texts  # seeded choices: the same through P + D as on one worker


async def test_n4_computes_the_prompt_once(urls, workers):
    p, _, both = workers
    pd_url, both_url = urls
    long = "The history of the river valley and its towns, told slowly. " * 20  # ~260 tokens
    async with aiohttp.ClientSession() as http:
        for url, worker in ((pd_url, p), (both_url, both)):
            cost = []
            for n, salt in ((1, "a"), (4, "b")):  # a salt each: no prefix hit between them
                before = await computed(http, worker)
                body = {"prompt": long, "max_tokens": 3, "n": n, "cache_salt": f"{url}{salt}"}
                resp = await http.post(f"{url}/v1/completions", json=body)
                answer = await resp.json()
                assert resp.status == 200 and len(answer["choices"]) == n, answer
                cost.append(await computed(http, worker) - before)
            assert cost[0] > 200 and cost[1] <= 1.5 * cost[0], (url, cost)


async def test_one_token_with_n3_is_answered_by_prefill_alone(urls):
    client = sdk(urls[0])
    out = await client.completions.create(
        model="default", prompt="Once upon a", max_tokens=1, n=3, temperature=1.0, seed=1
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert out.usage.completion_tokens == 3
    await client.close()


@pytest.mark.parametrize("kind", ["text", "ids"])
async def test_a_list_of_three_prompts_stream_and_not(urls, kind):
    texts = ["The sky is", "Two plus two is", "My favourite fruit is"]
    prompts = texts if kind == "text" else [[504, 3456, 314], [2095, 451], [1206, 12, 99, 42]]
    for url in urls:
        client = sdk(url)
        out = await client.completions.create(
            model="default", prompt=prompts, max_tokens=4, temperature=0, n=2
        )
        assert [c.index for c in out.choices] == list(range(6))
        singles = [
            (await client.completions.create(
                model="default", prompt=p, max_tokens=4, temperature=0)).choices[0].text
            for p in prompts
        ]  # fmt: skip
        assert [c.text for c in out.choices] == [t for t in singles for _ in range(2)]
        stream = await client.completions.create(
            model="default", prompt=prompts, max_tokens=4, temperature=0, stream=True
        )
        got: dict[int, str] = {}
        ends = set()
        async for chunk in stream:
            for c in chunk.choices:
                got[c.index] = got.get(c.index, "") + c.text
                if c.finish_reason is not None:
                    ends.add(c.index)
        assert ends == {0, 1, 2} and [got[i] for i in range(3)] == singles
        await client.close()


async def test_a_client_leaving_an_n4_stream_frees_every_choice(urls):
    for url in urls:
        async with aiohttp.ClientSession() as http:
            body = {"prompt": "Count slowly:", "max_tokens": 400, "n": 4, "stream": True,
                    "ignore_eos": True}  # fmt: skip
            resp = await http.post(f"{url}/v1/completions", json=body)
            assert resp.status == 200
            seen = set()
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    seen.update(c["index"] for c in orjson.loads(line[6:])["choices"])
                if len(seen) == 4:
                    break
            resp.close()  # gone mid-stream: the fixture checks every worker's pages
