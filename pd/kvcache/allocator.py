"""Page allocator: which KV pages are free. Plain Python over integers, no torch.

The allocator has few verbs (`can_allocate`, `allocate`, `free`); policy (budgets, admission,
preemption) belongs to the scheduler. Pages are handed out lowest id first, so a run is
deterministic and a fresh pool fills from page 0 upward.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable


class PageAllocatorError(ValueError):
    """A page was freed twice, or a page id outside the pool was freed."""


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self._num_total = num_pages
        # NOTE: invariant: a page id is in exactly one of _free_heap and _used.
        self._free_heap: list[int] = list(range(num_pages))  # a sorted list is a valid min-heap
        self._used: set[int] = set()

    @property
    def num_total(self) -> int:
        return self._num_total

    @property
    def num_free(self) -> int:
        return len(self._free_heap)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free_heap)

    def allocate(self, n: int) -> list[int] | None:
        """Take `n` pages, lowest ids first; None (and nothing taken) when fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > len(self._free_heap):
            return None
        pages = [heapq.heappop(self._free_heap) for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return pages to the pool. All-or-nothing: a bad id raises before anything is freed."""
        pages = list(pages)
        seen: set[int] = set()
        for page in pages:
            if page not in self._used:
                if not 0 <= page < self._num_total:
                    raise PageAllocatorError(
                        f"page {page} is not in this pool (0..{self._num_total - 1})"
                    )
                raise PageAllocatorError(f"double free of page {page} (it is already free)")
            if page in seen:
                raise PageAllocatorError(f"page {page} appears twice in one free() call")
            seen.add(page)
        self._used.difference_update(pages)
        for page in pages:
            heapq.heappush(self._free_heap, page)

    def check_integrity(self) -> None:
        """Raise AssertionError unless free + used == total, no duplicates, sets disjoint."""
        free = set(self._free_heap)
        assert len(free) == len(self._free_heap), (
            f"duplicate pages in the free list: {len(self._free_heap) - len(free)} extra"
        )
        overlap = free & self._used
        assert not overlap, f"pages both free and used: {sorted(overlap)[:10]}"
        assert len(free) + len(self._used) == self._num_total, (
            f"free ({len(free)}) + used ({len(self._used)}) != total ({self._num_total})"
        )
        out_of_range = [p for p in free | self._used if not 0 <= p < self._num_total]
        assert not out_of_range, f"page ids outside the pool: {sorted(out_of_range)[:10]}"

    def __repr__(self) -> str:
        return f"PageAllocator(total={self._num_total}, free={self.num_free}, used={self.num_used})"
