"""The asyncio-integrated poller: one task per manager drives in-flight transfers.

It polls only while something is in flight (every `interval_s`) and otherwise sleeps on an event,
so an idle manager costs no CPU. `polls` counts poll rounds (tests check it stays flat when idle).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

log = logging.getLogger(__name__)


class Pollable(Protocol):
    def progress(self, now: float) -> bool:
        """Advance once; True when finished (the poller then drops it)."""

    def poll_failed(self, error: Exception) -> None:
        """`progress` raised: end the transfer as failed (the poller drops it)."""


class Poller:
    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.polls = 0
        self._active: dict[int, Pollable] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="transfer-poller")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._active.clear()

    def add(self, item: Pollable) -> None:
        self._active[id(item)] = item
        self._wake.set()

    def discard(self, item: Pollable) -> None:
        self._active.pop(id(item), None)

    @property
    def in_flight(self) -> int:
        return len(self._active)

    async def _run(self) -> None:
        while True:
            if not self._active:
                self._wake.clear()
                await self._wake.wait()
                continue
            self.polls += 1
            now = time.monotonic()
            for key, item in list(self._active.items()):
                try:
                    finished = item.progress(now)
                except Exception as e:  # fail it, or its waiter would never return
                    log.exception("transfer poller: progress failed")
                    finished = True
                    try:
                        item.poll_failed(e)
                    except Exception:
                        log.exception("transfer poller: failing a transfer failed")
                if finished:
                    self._active.pop(key, None)
            if self._active:
                await asyncio.sleep(self.interval_s)
