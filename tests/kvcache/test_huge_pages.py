"""The KV pool asks for transparent huge pages on a Linux CPU (pd/kvcache/huge_pages.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pd.kvcache.huge_pages import HUGE_PAGE, advise_huge_pages
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
    pool = KVPool(256, 30, 3, 16, 64, torch.float32, "cpu")  # 180 MB
    nbytes = pool.buffer.numel() * pool.buffer.element_size()
    assert nbytes - 2 * HUGE_PAGE <= pool.huge_page_bytes <= nbytes
    assert not pool.buffer.any()
    inside = pool.buffer.data_ptr() + 2 * HUGE_PAGE  # past the unaligned head
    assert _anon_huge_kb(inside) > 0


def test_advice_is_skipped_where_it_cannot_apply():
    assert advise_huge_pages(torch.zeros(16)) == 0  # smaller than one huge page
    if torch.cuda.is_available():
        assert advise_huge_pages(torch.zeros(HUGE_PAGE, device="cuda")) == 0
