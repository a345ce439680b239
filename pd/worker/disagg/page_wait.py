"""The decode side's prealloc queue: pulled requests wait here, first come first served, until
the pages for their KV fit beside the running batch (`LentPages.lend_free`).

The decode side owns it; as the engine's connector it is told whenever pages may have come free
(after each step, after an abort or a failure, after lent pages are given back: `grant()` here)
and reports its waiters for the engine's `load()`. Each waiter is woken by the
grant of its pages, by its `until` future (the pull failed: P died, P aborted, the lease was lost
or the client left), or by its deadline. A waiter that gives up leaves the queue at once and never
holds a page; one granted pages owns them under its key (the caller gives them back).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from pd.protocol import APIError
from pd.worker.engine import LentPages


@dataclass(eq=False)
class _Waiter:
    key: str
    num_pages: int
    choices: int
    granted: asyncio.Future[list[int]] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class PageWaitQueue:
    def __init__(self, pages: LentPages, timeout_s: float) -> None:
        self.pages = pages
        self.timeout_s = timeout_s
        self._queue: deque[_Waiter] = deque()
        self.timeouts = 0  # waits that ran out (for tests and metrics)

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def choices(self) -> int:
        return sum(w.choices for w in self._queue)

    async def acquire(
        self,
        key: str,
        num_pages: int,
        until: Callable[[], Awaitable[object]],
        choices: int = 1,
    ) -> list[int] | None:
        """Pages for `num_pages` held under `key` (and running slots for `choices`), in arrival
        order; None when `until()` (e.g. the receiver's `wait`) finished first. Raises APIError
        503 when they do not fit within the queue's deadline."""
        if not self._queue and (pages := self.pages.lend_free(key, num_pages, choices)) is not None:
            return pages
        waiter = _Waiter(key, num_pages, choices)
        self._queue.append(waiter)
        stop = asyncio.ensure_future(until())
        try:
            done, _ = await asyncio.wait(
                (waiter.granted, stop), timeout=self.timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        except BaseException:
            self._leave(waiter)
            raise
        finally:
            stop.cancel()
        if waiter.granted in done:
            return waiter.granted.result()
        self._leave(waiter)
        if stop in done:
            return None
        self.timeouts += 1
        raise APIError(
            503,
            f"no KV pages came free for this request within {self.timeout_s}s",
            "server_busy",
            "kv_pages_exhausted",
        )

    def grant(self) -> None:
        """Give pages to the waiters at the head of the queue while they fit."""
        while self._queue:
            head = self._queue[0]
            if head.granted.done():  # cancelled meanwhile: `acquire` takes it out
                self._queue.popleft()
                continue
            pages = self.pages.lend_free(head.key, head.num_pages, head.choices)
            if pages is None:
                return
            self._queue.popleft()
            head.granted.set_result(pages)

    def _leave(self, waiter: _Waiter) -> None:
        """Take a waiter out; pages granted to it meanwhile are given back."""
        if waiter in self._queue:
            self._queue.remove(waiter)
        if waiter.granted.done() and not waiter.granted.cancelled():
            self.pages.give_back(waiter.key)
            self.grant()
        else:
            waiter.granted.cancel()
