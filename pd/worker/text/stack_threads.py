"""Threads with a stack of a set size, where grammars compile: in the grammar child and in the worker.

llguidance compiles recursively on the native stack, so whether a grammar compiles depends on the
stack it compiles on. A worker builds a matcher only for a grammar that compiled first in a
child, on a thread of `GRAMMAR_STACK_BYTES`, and it builds it on a thread of that same size:
what did not overflow there does not overflow here.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

GRAMMAR_STACK_BYTES = 8 << 20  # what Linux gives a thread by default (`ulimit -s`, 8 MiB)

_sizing = threading.Lock()  # threading.stack_size is process-wide: one start at a time


@contextlib.contextmanager
def thread_stack(stack_bytes: int) -> Iterator[None]:
    """Threads started inside get `stack_bytes` of stack (e.g. an executor's, forced to start
    by a first job): the torch thread, which fills grammar masks, gets the grammar stack."""
    with _sizing:
        before = threading.stack_size(stack_bytes)
        try:
            yield
        finally:
            threading.stack_size(before)


class StackThreads:
    """`n` threads of `stack_bytes` each, running what is submitted in order."""

    def __init__(self, n: int, stack_bytes: int, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self._threads: list[threading.Thread] = []
        with thread_stack(stack_bytes):
            for i in range(n):
                t = threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
                t.start()
                self._threads.append(t)

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        future: Future[T] = Future()
        self._jobs.put((lambda: fn(*args), future))
        return future

    def close(self) -> None:
        """Stop the threads once the jobs already submitted are done (does not wait)."""
        for _ in self._threads:
            self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on it
                future.set_exception(e)
