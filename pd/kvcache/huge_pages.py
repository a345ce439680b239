"""Transparent huge pages for the KV pool on a CPU (Linux `madvise(MADV_HUGEPAGE)`).

A decode step's attention copies each sequence's pages of one layer out of the pool: blocks of
`2 * Hkv * page_size * head_dim` items (24 KB for the default model in fp32), each a page
(all layers) apart: 720 KB. On 4 KB pages every block is several TLB misses and the hardware
prefetcher stops at each 4 KB boundary; on 2 MB pages a block is one, and both the per-layer
gather (`aten::index_select`) and the attention's matmuls after it ran faster. Huge pages for
every large allocation (torch's `THP_MEM_ALLOC_ENABLE=1`: the weights too) gave nothing more,
so only the pool is advised (docs/EXPERIMENTS.md §13, "The page gather and huge pages"; §23).

Where THP is off (`/sys/kernel/mm/transparent_hugepage/enabled` = never), off Linux or off the
CPU, the pool is an ordinary tensor: it works the same on 4 KB pages.

The pool's memory is its own anonymous mapping (`cpu_pool`), advised before anything touches
it: from torch's allocator, glibc could hand back heap memory already faulted in on 4 KB pages
(seen in a test process that had freed large tensors before), which the advice does not change.
"""

from __future__ import annotations

import mmap
import sys

import torch

HUGE_PAGE = 2 << 20


def cpu_pool(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """(a zeroed CPU tensor of `shape`, the bytes of it advised for huge pages): on Linux a
    fresh anonymous mapping advised `MADV_HUGEPAGE` before it is zeroed (the zeroing writes, so
    the kernel faults it in on huge pages where it can); elsewhere `torch.zeros`."""
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if not sys.platform.startswith("linux") or nbytes < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype), 0
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        memory.madvise(mmap.MADV_HUGEPAGE)
        advised = nbytes
    except (AttributeError, OSError):  # no such advice here, or THP not built in
        advised = 0
    # the tensor keeps `memory` alive (torch.frombuffer holds a reference to its buffer)
    pool = torch.frombuffer(memory, dtype=dtype, count=numel).view(shape)
    pool.zero_()
    return pool, advised
