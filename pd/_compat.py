"""Stand-ins for the asyncio APIs newer than the oldest Python supported (3.10, see pyproject)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator


class _Deadline:
    """What `timeout_py310` yields: like 3.11's `asyncio.Timeout`, its deadline can move
    (`reschedule(loop.time())` expires it at once, e.g. when the worker it waits on is ejected)."""

    def __init__(self, task: asyncio.Task, delay: float | None) -> None:
        self._task = task
        self.expired = False
        self._handle: asyncio.TimerHandle | None = None
        loop = asyncio.get_running_loop()
        self.reschedule(None if delay is None else loop.time() + delay)

    def reschedule(self, when: float | None) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if when is not None and not self.expired:
            self._handle = asyncio.get_running_loop().call_at(when, self._expire)

    def _expire(self) -> None:
        self.expired = True
        self._task.cancel()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()


@contextlib.asynccontextmanager
async def timeout_py310(delay: float | None) -> AsyncIterator[_Deadline]:
    """`asyncio.timeout` for Python 3.10: the block is cancelled after `delay` seconds (None:
    never) and TimeoutError (the builtin) is raised instead; any other cancellation passes.

    NOTE: unlike 3.11's, it cannot tell its own cancellation from one that arrives in the same
    loop iteration after the deadline (3.10 has no `Task.uncancel`); that one becomes TimeoutError.
    """
    task = asyncio.current_task()
    if task is None:
        raise RuntimeError("timeout should be used inside a task")
    deadline = _Deadline(task, delay)
    try:
        yield deadline
    except asyncio.CancelledError:
        if deadline.expired:
            raise TimeoutError from None
        raise
    finally:
        deadline.close()


if sys.version_info >= (3, 11):
    from asyncio import timeout as asyncio_timeout
else:
    asyncio_timeout = timeout_py310

__all__ = ["asyncio_timeout", "timeout_py310"]
