"""Overlap scheduling on the real model: the session's worker (overlap on, the default) gives the
same greedy text as one with `--no-overlap`, for concurrent requests that end by length, by EOS
and by stop strings; both end with every page free."""

from __future__ import annotations

import asyncio

import pytest

from pd.worker.api.server import make_app
from tests.e2e.conftest import assert_all_pages_free, chat, make_worker, wait_idle
from tests.e2e.test_worker_api import post

ASKS = [
    chat("What is the capital of France?", temperature=0, max_tokens=16),
    chat("Name three colors.", temperature=0, max_tokens=40),  # ends on EOS
    chat("Count from one to ten.", temperature=0, max_tokens=40, stop=[","]),
    chat("Tell me about the sea.", temperature=0, max_tokens=30, stop=["sea", "water"]),
    chat("Say hello in French.", temperature=0, max_tokens=8),
]


@pytest.fixture(scope="module")
def plain_worker():
    return make_worker(overlap=False)


async def answers(client) -> list[tuple[str, str]]:
    async def ask(body: dict) -> tuple[str, str]:
        status, out = await post(client, "/v1/chat/completions", body)
        assert status == 200, out
        choice = out["choices"][0]
        return choice["message"]["content"], choice["finish_reason"]

    return list(await asyncio.gather(*(ask(b) for b in ASKS)))


async def test_overlap_gives_the_no_overlap_greedy_text(
    client, worker, plain_worker, aiohttp_client
):
    assert worker.engine.overlap and not plain_worker.engine.overlap
    overlapped = await answers(client)
    plain_client = await aiohttp_client(make_app(plain_worker))
    plain = await answers(plain_client)
    await wait_idle(plain_worker)
    assert_all_pages_free(plain_worker)
    assert overlapped == plain
    reasons = [r for _, r in plain]
    assert "length" in reasons and "stop" in reasons, reasons
