"""A worker with `--compile` serves through its compiled decode step: concurrent greedy requests
give the text of the same worker without it, every decode step of theirs runs the compiled
graph, and every page is free afterwards. A 3-layer cut of the default model (fp32) keeps the
warm-up to seconds; the full model's figures are in docs/BENCHMARKS.md."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from pd.worker.api.server import make_app
from pd.worker.build import Worker
from pd.worker.model.one_row import BackgroundCompile
from tests.e2e.conftest import assert_all_pages_free, chat, make_worker, wait_idle
from tests.e2e.test_worker_api import post
from tests.model_fixtures import default_checkpoint

ASKS = [
    chat("What is the capital of France?", temperature=0, max_tokens=12),
    chat("Name three colors.", temperature=0, max_tokens=20),
    chat("Count from one to ten.", temperature=0, max_tokens=16),
]


def three_layer_worker(**overrides) -> Worker:
    ckpt = default_checkpoint()
    cut = dataclasses.replace(ckpt, config=dataclasses.replace(ckpt.config, num_layers=3))
    return make_worker(ckpt=cut, **overrides)


async def answers(client, asks: list[dict] = ASKS) -> list[list[tuple[str, float]]]:
    """Per request (at once), its tokens with the gap between the two best logprobs at each."""

    async def ask(body: dict) -> list[tuple[str, float]]:
        status, out = await post(
            client, "/v1/chat/completions", {**body, "logprobs": True, "top_logprobs": 2}
        )
        assert status == 200, out
        content = out["choices"][0]["logprobs"]["content"]
        return [
            (t["token"], t["top_logprobs"][0]["logprob"] - t["top_logprobs"][1]["logprob"])
            for t in content
        ]

    return list(await asyncio.gather(*(ask(b) for b in asks)))


@pytest.mark.slow
async def test_a_compiled_worker_serves_the_eager_text(aiohttp_client):
    compiled_worker = three_layer_worker(compile=True)
    model = compiled_worker.engine.runner.model
    assert model.compiled_decode is not None
    calls = 0
    graph = model.compiled_decode

    def counting(*args):
        nonlocal calls
        calls += 1
        return graph(*args)

    model.compiled_decode = counting
    client = await aiohttp_client(make_app(compiled_worker))
    status, health = await post_get(client, "/health")
    assert status == 200 and health["compiled_decode"] is True
    compiled = await answers(client)
    await wait_idle(compiled_worker)
    assert_all_pages_free(compiled_worker)
    assert calls > 0

    eager_worker = three_layer_worker()
    eager = await answers(await aiohttp_client(make_app(eager_worker)))
    await wait_idle(eager_worker)
    assert_all_pages_free(eager_worker)
    for c, e in zip(compiled, eager):
        for (tc, _), (te, gap) in zip(c, e):
            if tc != te:  # fp32: compiled is within ~3e-4 of eager, so only a near-tie parts them
                assert gap < 1e-2, f"compiled and eager part at a clear choice: {c} vs {e}"
                break


async def post_get(client, path: str) -> tuple[int, dict]:
    resp = await client.get(path)
    return resp.status, await resp.json()


@pytest.mark.slow
async def test_a_background_compile_takes_over_one_row_steps(aiohttp_client, monkeypatch):
    """`--background-compile on`: the worker serves eagerly while its one-row step compiles,
    then one-stream decode steps run the compiled graph with the eager text, batches stay
    eager, and the scratch pages it warmed up on are none of the allocator's."""
    # The timing is the machine's: here the graph is installed whatever it measured.
    monkeypatch.setattr(BackgroundCompile, "_time", lambda self, compiled: (2.0, 1.0))
    worker = three_layer_worker(background_compile="on")
    runner = worker.engine.runner
    bg = runner.background_compile
    assert bg is not None
    assert bg.scratch.start >= worker.engine.scheduler.cache.num_total  # past every page handed out
    client = await aiohttp_client(make_app(worker))
    early = await answers(client)  # served whatever the compile's state
    assert await asyncio.to_thread(bg.done.wait, 900), "the background compile did not finish"
    status, health = await post_get(client, "/health")
    assert status == 200 and health["one_row_compile"]["state"] == "on", health["one_row_compile"]
    model = runner.model
    graph, calls = bg.compiled, []
    assert graph is not None and model.compiled_one_row is not None

    def strict(*args):  # served inputs the graph does not take would run eagerly: fail instead
        calls.append(args[0].shape[0])
        with torch.compiler.set_stance("fail_on_recompile"):
            return graph(*args)

    model.compiled_one_row = strict
    alone = [(await answers(client, [ask]))[0] for ask in ASKS]  # one stream: one-row steps
    assert calls and set(calls) == {1}
    together = await answers(client)  # three streams: their batched steps are eager
    await wait_idle(worker)
    assert_all_pages_free(worker)
    for compiled, eager in ((alone, early), (together, early)):
        for c, e in zip(compiled, eager):
            for (tc, _), (te, gap) in zip(c, e):
                if tc != te:
                    assert gap < 1e-2, f"compiled and eager part at a clear choice: {c} vs {e}"
                    break
