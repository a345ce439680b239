"""Stand-ins for the asyncio APIs newer than the oldest Python supported (3.10, see pyproject)."""

from __future__ import annotations

import asyncio
import sys
from typing import Any


class timeout_py310:  # noqa: N801 (stands for `asyncio.timeout`)
    """`asyncio.timeout` for Python 3.10: the block is cancelled after `delay` seconds (None:
    never) and TimeoutError (the builtin) is raised instead; any other cancellation passes. Like
    3.11's `asyncio.Timeout`, its deadline can move: `reschedule(loop.time())` expires it at once
    (e.g. when the worker it waits on is ejected).

    NOTE: unlike 3.11's, it cannot tell its own cancellation from one that arrives in the same
    loop iteration after the deadline (3.10 has no `Task.uncancel`); that one becomes TimeoutError.
    """

    def __init__(self, delay: float | None) -> None:
        self._delay = delay
        self._task: asyncio.Task | None = None
        self._handle: asyncio.TimerHandle | None = None
        self.expired = False

    def reschedule(self, when: float | None) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if when is not None and not self.expired and self._task is not None:
            self._handle = asyncio.get_running_loop().call_at(when, self._expire)

    def _expire(self) -> None:
        self.expired = True
        assert self._task is not None
        self._task.cancel()

    async def __aenter__(self) -> timeout_py310:
        self._task = asyncio.current_task()
        if self._task is None:
            raise RuntimeError("timeout should be used inside a task")
        if self._delay is not None:
            self.reschedule(asyncio.get_running_loop().time() + self._delay)
        return self

    async def __aexit__(self, exc_type: type | None, exc: BaseException | None, tb: Any) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if exc_type is asyncio.CancelledError and self.expired:
            raise TimeoutError from None


if sys.version_info >= (3, 11):
    from asyncio import timeout as asyncio_timeout
else:
    asyncio_timeout = timeout_py310

__all__ = ["asyncio_timeout", "timeout_py310"]
