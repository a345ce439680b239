"""The cache manager: page states, references, prefix matching, dedup, LRU eviction, keys."""

from __future__ import annotations

import pytest

from pd.kvcache.cache_manager import KVCacheManager

PS = 4


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def cached_request(cm: KVCacheManager, toks: list[int]) -> list[int]:
    """A request that computed `toks` into fresh pages and made its full pages matchable."""
    pages = cm.allocate(-(-len(toks) // PS))
    assert pages is not None
    _, swaps = cm.insert(pages, [], toks)
    for i, p in swaps.items():
        pages[i] = p
    return pages


def test_states_and_refcounts():
    cm = KVCacheManager(8, PS)
    a = cached_request(cm, tokens(10))  # 2 full pages cached, 1 partial
    assert cm.num_used == 3 and cm.num_cached == 2 and cm.num_free == 5
    pages, hashes = cm.match(tokens(10), 10)
    assert pages == a[:2] and len(hashes) == 2
    cm.acquire(pages)  # a second holder
    cm.check_integrity([a, pages])
    cm.free(reversed(a))  # the first holder leaves: shared pages stay referenced
    assert cm.num_used == 2 and cm.num_evictable == 0 and cm.num_free == 6
    cm.check_integrity([pages])
    cm.free(pages)
    assert cm.num_used == 0 and cm.num_evictable == 2 and cm.num_free == 8
    cm.check_integrity()
    with pytest.raises(ValueError, match="nobody holds it"):
        cm.free([a[2]])


def test_match_takes_whole_pages_up_to_the_limit_and_stops_at_a_miss():
    cm = KVCacheManager(16, PS)
    a = cached_request(cm, tokens(12))
    assert cm.match(tokens(12), 11)[0] == a[:2]  # the last token is never matched
    assert cm.match(tokens(12), 12)[0] == a[:3]
    assert cm.match(tokens(7), 7)[0] == a[:1]  # a prefix ending mid-page
    assert cm.match(tokens(8, start=1), 8)[0] == []  # other tokens at the start: no match
    other = tokens(4) + [99, 99, 99, 99] + tokens(4, start=8)  # same page 3, other page 2
    assert cm.match(other, 12)[0] == a[:1]  # chains: page 3 does not match past a miss
    off = KVCacheManager(16, PS, prefix_cache=False)
    cached_request(off, tokens(12))
    assert off.match(tokens(12), 12) == ([], []) and off.num_cached == 0


def test_salt_keeps_models_apart():
    a, b = KVCacheManager(8, PS, salt="model-a"), KVCacheManager(8, PS, salt="model-b")
    cached_request(a, tokens(8))
    cached_request(b, tokens(8))
    assert a.match(tokens(8), 8)[1] != b.match(tokens(8), 8)[1]


def test_insert_deduplicates_against_a_cached_page():
    cm = KVCacheManager(8, PS)
    a = cached_request(cm, tokens(8))
    b = cm.allocate(2)  # a concurrent request computed the same prefix into its own pages
    assert b is not None
    new, swaps = cm.insert(b, [], tokens(8))
    assert swaps == {0: a[0], 1: a[1]} and len(new) == 2
    b = [swaps[0], swaps[1]]
    assert cm.num_used == 2  # b's own pages went back: one copy of the content
    cm.check_integrity([a, b])


def test_eviction_is_lru_and_an_allocation_never_fails_while_pages_are_evictable():
    cm = KVCacheManager(4, PS)
    old = cached_request(cm, tokens(8))
    new = cached_request(cm, tokens(8, start=100))
    cm.free(reversed(old))
    cm.free(reversed(new))
    assert cm.num_free == 4 and cm.num_evictable == 4
    got = cm.allocate(1)  # evicts the least recently released: old's tail page
    assert got == [old[1]]
    assert cm.match(tokens(8), 8)[0] == [old[0]]  # its head is still matchable
    assert cm.match(tokens(8, start=100), 8)[0] == new
    rest = cm.allocate(3)
    assert rest is not None and cm.num_cached == 0
    assert cm.allocate(1) is None
    cm.check_integrity([got, rest])


def test_a_hit_takes_the_page_out_of_the_lru():
    cm = KVCacheManager(2, PS)
    a = cached_request(cm, tokens(4))
    cm.free(a)
    pages, _ = cm.match(tokens(4), 4)
    cm.acquire(pages)
    assert cm.num_evictable == 0
    assert cm.allocate(2) is None  # the hit page is held, not evictable
    assert cm.allocate(1) is not None


def test_keys_hold_take_and_release():
    cm = KVCacheManager(8, PS)
    a = cached_request(cm, tokens(8))
    shared, _ = cm.match(tokens(8), 8)
    cm.acquire(shared)
    cm.hold("p-1", a)  # P pins a's pages
    cm.hold("p-2", shared)  # and another transfer of the same shared pages
    cm.check_integrity()
    cm.release("p-1")
    cm.release("p-1")  # idempotent
    assert cm.num_used == 2
    cm.release("p-2")
    assert cm.num_used == 0 and cm.num_evictable == 2
    r = cm.allocate(3)
    assert r is not None
    cm.hold("d-1", r)
    assert cm.take("d-1") == r and not cm.keyed
    cm.check_integrity([r])


def test_reset_drops_unreferenced_cached_pages_only():
    cm = KVCacheManager(8, PS)
    a = cached_request(cm, tokens(8))
    b = cached_request(cm, tokens(8, start=50))
    cm.free(reversed(a))
    assert cm.reset_prefix_cache() == 2
    assert cm.match(tokens(8), 8)[0] == [] and cm.match(tokens(8, start=50), 8)[0] == b
    cm.check_integrity([b])


def test_integrity_catches_a_wrong_refcount():
    cm = KVCacheManager(4, PS)
    a = cached_request(cm, tokens(8))
    with pytest.raises(AssertionError, match="references"):
        cm.check_integrity([a, a[:1]])  # a holder the manager does not count
    with pytest.raises(AssertionError, match="references"):
        cm.check_integrity([])
    cm.check_integrity([a])
