"""A worker's prefix cache in the DES: which prompt prefixes it holds, over the segments of
`SimTurn`, LRU-evicted when its worker needs the pages.

A prefix is a chain of segments; each entry is keyed by its chain (a hash of the parent's key
and the segment id) and holds how many of that segment's tokens are cached. pd's cache
(pd/kvcache/cache_manager.py) works on chained hashes of full pages; this keeps one entry per
segment instead, and the worker rounds what it matches down to whole pages, as pd does. Unlike
pd, an entry a running request reads may be evicted (it only stops being matchable): the DES
does not count references.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from pd.sim.cluster.requests import Segment


class PrefixCache:
    def __init__(self) -> None:
        self._entries: OrderedDict[int, int] = OrderedDict()  # chain key -> tokens cached
        self.tokens = 0  # cached tokens in all

    def match(self, segments: Sequence[Segment], limit: int) -> int:
        """Tokens of the longest cached prefix of `segments` (at most `limit`); marks it used."""
        matched, key = 0, 0
        for seg_id, n in segments:
            key = hash((key, seg_id))
            have = self._entries.get(key)
            if not have:
                break
            self._entries.move_to_end(key)
            matched += min(have, n)
            if have < n or matched >= limit:
                break
        return min(matched, limit)

    def insert(self, segments: Sequence[Segment], upto: int) -> int:
        """Cache the first `upto` tokens of `segments`; returns the tokens newly cached."""
        new, pos, key = 0, 0, 0
        for seg_id, n in segments:
            if pos >= upto:
                break
            take = min(n, upto - pos)
            key = hash((key, seg_id))
            old = self._entries.get(key, 0)
            if take > old:
                self._entries[key] = take
                new += take - old
            self._entries.move_to_end(key)
            pos += n
        self.tokens += new
        return new

    def evict_one(self) -> int:
        """Drop the least recently used entry; returns its tokens (0: the cache is empty)."""
        if not self._entries:
            return 0
        _, n = self._entries.popitem(last=False)
        self.tokens -= n
        return n

    def __len__(self) -> int:
        return len(self._entries)
