"""D's prealloc queue against a stub `LentPages`: first come first served, woken by grants, by
the pull failing meanwhile, or by its deadline; a waiter that gives up never holds a page."""

from __future__ import annotations

import asyncio

import pytest

from pd.protocol import APIError
from pd.worker.disagg.page_wait import PageWaitQueue


class Pages:
    """`LentPages` with a plain free count."""

    def __init__(self, free: int) -> None:
        self.free = free
        self.held: dict[str, int] = {}

    def lend_free(self, key: str, num_pages: int, choices: int = 1) -> list[int] | None:
        if num_pages > self.free:
            return None
        self.free -= num_pages
        self.held[key] = num_pages
        return list(range(num_pages))

    def give_back(self, key: str) -> None:
        self.free += self.held.pop(key, 0)

    def lend(self, seq, key):  # pragma: no cover - a finished request's pages
        raise NotImplementedError


def never():
    """An `until` that never finishes."""
    return asyncio.get_running_loop().create_future


async def test_pages_that_fit_are_reserved_at_once():
    pages = Pages(4)
    q = PageWaitQueue(pages, timeout_s=5)
    assert await q.acquire("a", 3, never()) == [0, 1, 2]
    assert pages.held == {"a": 3} and len(q) == 0


async def test_waiters_are_served_in_arrival_order_and_the_head_blocks_the_rest():
    pages = Pages(0)
    q = PageWaitQueue(pages, timeout_s=5)
    big = asyncio.create_task(q.acquire("big", 3, never()))
    small = asyncio.create_task(q.acquire("small", 1, never()))
    await asyncio.sleep(0)
    assert len(q) == 2
    pages.free = 2  # enough for small, not for big: FIFO keeps small behind big
    q.grant()
    await asyncio.sleep(0)
    assert not big.done() and not small.done()
    pages.free = 4
    q.grant()
    assert await big == [0, 1, 2] and await small == [0]
    assert pages.held == {"big": 3, "small": 1} and len(q) == 0


async def test_a_pull_that_fails_while_waiting_leaves_the_queue_without_pages():
    pages = Pages(0)
    q = PageWaitQueue(pages, timeout_s=5)
    failed = asyncio.get_running_loop().create_future()
    waiter = asyncio.create_task(q.acquire("a", 2, lambda: failed))
    behind = asyncio.create_task(q.acquire("b", 1, never()))
    await asyncio.sleep(0)
    failed.set_result(None)  # e.g. P died: the receiver's wait() returned Failed
    assert await waiter is None
    assert len(q) == 1 and pages.held == {}
    pages.free = 1
    q.grant()
    assert await behind == [0]  # the one behind is not stuck behind a ghost


async def test_the_deadline_is_a_503_and_the_waiter_is_gone():
    pages = Pages(0)
    q = PageWaitQueue(pages, timeout_s=0.05)
    with pytest.raises(APIError) as e:
        await q.acquire("a", 1, never())
    assert e.value.status == 503 and e.value.code == "kv_pages_exhausted"
    assert len(q) == 0 and q.timeouts == 1
    pages.free = 1
    q.grant()
    assert pages.held == {}


async def test_a_cancelled_waiter_gives_back_pages_granted_in_the_same_tick():
    pages = Pages(0)
    q = PageWaitQueue(pages, timeout_s=5)
    waiter = asyncio.create_task(q.acquire("a", 1, never()))
    await asyncio.sleep(0)
    pages.free = 1
    q.grant()  # granted, but the task is cancelled before it runs again
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert pages.held == {} and pages.free == 1 and len(q) == 0
