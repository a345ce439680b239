"""The KV cache manager: every page's life, and the prefix cache. Plain Python, no torch.

A page is in exactly one state:
- free: in the allocator's free list;
- referenced: held by one or more holders (running requests, or a key: pinned for a transfer on
  P, reserved for a pull on D); its refcount is the number of holders;
- evictable: no holder, but its KV is cached (its hash is registered); reclaimed least recently
  used first when an allocation needs pages.

Prefix matching works on full pages through hash chains, as vLLM does: a page's hash covers the
page's token ids and the hash of the page before it, starting from a root that covers what
else shapes the KV (`salt`: model fingerprint, dtype, page size) and the request's `cache_salt`
(tenants that must share nothing), so a hash names a whole prefix.
We chose chains over a radix tree (SGLang) because pages are the unit of sharing here anyway:
a dict lookup per page, no tree to keep balanced, and eviction is a plain LRU over pages (a
chain's pages are looked up in order, so an evicted page ends the match there). A page becomes
matchable as soon as it is full and computed (`insert`); a page whose hash is already cached is
deduplicated (the holder swaps it for the cached one). Cached pages are full, hence read-only:
a request only ever writes at positions past what it has computed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from pd.kvcache.allocator import PageAllocator

PageHash = bytes


def chain_hash(parent: PageHash, tokens: Sequence[int]) -> PageHash:
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class KVCacheManager:
    def __init__(
        self, num_pages: int, page_size: int, *, prefix_cache: bool = True, salt: str = ""
    ) -> None:
        self.page_size = page_size
        self.prefix_cache = prefix_cache
        self.root = hashlib.blake2b(f"pd-kv:{page_size}:{salt}".encode(), digest_size=16).digest()
        self._alloc = PageAllocator(num_pages)
        self._refs: dict[int, int] = {}  # referenced page -> holders
        self._hash_of: dict[int, PageHash] = {}  # cached page -> its hash
        self._page_of: dict[PageHash, int] = {}  # hash -> cached page
        self._lru: OrderedDict[int, None] = OrderedDict()  # evictable pages, oldest first
        self.keyed: dict[str, list[int]] = {}  # pages referenced under a key (each one reference)
        self.num_refs = 0  # references over all pages (for the cheap check)
        self.query_tokens = 0  # prompt tokens looked up, and those found (for metrics)
        self.hit_tokens = 0

    # ------------------------------------------------------------------------------ counts

    @property
    def num_total(self) -> int:
        return self._alloc.num_total

    @property
    def num_free(self) -> int:
        """Pages an allocation can have: free plus evictable."""
        return self._alloc.num_free + len(self._lru)

    @property
    def num_used(self) -> int:
        """Referenced pages (held by a request or a key)."""
        return len(self._refs)

    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    @property
    def num_cached(self) -> int:
        """Pages whose KV is matchable, referenced or not."""
        return len(self._hash_of)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= self.num_free

    # ------------------------------------------------------------------------------ pages

    def allocate(self, n: int) -> list[int] | None:
        """`n` pages with one reference each, evicting LRU cached pages as needed; None (and
        nothing taken) when fewer than `n` are free or evictable."""
        if not self.can_allocate(n):
            return None
        short = n - self._alloc.num_free
        for _ in range(max(0, short)):
            page, _ = self._lru.popitem(last=False)
            self._forget(page)
            self._alloc.free([page])
        pages = self._alloc.allocate(n)
        assert pages is not None
        for p in pages:
            self._refs[p] = 1
        self.num_refs += n
        return pages

    def acquire(self, pages: Iterable[int]) -> None:
        """One more reference on pages already referenced or evictable (a prefix hit)."""
        for p in pages:
            if p in self._refs:
                self._refs[p] += 1
            else:
                assert p in self._lru, f"page {p} is neither referenced nor cached"
                del self._lru[p]
                self._refs[p] = 1
            self.num_refs += 1

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference from each page; a page nobody holds becomes evictable when cached
        (most recently used last), else free."""
        for p in pages:
            n = self._refs.get(p)
            if n is None:
                raise ValueError(f"page {p} is released but nobody holds it")
            self.num_refs -= 1
            if n > 1:
                self._refs[p] = n - 1
                continue
            del self._refs[p]
            if p in self._hash_of and self.prefix_cache:
                self._lru[p] = None
            else:
                self._forget(p)
                self._alloc.free([p])

    # ------------------------------------------------------------------------------ prefixes

    def root_of(self, cache_salt: str | None) -> PageHash:
        """The hash a chain starts from: a request's `cache_salt` enters it, so requests with
        different salts share no page (and no hit count reveals another salt's pages)."""
        if cache_salt is None:
            return self.root
        return hashlib.blake2b(self.root + cache_salt.encode(), digest_size=16).digest()

    def match(
        self, tokens: Sequence[int], limit: int, cache_salt: str | None = None
    ) -> tuple[list[int], list[PageHash]]:
        """The cached pages of the longest cached prefix of `tokens` of whole pages and at most
        `limit` tokens (under `cache_salt`), with their hashes. Takes no reference (`acquire`
        does)."""
        pages: list[int] = []
        hashes: list[PageHash] = []
        if not self.prefix_cache:
            return pages, hashes
        parent, ps = self.root_of(cache_salt), self.page_size
        for i in range(min(limit, len(tokens)) // ps):
            h = chain_hash(parent, tokens[i * ps : (i + 1) * ps])
            page = self._page_of.get(h)
            if page is None:
                break
            pages.append(page)
            hashes.append(h)
            parent = h
        return pages, hashes

    def count_query(self, prompt_tokens: int, hit_tokens: int) -> None:
        self.query_tokens += prompt_tokens
        self.hit_tokens += hit_tokens

    def insert(
        self,
        pages: Sequence[int],
        hashes: Sequence[PageHash],
        tokens: Sequence[int],
        cache_salt: str | None = None,
    ) -> tuple[list[PageHash], dict[int, int]]:
        """Make a holder's full, computed pages matchable. `pages` are the holder's pages in
        order, `hashes` the hashes it already has (of its first pages), `tokens` the tokens of
        the full computed pages after those (only the new ones: nothing is hashed twice).
        Returns the new hashes and the swaps to make: index -> cached page, where another page
        already holds that content (the holder's page is released and the cached one acquired
        here)."""
        new: list[PageHash] = []
        swaps: dict[int, int] = {}
        if not self.prefix_cache:
            return new, swaps
        ps, first = self.page_size, len(hashes)
        parent = hashes[-1] if hashes else self.root_of(cache_salt)
        for k in range(len(tokens) // ps):
            i = first + k
            h = chain_hash(parent, tokens[k * ps : (k + 1) * ps])
            page = pages[i]
            cached = self._page_of.get(h)
            if cached is None:
                if page not in self._hash_of:  # an uncached page of this holder alone
                    self._hash_of[page] = h
                    self._page_of[h] = page
            elif cached != page:
                self.acquire([cached])
                self.free([page])
                swaps[i] = cached
            new.append(h)
            parent = h
        return new, swaps

    def reset_prefix_cache(self) -> int:
        """Drop every unreferenced cached page (they become free); returns how many. Referenced
        pages stay matchable until their holders let go."""
        dropped = list(self._lru)
        self._lru.clear()
        for p in dropped:
            self._forget(p)
        self._alloc.free(dropped)
        return len(dropped)

    def _forget(self, page: int) -> None:
        h = self._hash_of.pop(page, None)
        if h is not None:
            del self._page_of[h]

    # ------------------------------------------------------------------------------ by key

    def hold(self, key: str, pages: list[int]) -> None:
        """Move a holder's references on `pages` to `key` (P pins a finished request's pages)."""
        assert key not in self.keyed, f"key {key} is already held"
        self.keyed[key] = pages

    def take(self, key: str) -> list[int]:
        """Move `key`'s references to the caller (D admits a pulled request)."""
        return self.keyed.pop(key)

    def release(self, key: str) -> None:
        """Drop the references held under `key` (idempotent)."""
        pages = self.keyed.pop(key, None)
        if pages:
            self.free(reversed(pages))  # tail first, as a request's are

    # ------------------------------------------------------------------------------ checks

    def quick_check(self, holder_refs: int) -> None:
        """The counters of `check_integrity`, in time independent of the pages: raise
        AssertionError unless free + referenced + evictable pages are all the pages and the
        references are `holder_refs` (the requests' page counts) plus the keys' pages."""
        alloc = self._alloc
        assert alloc.num_free + alloc.num_used == alloc.num_total, "the free list lost pages"
        assert len(self._refs) + len(self._lru) == alloc.num_used, (
            f"{len(self._refs)} referenced + {len(self._lru)} evictable pages but "
            f"{alloc.num_used} are out of the free list"
        )
        refs = holder_refs + sum(map(len, self.keyed.values()))
        assert refs == self.num_refs, (
            f"requests and keys hold {refs} references but {self.num_refs} are counted"
        )
        assert len(self._page_of) == len(self._hash_of), "hash maps disagree"

    def check_integrity(self, holders: Iterable[Sequence[int]] = ()) -> None:
        """Raise AssertionError unless every page is in exactly one state and each referenced
        page's refcount equals its holders: `holders` (the requests' page lists) plus the keys."""
        self._alloc.check_integrity()
        counts: dict[int, int] = {}
        for pages in [*holders, *self.keyed.values()]:
            for p in pages:
                counts[p] = counts.get(p, 0) + 1
        held_refs, refs = sum(counts.values()), sum(self._refs.values())
        assert refs == self.num_refs, f"{refs} references but {self.num_refs} counted"
        assert counts == self._refs, (
            f"requests hold {held_refs} references on {len(counts)} pages but {refs} on "
            f"{len(self._refs)} pages are counted"
            + (f" (e.g. page {_first_diff(counts, self._refs)})" if counts else "")
        )
        lru = set(self._lru)
        assert not lru & set(self._refs), "a page is both evictable and referenced"
        assert lru <= set(self._hash_of), "an evictable page is not cached"
        assert len(lru) + len(self._refs) == self._alloc.num_used, (
            f"{len(self._refs)} referenced + {len(lru)} evictable pages but "
            f"{self._alloc.num_used} are out of the free list"
        )
        assert all(self._page_of[h] == p for p, h in self._hash_of.items()), "hash maps disagree"
        assert len(self._page_of) == len(self._hash_of), "hash maps disagree"

    def __repr__(self) -> str:
        return (
            f"KVCacheManager(total={self.num_total}, referenced={self.num_used}, "
            f"evictable={self.num_evictable}, cached={self.num_cached})"
        )


def _first_diff(a: dict[int, int], b: dict[int, int]) -> int | None:
    for p in sorted(set(a) | set(b)):
        if a.get(p) != b.get(p):
            return p
    return None
