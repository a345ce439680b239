"""The scheduler with the prefix cache, over integers: hits, pages matchable mid-prefill,
a pulled request's KV kept on D, and what D's reservations count as free."""

from pd.kvcache.cache_manager import KVCacheManager
from pd.protocol import GenerationOptions
from pd.worker.engine.request import SeqStatus, Sequence
from pd.worker.engine.scheduler import Scheduler

PAGE = 4


def make(num_pages=64, chunk=8) -> Scheduler:
    return Scheduler(KVCacheManager(num_pages, PAGE), chunk, max_running=8)


def seq(name: str, prompt: list[int], max_tokens: int = 4) -> Sequence:
    return Sequence(name, prompt, GenerationOptions(max_tokens=max_tokens), max_tokens)


def step(s: Scheduler, token: int = 7):
    batch = s.schedule()
    s.advance(batch)
    for q in batch.sampled:
        q.output_ids.append(token)
    s.check_integrity()
    return batch


def drain(s: Scheduler, q: Sequence) -> None:
    while len(q.output_ids) < q.max_tokens:
        step(s)
    s.finish(q, "length")
    s.check_integrity()


def test_a_second_request_computes_only_what_is_not_cached():
    s = make(chunk=64)
    a = seq("a", list(range(18)))
    s.add(a)
    drain(s, a)
    b = seq("b", list(range(14)) + [90, 91])
    s.add(b)
    batch = step(s)
    assert batch.num_cached == [12] and batch.num_new == [4]  # 3 cached pages, 4 tokens to go
    assert b.num_cached_tokens == 12 and b.page_ids[:3] == a_pages(s, list(range(12)))
    assert s.cache.hit_tokens == 12 and s.cache.query_tokens == 18 + 16


def a_pages(s: Scheduler, tokens: list[int]) -> list[int]:
    return s.cache.match(tokens, len(tokens))[0]


def test_pages_are_matchable_as_soon_as_full_and_computed():
    s = make(chunk=12)
    a = seq("a", list(range(20)))
    s.add(a)
    step(s)  # a computed 12 tokens: 3 full pages, 8 to go
    b = seq("b", list(range(20)))
    s.add(b)
    batch = step(s)  # a's last 8, then b with the 4 tokens of budget left
    assert batch.seqs == [a, b] and batch.num_cached == [12, 12] and batch.num_new == [8, 4]
    assert b.page_ids[:3] == a.page_ids[:3]  # shared while a still prefills
    drain(s, a)
    drain(s, b)
    assert s.cache.num_used == 0


def test_a_full_hit_recomputes_the_last_token_and_dedups_its_page():
    s = make(chunk=64)
    p = list(range(8))  # two whole pages
    a = seq("a", p)
    s.add(a)
    drain(s, a)
    b = seq("b", p)
    s.add(b)
    batch = step(s)
    assert batch.num_cached == [4] and batch.num_new == [4]  # page 2 is recomputed
    assert b.page_ids[:2] == a_pages(s, p)  # its recomputed page was swapped for the cached one
    drain(s, b)


def test_decode_keeps_a_pulled_requests_kv_for_the_next_turn():
    s = make()
    prompt = list(range(10))
    pages = s.lend_free("d-1", 3)
    assert pages is not None
    d = seq("d", prompt, max_tokens=9)
    d.status = SeqStatus.WAITING_FOR_KV
    d.output_ids.append(50)  # P's first token
    s.admit_arrived(d, "d-1")
    assert s.cache.num_cached == 2  # the prompt's full pages are matchable at once
    drain(s, d)  # 8 more tokens decoded on D
    history = prompt + d.output_ids  # 19 tokens: 4 full pages of prompt + answer
    assert len(a_pages(s, history + [1, 2, 3])) == 4
    assert s.cache.num_used == 0 and s.cache.num_evictable == 4


def test_reservations_count_evictable_pages_as_free():
    s = make(num_pages=8, chunk=64)
    a = seq("a", list(range(24)))
    s.add(a)
    drain(s, a)  # 24 + 4 tokens in 7 pages, 6 of them full and cached, then released
    assert s.cache.num_evictable == 6 and s.cache.num_free == 8
    assert s.lend_free("d-2", 8) is not None  # evicts what it needs
    s.give_back("d-2")
    s.check_integrity()


def test_a_failed_admission_records_no_hit():
    """cached_tokens is what the request got when it was really admitted."""
    s = make(num_pages=3, chunk=64)
    a = seq("a", list(range(8)))
    s.add(a)
    drain(s, a)  # its 2 full pages are cached, then evictable
    r = seq("r", list(range(100, 108)), max_tokens=1)
    s.add(r)
    step(s)  # r holds 2 pages (one of a's was evicted for it); a's first page is cached
    b = seq("b", list(range(8)) + [50, 51, 52, 53, 54])  # needs 4 pages: cannot be admitted
    s.add(b)
    step(s)
    assert b.status is SeqStatus.WAITING and b.num_cached_tokens is None
    assert s.cache.hit_tokens == 0


def test_requests_with_different_cache_salts_share_no_page():
    s = make(chunk=64)
    a = seq("a", list(range(18)))
    a.cache_salt = "tenant-1"
    s.add(a)
    drain(s, a)
    for salt, cached in [("tenant-2", 0), (None, 0), ("tenant-1", 16)]:
        b = seq(f"b-{salt}", list(range(18)))
        b.cache_salt = salt
        s.add(b)
        step(s)
        assert b.num_cached_tokens == cached, salt  # never a hit on another salt's pages
        drain(s, b)
    assert a_pages(s, list(range(16))) != []  # the unsalted request cached its own pages
