"""`--deterministic` end to end (issue 40 item 4): 32 greedy requests run one at a time on a
co-located worker, then all at once on it (their prompts now prefix-cache hits), then all at once
through router + P + D, where P prefills in chunks of another size; and one stream whose decode
worker is killed halfway (migrated). Every answer's token ids and logprobs (with the top
alternatives) are the same bits as the request's solo run."""

from __future__ import annotations

import asyncio
import signal

import aiohttp
import pytest

from pd.transfer import nixl_available
from tests.e2e.processes import start_workers, stop, wait_pages_free
from tests.e2e.test_migration_router import events, serving, start_router

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not nixl_available(), reason="the KV pull needs a NIXL package"),
]

# float32 int4 (the GGUF's own blocks, an int8 head): rows the same in any batch on both machine
# kinds; the worker checks that at start and refuses otherwise.
FLAGS = ("--deterministic", "--dtype", "float32", "--quantization", "int4", "--threads", "1",
         "--kv-pages", "320", "--max-model-len", "1024", "--max-running-requests", "32")  # fmt: skip
SUBJECTS = [
    "the sea", "a clock", "bread", "the moon", "a key", "winter", "a robot", "books",
    "rain", "a map", "mountains", "trains", "coffee", "a garden", "stars", "a river",
]  # fmt: skip
# 32 prompts of 6 to ~60 tokens: chunks of 16 (co-located) and 48 (P) cut them in other places
PROMPTS = [f"Here are some facts about {s}:" for s in SUBJECTS] + [
    f"{'Once upon a time, ' * (1 + i % 5)}there was {s}, and" for i, s in enumerate(SUBJECTS)
]
TOKENS = 10


@pytest.fixture(scope="module")
def deployment():
    """Co-located (chunks of 16), P (chunks of 48) and two decode workers: [(process, url)]."""
    procs = start_workers(
        ("--role", "both", "--chunk-size", "16", *FLAGS),
        ("--role", "prefill", "--chunk-size", "48", *FLAGS),
        ("--role", "decode", *FLAGS),
        ("--role", "decode", *FLAGS),
    )
    try:
        yield procs
    finally:
        for proc, _ in procs:
            stop(proc)


def _body(prompt: str, tokens: int = TOKENS, **kw) -> dict:
    return {"model": "default", "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "logprobs": 2, **kw}  # fmt: skip


async def _answer(http: aiohttp.ClientSession, url: str, prompt: str, **kw) -> dict:
    """The answer's logprobs: token ids' text, their logprobs and the top alternatives."""
    async with http.post(f"{url}/v1/completions", json=_body(prompt, **kw)) as resp:
        answer = await resp.json()
        assert resp.status == 200, answer
    lp = answer["choices"][0]["logprobs"]
    return {k: lp[k] for k in ("tokens", "token_logprobs", "top_logprobs")}


async def _streamed(http, url: str, prompt: str, tokens: int, at: int, then) -> dict:
    """The same fields, read from a stream; `then()` is awaited after `at` chunks."""
    got: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    chunks = 0
    async for obj in events(http, url, "/v1/completions", _body(prompt, tokens, stream=True)):
        for c in obj["choices"]:
            if c.get("logprobs"):
                for k in got:
                    got[k] += c["logprobs"][k]
                chunks += 1
                if chunks == at:
                    await then()
    return got


async def test_answers_are_the_same_bits_alone_among_31_through_pd_and_after_a_migration(
    deployment, aiohttp_server
):
    (_, both), (_, p), d1, d2 = deployment
    async with aiohttp.ClientSession() as http:
        health = [await (await http.get(f"{u}/health")).json() for _, u in deployment]
        assert all(h["runtime_format"] == health[0]["runtime_format"] for h in health), health
        assert health[0]["runtime_format"]["attention"].endswith("/uniform")

        solo = [await _answer(http, both, prompt) for prompt in PROMPTS]
        together = await asyncio.gather(*(_answer(http, both, prompt) for prompt in PROMPTS))
        differ = [i for i, (a, b) in enumerate(zip(solo, together)) if a != b]
        assert not differ, f"co-located, 32 at once (prefix-cache hits): {differ} differ"

        router = await start_router(aiohttp_server, p, [d1[1]])
        pd = await asyncio.gather(*(_answer(http, router, prompt) for prompt in PROMPTS))
        differ = [i for i, (a, b) in enumerate(zip(solo, pd)) if a != b]
        assert not differ, f"router + P + D, 32 at once: {differ} differ from the solo runs"

        # a stream whose decode worker dies at its 8th token goes on on the other one
        want = await _answer(http, both, PROMPTS[-1], tokens=24)
        router = await start_router(aiohttp_server, p, [d1[1], d2[1]])
        killed = []

        async def kill() -> None:
            proc, url = await serving(http, [d1, d2])
            proc.send_signal(signal.SIGKILL)
            killed.append(url)

        got = await _streamed(http, router, PROMPTS[-1], 24, 8, kill)
        assert killed and got == want, (got, want)
        for _, url in deployment:
            if url not in killed:
                await wait_pages_free(http, url)
