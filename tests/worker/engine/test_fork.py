"""n > 1 (pd/worker/engine/fork.py): one prefill, n choices sharing the prompt's full pages."""

from __future__ import annotations

import asyncio

import pytest

from pd.kvcache.cache_manager import KVCacheManager
from pd.protocol import GenerationOptions
from pd.worker.engine import AdmitRequest, KVConnector
from pd.worker.engine.engine import Engine
from pd.worker.engine.request import RequestHandle, SeqStatus, Sequence
from pd.worker.engine.scheduler import Scheduler
from pd.worker.model.sampler import SampleOutput
from tests.admit import admit
from tests.model_fixtures import default_checkpoint, make_runner

PAGE = 16
PROMPT = list(range(300, 400))  # 100 tokens: 6 full pages and 4 tokens on a partial one


@pytest.fixture(scope="module")
def runner():
    return make_runner(num_pages=96, page_size=PAGE)


def make_engine(runner, **kw) -> Engine:
    scheduler = Scheduler(KVCacheManager(96, PAGE, **kw), chunk_size=256, max_running=32)
    return Engine(
        runner, scheduler, default_checkpoint().tokenizer, max_model_len=2048,
        max_waiting=64,
    )  # fmt: skip


async def texts(handle: RequestHandle) -> list[tuple[list[int], str]]:
    out = []
    for choice in (handle, *handle.forks):
        ids, finish = [], None
        while finish is None:
            delta = await asyncio.wait_for(choice.queue.get(), 60)
            assert delta.error is None, delta.error
            ids += delta.token_ids
            finish = delta.finish_reason
        out.append((ids, finish))
    return out


async def run(engine: Engine, options: GenerationOptions, n: int, prompt=PROMPT):
    handle = engine.add(admit(list(prompt), options, n=n))
    return await texts(handle)


async def settle(engine: Engine) -> None:
    while engine.handles or engine.scheduler.has_work:
        await asyncio.sleep(0.005)
    engine.scheduler.check_integrity()
    assert engine.scheduler.cache.num_used == 0


def computed(engine: Engine) -> int:
    cache = engine.scheduler.cache
    return cache.query_tokens - cache.hit_tokens


async def test_greedy_choices_equal_the_n1_text_and_the_prompt_is_computed_once(runner):
    engine = make_engine(runner, prefix_cache=False)  # sharing is by fork, not by the cache
    engine.start()
    try:
        greedy = GenerationOptions(max_tokens=6, temperature=0.0)
        [one] = await run(engine, greedy, 1)
        n1 = computed(engine)
        assert n1 == len(PROMPT)
        four = await run(engine, greedy, 4)
        assert four == [one] * 4
        n4 = computed(engine) - n1
        # The prompt once, and each other choice's partial last page (4 tokens).
        assert n4 == len(PROMPT) + 3 * (len(PROMPT) % PAGE)
        assert n4 <= 1.5 * n1
        await settle(engine)
    finally:
        await engine.stop()


async def test_seeded_choice_i_is_the_n1_answer_with_seed_plus_i(runner):
    engine = make_engine(runner)
    engine.start()
    try:
        seeded = GenerationOptions(max_tokens=8, temperature=1.0, seed=7)
        three = await run(engine, seeded, 3)
        assert len({tuple(ids) for ids, _ in three}) > 1  # their own random streams
        again = await run(engine, seeded, 3)
        assert again == three
        for i in range(3):
            alone_options = GenerationOptions(max_tokens=8, temperature=1.0, seed=7 + i)
            [alone] = await run(engine, alone_options, 1)
            assert alone == three[i]
        await settle(engine)
    finally:
        await engine.stop()


async def test_children_share_the_full_pages_and_own_their_partial_page(runner):
    engine = make_engine(runner, prefix_cache=False)
    engine.start()
    try:
        opts = GenerationOptions(max_tokens=40, temperature=1.0, seed=1, ignore_eos=True)
        handle = engine.add(admit(list(PROMPT), opts, n=4))
        seqs = [c.seq for c in (handle, *handle.forks)]
        # Each choice has its first tokens and a few steps: look at the pages.
        for s in seqs:
            while len(s.output_ids) < 3:
                await asyncio.sleep(0.005)
        full = len(PROMPT) // PAGE
        shared = seqs[0].page_ids[:full]
        refs = engine.scheduler.cache._refs
        assert all(s.page_ids[:full] == shared for s in seqs)
        assert all(refs[p] == 4 for p in shared)
        partial = [s.page_ids[full] for s in seqs]
        assert len(set(partial)) == 4 and all(refs[p] == 1 for p in partial)
        engine.scheduler.check_integrity()
        # An abort mid-way frees every choice's pages.
        for c in (handle, *handle.forks):
            engine.abort(c)
        await settle(engine)
    finally:
        await engine.stop()


async def test_each_choice_stops_on_its_own(runner):
    engine = make_engine(runner)
    engine.start()
    try:
        # Choice 0 is short; the others go on to their length.
        opts = GenerationOptions(max_tokens=12, temperature=1.0, seed=3)
        handle = engine.add(admit(list(PROMPT), opts, n=3))
        handle.forks[0].seq.max_tokens = 2
        out = await texts(handle)
        assert len(out[1][0]) <= 2
        assert all(f in ("stop", "length") for _, f in out)
        await settle(engine)
    finally:
        await engine.stop()


