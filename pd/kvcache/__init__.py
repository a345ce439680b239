"""Paged KV cache: page allocator, per-rank KV pool (FlashInfer HND layout), batch metadata."""

from pd.kvcache.allocator import PageAllocator, PageAllocatorError
from pd.kvcache.kv_pool import KVPool, bytes_per_page, pages_for_budget
from pd.kvcache.paged_metadata import PagedMetadata, build_paged_metadata

__all__ = [
    "KVPool",
    "PageAllocator",
    "PageAllocatorError",
    "PagedMetadata",
    "build_paged_metadata",
    "bytes_per_page",
    "pages_for_budget",
]
