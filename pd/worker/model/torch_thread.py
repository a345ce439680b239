"""The one thread of a worker that runs torch: loading the checkpoint, building the model, and
every forward pass (the engine's executor). The event loop's thread runs no torch op of its own.

Why one thread: torch's CPU kernels parallelize with OpenMP, which keeps a team of threads per
calling thread. When the main thread has run multi-threaded ops (loading the checkpoint) and the
forward pass then runs in a second thread with a team of its own, a decode step is far slower than
when a single thread does all the torch work, even with the first team idle (docs/BENCHMARKS.md,
"Against the machine's bound, per quantization"). So the calling thread drops to one torch thread
before the torch thread starts (torch's setting also sets MKL's process-wide count: the order
matters), and the torch thread gets all of `--threads`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")

# torch's own default (one thread per core), read at import, before a TorchThread drops its
# caller to one thread: what `--threads 0` means for every worker a process builds, not only
# for the first (a second one read 1 from its caller, and ran at half speed in the tests).
DEFAULT_THREADS = torch.get_num_threads()


class TorchThread:
    def __init__(self, threads: int, stack_bytes: int | None = None) -> None:
        """`stack_bytes`: the thread's stack (it fills grammar masks, and llguidance recurses
        on the native stack: the worker gives it the stack grammar children compile on)."""
        self.threads = threads
        torch.set_num_threads(1)  # this (the event loop's) thread never forms a team of its own
        self.executor = ThreadPoolExecutor(
            1, thread_name_prefix="pd-torch", initializer=torch.set_num_threads, initargs=(threads,)
        )
        if stack_bytes is not None:  # at start-up, before any other thread starts
            before = threading.stack_size(stack_bytes)
            try:
                self.executor.submit(int).result()  # the thread starts now, with that stack
            finally:
                threading.stack_size(before)

    def run(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        """Run `fn` on the torch thread and wait for it (start-up work: loading, building)."""
        return self.executor.submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        self.executor.shutdown(wait=True)
