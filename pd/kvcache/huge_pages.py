"""Transparent huge pages for the KV pool on a CPU (Linux `madvise(MADV_HUGEPAGE)`).

A decode step's attention copies each sequence's pages of one layer out of the pool: blocks of
`2 * Hkv * page_size * head_dim` items (24 KB for the default model in fp32), each a page
(all layers) apart: 720 KB. On 4 KB pages every block is several TLB misses and the hardware
prefetcher stops at each 4 KB boundary; on 2 MB pages a block is one. Measured in process
(float32 `int4@8+onednn-fp32`, 32 sequences of 80 tokens on pages spread over a 4,000-page pool,
AMD EPYC Zen 4 under the AVX2 cap, 2 threads, torch profiler over 5 steps): the per-layer gather
435 us against 290 (`aten::index_select`), the attention's matmuls 165 us against 116. Huge pages
for every large allocation (torch's `THP_MEM_ALLOC_ENABLE=1`: the weights too) gave nothing
more there (linear layers 316-372 ms against 298-327 over 5 steps).

Where THP is off (`/sys/kernel/mm/transparent_hugepage/enabled` = never) or the call is not
Linux's, `advise_huge_pages` does nothing: the pool works the same on 4 KB pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

import torch

MADV_HUGEPAGE = 14  # linux/mman.h
HUGE_PAGE = 2 << 20


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


def advise_huge_pages(t: torch.Tensor) -> int:
    """Ask for huge pages under `t`'s storage (a CPU tensor not yet written: pages already
    touched stay small until the kernel merges them). Returns the bytes advised (the 2 MB-aligned
    span inside the storage; 0 when nothing was)."""
    madvise = _madvise()
    if madvise is None or t.device.type != "cpu":
        return 0
    start = t.untyped_storage().data_ptr()
    end = start + t.untyped_storage().nbytes()
    first, last = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
    if last <= first or madvise(first, last - first, MADV_HUGEPAGE) != 0:
        return 0
    return last - first
