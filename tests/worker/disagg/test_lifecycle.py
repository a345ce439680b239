"""A request's lifecycle through a real prefill side and a real decode side in one process (real
engines and schedulers, real transfer managers over the `fake` backend, a stand-in model), with
faults injected: every way a pull can end gives every page back on both sides, within seconds.

After each scenario both engines pass `check_integrity()` and hold no page.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import torch

from pd.kvcache.cache_manager import KVCacheManager
from pd.protocol import APIError, GenerationOptions
from pd.transfer import TransferConfig, create_manager
from pd.worker.disagg import DecodeSide, PrefillSide
from pd.worker.engine import Engine, RequestHandle, Scheduler
from pd.worker.metrics import WorkerMetrics
from pd.worker.model import ModelConfig, SampleOutput
from tests.admit import add_remote

PAGE = 4
CONFIG = ModelConfig("m", "llama", 64, 16, 32, 2, 2, 1, 8, 1e4, 1e-5, 128, True)
TOKEN = "lifecycle-test-token-0123456789"
# Heartbeats every 0.1 s: D gives a silent P up after 0.3 s, P a silent D after 0.4 s.
FAST = dict(heartbeat_interval_s=0.1, heartbeat_misses=3, handshake_timeout_s=2.0)
TOKENIZER = SimpleNamespace(eos_token_ids=frozenset({0}), decode=lambda *a, **k: "x", vocab_size=64)
PROMPT = list(range(1, 18))  # 17 tokens: 5 pages


class Runner:
    """Stands in for the ModelRunner: a KV buffer of its own and a step that samples token 7."""

    config = CONFIG
    page_size = PAGE
    dtype = torch.float32

    def __init__(self, num_pages: int) -> None:
        self.kv_pools = [SimpleNamespace(buffer=torch.zeros(num_pages, 2, 2, 1, PAGE, 8))]

    def execute(self, batch) -> SampleOutput:
        n = sum(batch.sample)
        return SampleOutput([7] * n, [None] * n, [None] * n)


class Pair:
    def __init__(self, d_pages: int, page_wait_s: float, quarantine_s: float, **d_cfg) -> None:
        p_sched = Scheduler(KVCacheManager(32, PAGE), chunk_size=64, max_running=8)
        p_mgr = create_manager(
            TransferConfig(backend="fake", cluster_token=TOKEN, default_lease_ttl_s=30, **FAST)
        )
        self.prefill = PrefillSide(p_mgr, Runner(32), p_sched, tp_size=1)
        self.p = Engine(
            Runner(32), p_sched, TOKENIZER, max_model_len=64, max_waiting=8,
            connector=self.prefill,
        )  # fmt: skip
        d_sched = Scheduler(KVCacheManager(d_pages, PAGE), chunk_size=64, max_running=8)
        self.d = Engine(
            Runner(d_pages), d_sched, TOKENIZER, max_model_len=64, max_waiting=8,
            metrics=WorkerMetrics(),
        )  # fmt: skip
        d_mgr = create_manager(
            TransferConfig(backend="fake", cluster_token=TOKEN, serve=False, **{**FAST, **d_cfg})
        )
        self.decode = DecodeSide(d_mgr, Runner(d_pages), self.d, quarantine_s, page_wait_s)
        self.decode.engine = self.d

    @property
    def d_backend(self):
        return self.decode.manager.backend

    async def start(self) -> None:
        # Each side registers its runner's buffer: the D runner above is the one pulled into.
        self.p.start()
        self.d.start()
        await self.prefill.start()
        await self.decode.start()

    async def stop(self) -> None:
        await self.decode.stop()
        await self.prefill.stop()
        await self.d.stop()
        await self.p.stop()

    async def prefilled(self) -> dict:
        """P prefills PROMPT for a decode worker; its kv_transfer_params."""
        h = add_remote(self.p, self.prefill, PROMPT, GenerationOptions(max_tokens=1))
        delta = await asyncio.wait_for(h.queue.get(), 5)
        assert delta.error is None and h.kv_transfer_params is not None
        self.p.abort(h)  # the HTTP handler's finally: a no-op once finished
        return h.kv_transfer_params

    async def decode_request(self, max_tokens: int = 3) -> RequestHandle:
        kvp = self.decode.validate(await self.prefilled())
        return await self.decode.admit(kvp, GenerationOptions(max_tokens=max_tokens))

    async def assert_settled(self) -> None:
        """Both sides hold nothing once the tasks that end a pull have run."""
        await until(lambda: self.p.idle and self.d.idle, 1.0, "both sides idle")
        for engine in (self.p, self.d):
            assert engine.integrity() == "ok"
            load = engine.load()
            assert load.kv_pages_free == load.kv_pages_total, load
            assert load.inflight_transfers == load.kv_pages_held == 0, load
            assert load.kv_pages_pinned == load.kv_pages_reserved == load.waiting_for_pages == 0


@pytest.fixture
async def make_pair():
    pairs: list[Pair] = []

    async def make(
        d_pages: int = 32, page_wait_s: float = 30.0, quarantine_s: float = 30.0, **d_cfg
    ) -> Pair:
        pair = Pair(d_pages, page_wait_s, quarantine_s, **d_cfg)
        await pair.start()
        pairs.append(pair)
        return pair

    yield make
    for pair in pairs:
        await pair.stop()


async def drain(h: RequestHandle, timeout_s: float = 5.0) -> tuple[list[int], APIError | None]:
    """Read a request to its end: (tokens, the error it ended with)."""
    tokens: list[int] = []
    deadline = time.monotonic() + timeout_s
    while True:
        delta = await asyncio.wait_for(h.queue.get(), max(0.01, deadline - time.monotonic()))
        if delta.error is not None:
            return tokens, delta.error
        tokens += delta.token_ids
        if delta.finish_reason is not None:
            return tokens, None


async def until(pred, timeout_s: float, what: str) -> float:
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout_s, f"{what}: not within {timeout_s}s"
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


async def test_a_pull_that_succeeds_gives_every_page_back_on_both_sides(make_pair):
    pair = await make_pair()
    h = await pair.decode_request(max_tokens=3)
    tokens, error = await drain(h)
    assert error is None and tokens == [7, 7, 7]  # P's first token, then D's
    metrics = pair.d.metrics
    assert metrics is not None
    samples = {s.name: s.value for s in metrics.kv_pull.collect()[0].samples}
    assert samples["pd_kv_transfer_seconds_count"] == 1
    page_bytes = 2 * 2 * 1 * PAGE * 8 * 4  # layers x K/V x heads x page x head dim x fp32
    assert metrics.kv_pull_bytes._value.get() == 5 * page_bytes
    pair.d.abort(h)
    await until(lambda: pair.prefill.released.get("done") == 1, 2, "P told done")
    await pair.assert_settled()


async def test_pulls_short_of_pages_queue_in_order_and_count_in_the_load(make_pair):
    # 8 pages on D: one pull (5 pages) fits, the next waits until the first request ends.
    pair = await make_pair(d_pages=8)
    pair.d_backend.read_delay_s = 0.2
    first = await pair.decode_request(max_tokens=2)
    second = await pair.decode_request(max_tokens=2)
    await until(lambda: pair.d.load().waiting_for_pages == 1, 2, "the second pull queued")
    load = pair.d.load()
    assert load.inflight_transfers == 2 and load.kv_pages_reserved == 5
    assert pair.p.load().kv_pages_pinned > 0
    assert (await drain(first))[1] is None
    pair.d.abort(first)
    assert (await drain(second))[1] is None  # granted when the first one's pages came free
    pair.d.abort(second)
    await until(lambda: pair.prefill.released.get("done") == 2, 2, "both pulls done")
    await pair.assert_settled()


async def test_a_prefill_worker_that_dies_while_d_waits_for_pages_ends_the_wait(make_pair):
    pair = await make_pair(d_pages=8)
    pair.d_backend.read_delay_s = 30  # the first pull holds D's pages
    first = await pair.decode_request()
    waiting = await pair.decode_request()
    await until(lambda: pair.d.load().waiting_for_pages == 1, 2, "the second pull queued")
    server = pair.prefill.manager._server
    assert server is not None and server._task is not None
    server._task.cancel()  # P goes silent: no acks, no aborts (as if SIGKILLed)
    t = await until(lambda: waiting.finished, 3, "the waiting request failed")
    assert t < 1.5  # heartbeats (0.1 s x 3 misses), not a lease or a transfer timeout
    _, error = await drain(waiting)
    assert error is not None and error.status == 502 and "PeerLost" in error.message
    _, error = await drain(first)
    assert error is not None and error.status == 502
    pair.d.abort(first)
    pair.d.abort(waiting)
    # The stale peer is forgotten and counted; D itself stays able to admit (ready).
    assert pair.decode.manager.peers_lost == 1 and pair.decode.manager.state().links == 0
    assert pair.d.admit_blocker() is None
    await pair.prefill.manager.close()  # P's process is gone: its pins with it
    await pair.assert_settled()


async def test_a_wait_for_pages_past_its_deadline_fails_and_releases_p(make_pair):
    pair = await make_pair(d_pages=8, page_wait_s=0.3)
    pair.d_backend.read_delay_s = 30
    first = await pair.decode_request()
    waiting = await pair.decode_request()
    _, error = await drain(waiting, timeout_s=3)
    assert error is not None and error.status == 503 and error.code == "kv_pages_exhausted"
    await until(lambda: pair.prefill.released.get("abort") == 1, 2, "P told abort")
    pair.d.abort(waiting)
    pair.d.abort(first)  # the client of the first leaves: its pull is cancelled
    await until(lambda: pair.prefill.released.get("abort") == 2, 2, "P told abort twice")
    await pair.assert_settled()


async def test_a_decode_worker_that_goes_silent_is_seen_by_p_within_seconds(make_pair):
    pair = await make_pair()
    pair.d_backend.read_delay_s = 30
    h = await pair.decode_request()
    await until(lambda: pair.p.load().kv_pages_pinned > 0, 2, "P pinned")
    for link in pair.decode.manager._links.values():
        for task in link._tasks:  # D's heartbeats stop (as if SIGKILLed): no abort is sent
            task.cancel()
    t = await until(lambda: pair.prefill.released.get("decode_lost") == 1, 3, "P released")
    assert t < 1.5  # 4 heartbeat intervals, not the 30 s lease
    assert pair.p.load().kv_pages_pinned == 0
    pair.d.abort(h)
    await pair.assert_settled()


async def test_a_progress_check_that_raises_fails_the_pull(make_pair):
    pair = await make_pair()
    pair.d_backend.read_delay_s = 0.5
    pair.d_backend.check_error = RuntimeError("transport bug")
    h = await pair.decode_request()
    _, error = await drain(h)
    assert error is not None and error.status == 502 and "transport bug" in error.message
    assert pair.d.metrics is not None
    assert pair.d.metrics.kv_pulls_failed.labels("transfer")._value.get() == 1
    pair.d.abort(h)
    await until(lambda: pair.prefill.released.get("abort") == 1, 2, "P told abort")
    await pair.assert_settled()


async def test_engine_fail_aborts_the_pull_and_p_is_told_at_once(make_pair):
    pair = await make_pair()
    pair.d_backend.read_delay_s = 30
    h = await pair.decode_request()
    await until(lambda: pair.decode.manager.poller.in_flight == 1, 2, "the pull in flight")
    pair.d.fail(h, APIError(500, "the step failed", "internal_error"))
    await until(lambda: pair.prefill.released.get("abort") == 1, 1, "P told abort")
    assert pair.decode.manager.poller.in_flight == 0
    await until(lambda: pair.d.load().kv_pages_reserved == 0, 1, "D's pages back")
    await pair.assert_settled()


async def test_pages_of_a_read_that_could_not_be_cancelled_come_back_when_it_ends(make_pair):
    pair = await make_pair()
    pair.d_backend.read_delay_s = 30
    pair.d_backend.uncancellable_s = 0.5  # the read "lands" for 0.5 s after its release
    h = await pair.decode_request()
    await until(lambda: pair.decode.manager.poller.in_flight == 1, 2, "the pull in flight")
    pair.d.abort(h)  # the client leaves mid-pull
    await asyncio.sleep(0.1)
    assert pair.decode.quarantined == 1 and pair.d.load().kv_pages_reserved == 5
    assert pair.d.integrity() == "ok"
    t = await until(lambda: pair.d.load().kv_pages_reserved == 0, 3, "quarantine over")
    assert 0.2 < t < 1.5
    await pair.assert_settled()


async def test_quarantine_is_bounded_when_the_transport_never_confirms(make_pair):
    pair = await make_pair(quarantine_s=0.3)
    pair.d_backend.read_delay_s = 30
    pair.d_backend.uncancellable_s = 1000.0
    h = await pair.decode_request()
    await until(lambda: pair.decode.manager.poller.in_flight == 1, 2, "the pull in flight")
    pair.d.abort(h)
    await until(lambda: pair.d.load().kv_pages_reserved == 0, 2, "quarantine bounded")
    assert pair.d.idle  # a drain waits for this, and finishes
    await pair.assert_settled()


def test_lost_peers_are_exported_as_a_counter():
    metrics = WorkerMetrics()
    lost = [0]
    metrics.read_peers_lost_from(lambda: lost[0])
    lost[0] = 3
    assert "pd_kv_peers_lost_total 3.0" in metrics.render().decode()
