"""Stand-ins for the asyncio APIs newer than the oldest Python supported (3.10, see pyproject)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator


@contextlib.asynccontextmanager
async def timeout_py310(delay: float | None) -> AsyncIterator[None]:
    """`asyncio.timeout` for Python 3.10: the block is cancelled after `delay` seconds (None:
    never) and TimeoutError (the builtin) is raised instead; any other cancellation passes.

    NOTE: unlike 3.11's, it cannot tell its own cancellation from one that arrives in the same
    loop iteration after the deadline (3.10 has no `Task.uncancel`); that one becomes TimeoutError.
    """
    task = asyncio.current_task()
    if task is None:
        raise RuntimeError("timeout should be used inside a task")
    expired = False

    def expire() -> None:
        nonlocal expired
        expired = True
        task.cancel()

    handle = None if delay is None else asyncio.get_running_loop().call_later(delay, expire)
    try:
        yield
    except asyncio.CancelledError:
        if expired:
            raise TimeoutError from None
        raise
    finally:
        if handle is not None:
            handle.cancel()


if sys.version_info >= (3, 11):
    from asyncio import timeout as asyncio_timeout
else:
    asyncio_timeout = timeout_py310

__all__ = ["asyncio_timeout", "timeout_py310"]
