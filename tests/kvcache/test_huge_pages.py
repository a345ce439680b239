"""The KV pool asks for transparent huge pages on a Linux CPU (pd/kvcache/huge_pages.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pd.kvcache.huge_pages import HUGE_PAGE, cpu_pool
from pd.kvcache.kv_pool import KVPool

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str:
    """The bracketed setting: always, madvise or never ("" where there is no such file)."""
    text = THP.read_text() if THP.exists() else ""
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else ""


def _anon_huge_kb(address: int) -> int:
    """AnonHugePages of the mapping holding `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or _thp_mode() in ("", "never"),
    reason="transparent huge pages are off here (or this is not Linux)",
)
def test_the_pool_sits_on_huge_pages_and_starts_zeroed():
    for _ in range(3):  # large tensors freed first: the pool must not reuse their 4 KB pages
        torch.ones(64 << 20).sum()
    pool = KVPool(256, 30, 3, 16, 64, torch.float32, "cpu")  # 180 MB
    nbytes = pool.buffer.numel() * pool.buffer.element_size()
    assert pool.huge_page_bytes == nbytes
    assert not pool.buffer.any()
    inside = pool.buffer.data_ptr() + 2 * HUGE_PAGE  # past an unaligned head
    assert _anon_huge_kb(inside) > 0
    pool.buffer[-1] = 1.0  # writable to its last byte, and the mapping lives with the tensor
    assert pool.buffer.sum() == pool.buffer[-1].numel()


def test_a_pool_off_linux_or_too_small_is_a_plain_zeroed_tensor(monkeypatch):
    small, advised = cpu_pool((4, 4), torch.float32)
    assert advised == 0 and not small.any()
    monkeypatch.setattr(sys, "platform", "darwin")
    other, advised = cpu_pool((1024, 1024), torch.bfloat16)
    assert advised == 0 and other.shape == (1024, 1024) and not other.any()