async def test_an_abort_before_the_first_token_frees_everything(runner):
    engine = make_engine(runner)
    engine.start()
    try:
        handle = engine.add(admit(list(PROMPT) * 3, GenerationOptions(max_tokens=20), n=4))
        assert all(c.seq.status is SeqStatus.FORKING for c in handle.forks)
        engine.abort(handle)  # choice 0 goes first: the others would prefill alone...
        for c in handle.forks:  # ...until the client's abort reaches them too
            engine.abort(c)
        await settle(engine)
        assert not engine.scheduler.forks
    finally:
        await engine.stop()


def test_a_parent_that_ends_first_leaves_its_children_as_requests():
    sched = Scheduler(KVCacheManager(16, 4), chunk_size=64, max_running=8)
    opts = GenerationOptions(max_tokens=4)
    parent = Sequence("p", list(range(10)), opts, 4)
    child = Sequence("c", list(range(10)), opts, 4, status=SeqStatus.FORKING)
    sched.add(parent)
    sched.add_children(parent, [child])
    batch = sched.schedule()
    assert batch.riders == [(0, child)]  # it samples its first token from the parent's row
    sched.finish(parent, "abort")  # before the step's end: the child prefills by itself
    sched.advance(batch)
    assert child.status is SeqStatus.WAITING and child in sched.waiting
    sched.check_integrity()
    batch = sched.schedule()
    assert batch.seqs == [child] and child.page_ids
    sched.finish(child, "abort")
    sched.check_integrity()
    assert sched.cache.num_used == 0


def test_riders_come_after_the_sampled_rows():
    class Fake:
        def execute(self, batch) -> SampleOutput:
            return SampleOutput(list(range(len(batch.sampled))))

    sched = Scheduler(KVCacheManager(16, 4), chunk_size=64, max_running=8)
    opts = GenerationOptions(max_tokens=4)
    a = Sequence("a", list(range(6)), opts, 4)
    b = Sequence("b", list(range(9)), opts, 4)
    kids = [Sequence(f"b{i}", list(range(9)), opts, 4, status=SeqStatus.FORKING) for i in (1, 2)]
    sched.add(a)
    sched.add(b)
    sched.add_children(b, kids)
    batch = sched.schedule()
    assert batch.sampled == [a, b, *kids] and batch.riders == [(1, kids[0]), (1, kids[1])]
    sched.advance(batch)
    for k in kids:  # b's 2 full pages shared, its partial one recomputed into a page of k's own
        assert k.status is SeqStatus.RUNNING and k.page_ids == b.page_ids[:2]
        assert k.num_computed == 8
    for s in (a, b, *kids):
        sched.finish(s, "abort")
    sched.check_integrity()
    assert sched.cache.num_used == 0 and not sched.forks


async def test_prefill_samples_n_first_tokens_and_hands_off_one_set_of_pages(runner):
    calls = []

    class Hooks(KVConnector):
        def request_finished(self, seq, reasons, firsts):
            if seq is not handle.seq:  # a choice of it: its pages go with the parent's
                return None
            calls.append((list(seq.output_ids), firsts[1:]))
            pages = engine.scheduler.lend(seq, "k")
            return {"pages": pages}

    engine = make_engine(runner)
    engine.connect(Hooks())
    engine.start()
    try:
        opts = GenerationOptions(max_tokens=1, temperature=1.0, seed=11, logprobs=True)
        handle = engine.add(admit(list(PROMPT), opts, n=3))
        out = await texts(handle)
        [(first, choices)] = calls  # one hand-off for the three choices
        assert [first[0], *(t for t, _ in choices)] == [ids[0] for ids, _ in out]
        assert all(lp is not None and lp[0] == t for t, lp in choices)
        assert handle.kv_transfer_params == {"pages": engine.scheduler.lent["k"]}
        assert all(not c.seq.page_ids for c in handle.forks)  # they never took a page
        engine.scheduler.check_integrity()
        engine.give_back("k")
        await settle(engine)
    finally:
        await engine.stop()


async def test_decode_forks_the_choices_from_the_one_pull(runner):
    class Loads(KVConnector):
        def waits_for_kv(self, request):
            return request.kv_from_elsewhere

    engine = make_engine(runner)
    engine.connect(Loads())
    engine.start()
    try:
        opts = GenerationOptions(max_tokens=5, temperature=0.0)
        handle = engine.add(AdmitRequest(list(PROMPT), opts, rules=(None,) * 3, kv_from_elsewhere=True))
        for choice, token in zip((handle, *handle.forks), (11, 12, 13)):
            engine.accept_token(choice, token, None)
        pages = engine.scheduler.lend_free("d", -(-len(PROMPT) // PAGE))
        assert pages is not None
        engine.kv_arrived(handle, "d")  # (the KV "from elsewhere" is whatever the pages hold)
        full = len(PROMPT) // PAGE
        refs = engine.scheduler.cache._refs
        assert all(c.seq.page_ids[:full] == pages[:full] for c in handle.forks)
        assert all(refs[p] == 3 for p in pages[:full])
        out = await texts(handle)
        assert [ids[0] for ids, _ in out] == [11, 12, 13]
        await settle(engine)
    finally:
        await engine.stop()
