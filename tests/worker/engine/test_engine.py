"""The engine loop with a stand-in model: aborts during a step, hand-off failures, page accounting."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pd.kvcache.cache_manager import KVCacheManager
from pd.protocol import APIError, GenerationOptions
from pd.worker.engine import KVConnector
from pd.worker.engine.engine import Engine
from pd.worker.engine.scheduler import Scheduler
from pd.worker.model.sampler import SampleOutput
from tests.admit import admit

PAGE = 4


class SlowRunner:
    """Samples token 5 for every row, but only when the test lets the step finish."""

    def __init__(self) -> None:
        self.in_step = threading.Event()
        self.go = threading.Event()
        self.free_run = False  # once set, steps no longer wait for the test

    def execute(self, batch) -> SampleOutput:
        self.in_step.set()
        assert self.go.wait(10), "the test never let the step finish"
        if not self.free_run:
            self.go.clear()
        self.in_step.clear()
        n = sum(batch.sample)
        return SampleOutput([5] * n, [None] * n, [None] * n)


class Tok:
    eos_token_ids = frozenset({0})

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


def make_engine(num_pages: int = 16, connector=None) -> tuple[Engine, SlowRunner]:
    runner = SlowRunner()
    scheduler = Scheduler(KVCacheManager(num_pages, PAGE), chunk_size=64, max_running=8)
    engine = Engine(
        runner, scheduler, Tok(), max_model_len=64, max_waiting=8, connector=connector
    )
    return engine, runner


async def wait_in_step(runner: SlowRunner) -> None:
    while not runner.in_step.is_set():
        await asyncio.sleep(0.001)


async def test_abort_during_a_step_frees_pages_only_after_the_step():
    engine, runner = make_engine()
    engine.start()
    try:
        handle = engine.add(admit(list(range(10)), GenerationOptions(max_tokens=8)))
        await wait_in_step(runner)
        engine.abort(handle)  # the client left while the forward pass writes into its pages
        alloc = engine.scheduler.cache
        assert alloc.num_used == 3, "pages in use by the running step were freed"
        assert alloc.allocate(16 - 3) is not None and alloc.allocate(1) is None
        alloc.free(range(3, 16))
        runner.go.set()
        while alloc.num_used:
            await asyncio.sleep(0.001)
        assert handle.finished and handle.seq.finish_reason == "abort"
        assert handle.queue.empty()  # no token of the aborted step reaches the client
        engine.scheduler.check_integrity()
    finally:
        runner.go.set()
        await engine.stop()


async def test_a_failed_hand_off_is_an_error_answer_and_frees_the_pages():
    class BrokenHandOff(KVConnector):
        def request_finished(self, seq, reasons, firsts):
            engine.scheduler.lend(seq, "k")
            engine.scheduler.give_back("k")
            raise RuntimeError("no transfer manager")

    engine, runner = make_engine(connector=BrokenHandOff())
    engine.start()
    try:
        handle = engine.add(admit(list(range(6)), GenerationOptions(max_tokens=1)))
        await wait_in_step(runner)
        runner.go.set()
        delta = await asyncio.wait_for(handle.queue.get(), 5)
        assert delta.finish_reason == "error" and delta.error.status == 503
        assert "no transfer manager" in delta.error.message
        assert engine.scheduler.cache.num_used == 0
        engine.scheduler.check_integrity()
    finally:
        runner.go.set()
        await engine.stop()


async def test_stopping_fails_queued_requests_and_frees_everything():
    engine, runner = make_engine()
    engine.start()
    handle = engine.add(admit(list(range(6)), GenerationOptions(max_tokens=8)))
    await wait_in_step(runner)
    runner.free_run = True
    runner.go.set()
    await engine.stop()
    deltas = []
    while not handle.queue.empty():
        deltas.append(handle.queue.get_nowait())
    assert deltas and deltas[-1].finish_reason in ("error", "length")
    assert engine.scheduler.cache.num_used == 0
    engine.scheduler.check_integrity()


def test_integrity_reports_pages_nobody_holds():
    engine, _ = make_engine()
    assert engine.integrity() == "ok"
    leaked = engine.scheduler.cache.allocate(2)  # in use, but held by no request
    assert engine.integrity() == "error: requests and keys hold 0 references but 2 are counted"
    assert engine.check_integrity().startswith(
        "error: requests hold 0 references on 0 pages but 2 on 2 pages"
    )
    engine.scheduler.cache.free(leaked)
    # The cheap check passes again, and reports the last full walk's error until the next walk.
    assert engine.integrity().startswith("error: requests hold 0")
    assert engine.check_integrity() == "ok" and engine.integrity() == "ok"


def test_health_integrity_costs_no_walk_over_the_pages(monkeypatch):
    engine, _ = make_engine()
    walked = []
    monkeypatch.setattr(engine.scheduler.cache, "check_integrity", lambda *a: walked.append(1))
    assert engine.integrity() == "ok" and walked == []
    assert engine.check_integrity() == "ok" and walked == [1]


async def test_choices_count_against_the_running_and_waiting_limits():
    """n > --max-running-requests could never run: a 400 naming n. The waiting queue counts
    choices: 8 waiting choices fill it, one more request is a 503 queue_full."""
    engine, runner = make_engine(num_pages=64)
    engine.start()
    try:
        with pytest.raises(APIError) as e:
            engine.add(admit([1, 2, 3], GenerationOptions(max_tokens=2), n=9))
        assert e.value.status == 400 and e.value.param == "n"
        with pytest.raises(APIError) as e:  # 7 shared pages + 8 x 8 > 64
            engine.add(admit(list(range(30)), GenerationOptions(max_tokens=30), n=8))
        assert e.value.status == 400 and "8 choices" in e.value.message
        first = engine.add(admit([1, 2, 3], GenerationOptions(max_tokens=2), n=8))
        await wait_in_step(runner)  # running: 8 choices, the batch full
        waiting = [engine.add(admit([4, 5], GenerationOptions(max_tokens=2), n=4)) for _ in "ab"]
        with pytest.raises(APIError) as e:
            engine.add(admit([6], GenerationOptions(max_tokens=2)))
        assert e.value.status == 503 and e.value.code == "queue_full"
        for h in (first, *waiting):
            engine.abort(h)
    finally:
        runner.go.set()
        await engine.stop()
    engine.scheduler.check_integrity()
