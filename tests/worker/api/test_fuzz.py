"""Property-based: generated request bodies, valid and not, sent to a worker's HTTP app in
process (the real tokenizer, engine and scheduler; a stand-in model that samples fixed tokens).
Never a 5xx, every 4xx an OpenAI error object, every page free and accounted for after each."""

from __future__ import annotations

import asyncio
import functools

import pytest
from aiohttp.test_utils import TestClient, TestServer

from pd.config import WorkerConfig
from pd.kvcache.cache_manager import KVCacheManager
from pd.worker.api.server import make_app
from pd.worker.build import Worker
from pd.worker.checkpoint import default_model_path, load_tokenizer
from pd.worker.disagg import CoLocated
from pd.worker.engine import Engine, Scheduler
from pd.worker.metrics import WorkerMetrics
from pd.worker.model import SampleOutput
from tests.api_bodies import fuzz

pytestmark = pytest.mark.slow  # loads the default model's tokenizer

MAX_MODEL_LEN = 512


class Runner:
    """Stands in for the model: each sampled row gets "the" (or EOS now and then)."""

    def __init__(self, eos: int) -> None:
        self.eos = eos
        self.steps = 0

    def execute(self, batch) -> SampleOutput:
        out = SampleOutput([])
        for seq in batch.sampled:  # n > 1: the fork children riding on a row too
            self.steps += 1
            out.token_ids.append(self.eos if self.steps % 11 == 0 else 260)
            wants = seq.params.wants_logprobs
            out.logprobs.append(-0.25 if wants else None)
            top = [(260, -0.25), (261, -2.0)][: seq.params.top_logprobs]
            out.top_logprobs.append(top if wants else None)
        return out


@functools.cache
def tokenizer():
    return load_tokenizer(default_model_path())


def make_worker() -> Worker:
    tok = tokenizer()
    cfg = WorkerConfig(max_model_len=MAX_MODEL_LEN, served_model_name="stub-model")
    # Room for any request the fuzz may send (n up to 16 choices of 512 tokens each: a 400
    # otherwise, as choices count against the running batch and the KV cache).
    scheduler = Scheduler(KVCacheManager(640, 16), chunk_size=128, max_running=16)
    engine = Engine(
        Runner(min(tok.eos_token_ids)), scheduler, tok, 
        max_model_len=MAX_MODEL_LEN, max_waiting=64,
    )  # fmt: skip
    return Worker(
        cfg, tok, engine, WorkerMetrics(), "stub-model", role=CoLocated(engine),
        accepted_names=frozenset({"stub-model", "default"}),
    )  # fmt: skip


async def settle(worker: Worker) -> None:
    # Up to 30 s (it returns as soon as the engine is idle): a loaded 2-core machine runs a
    # body's 16 choices of up to 512 tokens slowly, and a request that never ends still fails.
    for _ in range(3000):
        if worker.engine.idle and not worker.engine.handles:
            break
        await asyncio.sleep(0.01)
    engine = worker.engine
    assert engine.idle and not engine.handles, (engine.load(), list(engine.handles))
    assert worker.engine.check_integrity() == "ok"
    cache = worker.engine.scheduler.cache
    assert cache.num_used == 0, cache


def test_generated_bodies_get_an_answer_or_a_clear_4xx():
    loop = asyncio.new_event_loop()
    worker = make_worker()
    client = TestClient(TestServer(make_app(worker)), loop=loop)
    loop.run_until_complete(client.start_server())
    try:
        seen = fuzz(loop, client, lambda: settle(worker))
    finally:
        loop.run_until_complete(client.close())
        loop.close()
    assert seen.get(200, 0) >= 5, seen  # a good share was served, not only refused
